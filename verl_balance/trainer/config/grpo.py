"""Typed schema of the GRPO recipe (``config/grpo.yaml``) and its cross-section checks.

Key names are verl's, so a verl user's overrides carry over. Units are verl's:
``data.train_batch_size`` and ``ppo_mini_batch_size`` count prompts (each carries ``rollout.n``
responses); ``*_micro_batch_size_per_gpu`` counts responses; token caps are per worker (per SP rank,
after Ulysses padding). The balancer switch is ``trainer.balance_batch``; ``balance`` holds its cost model.

PPO with a critic is ``algorithm.adv_estimator=gae``: the ``critic`` section's null keys take the
actor's values (verl's ``oc.select`` interpolations); a critic key set with another estimator is an
error (verl ignores it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from verl_balance.algorithms import LossModeConfig, PolicyLossConfig
from verl_balance.data.rl_dataset import RLDataConfig
from verl_balance.data.synthetic import TASKS, SyntheticConfig
from verl_balance.engine.config import (
    APPLY_ON_RESUME,
    LAYOUT_ON_RESUME,
    ActorKeys,
    CriticFSDPKeys,
    EngineConfig,
    FSDPKeys,
)
from verl_balance.loss import WEIGHT_MODES, check_agg_mode
from verl_balance.rewards.overlong import REWARD_MANAGERS, OverlongBufferConfig
from verl_balance.rollout.agent_loop import MultiTurnConfig
from verl_balance.rollout.base import RolloutInputError
from verl_balance.rollout.factory import ROLLOUT_BACKENDS, resolve_backend
from verl_balance.trainer.checkpoint import COMPLETE_FILE, TRAINER_STATE_FILE
from verl_balance.trainer.config.algorithm import ActorAlgorithmKeys, AlgorithmSection
from verl_balance.trainer.config.async_mode import V1Section, check_async
from verl_balance.trainer.config.checks import (
    ConfigError,
    check_choice,
    check_hf_model_dir,
    check_positive,
    check_remove_padding,
)
from verl_balance.trainer.config.recipe import RecipeConfig, engine_keys
from verl_balance.trainer.config.sections import (
    BalanceSection,
    ModelSection,
    RayKwargsSection,
    SyntheticDataConfig,
    TrainerSection,
    narrow,
)
from verl_balance.trainer.config.sft import register_sft_schema

logger = logging.getLogger(__name__)
RECOMPUTE_OLD_LOG_PROB = ("auto", "always")
AR = "actor_rollout_ref"


@dataclass
class GRPOSyntheticConfig(SyntheticDataConfig):
    """The generated task used when ``data.train_files`` is null (see data/synthetic.py)."""

    tasks: list = field(default_factory=lambda: list(TASKS))
    """A non-empty subset of data.synthetic.TASKS."""
    median_size: float = 8.0
    """Median problem size (log-normal)."""
    sigma: float = 1.0
    """Log-normal spread of the problem size."""
    min_size: int = 1
    """Smallest problem size."""
    max_size: int = 96
    """Largest problem size."""

    def __post_init__(self) -> None:
        self.task_config()  # the generator checks its own settings

    def task_config(self) -> SyntheticConfig:
        """The generator's own config."""
        return SyntheticConfig(
            tasks=tuple(self.tasks),
            median_size=self.median_size,
            sigma=self.sigma,
            min_size=self.min_size,
            max_size=self.max_size,
        )


@dataclass
class GRPODataSection(RLDataConfig):
    """The dataset's own ``RLDataConfig`` plus the files, the batch sizes and the synthetic task."""

    train_files: Optional[Any] = None
    """RL parquet/jsonl file(s) in verl's schema; null = generate the synthetic task."""
    val_files: Optional[Any] = field(default=None, metadata=APPLY_ON_RESUME)
    """Validation file(s); null with synthetic data = the generated validation split."""
    train_batch_size: int = 16
    """Prompts per step (each gets actor_rollout_ref.rollout.n responses)."""
    val_batch_size: Optional[int] = field(default=None, metadata=APPLY_ON_RESUME)
    """Prompts scored per validation (null = the whole validation set)."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded by trainer.seed)."""
    synthetic: GRPOSyntheticConfig = field(default_factory=GRPOSyntheticConfig)
    """The generated task used when train_files is null."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("train_batch_size", self.train_batch_size)
        if self.val_batch_size is not None:
            check_positive("val_batch_size", self.val_batch_size)

    def dataset_config(self) -> RLDataConfig:
        """The dataset's own fields, as ``RLPromptDataset`` takes them."""
        return narrow(self, RLDataConfig)


def is_engine_checkpoint(path: str) -> bool:
    """Whether ``path`` is a ``global_step_N`` directory written by our trainers (not an HF model)."""
    return any(os.path.exists(os.path.join(path, name)) for name in (TRAINER_STATE_FILE, COMPLETE_FILE))


@dataclass
class ActorModelSection(ModelSection):
    """verl's ``actor_rollout_ref.model``: an HF directory or a built-in preset, optionally warm-started."""

    KEY_PREFIX: ClassVar[str] = "actor_rollout_ref.model."

    warm_start_path: Optional[str] = None
    """A global_step_N engine checkpoint whose model weights (only) the run starts from; its model must match."""
    use_remove_padding: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """verl's key; must be true (the engine always runs packed, padding-free sequences)."""

    def __post_init__(self) -> None:
        if self.path is not None and is_engine_checkpoint(self.path):
            raise ConfigError(
                f"path={self.path!r} is a training checkpoint (global_step_N), not a Hugging Face "
                "directory; start from its weights with warm_start_path (path takes HF directories only)"
            )
        super().__post_init__()
        check_remove_padding("use_remove_padding", self.use_remove_padding)
        if self.warm_start_path is not None and not is_engine_checkpoint(self.warm_start_path):
            raise ConfigError(
                f"warm_start_path={self.warm_start_path!r} is not a checkpoint written by the "
                f"trainers (no {TRAINER_STATE_FILE} or {COMPLETE_FILE}); point it at a global_step_N "
                "directory"
            )


@dataclass
class ActorSection(FSDPKeys, ActorKeys, ActorAlgorithmKeys, PolicyLossConfig):
    """verl's ``actor_rollout_ref.actor``: the policy loss, PPO mini-batching and the engine's actor keys."""

    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (all their responses)."""
    ppo_micro_batch_size_per_gpu: Optional[int] = field(default=8, metadata=LAYOUT_ON_RESUME)
    """Responses per micro-batch (when use_dynamic_bsz is false)."""
    use_dynamic_bsz: bool = field(default=False, metadata=LAYOUT_ON_RESUME)
    """Pack micro-batches up to ppo_max_token_len_per_gpu tokens instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = field(default=4096, metadata=LAYOUT_ON_RESUME)
    """Token cap of a micro-batch per worker (per SP rank, after Ulysses padding)."""
    ppo_epochs: int = 1
    """Passes over each step's rollout batch."""
    recompute_old_log_prob: str = "auto"
    """auto: skip the separate old-log-prob pass when the update is on-policy (ppo_epochs 1, ppo_mini_batch_size =
    data.train_batch_size; ratio exactly 1); always: run it every step (verl's behaviour). docs/verl.md section 8."""
    ulysses_sequence_parallel_size: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Ulysses degree (verl's spelling; the top-level key of the SFT recipe works too)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_agg_mode(self.loss_agg_mode, valid=WEIGHT_MODES)
        self.loss_mode_config()  # a loss mode's bad setting fails here, naming its policy_loss key
        forced = self.forced_agg_mode(self.loss_agg_mode)
        if forced != self.loss_agg_mode:
            logger.warning(
                "policy_loss.loss_mode=%s aggregates with %s as verl does (loss_agg_mode=%s is not used for it)",
                self.policy_loss.loss_mode,
                forced,
                self.loss_agg_mode,
            )
            self.loss_agg_mode = forced
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("ppo_epochs", self.ppo_epochs)
        check_choice("recompute_old_log_prob", self.recompute_old_log_prob, RECOMPUTE_OLD_LOG_PROB)
        if self.use_dynamic_bsz:
            check_positive("ppo_max_token_len_per_gpu", self.ppo_max_token_len_per_gpu)
        else:
            check_positive("ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        if self.ulysses_sequence_parallel_size is not None:
            check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)

    def single_on_policy_update(self, *, train_batch_size: int) -> bool:
        """Whether recompute_old_log_prob=auto and the update is on-policy (one epoch, one mini-batch)."""
        one_update = self.ppo_epochs == 1 and self.ppo_mini_batch_size == train_batch_size
        return self.recompute_old_log_prob == "auto" and one_update

    def policy_loss_config(self) -> PolicyLossConfig:
        """The policy loss's own config, as the workers take it."""
        return narrow(self, PolicyLossConfig)


@dataclass
class ValSamplingConfig:
    """verl's ``rollout.val_kwargs``: greedy single answers by default."""

    n: int = 1
    """Responses per validation prompt."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""

    def __post_init__(self) -> None:
        check_positive("n", self.n)
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass
class RolloutSection:
    """verl's ``actor_rollout_ref.rollout``: the rollout colocated with the actor."""

    name: str = field(default="auto", metadata=APPLY_ON_RESUME)
    """Rollout backend (rollout.factory.ROLLOUT_BACKENDS): 'kv_cache' (built-in model), 'hf' (HF model) or
    'auto' (kv_cache for a built-in preset, hf for model.path)."""
    n: int = 4
    """Responses per prompt (a group)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (> 0); log-probs are taken at it too."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    response_length: int = 64
    """Most tokens of one response."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Responses per micro-batch of the old (and default reference) log-prob pass; null = the actor's."""
    log_prob_use_dynamic_bsz: Optional[bool] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """verl's key: dynamic micro-batches for the old log-prob pass (null = the actor's use_dynamic_bsz)."""
    log_prob_max_token_len_per_gpu: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Token cap of the old log-prob pass (null = the actor's ppo_max_token_len_per_gpu)."""
    max_num_seqs: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Sequences decoded together on one worker (memory bound); null = all of its prompts at once."""
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig, metadata=APPLY_ON_RESUME)
    """Sampling of validation rollouts."""
    nnodes: int = field(default=0, metadata=LAYOUT_ON_RESUME)
    """verl's key: nodes of the separate rollout pool (separate_async only; 0 = one node)."""
    n_gpus_per_node: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """verl's key: rollout workers per node of that pool (null or 0 = trainer.n_gpus_per_node, verl's default)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """verl's multi-turn tool rollouts (rollout/agent_loop.py): the tool agent loop, its limits and tools."""
    # -- vLLM's keys (name=vllm only; with another backend verl_keys.py names them as without effect)
    top_k: int = field(default=-1, metadata=APPLY_ON_RESUME)
    """vLLM: top-k of training rollouts (-1 or 0: off)."""
    dtype: str = field(default="float32", metadata=APPLY_ON_RESUME)
    """vLLM: the engine's dtype (verl's default bfloat16 on GPUs; float32 keeps a CPU run exact)."""
    load_format: str = field(default="dummy", metadata=APPLY_ON_RESUME)
    """vLLM: 'dummy' (random until the first weight sync, verl's default), 'auto' or 'safetensors'."""
    gpu_memory_utilization: float = field(default=0.5, metadata=APPLY_ON_RESUME)
    """vLLM: GPU memory fraction for the engine (GPU only)."""
    max_num_batched_tokens: Optional[int] = field(default=None, metadata=APPLY_ON_RESUME)
    """vLLM: tokens per scheduler step (null = vLLM's default)."""
    max_model_len: Optional[int] = field(default=None, metadata=APPLY_ON_RESUME)
    """vLLM: prompt + response tokens (null = the model's max_position_embeddings)."""
    enforce_eager: bool = field(default=False, metadata=APPLY_ON_RESUME)
    """vLLM: true = no torch.compile and no CUDA graphs (verl's default false: compiled at start-up)."""
    enable_chunked_prefill: bool = field(default=True, metadata=APPLY_ON_RESUME)
    """vLLM: chunked prefill."""
    enable_prefix_caching: bool = field(default=False, metadata=APPLY_ON_RESUME)
    """vLLM: prefix caching (reset at every weight update)."""
    free_cache_engine: bool = field(default=True, metadata=APPLY_ON_RESUME)
    """vLLM on GPUs: sleep between generations (weights offloaded, KV cache freed); no effect on CPU."""
    seed: Optional[int] = field(default=None, metadata=APPLY_ON_RESUME)
    """vLLM: the engine's own seed (null = trainer.seed); rollouts use per-prompt seeds from trainer.seed."""

    def vllm_config(self, *, seed: int):
        """The ``VLLMRolloutConfig`` of these keys (``seed``: trainer.seed unless rollout.seed set)."""
        from verl_balance.batch_keys import TEMPERATURE_KEY
        from verl_balance.rollout.vllm_rollout import VLLMRolloutConfig

        keys = (
            "dtype", "load_format", "gpu_memory_utilization", "max_num_seqs",
            "max_num_batched_tokens", "max_model_len", "enforce_eager", "enable_chunked_prefill",
            "enable_prefix_caching", "free_cache_engine", TEMPERATURE_KEY, "top_p", "top_k",
        )  # fmt: skip
        engine_seed = self.seed if self.seed is not None else seed
        return VLLMRolloutConfig(**{k: getattr(self, k) for k in keys}, seed=engine_seed)

    def __post_init__(self) -> None:
        check_choice("name", self.name, ROLLOUT_BACKENDS)
        check_positive("n", self.n)
        check_positive("response_length", self.response_length)
        if not self.temperature > 0:
            raise ConfigError(
                f"temperature={self.temperature} must be > 0 for training rollouts "
                "(greedy samples are identical within a group)"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        for key in ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu", "max_num_seqs"):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))
        if self.nnodes < 0:
            raise ConfigError(f"nnodes={self.nnodes} must be >= 0")
        if self.name == "vllm":
            self.vllm_config(seed=0)  # its checks, before Ray starts

    @property
    def rollout_workers(self) -> int:
        """Workers of the separate rollout pool: nnodes x n_gpus_per_node (0 without one)."""
        return self.nnodes * (self.n_gpus_per_node or 0)


@dataclass
class RefSection:
    """verl's ``actor_rollout_ref.ref``: micro-batching of the reference pass; null keys take ``rollout.log_prob_*``."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Responses per micro-batch of the reference pass."""
    log_prob_use_dynamic_bsz: Optional[bool] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Pack the reference pass's micro-batches up to log_prob_max_token_len_per_gpu tokens."""
    log_prob_max_token_len_per_gpu: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Token cap of a reference-pass micro-batch per worker (per SP rank)."""

    def __post_init__(self) -> None:
        for key in ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))


@dataclass(frozen=True)
class LogProbPlan:
    """How a log-prob pass is cut into micro-batches (the planner's arguments), and the keys that set it."""

    micro_batch_size: Optional[int]
    token_cap: Optional[int]
    """None: fixed micro-batches of micro_batch_size responses."""
    micro_batch_key: str
    token_cap_key: str


LOG_PROB_PASSES = ("old", "ref")


@dataclass
class ActorRolloutRefSection:
    """verl's ``actor_rollout_ref``: one model, trained by the actor and sampled by the rollout."""

    model: ActorModelSection = field(default_factory=ActorModelSection)
    """The model (HF directory or preset), its tokenizer and the warm start."""
    actor: ActorSection = field(default_factory=ActorSection)
    """Policy loss, mini-batching and optimizer."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Sampling, and the old log-prob pass's micro-batching."""
    ref: RefSection = field(default_factory=RefSection)
    """The reference log-prob pass's micro-batching."""

    def log_prob_plan(self, name: str) -> LogProbPlan:
        """Micro-batching of log-prob pass ``name`` ('old'/'ref'): its keys, else the old pass's, else the actor's."""
        assert name in LOG_PROB_PASSES, name
        keys = {"micro": "ppo_micro_batch_size_per_gpu", "dyn": "use_dynamic_bsz", "cap": "ppo_max_token_len_per_gpu"}
        chosen = {k: (f"{AR}.actor.{key}", getattr(self.actor, key)) for k, key in keys.items()}
        own = {"micro": "log_prob_micro_batch_size_per_gpu", "dyn": "log_prob_use_dynamic_bsz"}
        own["cap"] = "log_prob_max_token_len_per_gpu"
        for section in ("rollout", "ref")[: LOG_PROB_PASSES.index(name) + 1]:
            for k, key in own.items():
                if getattr(getattr(self, section), key) is not None:
                    chosen[k] = (f"{AR}.{section}.{key}", getattr(getattr(self, section), key))
        return LogProbPlan(
            micro_batch_size=chosen["micro"][1],
            token_cap=chosen["cap"][1] if chosen["dyn"][1] else None,
            micro_batch_key=chosen["micro"][0],
            token_cap_key=chosen["cap"][0],
        )


@dataclass
class CriticModelSection:
    """verl's ``critic.model``: the value model (the actor's decoder family with a scalar head per token)."""

    path: Optional[str] = None
    """A local HF directory (a ``*ForCausalLM`` body, or ``*ForTokenClassification`` with num_labels=1);
    null = the actor's model (and its warm-start decoder weights). Must share the actor's tokenizer."""
    enable_gradient_checkpointing: Optional[bool] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """verl's key: activation checkpointing of the value model; null = the actor's."""
    use_remove_padding: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """verl's key; must be true (the engine always runs packed, padding-free sequences)."""

    def __post_init__(self) -> None:
        if self.path is not None:
            check_hf_model_dir("path", self.path)
        check_remove_padding("use_remove_padding", self.use_remove_padding)


@dataclass
class CriticSection(CriticFSDPKeys, ActorKeys):
    """verl's ``critic``: the value model trained on GAE returns (algorithm.adv_estimator=gae only).
    Null keys take ``actor_rollout_ref.actor.<same key>`` (INHERITED); ``optim`` and ``fsdp`` are its own."""

    ppo_mini_batch_size: Optional[int] = None
    """Prompts per critic optimizer step (all their responses); null = the actor's."""
    ppo_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Responses per micro-batch of the critic's passes (fixed micro-batches); null = the actor's."""
    use_dynamic_bsz: Optional[bool] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Pack the critic's micro-batches up to ppo_max_token_len_per_gpu tokens; null = the actor's."""
    ppo_max_token_len_per_gpu: Optional[int] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Token cap of a critic micro-batch per worker (per SP rank); null = the actor's."""
    ppo_epochs: Optional[int] = None
    """Passes of the critic over each step's batch; null = the actor's."""
    cliprange_value: float = 0.5
    """Clip of the new values around the old ones in the value loss (verl's default 0.5)."""
    loss_agg_mode: Optional[str] = None
    """Aggregation of the value loss (one of loss.AGG_MODES); null = the actor's."""
    model: CriticModelSection = field(default_factory=CriticModelSection)
    """The value model's initial weights."""

    INHERITED: ClassVar[tuple[str, ...]] = (
        "ppo_mini_batch_size",
        "ppo_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu",
        "ppo_epochs",
        "loss_agg_mode",
        "loss_scale_factor",
    )
    """Keys whose null means the actor's value."""

    def __post_init__(self) -> None:
        if self.loss_agg_mode is not None:
            check_agg_mode(self.loss_agg_mode, valid=WEIGHT_MODES)
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "ppo_epochs"):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))
        check_positive("cliprange_value", self.cliprange_value)

    def with_actor_defaults(self, actor: ActorSection) -> CriticSection:
        """A copy whose null inherited keys hold the actor's values."""
        inherited = {k: getattr(actor, k) for k in self.INHERITED if getattr(self, k) is None}
        return dataclasses.replace(self, **inherited)

    def keys_set(self) -> list[str]:
        """The ``critic.*`` keys set away from their defaults."""
        default = CriticSection()
        return [
            f"critic.{f.name}" for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)
        ]


@dataclass
class CustomRewardSection:
    """verl's ``custom_reward_function``: a python file with the reward function."""

    path: Optional[str] = None
    """Python file; null = the built-in rule of each sample's data_source."""
    name: Optional[str] = None
    """Function name in that file (null = compute_score)."""
    reward_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of every call."""
    timeout_s: Optional[float] = field(default=300.0, metadata=APPLY_ON_RESUME)
    """Longest one reward call (one response) may take before the run fails with an error naming the
    function and the sample; heartbeat lines (trainer.heartbeat_interval_s) while it runs; null = no limit."""
    reward_manager: str = "naive"
    """verl's reward manager (reward.reward_manager.name): naive, or dapo (adds overlong_buffer's shaping)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong penalty (verl's reward_kwargs.overlong_buffer_cfg; read with reward_manager=dapo)."""
    max_resp_len: Optional[int] = None
    """verl's reward_kwargs.max_resp_len: the length the overlong penalty reaches penalty_factor at
    (null = actor_rollout_ref.rollout.response_length)."""

    def __post_init__(self) -> None:
        check_choice("reward_manager", self.reward_manager, REWARD_MANAGERS)
        if self.overlong_buffer.enable and self.reward_manager != "dapo":
            raise ConfigError(
                f"overlong_buffer.enable=true is read by the dapo reward manager only (as in verl), not "
                f"reward_manager={self.reward_manager!r}: set reward.reward_manager.name=dapo"
            )
        if self.max_resp_len is not None:
            check_positive("max_resp_len", self.max_resp_len)
        if self.name is not None and self.path is None:
            raise ConfigError(f"name={self.name!r} is set but path is not")
        if self.timeout_s is not None:
            check_positive("timeout_s", self.timeout_s)


@dataclass
class GRPOBalanceSection(BalanceSection):
    """``balance`` of the GRPO recipe: the cost model only (the switch is ``trainer.balance_batch``)."""

    enable: Optional[bool] = field(default=None, metadata=LAYOUT_ON_RESUME)
    """Not GRPO's switch (that is trainer.balance_batch); declared so that setting it fails naming that key."""

    def __post_init__(self) -> None:
        if self.enable is not None:
            raise ConfigError(
                f"enable={self.enable} is the SFT recipe's switch; GRPO's balancer switch is verl's "
                f"trainer.balance_batch: set trainer.balance_batch={str(bool(self.enable)).lower()} and remove enable"
            )
        super().__post_init__()


@dataclass
class GRPOTrainerSection(TrainerSection):
    """``trainer`` plus GRPO's balancing and validation switches."""

    experiment_name: str = field(default="grpo", metadata=APPLY_ON_RESUME)
    """Tracking run name."""
    balance_batch: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """Plan each batch over DP ranks by workload, a prompt's responses on one rank."""
    val_before_train: bool = field(default=True, metadata=APPLY_ON_RESUME)
    """Validate the initial policy at step 0, whatever test_freq says (verl's rule; not again on resume)."""
    log_val_generations: int = field(default=0, metadata=APPLY_ON_RESUME)
    """verl's key: the first N validation samples (prompt, response, score, ground truth) logged to the
    console and the run log at every validation; 0 = none."""
    rollout_data_dir: Optional[str] = field(default=None, metadata=APPLY_ON_RESUME)
    """verl's key: write every step's responses as ``<dir>/<step>.jsonl`` (input, output, gts, score,
    step and the reward's extra fields, verl's layout); null = not written."""
    validation_data_dir: Optional[str] = field(default=None, metadata=APPLY_ON_RESUME)
    """verl's key: the same for every validation (step 0 = before training); null = not written."""
    v1: V1Section = field(default_factory=V1Section)
    """verl's ``trainer.v1``: trainer mode (sync | separate_async) and off-policy sampler (config/async_mode.py)."""
    critic_warmup: int = field(default=0, metadata=APPLY_ON_RESUME)
    """verl's key (adv_estimator=gae): the first critic_warmup steps train the critic only (verl's actor
    starts one step earlier: it counts from 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.critic_warmup < 0:
            raise ConfigError(f"critic_warmup={self.critic_warmup} must be >= 0")


@dataclass
class GRPOConfig(RecipeConfig):
    """The GRPO recipe (``config/grpo.yaml``)."""

    ENGINE_SECTIONS: ClassVar[tuple[str, ...]] = ("actor_rollout_ref.actor", "actor_rollout_ref.model")
    SP_KEY: ClassVar[str] = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    CRITIC_ENGINE_SECTIONS: ClassVar[tuple[str, ...]] = ("critic",)
    """The critic engine's own keys (adv_estimator=gae; model_type value_model)."""
    CRITIC_SHARED_KEYS: ClassVar[tuple[str, ...]] = ("param_dtype",)
    """Engine fields the critic takes from the actor's keys (not LoRA, the LM head or FSDP2 switches)."""
    BALANCE_KEY: ClassVar[str] = "trainer.balance_batch"
    RECIPE: ClassVar[str] = "grpo"

    data: GRPODataSection = field(default_factory=GRPODataSection)
    """Files, columns, prompt-length policy and batch sizes."""
    actor_rollout_ref: ActorRolloutRefSection = field(default_factory=ActorRolloutRefSection)
    """Model, actor and rollout."""
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    """Advantage estimation."""
    critic: CriticSection = field(default_factory=CriticSection)
    """The value model of PPO (algorithm.adv_estimator=gae only)."""
    custom_reward_function: CustomRewardSection = field(default_factory=CustomRewardSection)
    """Reward function."""
    balance: GRPOBalanceSection = field(default_factory=GRPOBalanceSection)
    """Workload model of the balancer (its switch is trainer.balance_batch; overlong must be error)."""
    ray_kwargs: RayKwargsSection = field(default_factory=RayKwargsSection)
    """verl's ``ray_kwargs``: ``ray.init``'s arguments."""
    trainer: GRPOTrainerSection = field(default_factory=GRPOTrainerSection)
    """Cluster, run length, logging, checkpoints."""

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per driver step: ppo_epochs x mini-batches of the step's prompts."""
        actor = self.actor_rollout_ref.actor
        return actor.ppo_epochs * (self.data.train_batch_size // actor.ppo_mini_batch_size)

    @property
    def use_critic(self) -> bool:
        """Whether the run trains a critic (verl's ``need_critic``): algorithm.adv_estimator=gae."""
        return self.algorithm.adv_estimator == "gae"

    @property
    def critic_updates_per_step(self) -> int:
        """Critic optimizer steps per driver step (the critic's keys with the actor's filled in)."""
        critic = self.critic
        return critic.ppo_epochs * (self.data.train_batch_size // critic.ppo_mini_batch_size)

    @classmethod
    def critic_engine_keys(cls) -> dict[str, str]:
        """The critic engine's ``engine_keys``: its own section's, plus the actor's CRITIC_SHARED_KEYS."""
        shared = {name: key for name, key in cls.engine_keys().items() if name in cls.CRITIC_SHARED_KEYS}
        return {**shared, **engine_keys(cls, cls.CRITIC_ENGINE_SECTIONS)}

    def critic_engine_config(self, *, total_steps: int) -> EngineConfig:
        """The critic engine's config for a run of ``total_steps`` driver steps (a value model)."""
        return self.engine_config(
            total_steps=total_steps,
            keys=self.critic_engine_keys(),
            updates_per_step=self.critic_updates_per_step,
            model_type="value_model",
        )

    @property
    def old_log_prob_from_update(self) -> bool:
        """Whether each step takes its old log-probs from the update forward: the actor allows it and the
        driver neither reads them before the advantages nor takes the rollout's (bypass_mode)."""
        algorithm = self.algorithm
        if algorithm.needs_old_log_probs_before_advantages or algorithm.rollout_correction.bypass_mode:
            return False
        return self.actor_rollout_ref.actor.single_on_policy_update(train_batch_size=self.data.train_batch_size)

    def loss_mode_config(self) -> LossModeConfig:
        """The actor's policy-loss mode as the workers take it (bypass_mode with the algorithm's keys when set)."""
        corr = self.algorithm.rollout_correction
        return self.actor_rollout_ref.actor.loss_mode_config(bypass=corr if corr.bypass_mode else None)

    def _check_bypass_mode(self) -> None:
        """verl's apply_bypass_mode overwrites policy_loss.loss_mode; a different mode set by the user is refused."""
        mode = self.actor_rollout_ref.actor.policy_loss.loss_mode
        if self.algorithm.rollout_correction.bypass_mode and mode not in ("vanilla", "bypass_mode"):
            raise ConfigError(
                f"algorithm.rollout_correction.bypass_mode=true runs actor_rollout_ref.actor.policy_loss.loss_mode="
                f"bypass_mode, but loss_mode={mode!r} is set; remove one of them"
            )

    @property
    def use_reference_policy(self) -> bool:
        """verl's need_reference_policy: the KL loss or the KL in the reward reads the reference log-probs."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def rollout_backend(self) -> str:
        """The rollout backend ``actor_rollout_ref.rollout.name`` chooses, 'auto' resolved by the model."""
        arr = self.actor_rollout_ref
        try:
            return resolve_backend(arr.rollout.name, hf_model=arr.model.path is not None)
        except RolloutInputError as err:
            raise ConfigError(f"actor_rollout_ref.rollout.name: {err}") from err

    def check_sections(self) -> None:
        self._check_bypass_mode()
        self._check_dynamic_sampling()
        self._check_overlong_buffer()
        self._check_critic()
        self._check_batch_sizes()
        self._check_token_caps()
        self._check_rollout_pool()
        self._check_multi_turn()
        check_async(self)
        self.rollout_backend  # noqa: B018 -- a backend that cannot run this model fails here

    def _check_overlong_buffer(self) -> None:
        """DAPO's overlong penalty starts max_resp_len - overlong_buffer.len tokens in (verl's assert)."""
        reward = self.custom_reward_function
        max_len = reward.max_resp_len or self.actor_rollout_ref.rollout.response_length
        if reward.overlong_buffer.enable and max_len < reward.overlong_buffer.len:
            raise ConfigError(
                f"custom_reward_function.overlong_buffer.len={reward.overlong_buffer.len} is longer than max_resp_len "
                f"{max_len} (reward_kwargs.max_resp_len, default actor_rollout_ref.rollout.response_length)"
            )

    def _check_dynamic_sampling(self) -> None:
        """algorithm.filter_groups filters on the scores before the log-prob passes."""
        groups, algorithm = self.algorithm.filter_groups, self.algorithm
        mode = self.trainer.v1.trainer_mode
        if mode != "sync" and groups.enable:
            raise ConfigError(
                f"algorithm.filter_groups.enable runs in the synchronous trainer only, not trainer.v1.trainer_mode="
                f"{mode!r}; set trainer.v1.trainer_mode=sync or remove it"
            )
        recompute = self.actor_rollout_ref.actor.recompute_old_log_prob
        if mode != "sync" and algorithm.corrects_rollout and recompute != "always":
            raise ConfigError(
                f"algorithm.rollout_correction.rollout_is/rollout_rs with trainer.v1.trainer_mode={mode!r} compares "
                "the actor's old log-probs with the rollout's, but actor_rollout_ref.actor.recompute_old_log_prob="
                f"{recompute!r} takes the rollout's as the old ones (bypass); set recompute_old_log_prob=always or "
                "remove the rollout correction"
            )
        if mode != "sync" and algorithm.needs_sum_pi_squared and recompute != "always":
            raise ConfigError(
                f"algorithm.adv_estimator={algorithm.adv_estimator!r} with trainer.v1.trainer_mode={mode!r} reads "
                "sum pi^2 from the actor's old log-prob pass, which actor_rollout_ref.actor.recompute_old_log_prob="
                f"{recompute!r} skips; set recompute_old_log_prob=always or choose another estimator"
            )
        if not groups.enable:
            return
        if algorithm.adv_estimator == "remax":
            raise ConfigError(
                "algorithm.filter_groups.enable=true with algorithm.adv_estimator=remax: the greedy baselines of "
                "several generation batches are not built; use a group estimator (grpo, rloo, ...)"
            )
        if groups.metric == "seq_final_reward" and algorithm.use_kl_in_reward:
            raise ConfigError(
                "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: groups are "
                "filtered before the KL penalty here; use metric=seq_reward (the score)"
            )

    def _check_critic(self) -> None:
        """The critic section is read with gae only; its null keys take the actor's values."""
        if not self.use_critic:
            keys = self.critic.keys_set()
            if self.trainer.critic_warmup:
                keys.append("trainer.critic_warmup")
            if keys:
                raise ConfigError(
                    f"{', '.join(keys)} set but algorithm.adv_estimator={self.algorithm.adv_estimator!r} trains no "
                    "critic; set algorithm.adv_estimator=gae to train one (PPO), or remove them"
                )
            return
        self.critic = self.critic.with_actor_defaults(self.actor_rollout_ref.actor)
        critic = self.critic
        if critic.model.path is not None and self.actor_rollout_ref.model.path is None:
            raise ConfigError(
                f"critic.model.path={critic.model.path!r} with a built-in actor model: the critic reads the "
                "actor's token ids, so it must share the actor's tokenizer; set actor_rollout_ref.model.path to an "
                "HF directory of the same tokenizer, or remove critic.model.path (the actor's preset is used)"
            )
        if self.data.train_batch_size % critic.ppo_mini_batch_size or critic.ppo_mini_batch_size < self.dp_size:
            raise ConfigError(
                f"critic.ppo_mini_batch_size={critic.ppo_mini_batch_size} must divide data.train_batch_size="
                f"{self.data.train_batch_size} and be at least the data-parallel size {self.dp_size} (prompts)"
            )
        self.critic_engine_config(total_steps=1)  # a critic engine error fails here, naming the critic's key

    def _check_batch_sizes(self) -> None:
        actor, rollout, d = self.actor_rollout_ref.actor, self.actor_rollout_ref.rollout, self.data
        if self.balance.overlong != "error":
            raise ConfigError(
                f"balance.overlong={self.balance.overlong!r}: GRPO never drops or cuts a scored "
                "response; use 'error' and size the token caps to hold a full sequence"
            )
        if rollout.n < 2 and self.algorithm.compares_group:
            raise ConfigError(
                f"actor_rollout_ref.rollout.n={rollout.n}: {self.algorithm.adv_estimator} compares the responses "
                "to one prompt, so it needs n >= 2 (a group of one has advantage 0 and teaches nothing)"
            )
        if d.train_batch_size % actor.ppo_mini_batch_size:
            raise ConfigError(
                f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} must divide "
                f"data.train_batch_size={d.train_batch_size} (both count prompts)"
            )
        if actor.ppo_mini_batch_size < self.dp_size:
            raise ConfigError(
                f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} is smaller than the "
                f"data-parallel size {self.dp_size}: a prompt's responses stay on one DP rank, so every rank "
                "needs a prompt"
            )

    def _check_rollout_pool(self) -> None:
        """verl's default: actor_rollout_ref.rollout.n_gpus_per_node = trainer.n_gpus_per_node."""
        rollout = self.actor_rollout_ref.rollout
        if not rollout.n_gpus_per_node:  # unset or verl's 0
            rollout.n_gpus_per_node = self.trainer.n_gpus_per_node
        check_positive("actor_rollout_ref.rollout.n_gpus_per_node", rollout.n_gpus_per_node)

    def _check_multi_turn(self) -> None:
        """Tool rollouts need an HF model's chat template, the synchronous trainer and loadable tools."""
        multi_turn, key = self.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
        if not multi_turn.enable:
            return
        if self.actor_rollout_ref.model.path is None:
            raise ConfigError(f"{key}.enable=true needs actor_rollout_ref.model.path (a chat model with a template)")
        if self.trainer.v1.trainer_mode != "sync":
            raise ConfigError(
                f"{key}.enable=true runs with trainer.v1.trainer_mode=sync only (got "
                f"{self.trainer.v1.trainer_mode!r}); the async modes' rollout workers have no tool loop yet"
            )
        from verl_balance.tools import ToolError, load_tools

        try:
            load_tools(tool_config_path=multi_turn.tool_config_path, function_tool_path=multi_turn.function_tool_path)
        except ToolError as err:
            raise ConfigError(f"{key}: {err}") from err

    def _check_token_caps(self) -> None:
        actor, rollout, sp = self.actor_rollout_ref.actor, self.actor_rollout_ref.rollout, self.sp_size
        max_len = self.data.max_prompt_length + rollout.response_length
        caps = {}
        if actor.use_dynamic_bsz:
            caps["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] = actor.ppo_max_token_len_per_gpu
        for name in LOG_PROB_PASSES:
            plan = self.actor_rollout_ref.log_prob_plan(name)
            if plan.token_cap is not None:
                caps[plan.token_cap_key] = plan.token_cap
            elif plan.micro_batch_size is None:
                raise ConfigError(
                    f"{plan.micro_batch_key}=null with fixed micro-batches for the {name} log-prob pass; "
                    "set it to a positive number of responses, or use dynamic batches"
                )
        if self.use_critic and self.critic.use_dynamic_bsz:
            caps["critic.ppo_max_token_len_per_gpu"] = self.critic.ppo_max_token_len_per_gpu
        for key, cap in caps.items():
            # A sequence is split over the sp ranks of its DP group, so each holds ceil(len / sp).
            if cap * sp < max_len:
                raise ConfigError(
                    f"{key}={cap} x sp={sp} cannot hold one sequence of data.max_prompt_length + "
                    f"rollout.response_length = {max_len} tokens; raise it to >= {-(-max_len // sp)}"
                )


def validate_grpo(cfg: DictConfig) -> GRPOConfig:
    """The GRPO config as typed objects; ConfigError naming the key when it is invalid."""
    return GRPOConfig.from_hydra(cfg)


def register_grpo_schema() -> None:
    """Register "grpo_schema" (and the SFT schema) in Hydra's ConfigStore."""
    register_sft_schema()
    ConfigStore.instance().store(name="grpo_schema", node=GRPOConfig.schema_node())


__all__ = ["GRPOConfig", "register_grpo_schema", "validate_grpo"]
