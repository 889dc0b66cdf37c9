"""``actor_rollout_ref.rollout.multi_turn`` in ``main_grpo``: verl's keys and data layout, checks before
Ray, and a GRPO run at dp2 with the tool agent loop on a tiny Qwen-shaped HF directory."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.conftest import compose_config
from verl_balance.data.tool_tasks import write_dataset
from verl_balance.trainer.config import ConfigError

MT = "actor_rollout_ref.rollout.multi_turn"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    from verl_balance.models.tiny_hf import main as tiny_hf_main

    out = str(tmp_path_factory.mktemp("tool_qwen2") / "model")
    tiny_hf_main(["--family", "qwen2", "--out", out, "--tool-chat-template", "--max-position-embeddings", "2048"])
    return out


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory) -> dict:
    return write_dataset(str(tmp_path_factory.mktemp("tool_data")), num_train=8, num_val=2)


def grpo_overrides(model_dir: str, data: dict, root, extra: list[str] = ()) -> list[str]:
    return [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={root / 'run'}",
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={data['train']}",
        f"data.val_files={data['val']}",
        "data.max_prompt_length=2048",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=24",
        "trainer.total_training_steps=2",
        "trainer.test_freq=0",
        f"{MT}.enable=true",
        f"{MT}.tool_config_path={data['tool_config']}",
        f"{MT}.max_assistant_turns=3",
        *extra,
    ]


def typed(overrides: list[str]):
    from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

    register_grpo_schema()
    return validate_grpo(compose_config("grpo", overrides))


def test_verl_multi_turn_keys_reach_the_rollout_config(tool_model, tool_data, tmp_path):
    config = typed(grpo_overrides(tool_model, tool_data, tmp_path, [f"{MT}.max_tool_response_length=64"]))
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.max_assistant_turns == 3 and multi_turn.max_tool_response_length == 64
    assert multi_turn.tool_config_path == tool_data["tool_config"] and multi_turn.format == "hermes"


def test_verls_other_multi_turn_keys_are_named_with_their_meaning(tool_model, tool_data, tmp_path):
    from verl_balance.trainer.config.grpo import GRPOConfig
    from verl_balance.trainer.config.verl_keys import startup_line

    verl_defaults = [
        f"{MT}.use_inference_chat_template=false",
        f"{MT}.num_repeat_rollouts=null",
        f"{MT}.interaction_config_path=null",
    ]
    args = grpo_overrides(tool_model, tool_data, tmp_path, verl_defaults)
    _, no_effect = GRPOConfig.translate(compose_config("grpo", args))
    assert sorted(no_effect) == sorted(arg.split("=")[0] for arg in verl_defaults)
    line = startup_line(no_effect, recipe="grpo")
    assert f"{MT}.use_inference_chat_template (each turn continues the recorded token ids" in line
    assert f"{MT}.interaction_config_path (older verl's interaction agents" in line
    assert typed(args).actor_rollout_ref.rollout.multi_turn.enable


@pytest.mark.parametrize(
    "extra, match",
    [
        ([f"{MT}.use_inference_chat_template=true"], "use_inference_chat_template=True: this project accepts only"),
        ([f"{MT}.interaction_config_path=/a/interaction.yaml"], "interaction_config_path=/a/interaction.yaml"),
        (
            [f"{MT}.tool_config_path=/nonexistent/tools.yaml"],
            "tool_config_path='/nonexistent/tools.yaml' does not exist",
        ),
        ([f"{MT}.format=json"], "multi_turn.format='json' is not valid"),
        (["trainer.v1.trainer_mode=separate_async"], "trainer_mode=sync only"),
    ],
)
def test_a_bad_multi_turn_setting_is_one_error_before_ray(tool_model, tool_data, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        typed(grpo_overrides(tool_model, tool_data, tmp_path, extra))


def test_verls_tool_data_layout_loads_with_agent_name_and_tools_kwargs(tool_model, tool_data):
    from verl_balance.data.rl_dataset import RLDataConfig, RLPromptDataset
    from verl_balance.data.tokenizer import build_tokenizer

    dataset = RLPromptDataset(
        files=[tool_data["train"]], tokenizer=build_tokenizer(tool_model), config=RLDataConfig(max_prompt_length=2048)
    )
    sample = dataset[0]
    assert sample.agent_name == "tool_agent" and sample.raw_prompt[0]["role"] == "system"
    kwargs = sample.extra_info["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]
    assert kwargs["ground_truth"] == sample.ground_truth


@pytest.mark.slow
def test_main_grpo_runs_the_tool_agent_loop_at_dp2(ray_cluster, tool_model, tool_data, tmp_path):
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer
    from verl_balance.utils.tracking import read_metrics

    register_grpo_schema()
    trainer = GRPOTrainer(compose_config("grpo", grpo_overrides(tool_model, tool_data, tmp_path)))
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    train = [r for r in read_metrics(summary["metrics"]) if "multi_turn/num_turns/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert record["multi_turn/num_turns/mean"] >= 1 and np.isfinite(record["actor/pg_loss"])
        assert 0 < record["response_length/mean"] <= 24


def _demo_stage(script: str, entry: str, subs: dict[str, str]) -> list[str]:
    """The overrides ``recipes/grpo_tool_cpu_demo.sh`` passes to ``python -m verl_balance.<entry>``."""
    import shlex

    from tests.trainer.conftest import REPO_ROOT

    text = (REPO_ROOT / script).read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if f"python -m verl_balance.{entry} " in line)
    for name, value in subs.items():
        line = line.replace(name, value)
    args = shlex.split(line.split('"$@"')[0])
    return args[args.index("-m") + 2 :]


def test_the_tool_demo_recipes_stages_build_valid_configs_on_the_files_its_data_step_writes(tool_model, tmp_path):
    from verl_balance.trainer.checkpoint import TRAINER_STATE_FILE
    from verl_balance.trainer.config.sft import validate_sft

    out = tmp_path / "demo"
    paths = write_dataset(str(out / "data"), num_train=4, num_val=2, tool="calculator", direct_fraction=0.5)
    checkpoint = out / "sft" / "global_step_1000"
    checkpoint.mkdir(parents=True)
    (checkpoint / TRAINER_STATE_FILE).write_text("{}")
    subs = {"$OUT/model": tool_model, "$OUT": str(out), "$SFT_STEPS": "1000", "$GRPO_STEPS": "40"}
    script = "recipes/grpo_tool_cpu_demo.sh"
    sft = validate_sft(compose_config("sft", _demo_stage(script, "main_sft", subs)))
    assert sft.data.train_files == paths["sft_train"] and sft.model.path == tool_model
    grpo = typed(_demo_stage(script, "main_grpo", subs))
    multi_turn = grpo.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.tool_config_path == paths["tool_config"]
    assert grpo.data.train_files == paths["train"]
    assert grpo.actor_rollout_ref.model.warm_start_path == str(checkpoint)
