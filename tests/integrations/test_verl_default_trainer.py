"""What verl runs by default is patched: the v1 trainer's ``_balance_batch``, the packer's workload,
and ``VERL_USE_EXTERNAL_MODULES`` reaching a process through ``import verl`` alone.

References: verl's own ``_balance_batch`` and ``rearrange_micro_batches`` on the same inputs, both
measured with verl's own workload model (``calculate_workload``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

import verl.utils.seqlen_balancing as verl_sb  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from verl_balance.integrations import verl as integration  # noqa: E402
from verl_balance.integrations.verl.patches import trainer_balance  # noqa: E402
from verl_balance.integrations.verl.patches.state import current_workload  # noqa: E402
from verl_balance.integrations.verl.patches.workload import VerlWorkload  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTOPATCH = "verl_balance.integrations.verl.autopatch"


def _verl_cost(lengths) -> np.ndarray:
    return verl_sb.calculate_workload(torch.as_tensor(np.asarray(lengths, dtype=np.int64))).numpy().astype(float)


# ----------------------------------------------------------------- v1 trainer (verl's default)
@pytest.fixture
def v1_trainer_base(monkeypatch):
    """verl.trainer.ppo.v1.trainer_base, importable without transfer_queue (a stub module that
    only provides the names the import needs; _balance_batch itself never calls it for batches
    that are already a multiple of the DP size)."""
    stub = types.ModuleType("transfer_queue")
    stub.KVBatchMeta = type("KVBatchMeta", (), {})

    def _missing(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})

    stub.__getattr__ = _missing
    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, "transfer_queue", stub)
    try:
        import verl.trainer.ppo.v1.trainer_base as trainer_base
    except ImportError as exc:  # pragma: no cover - a verl without the v1 trainer
        pytest.skip(f"verl's v1 trainer does not import here: {exc}")
    yield trainer_base
    for name in set(sys.modules) - before:  # forget the modules bound to the stub
        if name.startswith("verl.trainer.ppo.v1") or name.startswith("verl.experimental"):
            sys.modules.pop(name, None)


class _KVBatch:
    """The part of transfer_queue's KVBatchMeta that ``_balance_batch`` uses."""

    def __init__(self, lengths):
        self.keys = [f"k{i}" for i in range(len(lengths))]
        self.tags = [{"seq_len": int(n), "row": i} for i, n in enumerate(lengths)]

    def __len__(self):
        return len(self.tags)

    def reorder(self, order):
        self.keys = [self.keys[i] for i in order]
        self.tags = [self.tags[i] for i in order]


class _V1Trainer:
    def __init__(self, dp_size):
        self.actor_rollout_wg = types.SimpleNamespace(_dispatch_info={"actor": list(range(dp_size))})
        self.tokenizer = types.SimpleNamespace(eos_token_id=2)

    def _get_required_batch_multiple(self, dp_size):
        return dp_size


def _max_rank_cost(tags, dp_size):
    costs = _verl_cost([t["seq_len"] for t in tags])
    return max(chunk.sum() for chunk in np.split(costs, dp_size))


@pytest.mark.slow  # imports verl's whole v1 trainer
def test_patch_replaces_the_v1_trainers_balance_batch_and_undo_restores_it(v1_trainer_base):
    original = v1_trainer_base.PPOTrainer.__dict__["_balance_batch"]
    with integration.patch_verl() as handle:
        assert v1_trainer_base.PPOTrainer._balance_batch is trainer_balance.balanced_balance_batch_v1
        assert "verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch" in handle.patched
    assert v1_trainer_base.PPOTrainer.__dict__["_balance_batch"] is original


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_v1_balance_batch_keeps_every_row_and_balances_at_least_as_well_as_verl(v1_trainer_base, seed):
    dp_size, num_rows = 4, 32
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(num_rows) < 0.2, rng.integers(2000, 4000, num_rows), rng.integers(20, 400, num_rows))
    theirs = v1_trainer_base.PPOTrainer._balance_batch(_V1Trainer(dp_size), _KVBatch(lengths), metrics={})
    metrics = {}
    with integration.patch_verl():
        ours = v1_trainer_base.PPOTrainer._balance_batch(_V1Trainer(dp_size), _KVBatch(lengths), metrics=metrics)
    assert sorted(t["row"] for t in ours.tags) == list(range(num_rows))
    assert [f"k{t['row']}" for t in ours.tags] == ours.keys  # keys moved with their tags
    assert _max_rank_cost(ours.tags, dp_size) <= _max_rank_cost(theirs.tags, dp_size) * (1 + 1e-9)
    assert {"global_seqlen/balanced_max", "global_seqlen/min", "verl_balance/imbalance"} <= set(metrics)


# ----------------------------------------------------------------- packer weighs like the DP partition
def test_default_workload_is_verls_model_in_the_trainer_and_the_packer(monkeypatch):
    monkeypatch.delenv("VERL_BALANCE_WORKLOAD", raising=False)
    assert current_workload() == VerlWorkload()
    lengths = np.array([1, 100, 4096])
    np.testing.assert_array_equal(VerlWorkload().cost(lengths), _verl_cost(lengths))
    seen = []

    class Recording:
        def cost(self, lengths):
            seen.append(len(lengths))
            return VerlWorkload().cost(lengths)

    with integration.patch_verl(workload=Recording()):
        integration.rearrange_micro_batches(_padded([5, 9, 30, 2, 17, 11]), 40)
        assert seen, "the packer did not weigh by the patched workload"
        assert isinstance(current_workload(), Recording)  # what the trainer replacements read
    monkeypatch.setenv("VERL_BALANCE_WORKLOAD", "tokens")
    assert current_workload() == "tokens"


def _padded(lengths, width=None):
    lengths = torch.as_tensor(lengths)
    width = int(width or lengths.max())
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[len(lengths)])


def _heaviest_micro_batch(lengths, cap, rearrange, count):
    """Largest verl-workload micro-batch when ``lengths`` is packed into ``count`` micro-batches."""
    costs = _verl_cost(lengths)
    _, indices = rearrange(_padded(lengths), cap, min_num_micro_batch=count)
    assert len(indices) == count
    return max(costs[idx].sum() for idx in indices)


@pytest.mark.parametrize("mu, sigma, rows, cap", [(7.0, 1.2, 32, 16384), (6.0, 0.9, 16, 4096)])
def test_packer_heaviest_micro_batch_is_never_above_verls_at_verls_count(mu, sigma, rows, cap):
    from functools import partial

    # verl main (0.10.dev) packs into ceil(tokens / cap) micro-batches even when one then exceeds the
    # cap (0.9.1 adds micro-batches until the cap holds): a packing over the cap is no valid reference.
    rng = np.random.default_rng(3)
    by_tokens_worse = compared = 0
    for trial in range(12):
        lengths = np.clip(rng.lognormal(mu, sigma, rows).astype(np.int64), 16, cap // 2)
        verl_indices = verl_sb.rearrange_micro_batches(_padded(lengths), cap)[1]
        if any(lengths[idx].sum() > cap for idx in verl_indices):
            continue
        compared += 1
        count = len(verl_indices)
        theirs = _heaviest_micro_batch(lengths, cap, verl_sb.rearrange_micro_batches, count)
        ours = _heaviest_micro_batch(lengths, cap, integration.rearrange_micro_batches, count)
        assert ours <= theirs * (1 + 1e-12), (trial, ours, theirs)
        # negative control: weighing by tokens (the packer's old default) is measurably worse
        by_tokens = _heaviest_micro_batch(
            lengths, cap, partial(integration.rearrange_micro_batches, workload="tokens"), count
        )
        by_tokens_worse += by_tokens > theirs * (1 + 1e-9)
    assert by_tokens_worse >= 6


# ----------------------------------------------------------------- VERL_USE_EXTERNAL_MODULES
@pytest.mark.slow  # two fresh interpreters importing verl
def test_external_modules_env_patches_verl_on_import_without_importing_trainers_early():
    script = textwrap.dedent(
        """
        import sys
        import verl
        early = "verl.trainer.ppo.ray_trainer" in sys.modules
        import verl.utils.seqlen_balancing as sb
        import verl.workers.engine.utils as engine_utils
        import verl.trainer.ppo.ray_trainer as ray_trainer
        print(early, sb.get_seqlen_balanced_partitions.__module__, engine_utils.rearrange_micro_batches.__module__,
              ray_trainer.RayPPOTrainer._balance_batch.__module__)
        """
    )
    env = dict(
        os.environ,
        VERL_USE_EXTERNAL_MODULES=AUTOPATCH,
        PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    early, partition, packer, trainer = out.stdout.split()[-4:]
    assert early == "False"
    assert partition == packer == "verl_balance.integrations.verl.patches.seqlen"
    assert trainer == "verl_balance.integrations.verl.patches.trainer_balance"
    # negative control: without the variable verl keeps its own functions
    env.pop("VERL_USE_EXTERNAL_MODULES")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3] == "verl.utils.seqlen_balancing"
