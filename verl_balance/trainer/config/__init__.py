"""Typed configs of the Hydra recipes: the names users import (``SFTConfig``, ``ConfigError``,
``validate_sft``, ``register_schemas``...).

The merged config is open to undeclared keys until ``RecipeConfig.from_hydra`` translates verl's
spellings (``verl_keys``) and refuses the rest.
"""

from __future__ import annotations

from verl_balance.trainer.config.checks import (
    ConfigError,
    check_choice,
    check_finite_values,
    check_hf_model_dir,
    check_layout,
    check_positive,
    check_remove_padding,
    check_writable_dir,
    qualify,
)
from verl_balance.trainer.config.recipe import RecipeConfig
from verl_balance.trainer.config.sections import (
    CALIBRATION_RUN_FILE,
    DEVICES,
    LOGGERS,
    RESUME_MODES,
    WORKLOADS,
    BalanceSection,
    ModelSection,
    SyntheticDataConfig,
    TrainerSection,
    check_profile_steps,
    engine_profile_steps,
    narrow,
    record_workload,
)
from verl_balance.trainer.config.sft import (
    SFTBalanceSection,
    SFTConfig,
    SFTDataSection,
    SFTModelSection,
    register_sft_schema,
    validate_sft,
)
from verl_balance.trainer.config.typed import check_known_keys, open_sections, to_typed

register_schemas = register_sft_schema
"""Register the SFT schema in Hydra's ConfigStore (``grpo.register_grpo_schema`` adds GRPO's)."""

__all__ = [
    "CALIBRATION_RUN_FILE",
    "DEVICES",
    "LOGGERS",
    "RESUME_MODES",
    "WORKLOADS",
    "BalanceSection",
    "ConfigError",
    "ModelSection",
    "RecipeConfig",
    "SFTBalanceSection",
    "SFTConfig",
    "SFTDataSection",
    "SFTModelSection",
    "SyntheticDataConfig",
    "TrainerSection",
    "check_choice",
    "check_finite_values",
    "check_hf_model_dir",
    "check_known_keys",
    "check_layout",
    "check_positive",
    "check_profile_steps",
    "check_remove_padding",
    "check_writable_dir",
    "engine_profile_steps",
    "narrow",
    "open_sections",
    "qualify",
    "record_workload",
    "register_schemas",
    "to_typed",
    "validate_sft",
]
