"""verl's vLLM keys with ``actor_rollout_ref.rollout.name=vllm``: read into the engine's config, bad
values refused before Ray naming the key; with another backend named as without effect (no vLLM needed)."""

from __future__ import annotations

import pytest

from tests.trainer import recipe_snapshot
from tests.trainer.conftest import compose_config
from verl_balance.trainer.config import ConfigError
from verl_balance.trainer.config.grpo import GRPOConfig, register_grpo_schema, validate_grpo
from verl_balance.trainer.config.verl_keys import startup_line

AR = "actor_rollout_ref.rollout"
VLLM_KEYS = [f"{AR}.gpu_memory_utilization=0.3", f"{AR}.enforce_eager=True", f"{AR}.top_k=5", f"{AR}.dtype=bfloat16"]


@pytest.fixture(scope="module")
def snapshot_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_keys")


def _composed(snapshot_root, args):
    register_grpo_schema()
    hf = recipe_snapshot.make_fixtures(snapshot_root)["<hf>"]
    return compose_config("grpo", [f"actor_rollout_ref.model.path={hf}", *args])


def _config(snapshot_root, args):
    return validate_grpo(_composed(snapshot_root, args))


def translate(snapshot_root, args):
    """(the translated config, the no-effect keys) of the command line ``args``."""
    return GRPOConfig.translate(_composed(snapshot_root, args))


def test_with_name_vllm_the_keys_reach_the_engine_config(snapshot_root):
    args = [f"{AR}.name=vllm", *VLLM_KEYS, f"{AR}.tensor_model_parallel_size=2"]
    _, no_effect = translate(snapshot_root, args)
    assert no_effect == [f"{AR}.tensor_model_parallel_size"]  # one engine per worker: named, not read
    config = _config(snapshot_root, args)
    assert config.rollout_backend == "vllm"
    vllm = config.actor_rollout_ref.rollout.vllm_config(seed=7)
    assert (vllm.gpu_memory_utilization, vllm.enforce_eager, vllm.top_k, vllm.dtype) == (0.3, True, 5, "bfloat16")
    assert vllm.seed == 7 and vllm.logprobs_mode == "raw_logprobs"


def test_with_another_backend_the_keys_are_named_without_effect(snapshot_root):
    engine_keys = [k for k in VLLM_KEYS if ".top_k=" not in k]
    args = [f"{AR}.name=hf", *engine_keys]
    cfg, no_effect = translate(snapshot_root, args)
    assert sorted(no_effect) == sorted(k.partition("=")[0] for k in engine_keys)
    assert "read with rollout.name=vllm only" in startup_line(no_effect, recipe="grpo")
    assert cfg.actor_rollout_ref.rollout.dtype == "float32"  # not read: put back to the schema's default
    config = _config(snapshot_root, args)
    assert config.actor_rollout_ref.rollout.dtype == "float32"
    # a key at its default is not named
    assert translate(snapshot_root, [f"{AR}.name=hf", f"{AR}.gpu_memory_utilization=0.5"])[1] == []
    # top-k changes the samples, so a backend without it refuses it instead of ignoring it
    with pytest.raises(ConfigError, match=rf"{AR}.top_k=5: this project accepts only \['-1', '0'\]"):
        translate(snapshot_root, [f"{AR}.name=hf", f"{AR}.top_k=5"])


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (f"{AR}.gpu_memory_utilization=1.5", f"{AR}.gpu_memory_utilization=1.5 must be in"),
        (f"{AR}.load_format=gguf", f"{AR}.load_format='gguf' is not valid"),
        (f"{AR}.top_p=0.9", f"{AR}.temperature=0.7 with {AR}.top_p=0.9"),
    ],
)
def test_a_bad_vllm_value_is_one_line_naming_the_key_before_ray(snapshot_root, arg, message):
    with pytest.raises(ConfigError, match=message) as err:
        _config(snapshot_root, [f"{AR}.name=vllm", f"{AR}.temperature=0.7", arg])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (f"{AR}.gpu_memory_utilization=1.5", f"{AR}.gpu_memory_utilization=1.5 must be in"),
        (f"{AR}.gpu_memory_utilization=1e308", f"{AR}.gpu_memory_utilization=1e\\+308 must be in"),
        (f"{AR}.load_format=gguf", f"{AR}.load_format='gguf' is not valid"),
        (f"{AR}.max_model_len=0", f"{AR}.max_model_len=0 must be an int >= 1"),
    ],
)
def test_a_bad_vllm_value_is_refused_with_another_backend_too(snapshot_root, arg, message):
    """A key the run does not read is still checked as the vLLM run would check it, not reset silently."""
    with pytest.raises(ConfigError, match=message) as err:
        translate(snapshot_root, [f"{AR}.name=hf", arg])
    assert "\n" not in str(err.value)
    # control: the same key at a valid value is accepted and named without effect
    key = arg.partition("=")[0]
    assert translate(snapshot_root, [f"{AR}.name=hf", f"{key}={VALID[key]}"])[1] == [key]


VALID = {
    f"{AR}.gpu_memory_utilization": "0.9",
    f"{AR}.load_format": "safetensors",
    f"{AR}.max_model_len": "4096",
}


def test_sglang_is_refused_naming_the_backends(snapshot_root):
    valid = r"'sglang' is not valid; expected one of \['auto', 'kv_cache', 'hf', 'vllm'\]"
    with pytest.raises(ConfigError, match=valid):
        _config(snapshot_root, [f"{AR}.name=sglang"])


def test_engine_startup_is_one_timed_phrase_from_the_workers_answers():
    from verl_balance.trainer.cluster import describe_rollout_startup

    infos = [{"rank": 0, "rollout_startup_s": 21.04}, {"rank": 1, "rollout_startup_s": 30.96}]
    assert describe_rollout_startup(infos) == "; 2 vLLM engines started (slowest 31.0 s)"
    assert describe_rollout_startup([{"rank": 0, "rollout_startup_s": None}]) == ""  # HF / built-in rollouts


def test_multi_turn_tools_are_accepted_with_the_vllm_rollout(snapshot_root):
    """The tool agent loop runs on any RolloutEngine (its vLLM round trip: tests/rollout/test_vllm_rollout.py)."""
    config = _config(snapshot_root, [f"{AR}.name=vllm", f"{AR}.multi_turn.enable=true"])
    assert config.rollout_backend == "vllm" and config.actor_rollout_ref.rollout.multi_turn.enable
    # negative control: the loop's own requirements still hold (sync mode only)
    with pytest.raises(ConfigError, match="multi_turn.enable=true runs with trainer.v1.trainer_mode=sync only"):
        _config(
            snapshot_root, [f"{AR}.name=vllm", f"{AR}.multi_turn.enable=true", "trainer.v1.trainer_mode=separate_async"]
        )
