"""Structured (dataclass) schemas for the Hydra recipes, and their validation.

The YAML files in ``config/`` fill these schemas; Hydra rejects unknown keys at startup
because the merged config is typed by them. ``validate_*`` checks combinations that a
type cannot express and raises :class:`ConfigError` naming the key.
Key names follow verl's wherever the concept is the same, so a verl user's overrides
carry over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class ConfigError(ValueError):
    """A config key has an invalid value or an invalid combination with another key."""


@dataclass
class SyntheticDataConfig:
    """Generated task data used when no data files are given (no downloads needed)."""

    num_train: int = 2048
    num_val: int = 128
    seed: int = 0
    out_dir: Optional[str] = None


@dataclass
class SFTDataConfig:
    train_files: Optional[Any] = None
    val_files: Optional[Any] = None
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: Optional[str] = None
    max_length: int = 512
    truncation: str = "error"
    on_malformed: str = "error"
    train_batch_size: int = 32
    micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 2048
    balance_dp_token: bool = True
    shuffle: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass
class ModelSection:
    """A built-in preset ('tiny', 'small', '100m'); any dimension set here overrides the preset.

    vocab_size null means the tokenizer's vocabulary size.
    """

    name: str = "tiny"
    tokenizer: str = "byte"
    param_dtype: str = "float32"
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None


@dataclass
class BalanceSection:
    enable: bool = True
    workload: str = "flops"
    overlong: str = "error"


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps_ratio: float = 0.05
    lr_scheduler: str = "cosine"
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0


@dataclass
class TrainerSection:
    device: str = "auto"
    nnodes: int = 1
    n_gpus_per_node: int = 4
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    logger: list = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "verl_balance"
    experiment_name: str = "sft"
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    save_freq: int = -1
    test_freq: int = -1
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    seed: int = 1
    ray_address: Optional[str] = None
    placement_timeout_s: float = 120.0
    plot: bool = True
    # reliability (docs/fault_tolerance.md): null keeps every checkpoint; restarts after a worker dies
    max_ckpt_to_keep: Optional[int] = None
    max_restarts: int = 0


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: ModelSection = field(default_factory=ModelSection)
    ulysses_sequence_parallel_size: int = 1
    use_remove_padding: bool = True
    balance: BalanceSection = field(default_factory=BalanceSection)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)


def register_schemas() -> None:
    """Register the schemas so YAML files can name them in their defaults list."""
    cs = ConfigStore.instance()
    cs.store(name="sft_schema", node=SFTConfig)


def check_choice(key: str, value, allowed) -> None:
    """Raise ConfigError naming ``key`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; expected one of {list(allowed)}")


def check_positive(key: str, value) -> None:
    """Raise ConfigError naming ``key`` unless ``value`` is a positive number."""
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive number")


def check_known_keys(cfg, path: str = "") -> None:
    """Raise ConfigError naming any key a typed section does not declare (e.g. Hydra's
    ``+data.trian_files=x`` append syntax, which bypasses the schema's own check)."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(cfg)
    if dataclasses.is_dataclass(schema):
        fields = {f.name for f in dataclasses.fields(schema)}
        unknown = sorted(str(k) for k in cfg.keys() if k not in fields)
        if unknown:
            raise ConfigError(f"unknown config key(s) {[path + k for k in unknown]}; valid keys of "
                              f"{path.rstrip('.') or 'the root'}: {sorted(fields)}")
    for key in cfg.keys():
        if not OmegaConf.is_missing(cfg, key) and isinstance(cfg[key], DictConfig):
            check_known_keys(cfg[key], f"{path}{key}.")


def check_writable_dir(key: str, path: str) -> None:
    """Raise ConfigError naming ``key`` unless ``path`` is (or can be created as) a writable directory."""
    import os

    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        why = "is not a directory" if not os.path.isdir(probe) else "is not writable"
        raise ConfigError(f"{key}={path!r} cannot be used: {probe!r} {why}; point {key} at a writable directory")


def validate_common(cfg) -> None:
    """Checks shared by the SFT and GRPO recipes (parallel layout, trainer, loss)."""
    check_known_keys(cfg)
    check_writable_dir("trainer.default_local_dir", cfg.trainer.default_local_dir)
    if getattr(cfg.trainer, "max_ckpt_to_keep", None) is not None:
        check_positive("trainer.max_ckpt_to_keep", cfg.trainer.max_ckpt_to_keep)
    if (getattr(cfg.trainer, "max_restarts", 0) or 0) < 0:
        raise ConfigError(f"trainer.max_restarts={cfg.trainer.max_restarts} must be >= 0")
    sp = cfg.ulysses_sequence_parallel_size
    check_positive("ulysses_sequence_parallel_size", sp)
    check_positive("trainer.nnodes", cfg.trainer.nnodes)
    check_positive("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node)
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if world % sp:
        raise ConfigError(
            f"ulysses_sequence_parallel_size={sp} must divide the number of workers "
            f"trainer.nnodes * trainer.n_gpus_per_node = {world}"
        )
    check_choice("trainer.device", cfg.trainer.device, ("auto", "cpu", "cuda"))
    check_choice("trainer.resume_mode", cfg.trainer.resume_mode, ("auto", "disable", "resume_path"))
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    check_choice("balance.workload", cfg.balance.workload, ("tokens", "flops"))
    check_choice("balance.overlong", cfg.balance.overlong, ("error", "skip", "truncate"))
    check_choice("optim.lr_scheduler", cfg.optim.lr_scheduler, ("constant", "cosine"))
    if not cfg.use_remove_padding:
        raise ConfigError(
            "use_remove_padding=false is not supported: the engine always runs packed "
            "(padding-free) sequences, which Ulysses sequence parallelism requires"
        )
    for name in cfg.trainer.logger:
        check_choice("trainer.logger", name, ("console", "jsonl", "tensorboard", "wandb"))
    if cfg.trainer.total_training_steps is not None:
        check_positive("trainer.total_training_steps", cfg.trainer.total_training_steps)
    check_positive("trainer.total_epochs", cfg.trainer.total_epochs)


def validate_sft(cfg) -> None:
    """Raise ConfigError naming the key when the SFT config is invalid."""
    validate_common(cfg)
    check_choice("loss_agg_mode", cfg.loss_agg_mode, LOSS_AGG_MODES)
    if cfg.loss_agg_mode == "seq-mean-token-sum-norm" and cfg.loss_scale_factor is None:
        raise ConfigError("loss_agg_mode=seq-mean-token-sum-norm needs loss_scale_factor (the constant C)")
    d = cfg.data
    check_positive("data.train_batch_size", d.train_batch_size)
    check_positive("data.max_length", d.max_length)
    check_choice("data.truncation", d.truncation, ("error", "left", "right"))
    check_choice("data.on_malformed", d.on_malformed, ("error", "skip"))
    dp = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node // cfg.ulysses_sequence_parallel_size
    if d.train_batch_size < dp:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} is smaller than the data-parallel size {dp} "
            "(workers / ulysses_sequence_parallel_size); every DP rank needs at least one sample"
        )
    if d.use_dynamic_bsz:
        check_positive("data.max_token_len_per_gpu", d.max_token_len_per_gpu)
    else:
        check_positive("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu)
