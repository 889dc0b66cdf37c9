"""benchmarks/peer_bench.py: its argument checks, its table arithmetic, and one tiny section end to end
(no timing is asserted: only that the table is produced with both rows measured)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "peer_bench.py")


@pytest.fixture(scope="module")
def peer_bench():
    spec = importlib.util.spec_from_file_location("peer_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_parse_args_selects_sections_and_rejects_unknown_ones_and_too_few_steps(peer_bench):
    assert peer_bench.parse_args([]).only == list(peer_bench.SECTIONS)
    assert peer_bench.parse_args(["--only", "grpo-trl, sft-trl"]).only == ["grpo-trl", "sft-trl"]
    with pytest.raises(SystemExit):
        peer_bench.parse_args(["--only", "sft-trl,sft-foo"])
    with pytest.raises(SystemExit):  # --warmup 1 needs 3 steps for one timed interval
        peer_bench.parse_args(["--steps", "2", "--warmup", "1"])
    assert peer_bench.parse_args(["--steps", "2", "--warmup", "0"]).steps == 2


def test_summary_pools_repeats_and_table_ratios_are_ours_over_peer(peer_bench, capsys):
    R = peer_bench.RunResult
    ours = [R("ours", step_s=[1.0, 3.0], tokens=[100, 100], peak_rss=2**30), R("ours", step_s=[2.0], tokens=[100])]
    peer = [R("peer", step_s=[4.0], tokens=[200], peak_rss=2**31), R("peer", error="exit 1")]
    stats = {"ours": peer_bench.summarize(ours), "peer": peer_bench.summarize(peer)}
    # median of the pooled step intervals (1, 2, 3) = 2 s; tokens/s = 100 / 2; the failed repeat is left out.
    assert (stats["ours"]["s_step"], stats["ours"]["tok_s"], stats["ours"]["runs"]) == (2.0, 50.0, "2/2")
    assert (stats["peer"]["s_step"], stats["peer"]["tok_s"], stats["peer"]["runs"]) == (4.0, 50.0, "1/2")
    peer_bench.print_table([("sec", "ours", ["peer"])], stats)
    out = capsys.readouterr().out
    peer_row = next(line for line in out.splitlines() if line.startswith("sec") and " peer " in line)
    # s/step 2/4, tok/s 50/50, tok/cpu-s n/a (no CPU time recorded), RSS 1 GiB / 2 GiB
    assert peer_row.split()[-4:] == ["0.50", "1.00", "n/a", "0.50"]
    assert "peer: FAILED exit 1" in out


def test_verl_script_section_passes_verls_own_overrides_to_both_trainers(peer_bench):
    args = peer_bench.parse_args(["--only", "grpo-verl-script", "--grpo-prompts", "8", "--steps", "3"])
    ours = peer_bench.verl_script_ours_case(args, "/m", "/d.parquet", "/run").argv
    verl = peer_bench.verl_script_verl_case(args, "/m", "/d.parquet", "/run").argv
    assert verl[1:3] == ["-m", "verl.trainer.main_ppo"] and ours[1:3] == ["-m", "verl_balance.main_grpo"]
    with open(peer_bench.VERL_GRPO_SCRIPT) as f:
        script = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    scaled = ("data.", "actor_rollout_ref.model.path", "actor_rollout_ref.actor.ppo_mini_batch_size", "trainer.")
    unchanged = [line for line in script if not line.startswith(scaled) and "rollout.name" not in line]
    assert len(unchanged) >= 20  # the algorithm, actor, rollout and ref lines of verl's script
    for line in unchanged:
        assert line in ours, line
        assert line in verl or line.startswith("actor_rollout_ref.rollout.tensor_model_parallel_size"), line
    for argv in (ours, verl):
        assert "data.train_batch_size=8" in argv and "actor_rollout_ref.actor.ppo_mini_batch_size=2" in argv
        assert "trainer.n_gpus_per_node=2" in argv and "trainer.total_training_steps=3" in argv
    assert {"actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.name=verl_balance_cpu"} <= set(verl)
    assert "actor_rollout_ref.rollout.name=hf" in ours


@pytest.mark.slow
def test_sft_trl_section_on_a_tiny_model_prints_a_table_with_both_rows_measured(peer_bench):
    trl_path = os.environ.get("PEER_TRL_PATH")
    if not peer_bench._have("trl", trl_path):
        pytest.skip("trl is not importable (pip install --target DIR 'trl>=1.16', then PEER_TRL_PATH=DIR)")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    argv = [SCRIPT, "--only", "sft-trl", "--model", "tiny", "--steps", "2", "--warmup", "0", "--threads", "1"]
    argv += ["--sft-batch", "8", "--num-train", "64"]
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = {
        name: line
        for line in proc.stdout.splitlines()
        for name in ("ours main_sft", "TRL SFTTrainer")
        if line.startswith("sft-trl") and name in line
    }
    assert set(rows) == {"ours main_sft", "TRL SFTTrainer"}, proc.stdout[-3000:]
    for line in rows.values():
        assert " 1/1 " in line and "n/a" not in line, proc.stdout[-3000:]
    assert re.search(r"(\d+\.\d+\s+){3}\d+\.\d+$", rows["TRL SFTTrainer"].rstrip()), rows  # the ratio columns


def test_grpo_trl_vllm_section_runs_both_trainers_on_vllm_with_grpo_trls_shapes(peer_bench):
    args = peer_bench.parse_args(["--only", "grpo-trl-vllm", "--steps", "3", "--trl-path", "/trl"])
    ours = peer_bench.ours_grpo_case(args, "/m", "/d.parquet", "/run", vllm=True)
    plain = peer_bench.ours_grpo_case(args, "/m", "/d.parquet", "/run")
    assert ours.argv[1:3] == ["-m", "verl_balance.main_grpo"] and ours.name != plain.name
    # the grpo-trl row's command plus the vLLM rollout in TRL's engine dtype, nothing else changed
    assert ours.argv == [*plain.argv, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16"]
    trl = peer_bench.trl_case("trl-grpo-vllm", args, "/m", "/d.parquet", "/run")
    plain_trl = peer_bench.trl_case("trl-grpo", args, "/m", "/d.parquet", "/run")
    assert trl.argv[trl.argv.index("--child") + 1] == "trl-grpo-vllm" and "reload shim" in trl.name
    same_shapes = [a if a != "trl-grpo" else "trl-grpo-vllm" for a in plain_trl.argv]
    assert trl.argv == [*same_shapes, "--trl-vllm-sync", "reload"]
    assert trl.env["VLLM_CPU_KVCACHE_SPACE"] == str(peer_bench.TRL_VLLM_KV_CACHE_GIB)
    assert trl.env["PYTHONPATH"].endswith("/trl") and "VLLM_CPU_KVCACHE_SPACE" not in plain_trl.env
    own_sync = peer_bench.parse_args(["--only", "grpo-trl-vllm", "--steps", "3", "--trl-vllm-sync", "trl"])
    assert "shim" not in peer_bench.trl_case("trl-grpo-vllm", own_sync, "/m", "/d", "/run").name
    child = peer_bench.parse_args(["--child", "trl-grpo-vllm"])
    options = peer_bench._trl_vllm_options(child)
    assert options["use_vllm"] is True and options["vllm_mode"] == "colocate"
    assert peer_bench._trl_vllm_options(peer_bench.parse_args(["--child", "trl-grpo"])) == {}


def test_grpo_trl_vllm_pair_is_ours_then_trl_and_needs_vllm(peer_bench, monkeypatch):
    args = peer_bench.parse_args(["--only", "grpo-trl-vllm", "--steps", "3"])
    monkeypatch.setattr(peer_bench, "_have", lambda module, extra_path=None: True)
    pairs, skipped = peer_bench.build_pairs(args, "/m", {"rl": "/rl.parquet"})
    assert skipped == [] and [section for section, _ in pairs] == ["grpo-trl-vllm"]
    cases = [make("/run") for _, make in pairs[0][1]]
    assert [c.name for c in cases] == ["ours main_grpo (vLLM)", "TRL GRPOTrainer (vLLM colocate, reload shim)"]
    monkeypatch.setattr(peer_bench, "_have", lambda module, extra_path=None: module != "vllm")
    pairs, skipped = peer_bench.build_pairs(args, "/m", {"rl": "/rl.parquet"})
    assert pairs == [] and skipped[0].startswith("grpo-trl-vllm: vllm is not importable")
