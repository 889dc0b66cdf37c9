"""verl 0.9.1's own PPO step with ``actor_rollout_ref.actor.strategy=verl_balance`` gives the same
``pg_loss`` and ``grad_norm`` as verl's ``fsdp2`` engine on the same batch.

The pieces are verl's, unmodified: ``RayPPOTrainer._balance_batch`` -> ``_compute_old_log_prob`` ->
``compute_advantage`` (GRPO) -> ``_update_actor``, with verl's ``ActorRolloutRefWorker`` in a verl
``RayWorkerGroup`` of 2 CPU workers (``verl_ppo_pieces_runner.py``, one subprocess per environment,
each connected to the session's Ray cluster, fresh workers per case). The reference is verl's ``fsdp2`` engine at DP2 on
the same rollout batch.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests._verl import VERL_SKIP_REASON, no_worse_than_naive
from tests.integrations.verl_ray_head import runner_env
from verl_balance.testing.forked_workers import python_command

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_SHIM = "verl_balance.integrations.verl.cpu_shims.platform"
AUTOPATCH = "verl_balance.integrations.verl.autopatch"


def _run_cases(model_dir: str, cases: list[str], *, external_modules: str, ray_address: str) -> dict[str, dict]:
    """{case: result} from one ``verl_ppo_pieces_runner.py`` process (on the session's Ray cluster)."""
    env = runner_env(ray_address, VERL_USE_EXTERNAL_MODULES=external_modules)
    args = python_command([os.path.join(HERE, "verl_ppo_pieces_runner.py"), "--model-dir", model_dir])
    for case in cases:
        args += ["--case", case]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    results = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["case"] for r in results] == cases, proc.stdout[-3000:]
    return {r["case"]: r for r in results}


def _assert_same_step(ours: dict, reference: dict, *, rel: float = 1e-5) -> None:
    assert ours["balanced_uids"] == reference["balanced_uids"]  # the same rows on the same ranks
    assert ours["old_log_probs"] == pytest.approx(reference["old_log_probs"], rel=rel, abs=1e-5)
    assert len(ours["pg_loss"]) == len(reference["pg_loss"])
    assert ours["pg_loss"] == pytest.approx(reference["pg_loss"], rel=rel)
    assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=rel)


@pytest.fixture(scope="module")
def verl_balance_trainer_results(model_dir, ray_head):
    """verl's own ``_balance_batch``; our backend reached through ``model.external_lib`` only."""
    cases = ["fsdp2:1:1", "fsdp2:2:1", "verl_balance:1:1", "verl_balance:2:1", "verl_balance:1:2"]
    return _run_cases(model_dir, cases, external_modules=CPU_SHIM, ray_address=ray_head)


@pytest.mark.slow
def test_ppo_step_with_strategy_verl_balance_matches_fsdp2_for_one_mini_batch(verl_balance_trainer_results):
    results = verl_balance_trainer_results
    assert len(results["fsdp2:1:1"]["pg_loss"]) == 1
    _assert_same_step(results["verl_balance:1:1"], results["fsdp2:1:1"])


@pytest.mark.slow
def test_ppo_step_with_strategy_verl_balance_matches_fsdp2_for_two_mini_batches(verl_balance_trainer_results):
    results = verl_balance_trainer_results
    reference = results["fsdp2:2:1"]
    assert len(reference["pg_loss"]) == len(reference["grad_norm"]) == 2
    # The second mini-batch follows an optimizer step, so it checks the update too.
    assert reference["grad_norm"][0] != pytest.approx(reference["grad_norm"][1], rel=1e-3)
    _assert_same_step(results["verl_balance:2:1"], reference)


@pytest.mark.slow
def test_ppo_step_with_ulysses_sp2_matches_fsdp2_dp2_for_one_mini_batch(verl_balance_trainer_results):
    # 2 workers as DP1 x SP2 against verl's DP2: one mini-batch holds the same rows either way.
    # (verl's own fsdp2 cannot be the SP reference: it wires Ulysses only into flash-attention.)
    results = verl_balance_trainer_results
    ours, reference = results["verl_balance:1:2"], results["fsdp2:1:1"]
    assert ours["old_log_probs"] == pytest.approx(reference["old_log_probs"], rel=1e-5, abs=1e-5)
    assert ours["pg_loss"] == pytest.approx(reference["pg_loss"], rel=1e-5)
    assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_with_autopatch_the_ppo_step_matches_fsdp2_and_a_local_token_count_is_detected(
    model_dir, ray_head, verl_balance_trainer_results
):
    cases = ["fsdp2:2:1", "verl_balance:2:1", "verl_balance_local_token_count:2:1"]
    results = _run_cases(model_dir, cases, external_modules=f"{CPU_SHIM},{AUTOPATCH}", ray_address=ray_head)
    reference = results["fsdp2:2:1"]
    balance = reference["balance_metrics"]
    assert no_worse_than_naive(balance)  # the patch ran
    _assert_same_step(results["verl_balance:2:1"], reference)
    # The patched partition placed the rows differently from verl's own, so this is a second batch layout.
    assert reference["balanced_uids"] != verl_balance_trainer_results["fsdp2:2:1"]["balanced_uids"]
    # Negative control: normalising by this rank's loss tokens instead of the DP group's is caught.
    broken = results["verl_balance_local_token_count:2:1"]
    assert broken["pg_loss"] != pytest.approx(reference["pg_loss"], rel=1e-3)
    assert broken["grad_norm"] != pytest.approx(reference["grad_norm"], rel=1e-3)
