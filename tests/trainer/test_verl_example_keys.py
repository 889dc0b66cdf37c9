"""Every override of verl's FSDP example scripts (tests/data/verl_example_overrides/, 46 scripts:
examples/*_trainer/*fsdp*.sh and examples/sft/**/*fsdp*.sh of verl 1dda039b9) is accepted by our
recipes, honoured or named in the start-up line; only values this project cannot honour are refused.

Keys of the RL algorithm set (``algorithm.*``, ``actor.policy_loss.*``...) belong to another
change: they are checked here only once the GRPO schema declares them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.trainer.conftest import compose_config
from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.cli import _lookup, _verl_keys
from verl_balance.trainer.config.grpo import register_grpo_schema
from verl_balance.trainer.config.verl_keys import docs_table, lookup, startup_line, target_of, translate

register_grpo_schema()  # compose_config("grpo", ...) needs the GRPO schema in Hydra's store

DATA = Path(__file__).resolve().parents[1] / "data" / "verl_example_overrides"
SCRIPTS = sorted(p.stem for p in DATA.glob("*.txt"))
DOCS = Path(__file__).resolve().parents[2] / "docs" / "verl_keys.md"

ALGORITHM_KEYS = (
    "algorithm.",
    "actor_rollout_ref.actor.policy_loss.",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.kl_loss_",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.entropy_coeff",
)
"""Owned by the algorithm change (issue 30 item 2): accepted once the schema declares them."""

REFUSED = {
    "actor_rollout_ref.rollout.name": ("vllm", "sglang"),
    "actor_rollout_ref.actor.strategy": ("fsdp_turbo",),
    "actor_rollout_ref.ref.strategy": ("fsdp_turbo",),
    "engine": ("megatron",),
    "optim": ("megatron",),
    "distillation.enabled": ("true",),
    "reward.reward_model.enable": ("true",),
    "reward.reward_manager.name": ("gdpo",),
    "data.custom_cls.path": ("recipe/minicpmo/rl_dataset.py",),
}
"""Values this project cannot honour (no vLLM/SGLang rollout, no Megatron, no distillation, no
reward model, no custom dataset class): refused naming the key."""


def _overrides(script: str) -> list[str]:
    lines = (DATA / f"{script}.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def _recipe(script: str) -> str:
    return "sft" if script.startswith("sft__") else "grpo"


def _key(line: str) -> str:
    return line.partition("=")[0].lstrip("+")


def _refused(line: str) -> bool:
    key, _, value = line.partition("=")
    return value.strip("'\"").lower() in REFUSED.get(key.lstrip("+"), ())


def _declared(key: str, recipe: str) -> bool:
    from verl_balance.trainer.config.grpo import GRPOConfig
    from verl_balance.trainer.config.sft import SFTConfig

    return _lookup(OmegaConf.structured(GRPOConfig if recipe == "grpo" else SFTConfig), key)[0]


def test_every_verl_example_script_is_stored():
    assert len(SCRIPTS) == 46
    assert sum(s.startswith("sft__") for s in SCRIPTS) == 9


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_override_of_a_verl_script_is_accepted_or_logged(script):
    recipe = _recipe(script)
    lines = [
        line
        for line in _overrides(script)
        if not _refused(line) and (not _key(line).startswith(ALGORITHM_KEYS) or _declared(_key(line), recipe))
    ]
    args, no_effect = translate(lines, recipe=recipe)
    compose_config(recipe, args)  # Hydra refuses an unknown key or a value of the wrong type
    line = startup_line(no_effect, recipe=recipe) or ""
    for key in no_effect:
        assert lookup(key, recipe=recipe).status == "no_effect"
        assert key in line
    kept = {_key(a) for a in args}
    for given in lines:  # every line is either in the composed config or named in the start-up line
        key = _key(given)
        entry = lookup(key, recipe=recipe)
        assert (entry is not None and entry.status == "no_effect" and key in line) or (
            (target_of(key, entry) if entry else key) in kept
        ), given


@pytest.mark.parametrize(
    "script,line",
    [(s, line) for s in SCRIPTS for line in _overrides(s) if _refused(line)],
)
def test_a_value_this_project_cannot_honour_is_refused_naming_the_key(script, line):
    key = _key(line)
    if key == "actor_rollout_ref.rollout.name":
        from verl_balance.trainer.config.grpo import RolloutSection

        with pytest.raises(ConfigError, match=r"name.*kv_cache"):
            RolloutSection(name=line.partition("=")[2])
        return
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        translate([line], recipe=_recipe(script))


def test_startup_line_names_each_no_effect_key_once_with_its_reason():
    keys = ["actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.enforce_eager"]
    _, no_effect = translate([f"{keys[0]}=0.6", f"{keys[1]}=True", f"{keys[0]}=0.6"], recipe="grpo")
    line = startup_line(no_effect, recipe="grpo")
    assert line.count(keys[0]) == 1 and line.count(keys[1]) == 1
    assert "vLLM" in line
    assert startup_line([], recipe="grpo") is None


def test_run_recipe_rewrites_the_command_line_and_returns_the_startup_line(monkeypatch):
    monkeypatch.setattr(
        sys, "argv", ["main_grpo", "data.max_response_length=48", "actor_rollout_ref.rollout.mode=async"]
    )
    line = _verl_keys("grpo")
    assert sys.argv[1:] == ["actor_rollout_ref.rollout.response_length=48"]
    assert "actor_rollout_ref.rollout.mode" in line


def test_honoured_grpo_keys_reach_the_typed_config(tmp_path):
    from verl_balance.trainer.config.grpo import GRPOConfig

    args, _ = translate(
        [
            "data.max_response_length=48",
            "actor_rollout_ref.rollout.prompt_length=96",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4000",
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
            "reward.custom_reward_function.path=/r.py",
            "reward.custom_reward_function.name=score",
            "trainer.logger=console",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.n_gpus_per_node=2",
        ],
        recipe="grpo",
    )
    cfg = GRPOConfig.from_hydra(compose_config("grpo", args))
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.response_length, cfg.data.max_prompt_length) == (48, 96)
    assert (rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_max_token_len_per_gpu) == (3, 4000)
    assert cfg.sp_size == 2
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == ("/r.py", "score")
    assert cfg.trainer.logger == ["console"]


def test_ray_init_keys_reach_the_typed_config_and_ray_init(tmp_path):
    from verl_balance.trainer import cluster
    from verl_balance.trainer.config.grpo import GRPOConfig

    lines = [
        "ray_kwargs.ray_init.num_cpus=3",
        "ray_kwargs.ray_init.runtime_env.py_executable=null",
        "+ray_kwargs.ray_init.runtime_env.env_vars.TRANSFER_QUEUE_ENABLE=1",
        f"trainer.default_local_dir={tmp_path}",
    ]
    args, no_effect = translate(lines, recipe="grpo")
    assert no_effect == []
    cfg = GRPOConfig.from_hydra(compose_config("grpo", args))
    _, kwargs = cluster.ray_init_arguments(address=cfg.trainer.ray_address, ray_init=cfg.ray_kwargs.ray_init)
    assert kwargs["num_cpus"] == 3
    assert kwargs["runtime_env"]["env_vars"]["TRANSFER_QUEUE_ENABLE"] == "1"
    assert "py_executable" not in kwargs["runtime_env"]  # null left out, as verl does


def test_honoured_sft_keys_reach_the_typed_config(tmp_path):
    from verl_balance.trainer.config.sft import SFTConfig

    args, no_effect = translate(
        [
            "engine=fsdp",
            "engine.ulysses_sequence_parallel_size=2",
            "model.use_remove_padding=true",
            "optim.lr_warmup_steps_ratio=0.2",
            "optim.lr_decay_style=cosine",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.n_gpus_per_node=4",
        ],
        recipe="sft",
    )
    assert no_effect == ["engine"]
    cfg = SFTConfig.from_hydra(compose_config("sft", args))
    assert (cfg.ulysses_sequence_parallel_size, cfg.use_remove_padding) == (2, True)
    assert (cfg.optim.warmup_steps_ratio, cfg.optim.lr_scheduler) == (0.2, "cosine")


def test_verls_legacy_multiturn_sft_keys_are_honoured_or_named_with_their_meaning(tmp_path):
    from verl_balance.trainer.config.sft import SFTConfig

    legacy = ["data.multiturn.enable=true", "data.multiturn.messages_key=conversation", "data.multiturn.tools_key=t"]
    args, no_effect = translate([*legacy, f"trainer.default_local_dir={tmp_path}"], recipe="sft")
    assert SFTConfig.from_hydra(compose_config("sft", args)).data.messages_key == "conversation"
    assert no_effect == ["data.multiturn.enable", "data.multiturn.tools_key"]
    line = startup_line(no_effect, recipe="sft")
    assert "data.multiturn.enable (verl's legacy switch to chat data: here each file is read as chats" in line
    assert "data.multiturn.tools_key (verl's multi-turn dataset passes a row's tool schemas" in line
    with pytest.raises(ConfigError, match="data.multiturn.enable"):  # negative control: not a boolean
        translate(["data.multiturn.enable=sometimes"], recipe="sft")
    assert lookup("data.multiturn.enable", recipe="grpo") is None  # an SFT key only


@pytest.mark.parametrize(
    "args",
    [
        ["data.max_response_length=48", "actor_rollout_ref.rollout.response_length=32"],
        ["reward.custom_reward_function.path=/a.py", "custom_reward_function.path=/b.py"],
    ],
)
def test_two_spellings_set_to_different_values_are_refused(args):
    with pytest.raises(ConfigError, match="different values"):
        translate(args, recipe="grpo")


def test_two_spellings_set_to_the_same_value_are_one_override():
    args, _ = translate(
        ["custom_reward_function.path=/a.py", "reward.custom_reward_function.path=/a.py"], recipe="grpo"
    )
    assert args == ["custom_reward_function.path=/a.py"]


def test_docs_table_equals_the_generated_one():
    assert DOCS.read_text() == docs_table(), (
        "regenerate: python -m verl_balance.trainer.config.verl_keys > docs/verl_keys.md"
    )


def test_offload_and_critic_keys_reach_the_engines_and_the_offload_decision(tmp_path):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from verl_balance.engine.offload import cpu_offload_policy
    from verl_balance.trainer.config.grpo import GRPOConfig

    args, no_effect = translate(
        [
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "critic.fsdp.optimizer_offload=True",
            "critic.model.enable_gradient_checkpointing=True",
            "critic.model.use_remove_padding=True",
            f"trainer.default_local_dir={tmp_path}",
        ],
        recipe="grpo",
    )
    assert no_effect == ["actor_rollout_ref.ref.fsdp_config.param_offload"]  # the reference runs on the actor
    cfg = GRPOConfig.from_hydra(compose_config("grpo", args))
    actor_fsdp = cfg.engine_config(total_steps=1).fsdp
    critic_fsdp = cfg.critic_engine_config(total_steps=1).fsdp
    assert (actor_fsdp.param_offload, actor_fsdp.optimizer_offload) == (True, True)
    assert (critic_fsdp.param_offload, critic_fsdp.optimizer_offload) == (False, True)
    assert isinstance(cpu_offload_policy(actor_fsdp, device_type="cuda"), CPUOffloadPolicy)
    assert cpu_offload_policy(actor_fsdp, device_type="cpu") is None
    assert cfg.critic.model.enable_gradient_checkpointing is True


def test_max_inflight_gen_batches_is_accepted_with_no_effect_and_named_with_its_reason():
    key = "algorithm.filter_groups.max_inflight_gen_batches"
    args, no_effect = translate(["algorithm.filter_groups.enable=true", f"{key}=4"], recipe="grpo")
    assert args == ["algorithm.filter_groups.enable=true"] and no_effect == [key]
    line = startup_line(no_effect, recipe="grpo")
    assert f"{key} (dynamic sampling generates one whole prompt batch at a time" in line
    # The schema does not declare it, so without the registry Hydra refuses it (no silent no-op).
    assert not _declared(key, "grpo")
    with pytest.raises(Exception, match="max_inflight_gen_batches"):
        compose_config("grpo", [f"{key}=4"])


def _rollout_names(reason: str) -> list[str]:
    """The names a reason lists after 'rollout.name is ', parenthetical notes removed."""
    clause = re.sub(r" \([^)]*\)", "", re.search(r"rollout\.name is (.*?): ", reason).group(1))
    return re.findall(r"(?:^|, | or )(\w+)", clause)


def test_vllm_setting_reason_lists_exactly_the_rollout_backends():
    from verl_balance.rollout.factory import ROLLOUT_BACKENDS

    reason = lookup("actor_rollout_ref.rollout.gpu_memory_utilization", recipe="grpo").reason
    assert _rollout_names(reason) == list(ROLLOUT_BACKENDS)
    # Negative control: the former wording ("kv_cache or hf") misses auto.
    assert _rollout_names("rollout.name is kv_cache or hf: x") != list(ROLLOUT_BACKENDS)
