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
from verl_balance.trainer.config.cli import _lookup, _verl_command_line
from verl_balance.trainer.config.grpo import GRPOConfig, register_grpo_schema
from verl_balance.trainer.config.sft import SFTConfig
from verl_balance.trainer.config.typed import check_known_keys
from verl_balance.trainer.config.verl_keys import command_line, docs_table, lookup, startup_line, target_of

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
    "actor_rollout_ref.rollout.name": ("sglang",),
    "actor_rollout_ref.actor.strategy": ("fsdp_turbo",),
    "actor_rollout_ref.ref.strategy": ("fsdp_turbo",),
    "engine": ("megatron",),
    "optim": ("megatron",),
    "distillation.enabled": ("true",),
    "reward.reward_model.enable": ("true",),
    "reward.reward_manager.name": ("gdpo",),
    "data.custom_cls.path": ("recipe/minicpmo/rl_dataset.py",),
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype": ("bf16",),
}
"""Values this project cannot honour (no SGLang rollout, no Megatron, no distillation, no
reward model, no custom dataset class, no bf16 gradient reduction): refused naming the key."""


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


SCHEMAS = {"grpo": GRPOConfig, "sft": SFTConfig}
ABSENT = object()


def _declared(key: str, recipe: str) -> bool:
    return _lookup(OmegaConf.structured(SCHEMAS[recipe]), key)[0]


def _translated(recipe: str, lines: list[str]):
    """(the composed config with verl's keys translated, the no-effect keys incl. config-group choices)."""
    cfg, no_effect = SCHEMAS[recipe].translate(compose_config(recipe, lines))
    return cfg, no_effect + command_line(lines, recipe=recipe)[1]


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
    cfg, no_effect = _translated(recipe, lines)  # Hydra refuses a value of the wrong type
    check_known_keys(cfg)  # no key left that neither the schema nor the table knows
    line = startup_line(no_effect, recipe=recipe) or ""
    for key in no_effect:
        assert lookup(key, recipe=recipe).status == "no_effect"
        assert key in line
    for given in lines:  # every line is either in the translated config or named in the start-up line
        key = _key(given)
        entry = lookup(key, recipe=recipe)
        assert (entry is not None and entry.status == "no_effect" and key in line) or (
            OmegaConf.select(
                cfg, target_of(key, entry) if entry is not None and entry.status == "honoured" else key, default=ABSENT
            )
            is not ABSENT
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
        _translated(_recipe(script), [line])


def test_startup_line_names_each_no_effect_key_once_with_its_reason():
    keys = ["actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.enforce_eager"]
    # vLLM keys of the schema, named when set to other than their defaults (0.5, False) with another rollout
    _, no_effect = _translated("grpo", [f"{keys[0]}=0.6", f"{keys[1]}=True", f"{keys[0]}=0.6"])
    line = startup_line(no_effect, recipe="grpo")
    assert line.count(keys[0]) == 1 and line.count(keys[1]) == 1
    assert "vLLM" in line
    assert startup_line([], recipe="grpo") is None


def test_run_recipe_lets_hydra_add_verl_keys_and_names_the_config_group_choices(monkeypatch):
    monkeypatch.setattr(
        sys, "argv", ["main_sft", "engine=fsdp", "engine.ulysses_sequence_parallel_size=2", "data.max_length=8"]
    )
    line = _verl_command_line("sft")
    # nothing translated on the command line: the composed config is (test_honoured_sft_keys_...)
    assert sys.argv[1:] == ["++engine.ulysses_sequence_parallel_size=2", "data.max_length=8"]
    assert line.startswith("verl keys accepted with no effect here: engine (")


def test_honoured_grpo_keys_reach_the_typed_config(tmp_path):
    args = [
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
    ]
    cfg = GRPOConfig.from_hydra(compose_config("grpo", args))
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.response_length, cfg.data.max_prompt_length) == (48, 96)
    assert (rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_max_token_len_per_gpu) == (3, 4000)
    assert cfg.sp_size == 2
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == ("/r.py", "score")
    assert cfg.trainer.logger == ["console"]


def test_ray_init_keys_reach_the_typed_config_and_ray_init(tmp_path):
    from verl_balance.trainer import cluster

    lines = [
        "ray_kwargs.ray_init.num_cpus=3",
        "ray_kwargs.ray_init.runtime_env.py_executable=null",
        "+ray_kwargs.ray_init.runtime_env.env_vars.TRANSFER_QUEUE_ENABLE=1",
        f"trainer.default_local_dir={tmp_path}",
    ]
    assert _translated("grpo", lines)[1] == []
    cfg = GRPOConfig.from_hydra(compose_config("grpo", lines))
    _, kwargs = cluster.ray_init_arguments(address=cfg.trainer.ray_address, ray_init=cfg.ray_kwargs.ray_init)
    assert kwargs["num_cpus"] == 3
    assert kwargs["runtime_env"]["env_vars"]["TRANSFER_QUEUE_ENABLE"] == "1"
    assert "py_executable" not in kwargs["runtime_env"]  # null left out, as verl does


def test_honoured_sft_keys_reach_the_typed_config(tmp_path):
    args = [
        "engine=fsdp",
        "engine.ulysses_sequence_parallel_size=2",
        "model.use_remove_padding=true",
        "optim.lr_warmup_steps_ratio=0.2",
        "optim.lr_decay_style=constant",
        f"trainer.default_local_dir={tmp_path}",
        "trainer.n_gpus_per_node=4",
    ]
    assert _translated("sft", args)[1] == ["engine"]
    cfg = SFTConfig.from_hydra(compose_config("sft", args))
    assert (cfg.ulysses_sequence_parallel_size, cfg.use_remove_padding) == (2, True)
    # sft.yaml sets warmup_steps_ratio 0.05 and lr_scheduler cosine: verl's spelling overrides the file
    assert (cfg.optim.warmup_steps_ratio, cfg.optim.lr_scheduler) == (0.2, "constant")


def test_verls_legacy_multiturn_sft_keys_are_honoured_or_named_with_their_meaning(tmp_path):
    from verl_balance.trainer.config.sft import SFTConfig

    legacy = ["data.multiturn.enable=true", "data.multiturn.messages_key=conversation", "data.multiturn.tools_key=t"]
    run = f"trainer.default_local_dir={tmp_path}"
    data = SFTConfig.from_hydra(compose_config("sft", [*legacy, run])).data
    assert (data.messages_key, data.tools_key) == ("conversation", "t")
    _, no_effect = _translated("sft", [*legacy, run])
    assert sorted(no_effect) == ["data.multiturn.enable"]
    line = startup_line(no_effect, recipe="sft")
    assert "data.multiturn.enable (verl's legacy switch to chat data: here each file is read as chats" in line
    with pytest.raises(ConfigError, match="data.multiturn.enable"):  # negative control: not a boolean
        _translated("sft", ["data.multiturn.enable=sometimes", run])
    assert lookup("data.multiturn.enable", recipe="grpo") is None  # an SFT key only


@pytest.mark.parametrize(
    "args",
    [
        ["data.max_response_length=48", "actor_rollout_ref.rollout.response_length=32"],
        ["reward.custom_reward_function.path=/a.py", "custom_reward_function.path=/b.py"],
        ["optim.lr_decay_style=constant", "optim.warmup_style=cosine"],
    ],
)
def test_two_spellings_set_to_different_values_are_refused_naming_both(args):
    recipe = "sft" if args[0].startswith("optim") else "grpo"
    keys = [re.escape(_key(a)) for a in args]
    with pytest.raises(ConfigError, match=rf"({keys[0]}=.* and {keys[1]}|{keys[1]}=.* and {keys[0]})=.* disagree"):
        _translated(recipe, args)


def test_two_spellings_set_to_the_same_value_are_one_value():
    cfg, _ = _translated("grpo", ["custom_reward_function.path=/a.py", "reward.custom_reward_function.path=/a.py"])
    assert cfg.custom_reward_function.path == "/a.py" and "reward" not in cfg


def test_docs_table_equals_the_generated_one():
    assert DOCS.read_text() == docs_table(), (
        "regenerate: python -m verl_balance.trainer.config.verl_keys > docs/verl_keys.md"
    )


def test_offload_and_critic_keys_reach_the_engines_and_the_offload_decision(tmp_path):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from verl_balance.engine.offload import cpu_offload_policy

    args = [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "critic.fsdp.optimizer_offload=True",
        "critic.model.enable_gradient_checkpointing=True",
        "critic.model.use_remove_padding=True",
        f"trainer.default_local_dir={tmp_path}",
    ]
    # the reference runs on the actor
    assert _translated("grpo", args)[1] == ["actor_rollout_ref.ref.fsdp_config.param_offload"]
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
    cfg, no_effect = _translated("grpo", ["algorithm.filter_groups.enable=true", f"{key}=4"])
    assert no_effect == [key] and "max_inflight_gen_batches" not in cfg.algorithm.filter_groups
    line = startup_line(no_effect, recipe="grpo")
    assert f"{key} (dynamic sampling generates one whole prompt batch at a time" in line
    # The schema does not declare it, so without the table it is refused (no silent no-op).
    assert not _declared(key, "grpo")
    with pytest.raises(ConfigError, match="max_inflight_gen_batches"):
        check_known_keys(compose_config("grpo", [f"{key}=4"]))


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


VERL_SPELLINGS = {
    "data.max_response_length": 48,
    "actor_rollout_ref.rollout.prompt_length": 96,
    "ulysses_sequence_parallel_size": 2,
    "reward.custom_reward_function.path": "/r.py",
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,  # named: not its default (0.5)
    "trainer.logger": "console",
}
"""verl's spellings (honoured, one of them at the root, one no-effect) and verl's one-name logger."""


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _yaml_config(tmp_path, body: dict, *, run_dir):
    """A user's own config file (``--config-dir DIR --config-name mine``) on top of the recipe's
    file, composed as the command line composes it."""
    from hydra import compose, initialize_config_dir

    from tests.trainer.conftest import CONFIG_DIR

    mine = {
        "defaults": ["grpo", "_self_"],
        **_nested({**body, "trainer.default_local_dir": str(run_dir)}),
        "hydra": {"searchpath": [f"file://{CONFIG_DIR}"]},
    }
    (tmp_path / "mine.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(mine)))
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        return compose(config_name="mine")


def test_a_verl_key_in_a_yaml_file_equals_it_on_the_command_line_and_in_python(tmp_path, capsys):
    run_dir = tmp_path / "run"
    line_args = [f"{k}={v}" for k, v in VERL_SPELLINGS.items()] + [f"trainer.default_local_dir={run_dir}"]
    from_cli = GRPOConfig.from_hydra(compose_config("grpo", line_args))
    cli_out = capsys.readouterr().out
    from_yaml = GRPOConfig.from_hydra(_yaml_config(tmp_path, VERL_SPELLINGS, run_dir=run_dir))
    yaml_out = capsys.readouterr().out
    recipe_file = OmegaConf.load(Path(__file__).resolve().parents[2] / "verl_balance" / "config" / "grpo.yaml")
    mapping = OmegaConf.merge(
        {k: v for k, v in recipe_file.items() if k not in ("defaults", "hydra")},
        _nested({**VERL_SPELLINGS, "trainer.default_local_dir": str(run_dir)}),
    )
    from_python = GRPOConfig.from_hydra(mapping)
    assert from_cli == from_yaml == from_python
    # independent reference: the values as our own keys spell them
    rollout = from_yaml.actor_rollout_ref.rollout
    assert (rollout.response_length, from_yaml.data.max_prompt_length, from_yaml.sp_size) == (48, 96, 2)
    assert (from_yaml.custom_reward_function.path, from_yaml.trainer.logger) == ("/r.py", ["console"])
    assert "actor_rollout_ref.rollout.gpu_memory_utilization (a vLLM" in cli_out
    assert cli_out == yaml_out
    # negative control: without verl's spellings the config differs
    plain = GRPOConfig.from_hydra(compose_config("grpo", [f"trainer.default_local_dir={run_dir}"]))
    assert plain != from_yaml and plain.actor_rollout_ref.rollout.response_length != 48


@pytest.mark.parametrize(
    "body,match",
    [
        ({"data.max_respons_length": 48}, r"data\.max_respons_length"),
        ({"reward.custom_reward_functon.path": "/r.py"}, r"\breward\b"),
        ({"distillation.enabled": True}, r"distillation\.enabled=True: this project accepts only \['false'\]"),
        (
            {"data.max_response_length": 48, "actor_rollout_ref.rollout.response_length": 32},
            r"actor_rollout_ref\.rollout\.response_length=32 and data\.max_response_length=48 disagree",
        ),
    ],
)
def test_a_yaml_key_neither_schema_nor_table_knows_or_a_refused_value_is_refused_naming_it(tmp_path, body, match):
    cfg = _yaml_config(tmp_path, body, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=match):
        GRPOConfig.from_hydra(cfg)


def test_a_mapping_in_python_refuses_an_unknown_key_and_a_wrong_type_naming_them(tmp_path):
    run = {"trainer": {"default_local_dir": str(tmp_path)}}
    with pytest.raises(ConfigError, match=r"data\.max_respons_length"):
        GRPOConfig.from_hydra({**run, "data": {"max_respons_length": 48}})
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length"):
        GRPOConfig.from_hydra({**run, "data": {"max_prompt_length": "many"}})
    with pytest.raises(ConfigError, match=r"data\.max_response_length='many' \(our actor_rollout_ref"):
        GRPOConfig.from_hydra({**run, "data": {"max_response_length": "many"}})


@pytest.mark.parametrize(
    "body,named",
    [
        ({"data.max_respons_length": 3}, "data.max_respons_length"),  # neither schema nor table knows it
        ({"data.max_response_length": "many"}, "data.max_response_length='many'"),  # verl's key, a bad value
    ],
)
def test_main_grpo_with_a_users_yaml_file_exits_2_naming_its_bad_key(tmp_path, monkeypatch, capsys, body, named):
    from tests.trainer.conftest import run_cli_in_process

    _yaml_config(tmp_path, body, run_dir=tmp_path / "run")  # writes mine.yaml
    code, err = run_cli_in_process(
        "verl_balance.main_grpo",
        ["--config-dir", str(tmp_path), "--config-name", "mine"],
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert code == 2 and named in err and "Traceback" not in err, err


def test_main_grpo_takes_verl_keys_from_a_users_yaml_file_up_to_ray_start(tmp_path, monkeypatch, capsys):
    """Negative control of the test above: a file with verl's keys spelled right passes every start-up
    check (the stand-in for Ray's start fails on purpose)."""
    from tests.trainer.conftest import run_cli_in_process

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    body = {**VERL_SPELLINGS, "reward.custom_reward_function.path": str(reward)}
    _yaml_config(tmp_path, body, run_dir=tmp_path / "run")
    code, err = run_cli_in_process(
        "verl_balance.main_grpo",
        ["--config-dir", str(tmp_path), "--config-name", "mine"],
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert code == 1 and "Ray was started before the error" in err, err[-2000:]
