"""Structured schema of the GRPO recipe (``config/grpo.yaml``) and its validation.

Key names are verl's (``actor_rollout_ref.actor.ppo_mini_batch_size``, ``algorithm.adv_estimator``,
``trainer.balance_batch``, ...) so a verl user's overrides carry over. Sizes follow verl's units:
``data.train_batch_size`` and ``actor_rollout_ref.actor.ppo_mini_batch_size`` count prompts (each
carries ``rollout.n`` responses); ``*_micro_batch_size_per_gpu`` counts responses; token caps are
per worker (per SP rank, after Ulysses padding).

The Ulysses degree may be given as verl's ``actor_rollout_ref.actor.ulysses_sequence_parallel_size``
or as the top-level ``ulysses_sequence_parallel_size`` of the SFT recipe; setting both to different
values is an error. ``validate_grpo`` reuses ``config.validate_common`` on a view of this config
after checking the GRPO-specific spellings of the keys it shares with SFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from verl_balance.algorithms import ADV_ESTIMATORS
from verl_balance.algorithms.kl import KLEstimatorError, canonical_kl_type
from verl_balance.data.synthetic import TASKS
from verl_balance.trainer.config import (
    LOSS_AGG_MODES,
    BalanceSection,
    ConfigError,
    ModelSection,
    OptimConfig,
    SyntheticDataConfig,
    TrainerSection,
    check_choice,
    check_positive,
    register_schemas,
    validate_common,
)


@dataclass
class GRPOSyntheticConfig(SyntheticDataConfig):
    """The generated task used when ``data.train_files`` is null (see data/synthetic.py)."""

    tasks: list = field(default_factory=lambda: list(TASKS))
    median_size: float = 8.0
    sigma: float = 1.0
    min_size: int = 1
    max_size: int = 96


@dataclass
class GRPODataConfig:
    train_files: Optional[Any] = None
    val_files: Optional[Any] = None
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    filter_overlong_prompts: bool = True
    truncation: str = "error"
    on_malformed: str = "error"
    # prompts per step (each gets actor_rollout_ref.rollout.n responses)
    train_batch_size: int = 16
    # prompts scored per validation (null = the whole validation set)
    val_batch_size: Optional[int] = None
    shuffle: bool = True
    synthetic: GRPOSyntheticConfig = field(default_factory=GRPOSyntheticConfig)


@dataclass
class ActorModelSection(ModelSection):
    """A built-in preset plus dimension overrides, and ``path``: an SFT ``global_step_N`` to start from."""

    path: Optional[str] = None
    use_remove_padding: bool = True


@dataclass
class ActorSection:
    """verl's ``actor_rollout_ref.actor``: PPO mini-batching and the policy loss."""

    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: Optional[int] = 8
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 4096
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ulysses_sequence_parallel_size: Optional[int] = None
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class ValSamplingConfig:
    """verl's ``rollout.val_kwargs``: greedy single answers by default."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class RolloutSection:
    """verl's ``actor_rollout_ref.rollout`` for the built-in colocated (naive) rollout."""

    name: str = "naive"
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    response_length: int = 64
    # responses per micro-batch / token cap of the old- and reference log-prob passes
    # (null = the actor's ppo_micro_batch_size_per_gpu / ppo_max_token_len_per_gpu)
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None
    # sequences decoded together on one worker (memory bound); null = all of its prompts at once
    max_num_seqs: Optional[int] = None
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)


@dataclass
class ActorRolloutRefSection:
    model: ActorModelSection = field(default_factory=ActorModelSection)
    actor: ActorSection = field(default_factory=ActorSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass
class AlgorithmSection:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True


@dataclass
class CustomRewardSection:
    path: Optional[str] = None
    name: Optional[str] = None
    reward_kwargs: dict = field(default_factory=dict)


@dataclass
class GRPOTrainerSection(TrainerSection):
    experiment_name: str = "grpo"
    # plan each batch over DP ranks by workload, a prompt's responses on one rank
    balance_batch: bool = True
    val_before_train: bool = True
    # validation samples printed to the console (prompt, response, score)
    log_val_generations: int = 0


@dataclass
class GRPOConfig:
    data: GRPODataConfig = field(default_factory=GRPODataConfig)
    actor_rollout_ref: ActorRolloutRefSection = field(default_factory=ActorRolloutRefSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    custom_reward_function: CustomRewardSection = field(default_factory=CustomRewardSection)
    # SFT-recipe spelling of actor_rollout_ref.actor.ulysses_sequence_parallel_size (either works)
    ulysses_sequence_parallel_size: Optional[int] = None
    # workload model and overlong policy of the balancer; trainer.balance_batch switches it on
    balance: BalanceSection = field(default_factory=BalanceSection)
    trainer: GRPOTrainerSection = field(default_factory=GRPOTrainerSection)


def register_grpo_schema() -> None:
    """Register "grpo_schema" (and the SFT schemas) in Hydra's ConfigStore."""
    register_schemas()
    ConfigStore.instance().store(name="grpo_schema", node=GRPOConfig)


def sp_size_of(cfg) -> int:
    """The Ulysses degree from either spelling (see the module docstring); 1 when neither is set."""
    verl_key = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    top_key = cfg.ulysses_sequence_parallel_size
    if verl_key is not None and top_key is not None and verl_key != top_key:
        raise ConfigError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={verl_key} and "
            f"ulysses_sequence_parallel_size={top_key} disagree; set one of them"
        )
    return int(verl_key if verl_key is not None else (top_key if top_key is not None else 1))




def validate_grpo(cfg) -> None:
    """Raise ConfigError naming the key when the GRPO config is invalid."""
    arr = cfg.actor_rollout_ref
    actor, rollout, model = arr.actor, arr.rollout, arr.model
    # Keys shared with SFT but spelled differently here are checked first under their GRPO names.
    check_choice("actor_rollout_ref.actor.optim.lr_scheduler", actor.optim.lr_scheduler, ("constant", "cosine"))
    if not model.use_remove_padding:
        raise ConfigError(
            "actor_rollout_ref.model.use_remove_padding=false is not supported: the engine always runs "
            "packed (padding-free) sequences, which Ulysses sequence parallelism requires"
        )
    sp = sp_size_of(cfg)
    validate_common(OmegaConf.create({
        "ulysses_sequence_parallel_size": sp, "use_remove_padding": True,
        "trainer": OmegaConf.to_container(cfg.trainer, resolve=False),
        "balance": OmegaConf.to_container(cfg.balance), "optim": OmegaConf.to_container(actor.optim),
    }))
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    dp = world // sp
    if cfg.balance.overlong != "error":
        raise ConfigError(f"balance.overlong={cfg.balance.overlong!r}: GRPO never drops or cuts a scored "
                          "response; use 'error' and size the token caps to hold a full sequence")

    check_choice("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    if actor.loss_agg_mode == "seq-mean-token-sum-norm" and actor.loss_scale_factor is None:
        raise ConfigError("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm needs "
                          "actor_rollout_ref.actor.loss_scale_factor (the constant C, e.g. response_length)")
    check_positive("actor_rollout_ref.actor.optim.lr", actor.optim.lr)
    check_positive("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs)
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = actor[key]
        if value is not None and not 0 <= value:
            raise ConfigError(f"actor_rollout_ref.actor.{key}={value} must be >= 0")
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    if low >= 1:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_low={low} must be < 1 (the ratio is clipped at 1 - low)")
    if actor.clip_ratio_c is not None and not actor.clip_ratio_c > 1:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (or null)")
    if actor.use_kl_loss:
        try:
            canonical_kl_type(actor.kl_loss_type)
        except KLEstimatorError as err:
            raise ConfigError(f"actor_rollout_ref.actor.{err}") from None

    check_positive("actor_rollout_ref.rollout.n", rollout.n)
    if rollout.n < 2:
        raise ConfigError(
            f"actor_rollout_ref.rollout.n={rollout.n}: {cfg.algorithm.adv_estimator} compares the responses "
            "to one prompt, so it needs n >= 2 (a group of one has advantage 0 and teaches nothing)"
        )
    check_choice("actor_rollout_ref.rollout.name", rollout.name, ("naive",))
    check_positive("actor_rollout_ref.rollout.response_length", rollout.response_length)
    if not rollout.temperature > 0:
        raise ConfigError(f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be > 0 for "
                          "training rollouts (greedy samples are identical within a group)")
    if not 0 < rollout.top_p <= 1:
        raise ConfigError(f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]")
    if not rollout.val_kwargs.temperature >= 0:
        raise ConfigError(f"actor_rollout_ref.rollout.val_kwargs.temperature={rollout.val_kwargs.temperature} "
                          "must be >= 0 (0 = greedy)")
    check_positive("actor_rollout_ref.rollout.val_kwargs.n", rollout.val_kwargs.n)

    check_choice("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADV_ESTIMATORS)

    d = cfg.data
    check_positive("data.max_prompt_length", d.max_prompt_length)
    check_choice("data.truncation", d.truncation, ("error", "left", "right"))
    check_choice("data.on_malformed", d.on_malformed, ("error", "skip"))
    check_positive("data.train_batch_size", d.train_batch_size)
    if d.val_batch_size is not None:
        check_positive("data.val_batch_size", d.val_batch_size)
    unknown = [t for t in d.synthetic.tasks if t not in TASKS]
    if unknown or not d.synthetic.tasks:
        raise ConfigError(f"data.synthetic.tasks={list(d.synthetic.tasks)} is not valid; "
                          f"choose a non-empty subset of {list(TASKS)}")
    check_positive("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size)
    if d.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} must divide "
            f"data.train_batch_size={d.train_batch_size} (both count prompts)")
    if actor.ppo_mini_batch_size < dp:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} is smaller than the "
            f"data-parallel size {dp}: a prompt's responses stay on one DP rank, so every rank needs a prompt")

    max_len = d.max_prompt_length + rollout.response_length
    if actor.use_dynamic_bsz:
        check_positive("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu)
        caps = {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": actor.ppo_max_token_len_per_gpu}
        if rollout.log_prob_max_token_len_per_gpu is not None:
            caps["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] = rollout.log_prob_max_token_len_per_gpu
        for key, cap in caps.items():
            check_positive(key, cap)
            # A sequence is split over the sp ranks of its DP group, so each holds ceil(len / sp).
            if cap * sp < max_len:
                raise ConfigError(
                    f"{key}={cap} x sp={sp} cannot hold one sequence of data.max_prompt_length + "
                    f"rollout.response_length = {max_len} tokens; raise it to >= {-(-max_len // sp)}")
    else:
        check_positive("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu)
        if rollout.log_prob_micro_batch_size_per_gpu is not None:
            check_positive("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                      rollout.log_prob_micro_batch_size_per_gpu)
    if rollout.max_num_seqs is not None:
        check_positive("actor_rollout_ref.rollout.max_num_seqs", rollout.max_num_seqs)
    if (cfg.custom_reward_function.name is not None) and cfg.custom_reward_function.path is None:
        raise ConfigError(f"custom_reward_function.name={cfg.custom_reward_function.name!r} is set but "
                          "custom_reward_function.path is not")


__all__ = ["GRPOConfig", "register_grpo_schema", "sp_size_of", "validate_grpo"]
