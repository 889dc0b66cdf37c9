"""One home per engine key: each is one field of one group of ``engine.config`` (``ENGINE_KEY_GROUPS``),
which EngineConfig, the recipe sections and the verl backend's config inherit; the recipes' key maps
are derived from the groups, and no config class writes an engine key's default a second time.
(The recipe YAML repeating a schema default is test_config.py's
``test_recipe_yaml_holds_only_values_that_differ_from_the_schema``.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections import defaultdict

import pytest

from tests._verl import VERL_SKIP_REASON
from tests.trainer.conftest import compose_config
from verl_balance.engine.config import (
    ENGINE_FIELD,
    ENGINE_KEY_GROUPS,
    ActorKeys,
    CriticFSDPKeys,
    EngineConfig,
    KernelKeys,
    LoRAKeys,
)
from verl_balance.trainer.config import ConfigError
from verl_balance.trainer.config.grpo import GRPOConfig, register_grpo_schema, validate_grpo
from verl_balance.trainer.config.sft import SFTConfig, validate_sft

register_grpo_schema()

# The maps as they were written by hand before they were derived (issue 32): the recipe keys a
# user sets must not move.
LORA = ("lora_rank", "lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path")
SFT_KEYS = {
    "optim": "optim",
    "loss_agg_mode": "loss_agg_mode",
    "loss_scale_factor": "loss_scale_factor",
    "param_dtype": "model.param_dtype",
    "fsdp": "model.fsdp_config",
    "logits_chunk_size": "model.logits_chunk_size",
    **{k: f"model.{k}" for k in LORA},
}
GRPO_KEYS = {
    "optim": "actor_rollout_ref.actor.optim",
    "loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
    "loss_scale_factor": "actor_rollout_ref.actor.loss_scale_factor",
    "param_dtype": "actor_rollout_ref.model.param_dtype",
    "fsdp": "actor_rollout_ref.actor.fsdp_config",
    "logits_chunk_size": "actor_rollout_ref.actor.logits_chunk_size",
    **{k: f"actor_rollout_ref.model.{k}" for k in LORA},
}
CRITIC_KEYS = {
    "optim": "critic.optim",
    "loss_agg_mode": "critic.loss_agg_mode",
    "loss_scale_factor": "critic.loss_scale_factor",
    "param_dtype": "actor_rollout_ref.model.param_dtype",
    "fsdp": "critic.fsdp",  # verl's own critic section (issue 30): it was the actor's fsdp_config
}


def test_derived_engine_key_maps_keep_every_key_of_the_hand_written_ones_they_replace():
    # A key added later extends the maps (the next test checks they hold every group field).
    assert SFT_KEYS.items() <= SFTConfig.engine_keys().items()
    assert GRPO_KEYS.items() <= GRPOConfig.engine_keys().items()
    assert GRPOConfig.critic_engine_keys() == CRITIC_KEYS


def _engine_names(group: type) -> set[str]:
    return {f.metadata.get(ENGINE_FIELD, f.name) for f in dataclasses.fields(group)}


def test_every_recipe_key_group_field_reaches_the_engine_and_every_engine_field_exists():
    recipe_groups = set().union(*(_engine_names(g) for g in ENGINE_KEY_GROUPS if g is not KernelKeys))
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert recipe_groups <= engine_fields, recipe_groups - engine_fields
    assert set(SFTConfig.engine_keys()) == set(GRPOConfig.engine_keys()) == recipe_groups
    critic_own = _engine_names(ActorKeys) | _engine_names(CriticFSDPKeys)
    assert set(GRPOConfig.critic_engine_keys()) == critic_own | set(GRPOConfig.CRITIC_SHARED_KEYS)


def test_critic_fsdp_and_model_keys_reach_the_critic_engine_and_model(tmp_path):
    from types import SimpleNamespace

    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    gae = ["algorithm.adv_estimator=gae", f"trainer.default_local_dir={tmp_path}"]
    config = validate_grpo(
        compose_config(
            "grpo",
            [*gae, "critic.fsdp.reshard_after_forward=false", "critic.model.enable_gradient_checkpointing=true"],
        )
    )
    assert config.critic_engine_config(total_steps=1).fsdp.reshard_after_forward is False
    assert config.engine_config(total_steps=1).fsdp.reshard_after_forward is True  # the actor keeps its own
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    model = config.actor_rollout_ref.model.model_config(vocab_size=300)
    trainer.config, trainer.model_config, trainer.total_steps, trainer.sp = config, model, 1, 1
    trainer.tokenizer = SimpleNamespace(vocab_size=300)
    assert model.enable_gradient_checkpointing is False
    assert trainer._critic_worker_config().model.enable_gradient_checkpointing is True
    plain = validate_grpo(compose_config("grpo", gae))  # negative control: null = the actor's setting
    trainer.config = plain
    assert trainer._critic_worker_config().model.enable_gradient_checkpointing is False
    with pytest.raises(ConfigError, match=r"critic\.model\.use_remove_padding=false"):
        validate_grpo(compose_config("grpo", [*gae, "critic.model.use_remove_padding=false"]))


@pytest.mark.parametrize(
    "recipe, overrides, key",
    [
        ("sft", ["loss_agg_mode=seq-mean-token-sum-norm"], "loss_scale_factor"),
        ("grpo", ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"], "actor_rollout_ref.actor"),
        ("grpo", ["algorithm.adv_estimator=gae", "critic.loss_agg_mode=seq-mean-token-sum-norm"], "critic"),
        ("grpo", ["algorithm.adv_estimator=gae", "critic.loss_agg_mode=seq-mean-token-sum-norm"], None),
    ],
)
def test_an_engine_error_names_the_recipe_key_of_the_derived_map(recipe, overrides, key):
    # EngineConfig's error names its fields; the derived map writes them as the user's keys.
    validate = validate_sft if recipe == "sft" else validate_grpo
    if key is None:  # negative control: the same run with the constant C set is valid
        validate(compose_config(recipe, [*overrides, "critic.loss_scale_factor=32"]))
        return
    prefix = "" if key == "loss_scale_factor" else f"{key}."
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(prefix)}loss_agg_mode='seq-mean-token-sum-norm' needs "
        rf"{re.escape(prefix)}loss_scale_factor > 0",
    ):
        validate(compose_config(recipe, overrides))


# ---------------------------------------------------------------------- one default per key
def _config_classes(roots) -> set[type]:
    """Every dataclass of the package reachable from ``roots``: their bases and nested sections."""
    seen: set[type] = set()
    todo = list(roots)
    while todo:
        cls = todo.pop()
        for c in cls.__mro__:
            if dataclasses.is_dataclass(c) and c.__module__.startswith(("verl_balance", __name__)) and c not in seen:
                seen.add(c)
                nested = [f.default_factory for f in dataclasses.fields(c) if isinstance(f.default_factory, type)]
                todo += [n for n in nested if dataclasses.is_dataclass(n)]
    return seen


def _nested(f: dataclasses.Field) -> bool:
    return isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return f"{type(value).__name__}()" if dataclasses.is_dataclass(value) else repr(value)
    return repr(f.default)


def repeated_engine_defaults(roots) -> list[str]:
    """Each engine key whose same default value is written by two or more classes, naming them. A
    nested config (``optim``, ``fsdp_config``) is not a value: its defaults are its own class's
    fields, which the scan reaches."""
    keys = {f.name for g in ENGINE_KEY_GROUPS for f in dataclasses.fields(g)}
    written: dict[tuple[str, str], list[str]] = defaultdict(list)
    for cls in _config_classes(roots):
        own = vars(cls).get("__annotations__", {})
        for f in dataclasses.fields(cls):
            if f.name in own and f.name in keys and not _nested(f):
                written[(f.name, _default(f))].append(f"{cls.__module__}.{cls.__qualname__}")
    return [f"{k}={d} in {' and '.join(sorted(c))}" for (k, d), c in sorted(written.items()) if len(c) > 1]


def _roots() -> list[type]:
    roots = [SFTConfig, GRPOConfig, EngineConfig]
    if importlib.util.find_spec("verl") is not None:  # the verl backend's own config, when verl is installed
        from verl_balance.integrations.verl.engine import VerlBalanceEngineConfig

        roots.append(VerlBalanceEngineConfig)
    return roots


def test_no_engine_key_default_is_written_twice():
    assert repeated_engine_defaults(_roots()) == []
    # The scan sees every declaration: the critic's own loss_agg_mode (null = the actor's) is one.
    classes = _config_classes(_roots())
    declared = {
        c.__qualname__: _default(f)
        for c in classes
        for f in dataclasses.fields(c)
        if f.name == "loss_agg_mode" and "loss_agg_mode" in vars(c).get("__annotations__", {})
    }
    assert declared == {"ActorKeys": "'token-mean'", "CriticSection": "None"}


@dataclasses.dataclass
class _PlantedSection:
    lora_alpha: float = 16.0


def test_a_planted_second_default_is_found_naming_both_classes():
    # Negative control: a section writing LoRAKeys' lora_alpha default again fails, naming both.
    found = repeated_engine_defaults([*_roots(), _PlantedSection])
    assert found == [f"lora_alpha=16.0 in {__name__}._PlantedSection and verl_balance.engine.config.LoRAKeys"]


def test_the_verl_backend_reads_the_lora_and_kernel_keys_by_their_group_names():
    pytest.importorskip("verl", reason=VERL_SKIP_REASON)
    from types import SimpleNamespace

    from verl_balance.integrations.verl.engine import VerlBalanceEngineConfig, _lora_keys, _our_engine_config

    class Optim:
        lr, weight_decay, betas, clip_grad = 1e-3, 0.0, (0.9, 0.95), 1.0

    values = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ("q_proj",), "exclude_modules": None}
    model = SimpleNamespace(**values, lora_adapter_path="/adapter")
    ours = _our_engine_config(VerlBalanceEngineConfig(attn_impl="sdpa_loop"), Optim(), model_config=model)
    assert {k: getattr(ours, k) for k in (*values, "lora_adapter_path")} == {
        **values,
        "lora_alpha": 8.0,
        "target_modules": ["q_proj"],
        "lora_adapter_path": "/adapter",
    }
    # Every LoRAKeys field is read from verl's model config by its name.
    assert _lora_keys(model).keys() == {f.name for f in dataclasses.fields(LoRAKeys)}
    assert ours.attn_impl == "sdpa_loop"
    assert VerlBalanceEngineConfig().attn_impl == KernelKeys.attn_impl == EngineConfig().attn_impl
