"""Start-up checks of a model directory (``models.preflight``): each broken file is named before
Ray starts; the intact directory passes the same checks (negative control)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from verl_balance.models.preflight import (
    ModelDirSpec,
    PreflightError,
    check_safetensors_file,
    check_tokenizer,
    preflight_model_dir,
)
from verl_balance.models.tiny_hf import write_tiny_model


@pytest.fixture(scope="module")
def intact_dir(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("preflight") / "qwen2"), family="qwen2")


@pytest.fixture
def model_dir(intact_dir, tmp_path) -> str:
    """A fresh copy of the tiny model directory each test may break."""
    return shutil.copytree(intact_dir, tmp_path / "model", dirs_exist_ok=False).as_posix()


def _spec(model_dir: str, **kw) -> ModelDirSpec:
    return ModelDirSpec(key_prefix="model.", model_path=model_dir, tokenizer_path=model_dir, **kw)


def test_intact_directory_passes_every_check_and_yields_a_working_tokenizer(model_dir):
    tokenizer = preflight_model_dir(_spec(model_dir, chat_key="data.messages_key"))
    assert tokenizer.encode("hello world")
    assert tokenizer.vocab_size > 100


def test_truncated_safetensors_is_named_with_its_sizes(model_dir):
    weights = os.path.join(model_dir, "model.safetensors")
    full = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(full // 2)
    with pytest.raises(PreflightError) as err:
        preflight_model_dir(_spec(model_dir))
    message = str(err.value)
    assert weights in message and "truncated" in message
    assert f"declares {full} bytes" in message and f"has {full // 2} bytes" in message


def test_truncated_header_and_garbage_header_are_named(tmp_path, intact_dir):
    header_cut = tmp_path / "cut.safetensors"
    header_cut.write_bytes(open(os.path.join(intact_dir, "model.safetensors"), "rb").read(100))
    with pytest.raises(PreflightError, match=rf"{header_cut}: header declares \d+ bytes but the file has 100"):
        check_safetensors_file(str(header_cut))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes((8).to_bytes(8, "little") + b"not json")
    with pytest.raises(PreflightError, match=rf"{garbage}: the safetensors header cannot be parsed"):
        check_safetensors_file(str(garbage))


def test_weights_of_a_random_init_are_not_required(model_dir):
    os.remove(os.path.join(model_dir, "model.safetensors"))
    with pytest.raises(PreflightError, match=r"model.path=.* has no weights .*model.init=random"):
        preflight_model_dir(_spec(model_dir))
    preflight_model_dir(_spec(model_dir, init="random"))


def test_missing_shard_named_by_the_index_is_reported(model_dir):
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(PreflightError, match=r"missing: \[.*model-00002-of-00002.safetensors'\]"):
        preflight_model_dir(_spec(model_dir))


def test_missing_tokenizer_files_are_named_instead_of_loading_an_empty_tokenizer(model_dir):
    os.remove(os.path.join(model_dir, "tokenizer.json"))
    with pytest.raises(PreflightError) as err:
        preflight_model_dir(_spec(model_dir))
    message = str(err.value)
    assert f"model.tokenizer={model_dir!r}" in message
    assert "no tokenizer vocabulary file" in message and "tokenizer.json" in message


def test_corrupt_tokenizer_json_is_named(model_dir):
    path = os.path.join(model_dir, "tokenizer.json")
    with open(path, "w") as f:
        f.write('{"version": "1.0", "model": ')
    with pytest.raises(PreflightError, match=rf"model.tokenizer: {path} is not a readable JSON file"):
        check_tokenizer(model_dir, key="model.tokenizer")


def test_chat_data_without_a_chat_template_fails_naming_the_key_and_the_directory(model_dir):
    os.remove(os.path.join(model_dir, "chat_template.jinja"))
    with pytest.raises(PreflightError) as err:
        preflight_model_dir(_spec(model_dir, chat_key="data.messages_key"))
    message = str(err.value)
    assert "data.messages_key is set" in message and repr(model_dir) in message
    assert "model.custom_chat_template=builtin" in message
    # prompt/response data renders no chat template: the same directory passes
    preflight_model_dir(_spec(model_dir, chat_key=None))
    # the explicit opt-in passes too
    preflight_model_dir(_spec(model_dir, chat_key="data.messages_key", custom_chat_template="builtin"))


def test_builtin_opt_in_with_a_template_present_or_a_jinja_value_is_rejected(model_dir):
    with pytest.raises(PreflightError, match=r"has its own chat template"):
        preflight_model_dir(_spec(model_dir, chat_key="data.messages_key", custom_chat_template="builtin"))
    with pytest.raises(PreflightError, match=r"model.custom_chat_template: only null .* or 'builtin'"):
        preflight_model_dir(_spec(model_dir, custom_chat_template="{{ messages }}"))


def test_byte_tokenizer_needs_no_files(tmp_path):
    spec = ModelDirSpec(key_prefix="model.", model_path=None, tokenizer_path="byte", chat_key="data.messages_key")
    assert preflight_model_dir(spec).vocab_size == 260
