"""Every registered adv_estimator against verl 0.9.1's own function of the same name, on random inputs.

verl's tensors hold the response slice (B, R); ours hold whole rows (prompt + response + padding).
Each case builds both layouts of the same responses (random prompt lengths, dense random token
rewards, multi-turn masks with observation gaps where the estimator allows them) and compares on
the response tokens at rtol 1e-6 (verl runs on the float64 copies of our float32 inputs). Groups
have at least 2 rows where our documented convention differs from verl's for a group of one
(grpo, rloo and their vectorized twins); elsewhere singleton groups are included on purpose.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageParams
from verl_balance.algorithms.estimators import compute_advantage

RTOL, ATOL = 1e-6, 1e-6


@pytest.fixture(scope="module")
def core_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON)


def _algo_config(**kwargs):
    from verl.trainer.config import AlgoConfig

    return AlgoConfig(**kwargs)


def make_batch(*, seed: int, rows: int = 12, response: int = 9, gaps: bool = False, singletons: bool = True):
    """Both layouts of one random batch: verl's response slice and our whole rows."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response + 1, (rows,), generator=gen)
    mask = (torch.arange(response)[None, :] < lengths[:, None]).float()
    if gaps:  # tool-observation tokens inside the response (never the first token)
        holes = torch.rand(rows, response, generator=gen) < 0.25
        holes[:, 0] = False
        mask = mask * (~holes).float()
    rewards = torch.randn(rows, response, generator=gen) * mask
    rewards[::5] = 0.0  # rows scoring 0 (gpg counts non-zero scores)
    sizes = [1, 2, 3, 4, 2] if singletons else [2, 3, 4, 3]
    groups = np.concatenate([np.full(n, g) for g, n in enumerate(sizes * 3)])[:rows]
    uids = np.array([f"p{g}" for g in groups], dtype=object)[torch.randperm(rows, generator=gen).numpy()]
    prompt = torch.randint(1, 6, (rows,), generator=gen)
    width = int(prompt.max()) + response + 2
    verl = {
        "mask": mask,
        "rewards": rewards,
        "old_log_probs": -torch.rand(rows, response, generator=gen) * 3,
        "sum_pi_squared": torch.rand(rows, response, generator=gen) * 0.6,
        "is_weights": 0.5 + torch.rand(rows, response, generator=gen),
    }
    ours = {k: torch.zeros(rows, width) for k in verl}
    for i in range(rows):
        p = int(prompt[i])
        for k in verl:
            ours[k][i, p : p + response] = verl[k][i]
    return {"verl": verl, "ours": ours, "uids": uids, "prompt": prompt, "baselines": torch.randn(rows, generator=gen)}


def ours(batch, name, params=None, with_is=False, **extra):
    o = batch["ours"]
    inputs = AdvantageInputs(
        token_level_rewards=o["rewards"],
        response_mask=o["mask"],
        index=batch["uids"],
        old_log_probs=o["old_log_probs"],
        sum_pi_squared=o["sum_pi_squared"],
        rollout_is_weights=o["is_weights"] if with_is else None,
        reward_baselines=batch["baselines"],
        **extra,
    )
    out = compute_advantage(adv_estimator=name, inputs=inputs, params=params or AdvantageParams())
    response = batch["verl"]["mask"].shape[1]
    sliced = [torch.stack([t[i, p : p + response] for i, p in enumerate(batch["prompt"].tolist())]) for t in out]
    outside = o["mask"] == 0
    assert (out.advantages[outside] == 0).all(), f"{name}: advantages outside the response mask"
    return sliced


def assert_equal_on_mask(mine, ref, mask):
    on = mask > 0
    torch.testing.assert_close(mine[on].double(), ref.double()[on], rtol=RTOL, atol=ATOL)


def v64(batch, key):
    return batch["verl"][key].double()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_family(core_algos, seed, name, norm):
    batch = make_batch(seed=seed, singletons=False)
    fn = core_algos.get_adv_estimator_fn(name)
    ref, _ = fn(
        token_level_rewards=v64(batch, "rewards"),
        response_mask=v64(batch, "mask"),
        index=batch["uids"],
        norm_adv_by_std_in_grpo=norm,
    )
    adv, ret = ours(batch, name, AdvantageParams(norm_adv_by_std_in_grpo=norm))
    assert_equal_on_mask(adv, ref, batch["verl"]["mask"])
    assert_equal_on_mask(ret, ref, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drgrpo_is_verl_grpo_without_std(core_algos, seed):
    batch = make_batch(seed=seed, singletons=False)
    ref, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=v64(batch, "rewards"),
        response_mask=v64(batch, "mask"),
        index=batch["uids"],
        norm_adv_by_std_in_grpo=False,
    )
    assert_equal_on_mask(ours(batch, "drgrpo")[0], ref, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["rloo", "rloo_vectorized"])
def test_rloo_family(core_algos, seed, name):
    batch = make_batch(seed=seed, singletons=False)
    ref, _ = core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=v64(batch, "rewards"), response_mask=v64(batch, "mask"), index=batch["uids"]
    )
    assert_equal_on_mask(ours(batch, name)[0], ref, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["opo", "gpg", "reinforce_plus_plus_baseline"])
def test_group_baselines_with_singletons(core_algos, seed, name):
    batch = make_batch(seed=seed, gaps=seed == 2)
    ref, ref_ret = core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=v64(batch, "rewards"), response_mask=v64(batch, "mask"), index=batch["uids"]
    )
    adv, ret = ours(batch, name)
    assert_equal_on_mask(adv, ref, batch["verl"]["mask"])
    assert_equal_on_mask(ret, ref_ret, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(core_algos, seed, norm):
    batch = make_batch(seed=seed, singletons=False)
    ref, _ = core_algos.compute_grpo_passk_outcome_advantage(
        token_level_rewards=v64(batch, "rewards"),
        response_mask=v64(batch, "mask"),
        index=batch["uids"],
        config=_algo_config(norm_adv_by_std_in_grpo=norm),
    )
    params = AdvantageParams(norm_adv_by_std_in_grpo=norm)
    assert_equal_on_mask(ours(batch, "grpo_passk", params)[0], ref, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(core_algos, seed, gamma):
    batch = make_batch(seed=seed, gaps=True)
    ref, ref_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=v64(batch, "rewards"), response_mask=v64(batch, "mask"), config=_algo_config(gamma=gamma)
    )
    adv, ret = ours(batch, "reinforce_plus_plus", AdvantageParams(gamma=gamma))
    assert_equal_on_mask(adv, ref, batch["verl"]["mask"])
    assert_equal_on_mask(ret, ref_ret, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_remax(core_algos, seed):
    batch = make_batch(seed=seed, gaps=True)
    ref, ref_ret = core_algos.compute_remax_outcome_advantage(
        token_level_rewards=v64(batch, "rewards"),
        reward_baselines=batch["baselines"].double(),
        response_mask=v64(batch, "mask"),
    )
    adv, ret = ours(batch, "remax")
    assert_equal_on_mask(adv, ref, batch["verl"]["mask"])
    assert_equal_on_mask(ret, ref_ret, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baselines(core_algos, seed, name, with_is, zero_tail):
    # Gaps only for the multi-turn variant: verl's single-turn OTB indexes the slice by position.
    batch = make_batch(seed=seed, gaps=name.startswith("tir"))
    ref, ref_ret = core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=v64(batch, "rewards"),
        response_mask=v64(batch, "mask"),
        index=batch["uids"],
        old_log_probs=v64(batch, "old_log_probs"),
        sum_pi_squared=v64(batch, "sum_pi_squared"),
        rollout_is_weights=v64(batch, "is_weights") if with_is else None,
        handle_zero_tail=zero_tail,
    )
    adv, ret = ours(batch, name, AdvantageParams(otb_handle_zero_tail=zero_tail), with_is=with_is)
    assert_equal_on_mask(adv, ref, batch["verl"]["mask"])
    assert_equal_on_mask(ret, ref_ret, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_without_components_is_whitened_grpo(core_algos, seed, norm):
    batch = make_batch(seed=seed)
    ref, _ = core_algos.compute_gdpo_outcome_advantage(
        token_level_rewards=v64(batch, "rewards"),
        response_mask=v64(batch, "mask"),
        index=batch["uids"],
        norm_adv_by_std_in_grpo=norm,
    )
    params = AdvantageParams(norm_adv_by_std_in_grpo=norm)
    assert_equal_on_mask(ours(batch, "gdpo", params)[0], ref, batch["verl"]["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weights", [None, [0.3, 2.0]])
def test_gdpo_with_reward_components(core_algos, seed, weights):
    batch = make_batch(seed=seed)
    mask = batch["verl"]["mask"]
    gen = torch.Generator().manual_seed(100 + seed)
    # verl casts the components to float32 before its statistics: small integers keep that exact enough.
    components = {k: torch.randint(0, hi, (len(mask),), generator=gen).float() for k, hi in (("format", 2), ("acc", 5))}
    prompt_width = 4
    verl_batch = {
        "prompts": torch.zeros(len(mask), prompt_width),
        "attention_mask": torch.cat([torch.ones(len(mask), prompt_width), mask], dim=1).long(),
    }
    keys = ["format", "acc"]
    ref, _ = core_algos.compute_gdpo_outcome_advantage(
        token_level_rewards=v64(batch, "rewards"),
        response_mask=v64(batch, "mask"),
        index=batch["uids"],
        config=_algo_config(gdpo_reward_keys=keys, gdpo_reward_weights=weights),
        non_tensor_batch={k: v.numpy() for k, v in components.items()},
        batch=verl_batch,
    )
    params = AdvantageParams(gdpo_reward_keys=keys, gdpo_reward_weights=weights)
    assert_equal_on_mask(ours(batch, "gdpo", params, reward_components=components)[0], ref, mask)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_random_batches_trigger_the_zero_tail(seed):
    """Guard: the OTB cases above differ with and without handle_zero_tail, so both branches are compared."""
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        batch = make_batch(seed=seed, gaps=name.startswith("tir"))
        cut = ours(batch, name, AdvantageParams(otb_handle_zero_tail=True))[0]
        kept = ours(batch, name, AdvantageParams(otb_handle_zero_tail=False))[0]
        assert not torch.equal(cut, kept), name
