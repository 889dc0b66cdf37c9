"""Typed configs of the Hydra recipes: the names users import (``SFTConfig``, ``ConfigError``,
``validate_sft``, ``register_schemas``...), defined by role in:

- ``checks``: ``ConfigError`` and the checks that name the user's key;
- ``sections``: the sections both recipes share (model, balancer, trainer loop, synthetic task);
- ``typed``: the merged config as typed objects, in one pass (unknown keys refused);
- ``recipe``: ``RecipeConfig``, the base that hands out the engine's config;
- ``sft`` / ``grpo``: each recipe's schema (GRPO: import ``trainer.config.grpo``), with
  ``algorithm`` (verl's ``algorithm.*`` / ``policy_loss.*``) and ``async_mode`` (``trainer.v1.*``);
- ``verl_keys``: verl's spellings beyond the schemas, one table applied to the merged config
  (honoured spellings, no-effect keys, refused values);
- ``cli``: the command line (override checks, one-line user errors); ``ray_init``: ``ray_kwargs``.

The YAML files in ``config/`` fill the schemas with the recipe's values. The merged config is typed
by the schema (values checked as Hydra composes) and open to undeclared keys until
``RecipeConfig.from_hydra`` translates verl's and refuses the rest. Key names follow verl's wherever
the concept is the same, so a verl user's overrides carry over.
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
