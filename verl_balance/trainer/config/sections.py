"""The sections both recipes share, each the config of the component it configures (or nesting
it): the synthetic task, the model, the workload balancer and the trainer loop (verl's ``trainer``).

Choices are ``str`` fields checked in ``__post_init__`` against module-level tuples (OmegaConf
cannot hold ``Literal`` annotations).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from verl_balance.balance import FlopsWorkload, TokenWorkload
from verl_balance.balance.errors import BalanceConfigError
from verl_balance.balance.plan import OVERLONG_POLICIES
from verl_balance.balance.workload import CalibratedWorkload
from verl_balance.data.synthetic import SyntheticConfig, write_dataset
from verl_balance.engine.config import APPLY_ON_RESUME, LAYOUT_ON_RESUME, PARAM_DTYPES, ModelKeys
from verl_balance.models import MODEL_DIMENSION_KEYS, load_model_config
from verl_balance.models.config import ModelConfig, ModelConfigError
from verl_balance.models.hf import INIT_MODES, HFModelConfig
from verl_balance.trainer.config.checks import (
    ConfigError,
    check_adapter_dir,
    check_choice,
    check_hf_model_dir,
    check_positive,
)
from verl_balance.utils.atomic_io import atomic_write_json, refuse_symlink

logger = logging.getLogger(__name__)

WORKLOADS = ("tokens", "flops", "calibrated")
DEVICES = ("auto", "cpu", "cuda")
RESUME_MODES = ("auto", "disable", "resume_path")
LOGGERS = ("console", "jsonl", "file", "tensorboard", "wandb", "mlflow")


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

    def task_config(self) -> SyntheticConfig:
        """The generator's own config (the default task mix here; GRPO's section sets it)."""
        return SyntheticConfig()


def resolve_data_files(data, *, kind: str, default_local_dir: str) -> tuple:
    """(train files, validation files): ``data.train_files`` / ``data.val_files``, or with ``train_files``
    null the synthetic task's parquet files under ``data.synthetic.out_dir``, generated unless present."""
    if data.train_files is not None:
        return data.train_files, data.val_files
    synthetic = data.synthetic
    out_dir = synthetic.out_dir or os.path.join(default_local_dir, "data")
    train, val = (os.path.join(out_dir, f"{kind}_{split}.parquet") for split in ("train", "val"))
    if synthetic.out_dir is None:  # inside the run directory: never through a planted link
        for path in (out_dir, train, val):
            refuse_symlink(path)
    if not (os.path.exists(train) and os.path.exists(val)):
        logger.info("data.train_files is null: generating the synthetic task into %s", out_dir)
        write_dataset(
            out_dir=out_dir,
            num_train=synthetic.num_train,
            num_val=synthetic.num_val,
            seed=synthetic.seed,
            progress=True,
            config=synthetic.task_config(),
        )
    return train, (data.val_files if data.val_files is not None else val)


@dataclass
class ModelSection(ModelKeys):
    """The model: a local HF directory (``path``) or a built-in preset (``name``) whose dimensions keys set
    here override, plus the engine's ``model`` keys."""

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
    """verl's key. null: chats render with the tokenizer's own template (none: an error at start-up);
    'builtin': a tokenizer without one uses the built-in minimal template (a different loss)."""

    def __post_init__(self) -> None:
        check_choice("param_dtype", self.param_dtype, PARAM_DTYPES)
        check_choice("init", self.init, INIT_MODES)
        if self.lora_adapter_path is not None:
            check_adapter_dir("lora_adapter_path", self.lora_adapter_path)
        if self.lora_rank and self.path is None:
            raise ConfigError(
                f"lora_rank={self.lora_rank} needs a Hugging Face model (path); the built-in preset has no "
                "LoRA support: set lora_rank=0 or path"
            )
        if (self.lora_rank or self.lora_adapter_path is not None) and importlib.util.find_spec("peft") is None:
            key = f"lora_rank={self.lora_rank}" if self.lora_rank else "lora_adapter_path"
            raise ConfigError(
                f"{key}: LoRA needs peft, which is not installed: pip install 'peft>=0.13' (a dependency of "
                "verl-balance: reinstall it with pip install -e .), or set lora_rank=0"
            )
        if self.path is not None:
            check_hf_model_dir("path", self.path)
        for key in MODEL_DIMENSION_KEYS:  # a dimension override, when set, is a positive count
            value = getattr(self, key)
            if value is not None and not isinstance(value, bool):
                check_positive(key, value)

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer to build: ``tokenizer``, else the model directory, else 'byte'."""
        return self.tokenizer or self.path or "byte"

    def model_config(self, *, vocab_size: int):
        """``HFModelConfig`` of ``path``, or the preset with the tokenizer's vocab; ConfigError naming a bad key."""
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


@dataclass
class BalanceSection:
    """The workload balancer's cost model and length policy (``balance.plan_balance``). The switch
    is the recipe's own key: ``balance.enable`` in SFT, verl's ``trainer.balance_batch`` in GRPO."""

    workload: str = field(default="flops", metadata=LAYOUT_ON_RESUME)
    """Cost model: 'tokens' (linear), 'flops' (linear layers + quadratic causal attention) or 'calibrated'
    (measured by ``python -m verl_balance.calibrate``; needs calibration_path or calibration_coefficients)."""
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
    """Log the balancer's workload at start-up; a calibrated one is also written to ``out_dir/calibration.json``,
    whose path is returned (None for the token / FLOPs models)."""
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

    AT_LAST_STEP: ClassVar[bool] = False
    """Whether the last step saves and validates whatever save_freq / test_freq say (verl's
    sft_trainer: True) or only when they are > 0 (verl's ppo trainer: False)."""

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
    logger: Any = field(default_factory=lambda: ["console", "jsonl"], metadata=APPLY_ON_RESUME)
    """Tracking backends: a list of LOGGERS, or one name (``file``: the jsonl file; ``mlflow``: a local store
    under default_local_dir/mlruns unless MLFLOW_TRACKING_URI is set)."""
    console_metrics: Optional[list] = field(default=None, metadata=APPLY_ON_RESUME)
    """Metric keys the console's progress line shows (e.g. [train/loss,val/loss]); null = the recipe's
    few (utils/progress.py). metrics.jsonl and the trackers get every metric."""
    progress_interval_s: float = field(default=0.0, metadata=APPLY_ON_RESUME)
    """When stdout is not a terminal: print the progress line at most every this many seconds (and at
    the last step); 0 = every step. The run log gets every step's line."""
    project_name: str = field(default="verl_balance", metadata=APPLY_ON_RESUME)
    """Tracking project."""
    experiment_name: str = field(default="sft", metadata=APPLY_ON_RESUME)
    """Tracking run name."""
    default_local_dir: str = field(
        default="outputs/${trainer.project_name}/${trainer.experiment_name}", metadata=APPLY_ON_RESUME
    )
    """Run directory: metrics, checkpoints, plots, generated data."""
    save_freq: int = field(default=-1, metadata=APPLY_ON_RESUME)
    """Checkpoint every N steps and at the last step; -1 (any negative) = only at the last step in SFT
    (verl's sft_trainer), never in GRPO (verl's ppo trainer). 0 is refused: it reads as "always"."""
    save_hf_model: bool = field(default=False, metadata=APPLY_ON_RESUME)
    """Also write each checkpoint's model as a Hugging Face ``save_pretrained`` directory,
    ``global_step_N/hf`` (safetensors, config, tokenizer); a built-in model is written as Llama."""
    test_freq: int = field(default=-1, metadata=APPLY_ON_RESUME)
    """Validate every N steps and at the last step; <= 0 = only at the last step in SFT (when there is
    validation data, verl's sft_trainer), never in GRPO (verl's ppo trainer)."""
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
    allow_unverified_checkpoint: bool = field(default=False, metadata=APPLY_ON_RESUME)
    """Load a checkpoint without a verified completeness record (no checkpoint_complete.json, or one
    without file checksums, as older versions wrote) on resume and warm start; false refuses it."""
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
    """Seconds the driver waits for the workers to answer one call before an error naming the silent
    ranks; null = wait forever."""
    heartbeat_interval_s: Optional[float] = field(default=60.0, metadata=APPLY_ON_RESUME)
    """While the driver waits on the workers (or on the reward function), a line every this many
    seconds names what it waits for (the ranks that have not answered); null or 0 = no lines."""
    max_consecutive_nonfinite_steps: int = field(default=3, metadata=APPLY_ON_RESUME)
    """Stop the run after this many consecutive steps with a non-finite loss or gradient norm (each skips
    its update and saves no checkpoint)."""

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
        if self.resume_mode == "resume_path" and not os.path.isdir(self.resume_from_path):
            what = "is not a directory" if os.path.exists(self.resume_from_path) else "does not exist"
            raise ConfigError(
                f"resume_from_path={self.resume_from_path!r} {what} (resume_mode=resume_path); point it at a "
                "complete global_step_N directory, or set resume_mode=auto"
            )
        if isinstance(self.logger, str):
            self.logger = [self.logger]
        if not isinstance(self.logger, (list, tuple)):
            raise ConfigError(f"logger={self.logger!r}: give a list of {list(LOGGERS)} or one of them")
        for name in self.logger:
            check_choice("logger", name, LOGGERS)
        if self.save_freq == 0:
            raise ConfigError(
                "save_freq=0 would never save a checkpoint; set a positive N (every N steps and at the last step) "
                "or -1 (as in verl: only at the last step in SFT, never in GRPO)"
            )
        if self.progress_interval_s < 0:
            raise ConfigError(f"progress_interval_s={self.progress_interval_s} must be >= 0 (0: a line every step)")
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

    def save_due(self, step: int, *, is_last: bool) -> bool:
        """Whether the run saves a checkpoint after ``step`` (1-based)."""
        return _due(self.save_freq, step, is_last=is_last, at_last_step=self.AT_LAST_STEP)

    def validate_due(self, step: int, *, is_last: bool) -> bool:
        """Whether the run validates after ``step`` (1-based)."""
        return _due(self.test_freq, step, is_last=is_last, at_last_step=self.AT_LAST_STEP)

    @property
    def profile_path(self) -> str:
        """Absolute directory of the profiler traces: ``profile_dir``, else ``default_local_dir``/profile."""
        return os.path.abspath(self.profile_dir or os.path.join(self.default_local_dir, "profile"))

    @property
    def world_size(self) -> int:
        """Workers in the group: nnodes x n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node


@dataclass
class RayKwargsSection:
    """verl's ``ray_kwargs``: arguments of the ``ray.init`` that starts (or joins) the cluster."""

    ray_init: dict = field(default_factory=lambda: {"num_cpus": None}, metadata=APPLY_ON_RESUME)
    """verl's key: keyword arguments of ``ray.init`` merged over ours (null values left out, runtime_env key
    by key); a key ray.init does not take is refused."""

    def __post_init__(self) -> None:
        from verl_balance.trainer.config.ray_init import check_ray_init

        check_ray_init(self.ray_init)


def _due(freq: int, step: int, *, is_last: bool, at_last_step: bool) -> bool:
    """verl's rule: every ``freq`` steps and the last one when freq > 0; with ``at_last_step``, the last one always."""
    if freq > 0:
        return is_last or step % freq == 0
    return is_last and at_last_step


@dataclass
class SFTTrainerSection(TrainerSection):
    """``trainer`` of the SFT recipe: always saves and validates at the last step (verl's sft_trainer)."""

    AT_LAST_STEP: ClassVar[bool] = True


def narrow(instance, cls):
    """An instance of ``cls`` (a dataclass base of ``instance``'s class) with ``instance``'s values."""
    return cls(**{f.name: getattr(instance, f.name) for f in dataclasses.fields(cls)})


def engine_profile_steps(driver_steps: Sequence[int], *, updates_per_step: int) -> list[int]:
    """The engine's 1-based train steps of the given 1-based driver steps (``updates_per_step`` each)."""
    assert updates_per_step >= 1, updates_per_step
    return [
        (int(s) - 1) * updates_per_step + k for s in sorted(set(driver_steps)) for k in range(1, updates_per_step + 1)
    ]


def check_profile_steps(*, trainer: TrainerSection, total_steps: int) -> None:
    """ConfigError naming trainer.profile_steps when a step lies beyond the run's last step."""
    beyond = [s for s in trainer.profile_steps if s > total_steps]
    if beyond:
        raise ConfigError(
            f"trainer.profile_steps={list(trainer.profile_steps)}: steps {beyond} lie beyond the "
            f"run's last step {total_steps}; choose steps in 1..{total_steps}"
        )
