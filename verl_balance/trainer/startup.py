"""Start-up checks the trainers run before Ray starts: the model and tokenizer directories
(``models.preflight``), reported as ConfigError naming the key and the file."""

from __future__ import annotations

from verl_balance.data.tokenizer import Tokenizer
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
