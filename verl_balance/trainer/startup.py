"""Start-up checks the trainers run before Ray starts: the model and tokenizer directories
(``models.preflight``), the Ulysses degree against the model's heads (from config.json or the
preset) and ``trainer.device=cuda`` on a machine without a GPU, each a ConfigError naming the key."""

from __future__ import annotations

import torch

from verl_balance.data.tokenizer import Tokenizer
from verl_balance.models.attention import check_sequence_parallel_heads
from verl_balance.models.config import ModelConfigError
from verl_balance.models.preflight import ModelDirSpec, PreflightError, preflight_model_dir
from verl_balance.trainer.config import ConfigError, ModelSection


def check_model_files(model: ModelSection, *, chat_key: str | None) -> Tokenizer:
    """Tokenizer, chat template and weight files of ``model`` checked (no Ray, no weights read);
    ``chat_key`` names the data key whose values are rendered as chats (None: none are)."""
    spec = ModelDirSpec(
        key_prefix=model.KEY_PREFIX,
        model_path=model.path,
        tokenizer_path=model.tokenizer_path,
        init=model.init,
        custom_chat_template=model.custom_chat_template,
        chat_key=chat_key,
    )
    try:
        return preflight_model_dir(spec)
    except PreflightError as err:
        raise ConfigError(str(err)) from err


def check_layout_and_device(*, model_config, model_key: str, sp_key: str, sp_size: int, trainer) -> None:
    """Before Ray starts: ``sp_key`` must split the model's query and KV heads (the model read from
    ``model_key``), and ``trainer.device=cuda`` needs a GPU here when the embedded cluster runs here."""
    try:
        check_sequence_parallel_heads(
            num_heads=model_config.num_heads, num_kv_heads=model_config.num_kv_heads, sp_size=sp_size
        )
    except ModelConfigError as err:
        raise ConfigError(
            f"{sp_key}={sp_size} does not fit the model of {model_key} ({model_config.num_heads} query heads, "
            f"{model_config.num_kv_heads} KV heads): {err}; pick a {sp_key} that divides the heads"
        ) from err
    if trainer.device == "cuda" and trainer.ray_address is None and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda but this machine has no GPU torch can use, and the embedded Ray cluster runs "
            "here; use trainer.device=cpu (or auto), or trainer.ray_address of a cluster with GPUs"
        )
