"""PPOLoss (and every loss mode main_grpo runs) through TrainEngine on several (dp, sp) layouts ==
a single-process PPO reference.

The reference uses no engine, packing or loss-contract code: one plain model forward per
sequence, the per-token PPO loss on the token-aligned wire tensors, the aggregation formula of
each loss_agg_mode written out, torch.optim.AdamW. Every layout must match it (loss, metrics,
parameters after one step) for fixed and token-capped micro-batches and every agg mode, and for
every ``policy_loss.loss_mode`` of ``ENGINE_LOSS_MODES`` (token-capped micro-batches; gspo / geo_mean
reduce per-sequence means over the SP group), all in the same warm world per layout, and vanilla and
geo_mean with the rollout correction's per-token ``rollout_is_weights`` on the wire, and bypass_mode
(ppo_clip with sequence-level rejection; reinforce with sequence-level IS weights, also batch-normalised
with token rejection: per-sequence SUMs over the SP group, the mean over the world). Negative
controls: geo_mean, and bypass_mode's sequence-level IS weights, with the per-sequence sums left local
(no SP all-reduce) differ from the reference on sp=2.
"""

import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch

from verl_balance.algorithms import (
    LossModeConfig,
    PolicyLossConfig,
    PPOLoss,
    compute_grpo_outcome_advantage,
    policy_token_loss,
    ppo_clip_token_loss,
    reference_reductions,
)
from verl_balance.algorithms import rollout_correction as rc
from verl_balance.algorithms.loss_modes import BATCH_SELECTED_MODES, LOSS_MODE_REGISTRY, build_policy_loss
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.loss import AGG_MODES
from verl_balance.models import LlamaForCausalLM
from verl_balance.parity import ParitySettings, make_global_batch
from verl_balance.trainer.config.algorithm import ENGINE_LOSS_MODES

SETTINGS = ParitySettings()
LOSS_CONFIG = PolicyLossConfig(
    clip_ratio=0.2,
    clip_ratio_high=0.28,
    use_kl_loss=True,
    kl_loss_coef=0.1,
    kl_loss_type="low_var_kl",
    entropy_coeff=0.01,
)
CASES = [(micro, True, mode) for micro, mode in itertools.product(("fixed", "dynamic"), AGG_MODES)]
CASES.append(("dynamic", False, "token-mean"))
METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy")
MODE_SETTINGS = {"dro": {"dro_beta": 0.5}}
MODES = [
    LossModeConfig(loss_mode=name, **MODE_SETTINGS.get(name, {}))
    for name in ENGINE_LOSS_MODES
    if name not in ("vanilla", "bypass_mode") and name not in BATCH_SELECTED_MODES
]
"""Every non-vanilla mode main_grpo runs (vanilla is CASES above), with its forced aggregation; clip_cov and
kl_cov (a selection over the whole mini-batch, not per row) are test_cov_loss_layouts.py's, bypass_mode
(vanilla's loss without its correction keys) BYPASS_MODES."""
BYPASS_MODES = [
    LossModeConfig(
        loss_mode="bypass_mode",
        rollout_correction=rc.RolloutCorrectionConfig(
            loss_type="ppo_clip", rollout_rs="seq_max_k2,seq_mean_k1", rollout_rs_threshold="0.3,0.9_1.1"
        ),
    ),
    LossModeConfig(
        loss_mode="bypass_mode",
        rollout_correction=rc.RolloutCorrectionConfig(
            loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=5.0
        ),
    ),
    LossModeConfig(
        loss_mode="bypass_mode",
        rollout_correction=rc.RolloutCorrectionConfig(
            loss_type="reinforce",
            rollout_is="sequence",
            rollout_is_threshold=5.0,
            rollout_is_batch_normalize=True,
            rollout_rs="token_k2",
            rollout_rs_threshold=0.1,
        ),
    ),
]
"""bypass_mode rows (old log-probs = the batch's, standing for the rollout's): each needs per-sequence sums
over the SP group, the last also the IS weights' mean over the mini-batch (a world SUM)."""
BYPASS_CONTROL_MODE = BYPASS_MODES[1]
IS_MODES = [None, LossModeConfig(loss_mode="geo_mean")]
"""Rows with the rollout correction's IS weights (vanilla multiplies pg per token; geo_mean takes their
per-sequence geometric mean, an SP-reduced sum)."""
CONTROL_MODE = LossModeConfig(loss_mode="geo_mean")
LOCAL_ONLY = "local-only-sums"
"""The negative controls' name: geo_mean's and bypass_mode's per-sequence sums skip the SP all-reduce."""


def _mode_agg(mode: LossModeConfig) -> str:
    return LOSS_MODE_REGISTRY[mode.loss_mode].agg_mode or "token-mean"


def _engine_config(agg_mode: str):
    # Adam's first step is lr * g / (|g| + eps): with the default eps = 1e-8 a parameter whose
    # gradient is ~1e-8 (pure float round-off) moves by ~lr/2, so a larger eps keeps the
    # parameter comparison a comparison of gradients rather than of round-off.
    config = SETTINGS.engine_config(agg_mode=agg_mode)
    return dataclasses.replace(config, optim=dataclasses.replace(config.optim, eps=1e-4))


def _reference_model() -> LlamaForCausalLM:
    torch.manual_seed(SETTINGS.seed)  # TrainEngine builds its model from the same seed
    return LlamaForCausalLM(SETTINGS.model, attn_impl="sdpa_masked")


def _sequence_outputs(model, ids):
    length = len(ids)
    logits = model(
        input_ids=ids, position_ids=torch.arange(length), cu_seqlens=torch.tensor([0, length]), max_seqlen=length
    ).float()
    logp = torch.log_softmax(logits[:-1], -1)
    return logp.gather(-1, ids[1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _ppo_batch() -> dict[str, torch.Tensor]:
    """The parity batch plus token-aligned old/ref log-probs near the policy's and GRPO advantages."""
    batch = make_global_batch(SETTINGS)
    gen = torch.Generator().manual_seed(7)
    model = _reference_model()
    current = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i in range(len(current)):
            length = int(batch["attention_mask"][i].sum())
            current[i, 1:length] = _sequence_outputs(model, batch["input_ids"][i, :length])[0]
    mask = batch["attention_mask"].float()
    batch["old_log_probs"] = (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask
    batch["ref_log_prob"] = (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask
    scores = torch.randint(0, 2, (len(current),), generator=gen).float()
    batch["advantages"] = compute_grpo_outcome_advantage(
        scores=scores, index=np.arange(len(current)) // 4, loss_mask=batch["loss_mask"]
    )
    return batch


def _is_batch(batch):
    """The batch with IS weights in (0.5, 2) on the loss tokens (0 elsewhere), as the driver sets them."""
    gen = torch.Generator().manual_seed(11)
    out = dict(batch)
    out["rollout_is_weights"] = (0.5 + 1.5 * torch.rand(batch["loss_mask"].shape, generator=gen)) * batch["loss_mask"]
    return out


def _sequence_loss(logp, entropy, aligned, *, config: PolicyLossConfig, mode: LossModeConfig | None, is_mean=None):
    """One whole sequence's per-token loss: vanilla PPO-clip, or the mode with its reductions over this row
    (``is_mean``: bypass_mode's batch-normalisation terms over the whole batch)."""
    terms = dict(log_probs=logp, old_log_probs=aligned["old_log_probs"], advantages=aligned["advantages"])
    regularizers = dict(ref_log_probs=aligned["ref_log_prob"], entropy=entropy, config=config)
    weights = aligned.get("rollout_is_weights")
    if mode is None:
        return ppo_clip_token_loss(**terms, **regularizers, rollout_is_weights=weights)
    rows = {k: v[None] for k, v in terms.items()}
    if is_mean is not None:
        reduced = rc.bypass_reductions(
            log_probs=rows["log_probs"],
            old_log_probs=rows["old_log_probs"],
            loss_mask=aligned["loss_mask"][None],
            config=mode.rollout_correction,
            is_mean_terms=is_mean,
        )
    else:
        reduced = reference_reductions(
            **rows,
            loss_mask=aligned["loss_mask"][None],
            config=config,
            mode=mode,
            rollout_is_weights=None if weights is None else weights[None],
        )
    return policy_token_loss(
        **terms, **regularizers, mode=mode, reduced={k: v[0] for k, v in reduced.items()}, rollout_is_weights=weights
    )


def _references(batch, keys: list[tuple[str, PolicyLossConfig, LossModeConfig | None]]) -> list[dict]:
    """The reference of each (agg_mode, config, mode): one forward per sequence shared by all keys, then
    per key its loss, gradient (autograd.grad on the kept graph) and one AdamW step on a fresh model."""
    model = _reference_model()
    outputs = []
    for i in range(len(batch["input_ids"])):
        length = int(batch["attention_mask"][i].sum())
        columns = ("old_log_probs", "ref_log_prob", "advantages", "loss_mask", "rollout_is_weights")
        aligned = {k: batch[k][i, 1:length] for k in columns if k in batch}
        outputs.append((*_sequence_outputs(model, batch["input_ids"][i, :length]), aligned))
    return [_reference_step(model, outputs, agg_mode=a, config=c, mode=m) for a, c, m in keys]


def _batch_is_mean(outputs, mode: LossModeConfig | None):
    """bypass_mode's rollout_is_batch_normalize: the IS weights' mean terms summed over every sequence."""
    corr = None if mode is None else mode.rollout_correction
    if corr is None or mode.loss_mode != "bypass_mode" or not corr.rollout_is_batch_normalize:
        return None
    total = torch.zeros(2, dtype=torch.float64)
    for logp, _, aligned in outputs:
        mask = aligned["loss_mask"][None]
        log_ratio = logp.detach()[None] - aligned["old_log_probs"][None]
        total += rc.is_batch_mean_terms(rc.is_weights(log_ratio=log_ratio, loss_mask=mask, config=corr), mask, corr)
    return total


def _reference_step(model, outputs, *, agg_mode: str, config: PolicyLossConfig, mode: LossModeConfig | None) -> dict:
    sums, counts, metric_sums = [], [], {}
    is_mean = _batch_is_mean(outputs, mode)
    for logp, entropy, aligned in outputs:
        loss, metrics = _sequence_loss(logp, entropy, aligned, config=config, mode=mode, is_mean=is_mean)
        mask = aligned["loss_mask"]
        sums.append((loss * mask).sum())
        counts.append(mask.sum())
        for name, value in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + float((value * mask).sum())
    sums, counts = torch.stack(sums), torch.stack(counts)
    has = counts > 0
    loss = {
        "token-mean": lambda: sums.sum() / counts.sum(),
        "seq-mean-token-mean": lambda: (sums[has] / counts[has]).mean(),
        "seq-mean-token-sum": lambda: sums[has].mean(),
        "seq-mean-token-sum-norm": lambda: sums[has].mean() / SETTINGS.loss_scale_factor,
    }[agg_mode]()
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    stepped = _reference_model()
    for p, g in zip(stepped.parameters(), grads):
        p.grad = torch.zeros_like(p) if g is None else g.clone()
    grad_norm = torch.nn.utils.clip_grad_norm_(stepped.parameters(), SETTINGS.grad_clip)
    cfg = _engine_config(agg_mode).optim
    torch.optim.AdamW(
        stepped.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
    ).step()
    return {
        "loss": loss.item(),
        "grad_norm": float(grad_norm),
        "metrics": {k: v / float(counts.sum()) for k, v in metric_sums.items()},
        "params": {k: v.detach().clone() for k, v in stepped.state_dict().items()},
    }


def _worker(rank, *, dp, sp, batch):
    """Every case, then every loss mode and the negative control, on this rank of a (dp, sp) mesh;
    (eval, train, params) per case."""
    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine import TrainEngine

    class LocalSumsEngine(TrainEngine):
        def sequence_sum(self, packed, values):  # the fault: no SP all-reduce of the sums
            return super().sequence_sum(packed, values) if self.layout.sp == 1 else _local_sums(packed, values)

    layout = ParallelLayout(dp=dp, sp=sp, device_type="cpu")
    results = []
    for micro, balance, agg_mode in CASES:
        results.append(_run_case(TrainEngine, layout, batch, micro, balance, agg_mode, PPOLoss(LOSS_CONFIG)))
    for mode in MODES:
        loss_fn = build_policy_loss(LOSS_CONFIG, mode=mode)
        results.append(_run_case(TrainEngine, layout, batch, "dynamic", True, _mode_agg(mode), loss_fn))
    for mode in IS_MODES:
        agg_mode = "token-mean" if mode is None else _mode_agg(mode)
        loss_fn = build_policy_loss(LOSS_CONFIG, mode=mode)
        results.append(_run_case(TrainEngine, layout, _is_batch(batch), "dynamic", True, agg_mode, loss_fn))
    for mode in BYPASS_MODES:
        results.append(
            _run_case(
                TrainEngine, layout, batch, "dynamic", True, "token-mean", build_policy_loss(LOSS_CONFIG, mode=mode)
            )
        )
    control_batch = _control_batch(batch)
    for mode in (CONTROL_MODE, BYPASS_CONTROL_MODE):
        control = build_policy_loss(LOSS_CONFIG, mode=mode)
        results.append(_run_case(LocalSumsEngine, layout, control_batch, "dynamic", True, _mode_agg(mode), control))
    return results


def _control_batch(batch):
    """The batch with every token but the first trained, so loss tokens of a sequence straddle the SP
    boundary (with response-suffix masks the straddling part is often all prompt, hiding the fault)."""
    out = dict(batch)
    mask = batch["attention_mask"].float().clone()
    mask[:, 0] = 0
    out["loss_mask"] = mask
    return out


def _local_sums(packed, values):
    bounds = packed.cu_seqlens_padded.cpu()
    ids = torch.repeat_interleave(torch.arange(len(bounds) - 1), (bounds[1:] - bounds[:-1]).long())[packed.local_slice]
    sums = torch.zeros(len(bounds) - 1, dtype=torch.float64).index_add_(0, ids, values.detach().double())
    return sums[ids].to(values.dtype)


def _run_case(engine_cls, layout, batch, micro, balance, agg_mode, loss_fn):
    from verl_balance.balance import plan_balance

    dp, sp = layout.dp, layout.sp
    fixed = micro == "fixed"
    plan = plan_balance(
        seq_lens=batch["attention_mask"].sum(1).numpy(),
        dp_size=dp,
        sp_size=sp,
        micro_batch_size=SETTINGS.micro_batch_size if fixed else None,
        max_token_len_per_gpu=None if fixed else -(-SETTINGS.tokens_per_micro_batch // sp),
        balance=balance,
    )
    micro_batches = [
        {k: v[torch.as_tensor(np.asarray(idx, dtype=np.int64))] for k, v in batch.items()}
        for idx in plan.micro_batches[layout.dp_rank]
    ]
    engine = engine_cls(model_config=SETTINGS.model, layout=layout, engine_config=_engine_config(agg_mode))
    evaluated = engine.eval_loss(micro_batches, loss_fn=loss_fn)
    trained = engine.train_batch(micro_batches, loss_fn=loss_fn)
    return evaluated, trained, engine.full_state_dict()


@pytest.fixture(scope="module")
def batch():
    return _ppo_batch()


@pytest.fixture(scope="module")
def reference(batch):
    """reference(agg_mode, config=LOSS_CONFIG), computed once per argument pair."""
    cache = {}

    def get(agg_mode: str, config: PolicyLossConfig = LOSS_CONFIG, mode: LossModeConfig | None = None) -> dict:
        if not cache:  # every row the layout test compares, from one shared forward
            keys = [(a, LOSS_CONFIG, None) for a in AGG_MODES] + [(_mode_agg(m), LOSS_CONFIG, m) for m in MODES]
            keys += [("token-mean", LOSS_CONFIG, m) for m in BYPASS_MODES]
            for k, ref in zip(keys, _references(batch, keys)):
                cache[(k[0], repr(k[1]), repr(k[2]))] = ref
        key = (agg_mode, repr(config), repr(mode))
        if key not in cache:
            cache[key] = _references(batch, [(agg_mode, config, mode)])[0]
        return cache[key]

    return get


def test_reference_is_sensitive_to_clipping_kl_and_entropy(reference):
    """Negative control: the batch exercises every term, so a wrong loss could not pass by luck."""
    base = reference("token-mean")
    assert 0.05 < base["metrics"]["pg_clipfrac"] < 0.95 and base["metrics"]["kl_loss"] > 1e-3
    for change in ({"clip_ratio_high": 0.2}, {"kl_loss_coef": 0.0}, {"entropy_coeff": 0.0}):
        other = reference("token-mean", PolicyLossConfig(**{**LOSS_CONFIG.__dict__, **change}))
        assert abs(other["loss"] - base["loss"]) > 1e-4 * abs(base["loss"]), change


@pytest.mark.slow
@pytest.mark.parametrize("dp,sp", [(2, 1), (1, 2)])
def test_ppo_loss_is_layout_invariant(batch, reference, dp, sp):
    results = run_on_ranks(functools.partial(_worker, dp=dp, sp=sp, batch=batch), world=dp * sp)[0]
    assert len(results) == len(CASES) + len(MODES) + len(IS_MODES) + len(BYPASS_MODES) + 2
    for (micro, balance, agg_mode), result in zip(CASES, results):
        _assert_matches(result, reference(agg_mode), where=f"dp={dp} sp={sp} {micro} balance={balance} {agg_mode}")
    for mode, result in zip(MODES, results[len(CASES) :]):
        ref = reference(_mode_agg(mode), mode=mode)
        _assert_matches(result, ref, where=f"dp={dp} sp={sp} loss_mode={mode.loss_mode} {_mode_agg(mode)}")
    for mode, result in zip(IS_MODES, results[len(CASES) + len(MODES) :]):
        ref = _is_reference(batch, mode)
        _assert_matches(result, ref, where=f"dp={dp} sp={sp} rollout_is_weights loss_mode={mode and mode.loss_mode}")
    first = len(CASES) + len(MODES) + len(IS_MODES)
    for mode, result in zip(BYPASS_MODES, results[first:]):
        ref = reference("token-mean", mode=mode)
        _assert_matches(result, ref, where=f"dp={dp} sp={sp} loss_mode=bypass_mode {mode.rollout_correction}")
    for mode, result in zip((CONTROL_MODE, BYPASS_CONTROL_MODE), results[-2:]):
        control = _references(_control_batch(batch), [(_mode_agg(mode), LOSS_CONFIG, mode)])[0]
        if sp > 1:  # negative control: sums left on the slice fail the same comparison
            with pytest.raises(AssertionError):
                _assert_matches(result, control, where=f"{LOCAL_ONLY} {mode.loss_mode}")
        else:
            _assert_matches(result, control, where=f"{LOCAL_ONLY} {mode.loss_mode}")


def _assert_matches(result, ref, *, where: str) -> None:
    evaluated, trained, params = result
    # abs: fp32 noise of O(1) per-sequence terms whose signed advantages cancel (the control's loss is
    # 7.6e-4 from terms near 1; layouts differ by 2-3e-8, the local-sums fault by 9e-4)
    assert evaluated["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), where
    assert trained["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), where
    assert trained["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), where
    for name, value in ref["metrics"].items():
        assert trained[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (where, name)
    delta = max(float((params[k] - v).abs().max()) for k, v in ref["params"].items())
    assert delta <= 1e-5, where


def _is_reference(batch, mode: LossModeConfig | None) -> dict:
    agg_mode = "token-mean" if mode is None else _mode_agg(mode)
    return _references(_is_batch(batch), [(agg_mode, LOSS_CONFIG, mode)])[0]


@pytest.mark.parametrize("mode", IS_MODES, ids=["vanilla", "geo_mean"])
def test_rollout_is_weights_change_the_reference_loss_and_gradient(batch, reference, mode):
    """Negative control of the IS rows: with the weights the loss is not the unweighted one."""
    unweighted = reference("token-mean" if mode is None else _mode_agg(mode), mode=mode)
    weighted = _is_reference(batch, mode)
    assert abs(weighted["loss"] - unweighted["loss"]) > 1e-4 * abs(unweighted["loss"])
    assert abs(weighted["grad_norm"] - unweighted["grad_norm"]) > 1e-6


def test_every_loss_mode_reference_differs_from_vanilla_and_exercises_the_batch(reference):
    """Negative control of the mode rows: each mode's reference is its own loss, not vanilla's."""
    base = reference("token-mean")["loss"]
    for mode in MODES:
        ref = reference(_mode_agg(mode), mode=mode)
        assert abs(ref["loss"] - base) > 1e-4 * abs(base), mode.loss_mode
        assert ref["grad_norm"] > 0, mode.loss_mode


def test_bypass_rows_reject_some_sequences_truncate_some_weights_and_differ_from_vanilla(batch, reference):
    """Negative control of the bypass rows: rejection and truncation act on part of the batch (so a wrong
    per-sequence sum changes them), and each row's loss is not vanilla PPO's."""
    base = reference("token-mean")["loss"]
    for mode in BYPASS_MODES:
        ref = reference("token-mean", mode=mode)
        assert abs(ref["loss"] - base) > 1e-4 * abs(base), mode.rollout_correction
        if mode.rollout_correction.rollout_rs is not None:
            assert 0.05 < ref["metrics"]["rollout_corr/rollout_rs_masked_fraction"] < 0.95, mode.rollout_correction
    model = _reference_model()
    corr, weights = BYPASS_MODES[1].rollout_correction, []
    for i in range(len(batch["input_ids"])):
        length = int(batch["attention_mask"][i].sum())
        logp = _sequence_outputs(model, batch["input_ids"][i, :length])[0].detach()[None]
        mask = batch["loss_mask"][i, 1:length][None]
        lr = logp - batch["old_log_probs"][i, 1:length][None]
        if mask.sum() > 0:
            weights.append(float(rc.is_weights(log_ratio=lr, loss_mask=mask, config=corr).max()))
    truncated = sum(w == corr.rollout_is_threshold for w in weights)
    assert 0 < truncated < len(weights) - 2, weights
