"""TrainEngine on a 2 x 2 (dp x sp) gloo mesh, checked against single-process references.

One spawn runs every scenario; the assertions run in the parent on the collected results.
"""

import dataclasses
import functools
import glob
import logging
import os

import pytest
import torch

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import EngineConfig, MicroBatchError, TrainEngine
from verl_balance.engine.config import FSDPConfig, OptimConfig
from verl_balance.engine.optim import lr_multiplier
from verl_balance.models import LlamaForCausalLM
from verl_balance.parity import ParitySettings, make_global_batch, reference_steps

pytestmark = pytest.mark.slow  # spawns a process group

SETTINGS = ParitySettings(num_samples=8, seed=99)
# DP rank 0: two micro-batches; DP rank 1: one micro-batch and an EMPTY one (a dummy forward).
RANK_SAMPLES = {0: [[0, 1], [2]], 1: [[3, 4, 5, 6, 7], []]}


def rank_micro_batches(batch, dp_rank):
    return [{k: v[torch.tensor(idx, dtype=torch.long)] for k, v in batch.items()} for idx in RANK_SAMPLES[dp_rank]]


class ProbeLoss:
    """SFT loss plus two per-token metrics whose global token means are known exactly."""

    needs_entropy = True

    def __call__(self, *, log_probs, entropy, inputs):
        return -log_probs, {"one": torch.ones_like(log_probs), "nll": -log_probs, "entropy": entropy}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _count_fsdp_collectives(engine, mbs):
    """(all-gathers, reduce-scatters, FSDP parameter groups) of one train_batch on this rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    counts = {"all_gather_single": 0, "reduce_scatter_single": 0}
    originals = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in counts:
        setattr(dist, name, counting(name))
    try:
        engine.train_batch(mbs)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    groups = sum(1 for m in engine.model.modules() if isinstance(m, FSDPModule))
    return counts["all_gather_single"], counts["reduce_scatter_single"], groups


def _engine_scenarios(rank, *, ckpt_dir, profile_dir):
    layout = ParallelLayout(dp=2, sp=2, device_type="cpu")
    batch = make_global_batch(SETTINGS)
    mbs = rank_micro_batches(batch, layout.dp_rank)
    config = dataclasses.replace(
        SETTINGS.engine_config(agg_mode="token-mean"), profile_steps=[1], profile_dir=profile_dir
    )
    out = {}

    engine = TrainEngine(model_config=SETTINGS.model, engine_config=config, layout=layout)
    out["log_probs"] = engine.compute_log_prob(mbs, with_entropy=True)
    out["eval"] = engine.eval_loss(mbs, loss_fn=ProbeLoss())
    out["train"] = engine.train_batch(mbs)
    out["params"] = engine.full_state_dict()

    # Zero loss tokens in the whole mini-batch: warning, no step, no NaN.
    silent = [{**mb, "loss_mask": torch.zeros_like(mb["loss_mask"])} for mb in mbs]
    records = _Records()
    logging.getLogger("verl_balance.engine.train_engine").addHandler(records)
    out["zero"] = engine.train_batch(silent)
    logging.getLogger("verl_balance.engine.train_engine").removeHandler(records)
    out["zero_warned"] = any("zero valid" in m for m in records.messages)
    out["zero_params_unchanged"] = all(torch.equal(engine.full_state_dict()[k], v) for k, v in out["params"].items())

    # Warmup over 4 steps: a step skipped for zero tokens still moves the schedule on, so the
    # lr of train step k is lr_multiplier(k - 1) whatever was skipped before it.
    warm = dataclasses.replace(
        config, profile_steps=[], total_steps=4, optim=dataclasses.replace(config.optim, warmup_steps_ratio=1.0)
    )
    warm_engine = TrainEngine(model_config=SETTINGS.model, engine_config=warm, layout=layout)
    out["warmup_lrs"] = [warm_engine.train_batch(x)["lr"] for x in (mbs, silent, mbs)]

    # Every FSDP2 gradient-accumulation control on, with an empty micro-batch on DP rank 1.
    deferred = dataclasses.replace(
        config,
        profile_steps=[],
        fsdp=FSDPConfig(reshard_after_forward=False, reshard_after_backward=False, defer_gradient_sync=True),
    )
    deferred_engine = TrainEngine(model_config=SETTINGS.model, engine_config=deferred, layout=layout)
    out["deferred_eval"] = deferred_engine.eval_loss(mbs)
    out["deferred_train"] = deferred_engine.train_batch(mbs)
    out["deferred_params"] = deferred_engine.full_state_dict()
    plain_engine = TrainEngine(
        model_config=SETTINGS.model, layout=layout, engine_config=dataclasses.replace(config, profile_steps=[])
    )
    out["collectives"] = {
        "default": _count_fsdp_collectives(plain_engine, mbs),
        "deferred": _count_fsdp_collectives(deferred_engine, mbs),
    }

    # Checkpoint round trip: save, move on, load -> same params, extra and schedule.
    engine.save_checkpoint(ckpt_dir, step=7, extra={"data_cursor": 17})
    saved_step = engine.global_step
    engine.train_batch(mbs)
    moved = any(not torch.equal(engine.full_state_dict()[k], v) for k, v in out["params"].items())
    extra = engine.load_checkpoint(ckpt_dir)
    restored = all(torch.equal(engine.full_state_dict()[k], v) for k, v in out["params"].items())
    fresh = TrainEngine(
        model_config=SETTINGS.model, layout=layout, engine_config=EngineConfig(**{**config.__dict__, "seed": 5})
    )
    fresh.load_checkpoint(ckpt_dir)
    fresh_ok = all(torch.equal(fresh.full_state_dict()[k], v) for k, v in out["params"].items())
    # Same optimizer state => the next step is identical on both engines.
    engine.train_batch(mbs)
    fresh.train_batch(mbs)
    next_same = all(
        torch.equal(a, b) for a, b in zip(engine.full_state_dict().values(), fresh.full_state_dict().values())
    )
    out["ckpt"] = dict(
        moved=moved,
        extra=extra,
        restored=restored,
        fresh=fresh_ok,
        step=engine.global_step - 1 == saved_step,
        next_same=next_same,
    )

    bf16 = TrainEngine(
        model_config=SETTINGS.model,
        layout=layout,
        engine_config=EngineConfig(**{**config.__dict__, "param_dtype": "bfloat16"}),
    )
    out["bf16_eval"] = bf16.eval_loss(mbs)

    # Mismatched micro-batch counts must raise on every rank instead of hanging.
    try:
        engine.eval_loss(mbs + mbs[:1] if layout.rank == 0 else mbs)
        out["count_mismatch"] = None
    except MicroBatchError as err:
        out["count_mismatch"] = str(err)
    try:
        engine.eval_loss(mbs[::-1] if layout.sp_rank == 1 and layout.dp_rank == 0 else mbs)
        out["sp_mismatch"] = None
    except MicroBatchError as err:
        out["sp_mismatch"] = str(err)
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    profile_dir = str(tmp_path_factory.mktemp("profile"))
    results = run_on_ranks(functools.partial(_engine_scenarios, ckpt_dir=ckpt_dir, profile_dir=profile_dir), world=4)
    for out in results:
        out["traces"] = sorted(os.path.relpath(p, profile_dir) for p in glob.glob(f"{profile_dir}/*/*"))
    return results


@pytest.fixture(scope="module")
def reference():
    return reference_steps(SETTINGS, agg_modes=["token-mean"])["token-mean"]


def test_train_step_with_an_empty_micro_batch_matches_single_process(scenario, reference):
    for out in scenario:
        metrics = out["train"]
        assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        assert metrics["valid_tokens"] == int(make_global_batch(SETTINGS)["loss_mask"][:, 1:].sum())
        assert not metrics["step_skipped"] and len(metrics["micro_batch_seconds"]) == 2
        assert metrics["lr"] == SETTINGS.lr
        for name, value in out["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=0, atol=1e-5)


def test_deferred_sync_and_unsharded_params_match_single_process(scenario, reference):
    for out in scenario:
        assert out["deferred_eval"]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert out["deferred_train"]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert out["deferred_train"]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        for name, value in out["deferred_params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=0, atol=1e-5)


def test_deferred_sync_reduces_once_and_unsharded_step_gathers_once_per_step(scenario):
    for out in scenario:
        gathers, scatters, groups = out["collectives"]["deferred"]
        assert (gathers, scatters) == (groups, groups)
        # negative control: by default every one of the 2 micro-batches reduce-scatters
        gathers, scatters, groups = out["collectives"]["default"]
        assert scatters == 2 * groups and gathers >= 2 * groups


def test_perf_metrics_count_every_real_token_once_and_no_mfu_on_cpu(scenario):
    tokens = int(make_global_batch(SETTINGS)["attention_mask"].sum())
    for out in scenario:
        metrics = out["train"]
        assert metrics["perf/tokens"] == tokens  # not sp times: each DP group counted once
        assert metrics["perf/tokens_per_s_per_device"] == pytest.approx(tokens / (metrics["perf/step_seconds"] * 4))
        assert "perf/mfu" not in metrics and "perf/max_memory_allocated_gb" not in metrics
        assert len(metrics["micro_batch_seconds"]) == 2 and metrics["busy_seconds"] > 0


def test_profile_steps_write_one_trace_per_rank(scenario):
    assert scenario[0]["traces"] == [f"step_1/rank_{r}.trace.json" for r in range(4)]


def test_skipped_zero_token_step_keeps_the_lr_schedule_on_the_step_counter(scenario):
    for out in scenario:
        assert out["warmup_lrs"] == pytest.approx([SETTINGS.lr * f for f in (0.25, 0.5, 0.75)])


def test_eval_loss_and_metrics_are_global_token_means(scenario, reference):
    for out in scenario:
        metrics = out["eval"]
        assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert metrics["one"] == pytest.approx(1.0, rel=1e-6)
        assert metrics["nll"] == pytest.approx(reference["loss"], rel=1e-5)


def test_bf16_params_give_the_fp32_loss_to_bf16_tolerance(scenario, reference):
    for out in scenario:
        assert out["bf16_eval"]["loss"] == pytest.approx(reference["loss"], rel=2e-2)


def test_log_probs_and_entropy_match_a_plain_per_sequence_forward(scenario):
    batch = make_global_batch(SETTINGS)
    torch.manual_seed(SETTINGS.seed)
    model = LlamaForCausalLM(SETTINGS.model, attn_impl="sdpa_masked")
    for out in scenario:
        dp_rank = 0 if len(out["log_probs"][0]["log_probs"]) == 2 else 1
        for idx, got in zip(RANK_SAMPLES[dp_rank], out["log_probs"]):
            assert got["log_probs"].shape == (len(idx), SETTINGS.max_len)
            for row, i in enumerate(idx):
                n = int(batch["attention_mask"][i].sum())
                ids = batch["input_ids"][i, :n]
                with torch.no_grad():
                    logits = model(
                        input_ids=ids, position_ids=torch.arange(n), cu_seqlens=torch.tensor([0, n]), max_seqlen=n
                    )
                logp = torch.log_softmax(logits, -1)
                want = torch.zeros(SETTINGS.max_len)
                want[1:n] = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)
                ent = torch.zeros(SETTINGS.max_len)
                ent[1:n] = -(logp.exp() * logp).sum(-1)[:-1]
                torch.testing.assert_close(got["log_probs"][row], want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got["entropy"][row], ent, rtol=1e-5, atol=1e-5)


def test_zero_valid_tokens_skips_the_step_with_a_warning_and_no_nan(scenario):
    for out in scenario:
        assert out["zero"]["step_skipped"] and out["zero"]["loss"] == 0.0
        assert out["zero_warned"] and out["zero_params_unchanged"]


def test_checkpoint_round_trip_restores_params_optimizer_and_extra(scenario):
    for out in scenario:
        ckpt = out["ckpt"]
        assert ckpt["moved"] and ckpt["restored"] and ckpt["fresh"] and ckpt["next_same"]
        assert ckpt["extra"] == {"data_cursor": 17} and ckpt["step"]


def test_full_state_dict_is_unsharded_with_contract_names(scenario, reference):
    for out in scenario:
        assert set(out["params"]) == set(reference["params"])
        for name, value in out["params"].items():
            assert value.shape == reference["params"][name].shape and value.device.type == "cpu"


def test_inconsistent_micro_batches_raise_on_every_rank_instead_of_hanging(scenario):
    for out in scenario:
        assert out["count_mismatch"] and "same number of micro-batches" in out["count_mismatch"]
        assert out["sp_mismatch"] and "SP ranks" in out["sp_mismatch"]


def test_lr_schedule_warmup_then_cosine():
    optim = OptimConfig(lr=1.0, warmup_steps_ratio=4 / 14, lr_scheduler="cosine", min_lr_ratio=0.1)
    cfg = EngineConfig(optim=optim, total_steps=14)
    assert cfg.warmup_steps == 4
    assert [lr_multiplier(s, config=cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(9, config=cfg) == pytest.approx(0.55)
    assert lr_multiplier(14, config=cfg) == pytest.approx(0.1)
    assert lr_multiplier(100, config=EngineConfig(optim=OptimConfig(warmup_steps_ratio=0.02), total_steps=100)) == 1.0
