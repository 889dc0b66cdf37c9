"""Start-up checks the trainers run before Ray starts: the model and tokenizer directories
(``models.preflight``), the Ulysses degree against the model's heads and ``trainer.device=cuda``
without a GPU, each a ConfigError naming the key."""

from __future__ import annotations

import os

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


def check_warm_start(path: str, *, key: str, model_config, engine_config, sp_size: int) -> None:
    """Before Ray: the checkpoint at ``path`` (``key``'s value) has DCP metadata whose model names and
    shapes fit the model ``model_config`` builds (a LoRA checkpoint needs ``engine_config.lora_rank``).
    Raises WarmStartError naming the key and the first mismatches."""
    from verl_balance.engine.lora import read_base_fingerprint
    from verl_balance.engine.materialize import build_meta_model
    from verl_balance.utils import safe_load
    from verl_balance.workers.actor_rollout import WarmStartError

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise WarmStartError(
            f"{key}={path!r} is not an engine checkpoint (no .metadata); point it at a global_step_N directory"
        )
    adapters_only = read_base_fingerprint(path) is not None
    if adapters_only and not engine_config.lora_rank:
        raise WarmStartError(
            f"{key}={path!r} is a LoRA checkpoint (adapters only); set actor_rollout_ref.model.lora_rank to "
            "warm-start from it"
        )
    if adapters_only or engine_config.lora_rank:
        return  # adapters are matched against their base by the workers
    model = build_meta_model(model_config, sp_size=sp_size, attn_impl=engine_config.attn_impl)
    # a plain (unsharded) module's state_dict has the FQNs the engine saves through get_model_state_dict
    problems = safe_load.state_mismatch(safe_load.read_dcp_metadata(path), model.state_dict())
    if problems:
        raise WarmStartError(
            f"{key}={path!r} does not fit a model of {model_config}: {'; '.join(problems)}. Warm-start from a "
            "checkpoint of the same architecture"
        )


def check_critic_weights(config) -> None:
    """Before Ray: ``critic.model.path``'s weight files, checked as ``check_model_files`` checks the actor's."""
    from verl_balance.models.preflight import check_weight_files

    path = config.critic.model.path if config.use_critic else None
    if path is None or config.actor_rollout_ref.model.init != "pretrained":
        return
    try:
        check_weight_files(os.path.expanduser(path), key="critic.model.path")
    except PreflightError as err:
        raise ConfigError(str(err)) from err
