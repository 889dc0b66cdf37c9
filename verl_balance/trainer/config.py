"""Typed configs of the Hydra recipes: each section is, or nests, the config class of the component
it configures, and ``to_typed`` turns the merged config into those objects.

The YAML files in ``config/`` fill the schemas with the recipe's values; Hydra rejects unknown
keys at startup because the merged config is typed by them. Choices are ``str`` fields checked in
``__post_init__`` against module-level tuples (OmegaConf cannot hold ``Literal`` annotations), so
the checks run when ``to_typed`` instantiates the sections; its ``ConfigError`` names the full
key. ``validate_*`` adds only the checks that combine several sections.

Key names follow verl's wherever the concept is the same, so a verl user's overrides carry over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from verl_balance.balance import FlopsWorkload, TokenWorkload
from verl_balance.balance.errors import BalanceConfigError
from verl_balance.balance.plan import OVERLONG_POLICIES
from verl_balance.balance.workload import CalibratedWorkload
from verl_balance.data.sft_dataset import SFTDataConfig
from verl_balance.engine.config import (
    APPLY_ON_RESUME,
    DEFAULT_LOGITS_CHUNK_SIZE,
    LAYOUT_ON_RESUME,
    PARAM_DTYPES,
    EngineConfig,
    FSDPConfig,
    OptimConfig,
)
from verl_balance.loss import check_agg_mode
from verl_balance.models import MODEL_DIMENSION_KEYS, load_model_config
from verl_balance.models.config import ModelConfig, ModelConfigError
from verl_balance.models.hf import INIT_MODES, REFUSED_MODEL_TYPES, SUPPORTED_MODEL_TYPES, HFModelConfig
from verl_balance.utils.atomic_io import atomic_write_json

logger = logging.getLogger(__name__)

WORKLOADS = ("tokens", "flops", "calibrated")
DEVICES = ("auto", "cpu", "cuda")
RESUME_MODES = ("auto", "disable", "resume_path")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


class ConfigError(ValueError):
    """A config key has an invalid value or an invalid combination with another key."""


def check_choice(key: str, value, allowed) -> None:
    """Raise ConfigError naming ``key`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; expected one of {list(allowed)}")


def check_positive(key: str, value) -> None:
    """Raise ConfigError naming ``key`` unless ``value`` is a positive number."""
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive number")


# ---------------------------------------------------------------------- sections shared by the recipes
@dataclass
class SyntheticDataConfig:
    """Generated task data used when no data files are given (no downloads needed)."""

    num_train: int = 2048
    """Training samples to generate."""
    num_val: int = 128
    """Validation samples to generate."""
    seed: int = 0
    """Seed of the generator (the same seed gives the same files)."""
    out_dir: Optional[str] = None
    """Where the files go; null = ``trainer.default_local_dir``/data."""


@dataclass
class ModelSection:
    """The model: a local Hugging Face directory (``path``) or a built-in preset (``name``) whose
    dimensions any key set here overrides."""

    KEY_PREFIX: ClassVar[str] = "model."

    name: str = "tiny"
    """Built-in preset (``models.config.ModelConfig.preset``); ignored when ``path`` is set."""
    path: Optional[str] = None
    """A local Hugging Face model directory (config.json + safetensors; a family of
    ``models.hf.SUPPORTED_MODEL_TYPES``); null = the built-in preset ``name``. Nothing is downloaded."""
    tokenizer: Optional[str] = None
    """'byte' (built-in) or a local HF tokenizer directory (its chat template is used); null = ``path``
    when a model directory is given, else 'byte'."""
    init: str = "pretrained"
    """With ``path``: 'pretrained' loads the directory's weights, 'random' draws new ones of that
    architecture (seeded by trainer.seed). A built-in preset is always random."""
    enable_gradient_checkpointing: bool = field(default=False, metadata=LAYOUT_ON_RESUME)
    """verl's key: activation checkpointing per decoder layer (built-in and HF models): the same loss
    and gradients, activations recomputed in the backward (parity-tested under FSDP2)."""
    param_dtype: str = "float32"
    """Dtype of the parameters the engine computes in: one of engine.config.PARAM_DTYPES."""
    vocab_size: Optional[int] = None
    """null = the tokenizer's vocabulary size (a larger value pads the embedding)."""
    hidden_size: Optional[int] = None
    """Override of the preset's hidden size."""
    intermediate_size: Optional[int] = None
    """Override of the preset's MLP width."""
    num_layers: Optional[int] = None
    """Override of the preset's layer count."""
    num_heads: Optional[int] = None
    """Override of the preset's attention heads."""
    num_kv_heads: Optional[int] = None
    """Override of the preset's key/value heads (grouped-query attention)."""
    max_position_embeddings: Optional[int] = None
    """Override of the preset's longest position."""
    tie_word_embeddings: Optional[bool] = None
    """Override: share the input embedding with the output projection."""
    custom_chat_template: Optional[str] = None
    """verl's key. null: chats (``data.messages_key``, GRPO prompts) are rendered with the tokenizer's
    own chat template, and a tokenizer without one is an error at start-up; 'builtin': a tokenizer
    without one renders chats with the built-in minimal template (a different format than the
    model's, hence a different loss). Other Jinja templates belong in the tokenizer directory."""

    def __post_init__(self) -> None:
        check_choice("param_dtype", self.param_dtype, PARAM_DTYPES)
        check_choice("init", self.init, INIT_MODES)
        if self.path is not None:
            check_hf_model_dir("path", self.path)

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer to build: ``tokenizer``, else the model directory, else 'byte'."""
        return self.tokenizer or self.path or "byte"

    def model_config(self, *, vocab_size: int):
        """``HFModelConfig`` of ``path``, or the preset with the tokenizer's vocabulary and the
        dimensions set here; ConfigError naming the key when they do not fit together."""
        overrides = {k: getattr(self, k) for k in MODEL_DIMENSION_KEYS}
        # HF-only keys are passed only when set away from their defaults, so a preset rejects them.
        if self.path is not None or self.init != "pretrained":
            overrides["init"] = self.init
        overrides["enable_gradient_checkpointing"] = self.enable_gradient_checkpointing
        try:
            return load_model_config(name=self.name, path=self.path, overrides=overrides, vocab_size=vocab_size)
        except ModelConfigError as err:
            raise ConfigError(re.sub(r"(?<![\w.])model[. ]", self.KEY_PREFIX, str(err))) from err

    def describe(self, model_config) -> str:
        """The start-up description of the model: family and directory, or the preset."""
        dims = f"{model_config.num_layers} layers, hidden {model_config.hidden_size}"
        if isinstance(model_config, HFModelConfig):
            return (
                f"HF model_type={model_config.model_type} from {model_config.path} ({dims}, init={model_config.init})"
            )
        return f"model {self.name} ({dims})"


def check_hf_model_dir(key: str, path: str) -> None:
    """Raise ConfigError naming ``key`` unless ``path`` is a local HF model directory of a supported family."""
    config_file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(
            f"{key}={path!r} is not a local Hugging Face directory (no config.json); point {key} at "
            f"a save_pretrained output of a checkpoint of one of {list(SUPPORTED_MODEL_TYPES)} (nothing is "
            "downloaded)"
        )
    try:
        with open(config_file, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{key}={path!r}: config.json cannot be read ({err})") from err
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = REFUSED_MODEL_TYPES.get(model_type)
        raise ConfigError(
            f"{key}={path!r} has model_type={model_type!r}, which is not supported{' (' + why + ')' if why else ''}; "
            f"supported model_type values: {list(SUPPORTED_MODEL_TYPES)}"
        )


@dataclass
class SFTModelSection(ModelSection):
    """``model`` of the SFT recipe: ModelSection plus verl's spelling of the model directory."""

    partial_pretrain: Optional[str] = None
    """verl's SFT key for the model directory: the same as ``path`` (set either)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig, metadata=LAYOUT_ON_RESUME)
    """verl's key: the engine's FSDP2 switches (reshard_after_forward, reshard_after_backward,
    defer_gradient_sync); the defaults use the least memory. See docs/performance.md."""
    logits_chunk_size: int = field(default=DEFAULT_LOGITS_CHUNK_SIZE, metadata=LAYOUT_ON_RESUME)
    """Tokens per chunk of the engine's output head: log-probs, entropy and their backward are
    computed chunk by chunk from the final hidden states (logits recomputed in the backward), so the
    head holds about logits_chunk_size x vocab fp32 values, not micro-batch tokens x vocab; the same
    values and gradients. 0 = materialize the full logits (engine/config.py, docs/performance.md)."""

    def __post_init__(self) -> None:
        if self.partial_pretrain is not None:
            if self.path is not None and self.path != self.partial_pretrain:
                raise ConfigError(
                    f"path={self.path!r} and partial_pretrain={self.partial_pretrain!r} disagree; set one of them"
                )
            self.path = self.partial_pretrain
        super().__post_init__()


@dataclass
class BalanceSection:
    """The workload balancer (``balance.plan_balance``)."""

    enable: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """Balance DP ranks and micro-batches by workload; false = the contiguous split."""
    workload: str = field(default="flops", metadata=LAYOUT_ON_RESUME)
    """Cost model: 'tokens' (linear), 'flops' (linear layers + quadratic causal attention) or
    'calibrated' (seconds measured on this hardware by ``python -m verl_balance.calibrate``: a fixed
    cost per micro-batch + per sequence + per token + per attention pair; needs calibration_path
    or all of calibration_coefficients)."""
    calibration_path: Optional[str] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """JSON written by ``python -m verl_balance.calibrate --out FILE`` (workload=calibrated only);
    copied into the run directory as calibration.json."""
    calibration_coefficients: dict = field(default_factory=dict, metadata=LAYOUT_ON_RESUME)
    """Seconds overriding the file's coefficients (workload=calibrated only): any of micro_batch,
    sequence, token, pair; without calibration_path, micro_batch, token and pair are required."""
    overlong: str = "error"
    """A sample longer than the token cap: 'error', 'skip' (drop it) or 'truncate' (cut it)."""

    def __post_init__(self) -> None:
        check_choice("workload", self.workload, WORKLOADS)
        check_choice("overlong", self.overlong, OVERLONG_POLICIES)
        uses_calibration = self.calibration_path is not None or bool(self.calibration_coefficients)
        if self.workload != "calibrated" and uses_calibration:
            raise ConfigError(
                f"balance.calibration_path / balance.calibration_coefficients are set but balance.workload="
                f"{self.workload!r}; set balance.workload=calibrated to use them, or remove them"
            )
        if self.workload == "calibrated" and not uses_calibration:
            raise ConfigError(
                "balance.workload=calibrated needs balance.calibration_path=FILE (python -m "
                "verl_balance.calibrate --out FILE) or balance.calibration_coefficients={micro_batch,token,pair}"
            )
        if self.workload == "calibrated":
            self.calibrated_workload()  # a bad file or coefficient fails at config time

    def calibrated_workload(self) -> CalibratedWorkload:
        """The calibration file with calibration_coefficients applied on top."""
        data = {"coefficients": {}, "fingerprint": {}}
        source = "balance.calibration_coefficients"
        try:
            if self.calibration_path is not None:
                data = CalibratedWorkload.from_file(os.path.expanduser(self.calibration_path)).to_dict()
                source = self.calibration_path
            overrides = dict(self.calibration_coefficients)
            if overrides:
                data["coefficients"].update(overrides)
                data["fingerprint"]["overridden"] = sorted(overrides)
                source += " + balance.calibration_coefficients" if self.calibration_path else ""
            return CalibratedWorkload.from_dict(data, source=source)
        except BalanceConfigError as err:
            raise ConfigError(f"balance.workload=calibrated: {err}") from err

    def workload_for(self, model_config: ModelConfig):
        """The balancer's cost model: tokens, FLOPs from the model's dimensions, or calibrated seconds."""
        if self.workload == "calibrated":
            return self.calibrated_workload()
        return FlopsWorkload.from_model_config(model_config) if self.workload == "flops" else TokenWorkload()


CALIBRATION_RUN_FILE = "calibration.json"


def record_workload(workload, out_dir: str) -> str | None:
    """Log the balancer's workload at start-up; a calibrated one is also written to
    ``out_dir/calibration.json`` (coefficients, fingerprint, source), so the run keeps the cost
    model it was planned with. Returns that file's path, or None for the token / FLOPs models."""
    if not isinstance(workload, CalibratedWorkload):
        logger.info("balancer workload: %s", getattr(workload, "name", type(workload).__name__))
        return None
    logger.info("balancer %s", workload.describe())
    path = os.path.join(out_dir, CALIBRATION_RUN_FILE)
    atomic_write_json(path, {**workload.to_dict(), "source": workload.source})
    return path


@dataclass
class TrainerSection:
    """Cluster size, run length, logging, checkpoints (verl's ``trainer`` keys)."""

    device: str = field(default="auto", metadata=LAYOUT_ON_RESUME)
    """'auto' (GPUs when the Ray cluster has them), 'cpu' or 'cuda'."""
    nnodes: int = field(default=1, metadata=LAYOUT_ON_RESUME)
    """Nodes of the worker group."""
    n_gpus_per_node: int = field(default=4, metadata=LAYOUT_ON_RESUME)
    """Workers per node (on CPU: CPU worker processes)."""
    total_epochs: int = field(default=1, metadata=APPLY_ON_RESUME)
    """Passes over the training set (when total_training_steps is null)."""
    total_training_steps: Optional[int] = field(default=None, metadata=APPLY_ON_RESUME)
    """Steps to train; null = total_epochs x steps per epoch."""
    logger: list = field(default_factory=lambda: ["console", "jsonl"], metadata=APPLY_ON_RESUME)
    """Tracking backends: any of LOGGERS."""
    project_name: str = field(default="verl_balance", metadata=APPLY_ON_RESUME)
    """Tracking project."""
    experiment_name: str = field(default="sft", metadata=APPLY_ON_RESUME)
    """Tracking run name."""
    default_local_dir: str = field(
        default="outputs/${trainer.project_name}/${trainer.experiment_name}", metadata=APPLY_ON_RESUME
    )
    """Run directory: metrics, checkpoints, plots, generated data."""
    save_freq: int = field(default=-1, metadata=APPLY_ON_RESUME)
    """Checkpoint every N steps (and at the end); <= 0 = never."""
    save_hf_model: bool = field(default=False, metadata=APPLY_ON_RESUME)
    """Also write each checkpoint's model as a Hugging Face ``save_pretrained`` directory,
    ``global_step_N/hf`` (safetensors, config, tokenizer); a built-in model is written as Llama."""
    test_freq: int = field(default=-1, metadata=APPLY_ON_RESUME)
    """Validate every N steps (and at the end); <= 0 = never."""
    resume_mode: str = field(default="auto", metadata=APPLY_ON_RESUME)
    """'auto' (latest checkpoint of default_local_dir, if any), 'disable' or 'resume_path'."""
    resume_from_path: Optional[str] = field(default=None, metadata=APPLY_ON_RESUME)
    """Checkpoint directory for resume_mode=resume_path."""
    seed: int = 1
    """Seed of the data order, the model initialisation and the rollout sampling."""
    ray_address: Optional[str] = field(default=None, metadata=APPLY_ON_RESUME)
    """Address of a running Ray cluster; null = start an embedded one."""
    placement_timeout_s: float = field(default=120.0, metadata=APPLY_ON_RESUME)
    """How long to wait for the workers' resources before failing."""
    plot: bool = field(default=True, metadata=APPLY_ON_RESUME)
    """Write curves.png at the end of the run."""
    max_ckpt_to_keep: Optional[int] = field(default=None, metadata=APPLY_ON_RESUME)
    """Keep only the newest N complete checkpoints of this run (older ones are deleted after a newer one
    is complete); null keeps every checkpoint. See docs/fault_tolerance.md."""
    max_restarts: int = field(default=0, metadata=APPLY_ON_RESUME)
    """How often a run rebuilds its worker group after a worker dies and continues from the last complete
    checkpoint; 0 = a dead worker ends the run."""
    profile_steps: list[int] = field(default_factory=list, metadata=APPLY_ON_RESUME)
    """verl's key: 1-based driver steps (global_step as logged) to trace with torch.profiler on every
    worker; empty = never. See docs/performance.md for where the traces go."""
    profile_dir: Optional[str] = field(default=None, metadata=APPLY_ON_RESUME)
    """Directory of the profiler traces; null = ``default_local_dir``/profile."""
    worker_call_timeout_s: Optional[float] = field(default=3600.0, metadata=APPLY_ON_RESUME)
    """How long the driver waits for the workers to answer one call (a step's update, a rollout, a
    checkpoint, the model build) before failing with an error naming the ranks that did not answer
    (a stopped, deadlocked or starved worker); null = wait forever."""
    heartbeat_interval_s: Optional[float] = field(default=60.0, metadata=APPLY_ON_RESUME)
    """While the driver waits on the workers (or on the reward function), a line every this many
    seconds names what it waits for (the ranks that have not answered); null or 0 = no lines."""
    max_consecutive_nonfinite_steps: int = field(default=3, metadata=APPLY_ON_RESUME)
    """Stop the run (an error naming the step) after this many consecutive steps with a non-finite
    loss or gradient norm; each such step skips its optimizer update and no checkpoint is saved
    from it. See docs/fault_tolerance.md."""

    def __post_init__(self) -> None:
        check_choice("device", self.device, DEVICES)
        check_positive("nnodes", self.nnodes)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_positive("total_epochs", self.total_epochs)
        if self.total_training_steps is not None:
            check_positive("total_training_steps", self.total_training_steps)
        check_choice("resume_mode", self.resume_mode, RESUME_MODES)
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigError("resume_mode=resume_path needs resume_from_path")
        for name in self.logger:
            check_choice("logger", name, LOGGERS)
        if self.max_ckpt_to_keep is not None:
            check_positive("max_ckpt_to_keep", self.max_ckpt_to_keep)
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts} must be >= 0")
        if self.worker_call_timeout_s is not None:
            check_positive("worker_call_timeout_s", self.worker_call_timeout_s)
        if self.heartbeat_interval_s is not None and self.heartbeat_interval_s < 0:
            raise ConfigError(f"heartbeat_interval_s={self.heartbeat_interval_s} must be >= 0 (0 or null: no lines)")
        check_positive("max_consecutive_nonfinite_steps", self.max_consecutive_nonfinite_steps)
        bad_steps = [s for s in self.profile_steps if s < 1]
        if bad_steps:
            raise ConfigError(
                f"profile_steps={list(self.profile_steps)}: steps are 1-based driver steps "
                f"(global_step as logged), got {bad_steps}"
            )

    @property
    def profile_path(self) -> str:
        """Absolute directory of the profiler traces: ``profile_dir``, else ``default_local_dir``/profile."""
        return os.path.abspath(self.profile_dir or os.path.join(self.default_local_dir, "profile"))

    @property
    def world_size(self) -> int:
        """Workers in the group: nnodes x n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node


# ---------------------------------------------------------------------- the SFT recipe
@dataclass
class SFTDataSection(SFTDataConfig):
    """The dataset's own ``SFTDataConfig`` plus the files, the batching and the synthetic task."""

    train_files: Optional[Any] = None
    """Parquet/jsonl file(s) in verl's SFT schema; null = generate the synthetic task."""
    val_files: Optional[Any] = field(default=None, metadata=APPLY_ON_RESUME)
    """Validation file(s); null with synthetic data = the generated validation split."""
    train_batch_size: int = 32
    """Global mini-batch: samples per optimizer step over all DP ranks."""
    micro_batch_size_per_gpu: int = field(default=4, metadata=LAYOUT_ON_RESUME)
    """Samples per micro-batch (when use_dynamic_bsz is false)."""
    use_dynamic_bsz: bool = field(default=False, metadata=LAYOUT_ON_RESUME)
    """Pack micro-batches up to max_token_len_per_gpu tokens instead of a fixed sample count."""
    max_token_len_per_gpu: int = field(default=2048, metadata=LAYOUT_ON_RESUME)
    """Token cap of a micro-batch per worker (per SP rank, after Ulysses padding)."""
    balance_dp_token: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """verl's switch for DP-global token counts. Always true here: the loss contract takes its
    token and sequence counts over the whole mini-batch (every DP rank and micro-batch); false is
    rejected rather than silently ignored."""
    shuffle: bool = True
    """Reshuffle the training set every epoch (seeded by trainer.seed)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """The generated task used when train_files is null."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("train_batch_size", self.train_batch_size)
        if self.use_dynamic_bsz:
            check_positive("max_token_len_per_gpu", self.max_token_len_per_gpu)
        else:
            check_positive("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        if not self.balance_dp_token:
            raise ConfigError(
                "balance_dp_token=false is not supported: token and sequence counts are always taken over "
                "the whole mini-batch (all DP ranks and micro-batches), so the loss is the global mean on any "
                "layout; remove the key or set it to true"
            )

    def dataset_config(self) -> SFTDataConfig:
        """The dataset's own fields, as ``SFTDataset`` takes them."""
        return narrow(self, SFTDataConfig)


@dataclass
class SFTConfig:
    """The SFT recipe (``config/sft.yaml``)."""

    data: SFTDataSection = field(default_factory=SFTDataSection)
    """Files, columns, length policy and batching."""
    model: SFTModelSection = field(default_factory=SFTModelSection)
    """The model: an HF directory (model.path) or a preset with dimension overrides."""
    ulysses_sequence_parallel_size: int = field(default=1, metadata=LAYOUT_ON_RESUME)
    """Ulysses degree: workers per DP group that split each sequence."""
    use_remove_padding: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """verl's key; must be true (the engine always runs packed, padding-free sequences)."""
    balance: BalanceSection = field(default_factory=BalanceSection)
    """Workload balancer."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation: one of loss.AGG_MODES (the loss contract)."""
    loss_scale_factor: Optional[float] = None
    """The constant C of seq-mean-token-sum-norm."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The engine's optimizer and learning-rate schedule."""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    """Cluster, run length, logging, checkpoints."""

    def __post_init__(self) -> None:
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)
        check_agg_mode(self.loss_agg_mode)
        check_remove_padding("use_remove_padding", self.use_remove_padding)


def register_schemas() -> None:
    """Register the schemas so YAML files can name them in their defaults list."""
    ConfigStore.instance().store(name="sft_schema", node=SFTConfig)


# ---------------------------------------------------------------------- DictConfig -> objects
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
            raise ConfigError(
                f"unknown config key(s) {[path + k for k in unknown]}; valid keys of "
                f"{path.rstrip('.') or 'the root'}: {sorted(fields)}"
            )
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


def narrow(instance, cls):
    """An instance of ``cls`` (a dataclass base of ``instance``'s class) with ``instance``'s values."""
    return cls(**{f.name: getattr(instance, f.name) for f in dataclasses.fields(cls)})


def check_remove_padding(key: str, value: bool) -> None:
    """Reject use_remove_padding=false: the engine always runs packed sequences."""
    if not value:
        raise ConfigError(
            f"{key}=false is not supported: the engine always runs packed (padding-free) "
            "sequences, which Ulysses sequence parallelism requires"
        )


def qualify(message: str, prefixes: dict[str, str]) -> str:
    """``message`` with every bare key name in ``prefixes`` written as its full key."""
    if not prefixes:
        return message
    names = "|".join(sorted(map(re.escape, prefixes), key=len, reverse=True))
    return re.sub(rf"(?<![\w.'\"])({names})\b", lambda m: prefixes[m.group(1)] + m.group(1), message)


def _section_prefixes(node: DictConfig, path: str) -> dict[str, str]:
    parent, _, leaf = path.rpartition(".")
    prefixes = {str(key): f"{path}." for key in node.keys()}
    prefixes[leaf] = f"{parent}." if parent else ""
    return prefixes


def _instantiate(node: DictConfig, path: str):
    """``OmegaConf.to_object(node)`` after its subsections, a ValueError from a ``__post_init__``
    re-raised as ConfigError with the keys written out in full."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _instantiate(child, f"{path}.{key}" if path else str(key))
    try:
        return OmegaConf.to_object(node)
    except ValueError as err:
        message = qualify(str(err), _section_prefixes(node, path) if path else {})
        raise ConfigError(message if not path or path in message else f"{message} (in {path})") from err


def to_typed(cfg: DictConfig):
    """The merged Hydra config as its schema's objects (every ``__post_init__`` check has run, and
    no number is inf or nan)."""
    config = _instantiate(cfg, "")
    check_finite_values(config)
    return config


def check_finite_values(value, key: str = "") -> None:
    """Raise ConfigError naming the first key (dotted, list index as ``[i]``) under ``value`` (a
    dataclass, dict, list or number) that holds inf or nan: no setting is meaningful at infinity,
    and e.g. optim.lr=inf would train on NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not a finite number; give a finite value")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            check_finite_values(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for name, item in value.items():
            check_finite_values(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite_values(item, f"{key}[{i}]")


def build_engine_config(
    *,
    optim: OptimConfig,
    loss_agg_mode: str,
    loss_scale_factor: float | None,
    param_dtype: str,
    seed: int,
    total_steps: int,
    keys: dict[str, str],
    fsdp: FSDPConfig | None = None,
    profile_steps: Sequence[int] = (),
    profile_dir: str = "profile",
    updates_per_step: int = 1,
    logits_chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE,
) -> EngineConfig:
    """The engine's config for a run of ``total_steps`` optimizer steps; ``keys`` maps its field
    names (optim, loss_agg_mode, loss_scale_factor, param_dtype) to the recipe's keys for errors.

    ``profile_steps`` are driver steps; each driver step runs ``updates_per_step`` engine train
    steps (GRPO: ppo_epochs x mini-batches), all of which are traced (``engine_profile_steps``).
    """
    try:
        return EngineConfig(
            optim=optim,
            total_steps=total_steps,
            loss_agg_mode=loss_agg_mode,
            loss_scale_factor=loss_scale_factor,
            param_dtype=param_dtype,
            seed=seed,
            fsdp=fsdp if fsdp is not None else FSDPConfig(),
            profile_steps=engine_profile_steps(profile_steps, updates_per_step=updates_per_step),
            profile_dir=profile_dir,
            logits_chunk_size=logits_chunk_size,
        )
    except ValueError as err:
        prefixes = {name: key[: -len(name)] for name, key in keys.items()}
        raise ConfigError(qualify(str(err), prefixes)) from err


def engine_profile_steps(driver_steps: Sequence[int], *, updates_per_step: int) -> list[int]:
    """The engine's 1-based train steps of the given 1-based driver steps: driver step s runs engine
    steps (s - 1) * updates_per_step + 1 .. s * updates_per_step."""
    assert updates_per_step >= 1, updates_per_step
    return [
        (int(s) - 1) * updates_per_step + k for s in sorted(set(driver_steps)) for k in range(1, updates_per_step + 1)
    ]


def check_profile_steps(*, trainer: TrainerSection, total_steps: int) -> None:
    """Raise ConfigError naming trainer.profile_steps when a step lies beyond the run's last step
    (it would silently never be traced)."""
    beyond = [s for s in trainer.profile_steps if s > total_steps]
    if beyond:
        raise ConfigError(
            f"trainer.profile_steps={list(trainer.profile_steps)}: steps {beyond} lie beyond the "
            f"run's last step {total_steps}; choose steps in 1..{total_steps}"
        )


def check_layout(*, sp_size: int, trainer: TrainerSection, sp_key: str) -> int:
    """The DP size; ConfigError unless the Ulysses degree divides the worker count."""
    world = trainer.world_size
    if world % sp_size:
        raise ConfigError(
            f"{sp_key}={sp_size} must divide the number of workers trainer.nnodes * trainer.n_gpus_per_node = {world}"
        )
    return world // sp_size


SFT_ENGINE_KEYS = {
    "optim": "optim",
    "loss_agg_mode": "loss_agg_mode",
    "loss_scale_factor": "loss_scale_factor",
    "param_dtype": "model.param_dtype",
    "fsdp": "model.fsdp_config",
    "profile_steps": "trainer.profile_steps",
    "logits_chunk_size": "model.logits_chunk_size",
}


def validate_sft(cfg: DictConfig) -> SFTConfig:
    """The SFT config as typed objects; ConfigError naming the key when it is invalid."""
    check_known_keys(cfg)
    config: SFTConfig = to_typed(cfg)
    check_writable_dir("trainer.default_local_dir", config.trainer.default_local_dir)
    dp = check_layout(
        sp_size=config.ulysses_sequence_parallel_size, trainer=config.trainer, sp_key="ulysses_sequence_parallel_size"
    )
    if config.data.train_batch_size < dp:
        raise ConfigError(
            f"data.train_batch_size={config.data.train_batch_size} is smaller than the data-parallel size {dp} "
            "(workers / ulysses_sequence_parallel_size); every DP rank needs at least one sample"
        )
    build_engine_config(
        optim=config.optim,
        loss_agg_mode=config.loss_agg_mode,
        loss_scale_factor=config.loss_scale_factor,
        param_dtype=config.model.param_dtype,
        seed=config.trainer.seed,
        total_steps=1,
        keys=SFT_ENGINE_KEYS,
        fsdp=config.model.fsdp_config,
        profile_steps=config.trainer.profile_steps,
        profile_dir=config.trainer.profile_path,
        logits_chunk_size=config.model.logits_chunk_size,
    )
    return config
