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
from verl_balance.trainer.config import ConfigError, qualify, validate_sft
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

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
    config = validate_sft(cfg) if recipe == "sft" else validate_grpo(cfg)
    engine = config.engine_config(total_steps=100)
    assert dataclasses.asdict(engine.optim) == expected
    assert engine.warmup_steps == round(expected["warmup_steps_ratio"] * 100)
    assert (engine.loss_agg_mode, engine.param_dtype) == ("token-mean", "float32")


def test_sft_data_section_is_the_dataset_config():
    config = validate_sft(compose_config("sft", ["data.max_length=300", "data.truncation=left"]))
    assert isinstance(config.data, SFTDataConfig)
    assert config.data.dataset_config() == SFTDataConfig(max_length=300, truncation="left")
    assert validate_sft(compose_config("sft", [])).data.max_length == 512  # the recipe's value


def test_sft_messages_key_is_unset_by_default_so_each_file_chooses_and_a_set_key_is_kept():
    # null: verl's default "messages" where the file has that column, else prompt_key/response_key, so
    # prompt/response files keep working (data.sft_dataset.chat_column; tests/data/test_sft_dataset.py).
    assert validate_sft(compose_config("sft", [])).data.messages_key is None
    assert validate_sft(compose_config("sft", ["data.messages_key=messages"])).data.messages_key == "messages"


# verl 0.9.1's rules, worked by hand for a 5-step run: sft_trainer saves and validates at the last step
# whatever the freq; the ppo trainer only when freq > 0 (then every freq steps and at the last step).
LAST_STEP_CASES = [
    ("sft", -1, [5]),
    ("sft", 2, [2, 4, 5]),
    ("sft", 5, [5]),
    ("grpo", -1, []),
    ("grpo", 2, [2, 4, 5]),
    ("grpo", 3, [3, 5]),
]


@pytest.mark.parametrize("recipe, freq, steps", LAST_STEP_CASES)
def test_save_and_validation_steps_follow_verls_trainers(recipe, freq, steps, tmp_path):
    overrides = [f"trainer.save_freq={freq}", f"trainer.test_freq={freq}", f"trainer.default_local_dir={tmp_path}"]
    cfg = compose_config(recipe, overrides)
    trainer = (validate_sft(cfg) if recipe == "sft" else validate_grpo(cfg)).trainer
    assert [s for s in range(1, 6) if trainer.save_due(s, is_last=s == 5)] == steps
    assert [s for s in range(1, 6) if trainer.validate_due(s, is_last=s == 5)] == steps


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
    assert actor.policy_loss_config() == PolicyLossConfig(
        clip_ratio_high=0.28, use_kl_loss=True, kl_loss_type="low_var_kl"
    )


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


# ---------------------------------------------------------------------- one spelling per key
def test_grpo_rollout_name_chooses_the_backend_of_the_model(snapshot_root):
    hf = recipe_snapshot.make_fixtures(snapshot_root)["<hf>"]
    run = f"trainer.default_local_dir={snapshot_root / 'run'}"
    cases = [([], "kv_cache"), (["actor_rollout_ref.rollout.name=kv_cache"], "kv_cache")]
    cases += [([f"actor_rollout_ref.model.path={hf}"], "hf")]
    cases += [([f"actor_rollout_ref.model.path={hf}", "actor_rollout_ref.rollout.name=hf"], "hf")]
    for overrides, backend in cases:
        assert validate_grpo(compose_config("grpo", overrides + [run])).rollout_backend == backend, overrides


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor_rollout_ref.rollout.name=naive"],
            r"actor_rollout_ref.rollout.name='naive' is not valid; "
            r"expected one of \['auto', 'kv_cache', 'hf', 'vllm'\]",
        ),
        (
            ["actor_rollout_ref.rollout.name=hf"],
            r"actor_rollout_ref.rollout.name: rollout backend 'hf' cannot "
            r"run the built-in model; expected one of \['auto', 'kv_cache'\]",
        ),
        (
            ["actor_rollout_ref.rollout.name=kv_cache", "actor_rollout_ref.model.path=<hf>"],
            r"'kv_cache' cannot run an HF model directory; expected one of \['auto', 'hf', 'vllm'\]",
        ),
    ],
)
def test_grpo_rollout_name_that_cannot_run_is_rejected_listing_valid_values(overrides, message, snapshot_root):
    hf = recipe_snapshot.make_fixtures(snapshot_root)["<hf>"]
    cfg = compose_config("grpo", [o.replace("<hf>", hf) for o in overrides])
    with pytest.raises(ConfigError, match=message):
        validate_grpo(cfg)


def test_rollout_factory_builds_the_backend_it_is_given():
    from verl_balance.models.config import ModelConfig
    from verl_balance.rollout import KVCacheRollout, RolloutInputError, build_rollout

    model = ModelConfig.preset("tiny")
    assert isinstance(build_rollout(model, backend="kv_cache", pad_token_id=0), KVCacheRollout)
    with pytest.raises(RolloutInputError, match="'hf' cannot run the built-in model"):
        build_rollout(model, backend="hf", pad_token_id=0)


def test_each_recipe_has_one_balance_switch():
    sft = validate_sft(compose_config("sft", ["balance.enable=false"]))
    assert not sft.balance_enabled
    grpo = validate_grpo(compose_config("grpo", ["trainer.balance_batch=false"]))
    assert not grpo.balance_enabled
    assert validate_grpo(compose_config("grpo", [])).balance_enabled
    # SFT's spelling in GRPO fails naming verl's key instead of being ignored.
    with pytest.raises(ConfigError, match=r"balance.enable=False .* set trainer.balance_batch=false"):
        validate_grpo(compose_config("grpo", ["balance.enable=false"]))


def test_grpo_top_level_ulysses_degree_is_verls_key():
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    config = validate_grpo(compose_config("grpo", ["ulysses_sequence_parallel_size=2"]))
    assert (config.sp_size, config.actor_rollout_ref.actor.ulysses_sequence_parallel_size) == (2, 2)
    assert validate_grpo(compose_config("grpo", [f"{key}=2", "ulysses_sequence_parallel_size=2"])).sp_size == 2
    with pytest.raises(ConfigError, match=rf"{key}=2 and ulysses_sequence_parallel_size=1 disagree"):
        validate_grpo(compose_config("grpo", [f"{key}=2", "ulysses_sequence_parallel_size=1"]))


def test_instantiation_builds_every_section_once(monkeypatch):
    # Each section's __post_init__ (its checks, any file it reads) runs once per config, however
    # deep the section sits (data.synthetic, actor_rollout_ref.rollout.val_kwargs, ...).
    from verl_balance.trainer.config import grpo as grpo_config

    calls: dict[str, int] = {}
    for cls in (grpo_config.GRPOSyntheticConfig, grpo_config.ValSamplingConfig, grpo_config.ActorModelSection):
        original = cls.__post_init__

        def counting(self, _original=original, _name=cls.__name__):
            calls[_name] = calls.get(_name, 0) + 1
            _original(self)

        monkeypatch.setattr(cls, "__post_init__", counting)
    validate_grpo(compose_config("grpo", []))
    assert calls == {"GRPOSyntheticConfig": 1, "ValSamplingConfig": 1, "ActorModelSection": 1}


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_recipe_yaml_holds_only_values_that_differ_from_the_schema(recipe):
    # A YAML value equal to the schema default would be a second copy of the default, to be kept
    # in step by hand; every key is still overridable without '+' because the schema is typed.
    from verl_balance.trainer.config.grpo import GRPOConfig
    from verl_balance.trainer.config.sft import SFTConfig

    yaml = OmegaConf.to_container(OmegaConf.load(recipe_snapshot.CONFIG_DIR / f"{recipe}.yaml"))
    for key in ("defaults", "hydra"):
        yaml.pop(key)
    schema = _leaves(OmegaConf.to_container(OmegaConf.structured(SFTConfig if recipe == "sft" else GRPOConfig)))

    def repeated(leaves: dict) -> dict:
        return {k: v for k, v in leaves.items() if schema.get(k, object()) == v}

    assert _leaves(yaml) and not repeated(_leaves(yaml)), f"config/{recipe}.yaml repeats schema defaults"
    # Negative control: a planted copy of a default is found.
    assert repeated({**_leaves(yaml), "trainer.nnodes": 1}) == {"trainer.nnodes": 1}
