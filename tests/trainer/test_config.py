"""The recipe configs as typed objects (no Ray): each section is its component's config, the YAML
recipe values reach the components unchanged, and errors name the full key."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from omegaconf import OmegaConf

from tests.trainer import recipe_snapshot
from tests.trainer.conftest import compose_config
from verl_balance.algorithms import PolicyLossConfig
from verl_balance.data.sft_dataset import SFTDataConfig
from verl_balance.engine.config import OptimConfig
from verl_balance.trainer.config import SFT_ENGINE_KEYS, ConfigError, build_engine_config, qualify, validate_sft
from verl_balance.trainer.grpo_config import GRPO_ENGINE_KEYS, register_grpo_schema, validate_grpo

register_grpo_schema()

# The optimizer settings the recipes ran with before the sections nested OptimConfig (read off
# the old trainer schema defaults + YAML): behaviour must not change.
SFT_RECIPE_OPTIM = dict(
    lr=1e-3,
    weight_decay=0.01,
    betas=[0.9, 0.95],
    eps=1e-8,
    clip_grad=1.0,
    warmup_steps_ratio=0.05,
    lr_scheduler="cosine",
    min_lr_ratio=0.1,
)
GRPO_RECIPE_OPTIM = dict(
    lr=1e-4,
    weight_decay=0.0,
    betas=[0.9, 0.95],
    eps=1e-8,
    clip_grad=1.0,
    warmup_steps_ratio=0.0,
    lr_scheduler="constant",
    min_lr_ratio=0.1,
)


def test_optim_sections_are_the_engine_optim_config():
    assert OmegaConf.get_type(compose_config("sft", []).optim) is OptimConfig
    assert OmegaConf.get_type(compose_config("grpo", []).actor_rollout_ref.actor.optim) is OptimConfig


@pytest.mark.parametrize("recipe, expected", [("sft", SFT_RECIPE_OPTIM), ("grpo", GRPO_RECIPE_OPTIM)])
def test_recipe_values_reach_the_engine_unchanged(recipe, expected):
    cfg = compose_config(recipe, [])
    if recipe == "sft":
        config = validate_sft(cfg)
        optim, agg, scale, dtype, keys = (
            config.optim,
            config.loss_agg_mode,
            config.loss_scale_factor,
            config.model.param_dtype,
            SFT_ENGINE_KEYS,
        )
    else:
        config = validate_grpo(cfg)
        actor = config.actor_rollout_ref.actor
        optim, agg, scale, dtype, keys = (
            actor.optim,
            actor.loss_agg_mode,
            actor.loss_scale_factor,
            config.actor_rollout_ref.model.param_dtype,
            GRPO_ENGINE_KEYS,
        )
    engine = build_engine_config(
        optim=optim, loss_agg_mode=agg, loss_scale_factor=scale, param_dtype=dtype, seed=1, total_steps=100, keys=keys
    )
    assert dataclasses.asdict(engine.optim) == expected
    assert engine.warmup_steps == round(expected["warmup_steps_ratio"] * 100)
    assert (engine.loss_agg_mode, engine.param_dtype) == ("token-mean", "float32")


def test_sft_data_section_is_the_dataset_config():
    config = validate_sft(compose_config("sft", ["data.max_length=300", "data.truncation=left"]))
    assert isinstance(config.data, SFTDataConfig)
    assert config.data.dataset_config() == SFTDataConfig(max_length=300, truncation="left")
    assert validate_sft(compose_config("sft", [])).data.max_length == 512  # the recipe's value


def test_actor_section_is_the_policy_loss_config():
    config = validate_grpo(
        compose_config(
            "grpo",
            [
                "actor_rollout_ref.actor.clip_ratio_high=0.28",
                "actor_rollout_ref.actor.use_kl_loss=true",
                "actor_rollout_ref.actor.kl_loss_type=k3",
            ],
        )
    )
    actor = config.actor_rollout_ref.actor
    assert isinstance(actor, PolicyLossConfig)
    assert actor.policy_loss() == PolicyLossConfig(clip_ratio_high=0.28, use_kl_loss=True, kl_loss_type="low_var_kl")


@pytest.mark.parametrize("value", [True, False])
def test_balance_dp_token_false_is_rejected_naming_the_key(value):
    cfg = compose_config("sft", [f"data.balance_dp_token={str(value).lower()}"])
    if value:
        validate_sft(cfg)
    else:
        with pytest.raises(ConfigError, match=r"data\.balance_dp_token=false .*always"):
            validate_sft(cfg)


@pytest.mark.parametrize(
    "recipe, override, key",
    [
        ("sft", "optim.lr=0", "optim.lr"),
        ("sft", "optim.betas=[0.9,1.5]", "optim.betas"),
        ("sft", "model.param_dtype=fp8", "model.param_dtype"),
        ("sft", "trainer.logger=[stdout]", "trainer.logger"),
        ("sft", "data.use_dynamic_bsz=true", None),
        ("grpo", "actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr"),
        ("grpo", "actor_rollout_ref.actor.clip_ratio_low=1.5", "actor_rollout_ref.actor.clip_ratio_low"),
        (
            "grpo",
            "actor_rollout_ref.rollout.val_kwargs.temperature=-1",
            "actor_rollout_ref.rollout.val_kwargs.temperature",
        ),
        ("grpo", "actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p"),
        ("grpo", "custom_reward_function.name=score", "custom_reward_function.path"),
        ("sft", "model.logits_chunk_size=-1", "model.logits_chunk_size"),
        ("grpo", "actor_rollout_ref.actor.logits_chunk_size=-1", "actor_rollout_ref.actor.logits_chunk_size"),
        ("grpo", "actor_rollout_ref.actor.logits_chunk_size=0", None),
    ],
)
def test_component_config_errors_name_the_full_key(recipe, override, key):
    validate = validate_sft if recipe == "sft" else validate_grpo
    cfg = compose_config(recipe, [override])
    if key is None:  # negative control: a valid override passes
        validate(cfg)
        return
    with pytest.raises(ConfigError, match=r"(^|\s)" + re.escape(key) + r"\b"):
        validate(cfg)


def test_qualify_writes_bare_keys_in_full_and_leaves_values_alone():
    prefixes = {"lr": "optim.", "clip_grad": "optim.", "optim": "actor."}
    assert (
        qualify("lr=0 must be > 0; clip_grad='lr' and optim.eps stay", prefixes)
        == "optim.lr=0 must be > 0; optim.clip_grad='lr' and actor.optim.eps stay"
    )


# ---------------------------------------------------------------------- component configs vs the snapshot
@pytest.fixture(scope="module")
def snapshot_root(tmp_path_factory):
    return tmp_path_factory.mktemp("recipe_snapshot")


def _field_diff(expected, actual, key: str = "") -> list[str]:
    """Every leaf where two JSON trees differ, as 'key: expected -> actual'."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for name in sorted(set(expected) | set(actual)):
            sub = f"{key}.{name}" if key else name
            if name not in actual or name not in expected:
                out.append(f"{sub}: {expected.get(name, '<absent>')!r} -> {actual.get(name, '<absent>')!r}")
            else:
                out += _field_diff(expected[name], actual[name], sub)
        return out
    return [] if expected == actual else [f"{key}: {expected!r} -> {actual!r}"]


@pytest.mark.parametrize("case", sorted(recipe_snapshot.CASES))
def test_engine_configs_from_recipes_equal_pre_refactor_snapshot(case, snapshot_root):
    expected = json.loads(recipe_snapshot.SNAPSHOT.read_text())[case]
    recipe, overrides = recipe_snapshot.CASES[case]
    actual = recipe_snapshot.component_configs(recipe, overrides, snapshot_root)
    diff = _field_diff(expected, actual)
    assert not diff, f"{case}: component configs differ from the snapshot:\n" + "\n".join(diff)


def test_snapshot_diff_names_a_changed_engine_field():
    # Negative control: the comparison sees one changed leaf deep in the engine config.
    expected = json.loads(recipe_snapshot.SNAPSHOT.read_text())["sft_defaults"]
    changed = json.loads(json.dumps(expected))
    changed["engine"]["optim"]["lr"] *= 2
    assert _field_diff(expected, changed) == [
        f"engine.optim.lr: {expected['engine']['optim']['lr']!r} -> {changed['engine']['optim']['lr']!r}"
    ]
