"""The SFT recipe's schema (``config/sft.yaml``): ``SFTConfig`` and its own sections.

Key names are verl's SFT trainer's (other spellings are rows of ``verl_keys``); the balancer switch
is ``balance.enable``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from verl_balance.data.sft_dataset import SFTDataConfig
from verl_balance.engine.config import APPLY_ON_RESUME, LAYOUT_ON_RESUME, ActorKeys, FSDPKeys
from verl_balance.loss import check_agg_mode
from verl_balance.trainer.config.checks import ConfigError, check_positive, check_remove_padding
from verl_balance.trainer.config.recipe import RecipeConfig
from verl_balance.trainer.config.sections import (
    BalanceSection,
    ModelSection,
    RayKwargsSection,
    SFTTrainerSection,
    SyntheticDataConfig,
    narrow,
)

__all__ = ["SFTConfig", "register_sft_schema", "validate_sft"]


@dataclass
class SFTModelSection(FSDPKeys, ModelSection):
    """``model`` of the SFT recipe: ModelSection plus the engine's ``fsdp_config`` / ``logits_chunk_size``."""


@dataclass
class SFTBalanceSection(BalanceSection):
    """``balance`` of the SFT recipe: the balancer's cost model plus its switch."""

    enable: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """Balance DP ranks and micro-batches by workload; false = the contiguous split."""


@dataclass
class SFTDataSection(SFTDataConfig):
    """The dataset's own ``SFTDataConfig`` plus the files, the batching and the synthetic task."""

    train_files: Optional[Any] = None
    """Parquet/jsonl file(s) in verl's SFT schema; null = generate the synthetic task."""
    messages_key: Optional[str] = None
    """Each row's chat column. Null: ``messages`` where a file has it, else prompt_key/response_key. A set
    key must be a column of every file."""
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
    """verl's switch for DP-global token counts; must be true (the loss contract always uses them)."""
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
class SFTConfig(RecipeConfig, ActorKeys):
    """The SFT recipe (``config/sft.yaml``): the engine's ``loss_agg_mode``, ``loss_scale_factor`` and
    ``optim`` at the top level (engine.config.ActorKeys), its model keys under ``model``."""

    ENGINE_SECTIONS: ClassVar[tuple[str, ...]] = ("", "model")
    SP_KEY: ClassVar[str] = "ulysses_sequence_parallel_size"
    BALANCE_KEY: ClassVar[str] = "balance.enable"
    RECIPE: ClassVar[str] = "sft"

    data: SFTDataSection = field(default_factory=SFTDataSection)
    """Files, columns, length policy and batching."""
    model: SFTModelSection = field(default_factory=SFTModelSection)
    """The model: an HF directory (model.path) or a preset with dimension overrides."""
    ulysses_sequence_parallel_size: int = field(default=1, metadata=LAYOUT_ON_RESUME)
    """Ulysses degree: workers per DP group that split each sequence."""
    use_remove_padding: bool = field(default=True, metadata=LAYOUT_ON_RESUME)
    """verl's key; must be true (the engine always runs packed, padding-free sequences)."""
    balance: SFTBalanceSection = field(default_factory=SFTBalanceSection)
    """Workload balancer."""
    ray_kwargs: RayKwargsSection = field(default_factory=RayKwargsSection)
    """verl's ``ray_kwargs``: ``ray.init``'s arguments."""
    trainer: SFTTrainerSection = field(default_factory=SFTTrainerSection)
    """Cluster, run length, logging, checkpoints (saved and validated at the last step, as verl's sft_trainer)."""

    def __post_init__(self) -> None:
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)
        check_agg_mode(self.loss_agg_mode)
        check_remove_padding("use_remove_padding", self.use_remove_padding)

    def check_sections(self) -> None:
        if self.data.train_batch_size < self.dp_size:
            raise ConfigError(
                f"data.train_batch_size={self.data.train_batch_size} is smaller than the data-parallel size "
                f"{self.dp_size} (workers / ulysses_sequence_parallel_size); every DP rank needs at least one sample"
            )


def validate_sft(cfg: DictConfig) -> SFTConfig:
    """The SFT config as typed objects; ConfigError naming the key when it is invalid."""
    return SFTConfig.from_hydra(cfg)


def register_sft_schema() -> None:
    """Register "sft_schema" in Hydra's ConfigStore (config/sft.yaml names it in its defaults)."""
    ConfigStore.instance().store(name="sft_schema", node=SFTConfig.schema_node())
