"""Every policy_loss.loss_mode against verl 0.9.1's own function of the same name, on random inputs.

Ours is a per-token loss; the objective is J = sum(w * loss) with the contract weights of
``loss.compute_token_weights`` over the batch (one micro-batch holding the mini-batch, so verl's
per-micro-batch statistics are the mini-batch's). J and dJ/dlog_prob must equal verl's pg_loss
and its gradient (rtol 1e-6, float64 on both sides), and the loss-mask token means of our
per-token metrics verl's scalar metrics. Reductions come from ``reference_reductions``.
"""

from __future__ import annotations

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms.loss_modes import LOSS_MODE_REGISTRY, LossModeConfig, policy_token_loss
from verl_balance.algorithms.loss_reductions import reference_reductions
from verl_balance.algorithms.policy_loss import PolicyLossConfig
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig
from verl_balance.loss import compute_token_weights

RTOL, ATOL = 1e-6, 1e-9
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


@pytest.fixture(scope="module")
def core_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON)


def make_inputs(seed: int, rows: int = 10, width: int = 16, spread: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2.5 - 0.02
    log_probs = torch.clamp(old + spread * torch.randn(rows, width, generator=gen, dtype=torch.float64), max=-1e-3)
    advantages = torch.randn(rows, width, generator=gen, dtype=torch.float64) * 2
    is_weights = 0.5 + torch.rand(rows, width, generator=gen, dtype=torch.float64)
    return {"mask": mask, "old": old, "log_probs": log_probs, "adv": advantages, "is_weights": is_weights}


def verl_config(loss_mode: str, config: PolicyLossConfig, mode: LossModeConfig, global_batch_info=None):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlRC
    from verl.workers.config import ActorConfig
    from verl.workers.config import PolicyLossConfig as VerlPL

    corr = mode.rollout_correction
    actor = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low_value,
        clip_ratio_high=config.clip_ratio_high_value,
        clip_ratio_c=config.clip_ratio_c,
        tau_pos=mode.tau_pos,
        tau_neg=mode.tau_neg,
        policy_loss=VerlPL(
            loss_mode=loss_mode,
            clip_cov_ratio=mode.clip_cov_ratio,
            clip_cov_lb=mode.clip_cov_lb,
            clip_cov_ub=mode.clip_cov_ub,
            kl_cov_ratio=mode.kl_cov_ratio,
            ppo_kl_coef=mode.ppo_kl_coef,
            dro_beta=mode.dro_beta,
            rollout_correction=VerlRC(
                rollout_is=corr.rollout_is,
                rollout_is_threshold=corr.rollout_is_threshold,
                rollout_is_batch_normalize=corr.rollout_is_batch_normalize,
                rollout_rs=corr.rollout_rs,
                rollout_rs_threshold=corr.rollout_rs_threshold,
                loss_type=corr.loss_type,
            ),
        ),
    )
    if global_batch_info:
        actor.global_batch_info.update(global_batch_info)
    return actor


def our_objective(d, config, mode, agg_mode, *, with_is=False, seed=0):
    log_probs = d["log_probs"].clone().requires_grad_(True)
    torch.manual_seed(seed)
    reduced = reference_reductions(
        log_probs=log_probs,
        old_log_probs=d["old"],
        advantages=d["adv"],
        loss_mask=d["mask"],
        config=config,
        mode=mode,
        rollout_is_weights=d["is_weights"] if with_is else None,
    )
    loss, metrics = policy_token_loss(
        log_probs=log_probs,
        old_log_probs=d["old"],
        advantages=d["adv"],
        config=config,
        mode=mode,
        reduced=reduced,
        rollout_is_weights=d["is_weights"] if with_is else None,
    )
    rows, width = d["mask"].shape
    agg = LOSS_MODE_REGISTRY[mode.loss_mode].agg_mode or agg_mode
    weights = compute_token_weights(
        loss_masks=[d["mask"].flatten()],
        cu_seqlens=[torch.arange(rows + 1) * width],
        agg_mode=agg,
        loss_scale_factor=float(width),
        dp_group=None,
    ).weights[0]
    objective = (weights.view(rows, width).double() * loss).sum()
    objective.backward()
    means = {k: float((v * d["mask"]).sum() / d["mask"].sum()) for k, v in metrics.items()}
    return objective.detach(), log_probs.grad, means


def verl_objective(core_algos, d, config, mode, agg_mode, *, with_is=False, seed=0, global_batch_info=None):
    log_probs = d["log_probs"].clone().requires_grad_(True)
    torch.manual_seed(seed)
    fn = core_algos.get_policy_loss_fn(mode.loss_mode)
    pg_loss, metrics = fn(
        old_log_prob=d["old"],
        log_prob=log_probs,
        advantages=d["adv"],
        response_mask=d["mask"],
        loss_agg_mode=agg_mode,
        config=verl_config(mode.loss_mode, config, mode, global_batch_info),
        rollout_is_weights=d["is_weights"] if with_is else None,
    )
    pg_loss.backward()
    return pg_loss.detach(), log_probs.grad, {k.removeprefix("actor/"): v for k, v in metrics.items()}


def compare(
    core_algos, d, config, mode, agg_mode, *, with_is=False, seed=0, global_batch_info=None, metrics=True, atol=ATOL
):
    ours = our_objective(d, config, mode, agg_mode, with_is=with_is, seed=seed)
    ref = verl_objective(
        core_algos, d, config, mode, agg_mode, with_is=with_is, seed=seed, global_batch_info=global_batch_info
    )
    torch.testing.assert_close(ours[0], ref[0], rtol=RTOL, atol=atol)
    torch.testing.assert_close(ours[1], ref[1], rtol=RTOL, atol=atol)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl") if metrics else ():
        if key in ref[2] and key in ours[2]:
            assert ours[2][key] == pytest.approx(ref[2][key], rel=1e-6, abs=1e-7), key
    return ours


CONFIG = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)

PER_TOKEN_CASES = {
    "vanilla": LossModeConfig(loss_mode="vanilla"),
    "gspo": LossModeConfig(loss_mode="gspo"),
    "sapo": LossModeConfig(loss_mode="sapo", tau_pos=1.0, tau_neg=1.05),
    "gpg": LossModeConfig(loss_mode="gpg"),
    "dro": LossModeConfig(loss_mode="dro", dro_beta=0.3),
    "cispo": LossModeConfig(loss_mode="cispo"),
    "dppo_tv": LossModeConfig(loss_mode="dppo_tv"),
    "dppo_kl": LossModeConfig(loss_mode="dppo_kl"),
    "kl_cov": LossModeConfig(loss_mode="kl_cov", kl_cov_ratio=0.1, ppo_kl_coef=0.5),
    "clip_cov": LossModeConfig(loss_mode="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=5.0),
    "geo_mean": LossModeConfig(loss_mode="geo_mean"),
}


SPREAD = {"dppo_tv": 1.5, "dppo_kl": 1.5, "gspo": 1.0}
"""Log-prob moves large enough that DPPO's trust regions mask tokens and GSPO's sequence ratio clips."""


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(PER_TOKEN_CASES))
def test_loss_mode_equals_verl(core_algos, name, agg_mode, seed):
    d = make_inputs(seed, spread=SPREAD.get(name, 0.3))
    compare(core_algos, d, CONFIG, PER_TOKEN_CASES[name], agg_mode, seed=seed)


@pytest.mark.parametrize("name", sorted(PER_TOKEN_CASES))
def test_loss_mode_with_rollout_is_weights_equals_verl(core_algos, name):
    d = make_inputs(7, spread=SPREAD.get(name, 0.3))
    compare(core_algos, d, CONFIG, PER_TOKEN_CASES[name], "token-mean", with_is=True, seed=7)


def test_clip_cov_and_kl_cov_act_on_some_tokens_in_these_cases():
    """A guard on the cases above: the covariance selections are non-empty, so those tests can fail."""
    d = make_inputs(0)
    for name, key in (("clip_cov", "clip_cov_drop"), ("kl_cov", "kl_cov_select")):
        reduced = reference_reductions(
            log_probs=d["log_probs"],
            old_log_probs=d["old"],
            advantages=d["adv"],
            loss_mask=d["mask"],
            config=CONFIG,
            mode=PER_TOKEN_CASES[name],
        )
        assert reduced[key].sum() >= 2, name


BYPASS_CASES = [
    RolloutCorrectionConfig(loss_type="ppo_clip", rollout_is=None),
    RolloutCorrectionConfig(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.2),
    RolloutCorrectionConfig(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0),
    RolloutCorrectionConfig(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.8_1.3"),
    RolloutCorrectionConfig(loss_type="reinforce", rollout_is="sequence", rollout_is_batch_normalize=True),
    RolloutCorrectionConfig(loss_type="reinforce", rollout_is="token", rollout_is_batch_normalize=True),
    RolloutCorrectionConfig(loss_type="ppo_clip", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    RolloutCorrectionConfig(loss_type="reinforce", rollout_rs="token_k2,seq_mean_k3", rollout_rs_threshold="0.02"),
    RolloutCorrectionConfig(loss_type="ppo_clip", rollout_rs="seq_sum_k1,seq_max_k2", rollout_rs_threshold="3.0,0.05"),
]


def _token_rejection(corr: RolloutCorrectionConfig) -> bool:
    return corr.rollout_rs is not None and any(o.startswith("token_") for o in corr.rollout_rs.split(","))


BYPASS_AGG_CASES = [
    (case, agg)
    for case in range(len(BYPASS_CASES))
    for agg in AGG_MODES
    if not (agg == "seq-mean-token-mean" and _token_rejection(BYPASS_CASES[case]))
]
"""Every case x agg mode but the documented difference (test_bypass_token_rejection_under_seq_mean_token_mean...)."""


def _bypass_compare(core_algos, case: int, agg_mode: str):
    corr = BYPASS_CASES[case]
    d = make_inputs(20 + case, spread=0.15)
    mode = LossModeConfig(loss_mode="bypass_mode", rollout_correction=corr)
    # verl's engine passes the mini-batch's counts from the original mask (rejected tokens count).
    info = {"dp_size": 1, "batch_num_tokens": d["mask"].sum(), "global_batch_size": len(d["mask"])}
    # verl's metrics are means over the kept tokens only; ours over every loss-mask token (documented).
    # seq-mean-token-mean: verl's sequence means divide by n_i + 1e-8 (a 1e-8 / n_i relative term per sequence,
    # which cancellation can lift above rtol 1e-6 of a small total): an absolute 1e-8 covers it.
    atol = 1e-8 if agg_mode == "seq-mean-token-mean" else ATOL
    metrics = corr.rollout_rs is None
    ours = compare(core_algos, d, CONFIG, mode, agg_mode, global_batch_info=info, metrics=metrics, atol=atol)
    ref = verl_objective(core_algos, d, CONFIG, mode, agg_mode, global_batch_info=info)
    return ours, ref


@pytest.mark.parametrize("case,agg_mode", BYPASS_AGG_CASES)
def test_bypass_mode_equals_verl(core_algos, case, agg_mode):
    """Value, gradient and the rollout_corr metrics we log, against verl's compute_policy_loss_bypass_mode."""
    (_, _, means), (_, _, verl_metrics) = _bypass_compare(core_algos, case, agg_mode)
    corr = BYPASS_CASES[case]
    logged = ["rollout_corr/rollout_rs_masked_fraction"] if corr.rollout_rs is not None else []
    if "rollout_corr/rollout_is_mean" in means and not corr.rollout_is_batch_normalize:
        logged.append("rollout_corr/rollout_is_mean")
    for key in logged:
        assert means[key] == pytest.approx(verl_metrics[key], rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("case", [c for c, corr in enumerate(BYPASS_CASES) if _token_rejection(corr)])
def test_bypass_token_rejection_under_seq_mean_token_mean_divides_by_every_loss_token(core_algos, case):
    """The documented difference (rollout_correction.py): verl divides a sequence's loss by its kept tokens,
    the loss contract by all its loss-mask tokens n_i, so the two differ here; every other agg mode agrees."""
    with pytest.raises(AssertionError):
        _bypass_compare(core_algos, case, "seq-mean-token-mean")


def test_the_cases_exercise_clipping_truncation_and_rejection():
    """Guards on the random cases above, so that the equality tests cover every branch: some tokens are
    clipped (vanilla, cispo, dppo), truncated or zeroed by the IS bounds, and rejected."""
    for name in ("vanilla", "cispo", "dppo_tv", "dppo_kl", "gspo", "geo_mean"):
        d = make_inputs(0, spread=SPREAD.get(name, 0.3))
        _, _, means = our_objective(d, CONFIG, PER_TOKEN_CASES[name], "token-mean")
        assert 0 < means["pg_clipfrac"] < 1, name
    for case, corr in enumerate(BYPASS_CASES):
        d = make_inputs(20 + case, spread=0.15)
        mode = LossModeConfig(loss_mode="bypass_mode", rollout_correction=corr)
        reduced = reference_reductions(
            log_probs=d["log_probs"],
            old_log_probs=d["old"],
            advantages=d["adv"],
            loss_mask=d["mask"],
            config=CONFIG,
            mode=mode,
        )
        on = d["mask"] > 0
        if corr.rollout_rs is not None:
            assert 0 < (reduced["bypass_keep_mask"][on] == 0).sum() < on.sum(), case
        if "bypass_is_weights" in reduced and not corr.rollout_is_batch_normalize:
            weights = reduced["bypass_is_weights"][on]
            upper = float(str(corr.rollout_is_threshold).split("_")[-1])
            bounded = (weights == 0) if "_" in str(corr.rollout_is_threshold) else (weights == upper)
            assert bounded.any() and not bounded.all(), case
