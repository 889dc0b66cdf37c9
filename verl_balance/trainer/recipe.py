"""``RecipeConfig``: the base of the recipe schemas (``SFTConfig``, ``GRPOConfig``), which hand
their components finished configs.

Each recipe declares, in one place, where its components' values live: ``ENGINE_KEYS`` maps every
recipe-supplied ``EngineConfig`` field to the recipe key holding it (so an engine error names the
user's key), ``SP_KEY`` and ``BALANCE_KEY`` name the Ulysses degree and the balancer switch, and
``ALIASES`` maps verl's alternative spellings to their canonical key (resolved by ``to_typed``).
``from_hydra`` turns the merged Hydra config into the typed recipe and runs the checks that
combine sections; ``engine_config(total_steps=...)`` is the engine's config for the run.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import ClassVar

from omegaconf import DictConfig

from verl_balance.engine.config import EngineConfig
from verl_balance.trainer.config_checks import ConfigError, check_layout, check_writable_dir
from verl_balance.trainer.sections import TrainerSection, engine_profile_steps
from verl_balance.trainer.typed_config import check_known_keys, to_typed

__all__ = ["RecipeConfig"]


class RecipeConfig:
    """Mixin of the recipe dataclasses: component configs and validation from the class-level key maps."""

    ENGINE_KEYS: ClassVar[dict[str, str]]
    """``EngineConfig`` field -> dotted recipe key of its value (also the key an error names)."""
    SP_KEY: ClassVar[str]
    """Dotted key of the Ulysses degree (null = 1)."""
    BALANCE_KEY: ClassVar[str]
    """Dotted key of the one switch of the workload balancer."""
    ALIASES: ClassVar[dict[str, str]] = {}
    """verl's alternative spelling -> the canonical key it sets (setting both differently is an error)."""
    trainer: TrainerSection

    def value_of(self, key: str):
        """The value of a dotted recipe key."""
        return functools.reduce(getattr, key.split("."), self)

    @property
    def sp_size(self) -> int:
        """The Ulysses degree (1 when unset)."""
        return int(self.value_of(self.SP_KEY) or 1)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: workers / Ulysses degree."""
        return self.trainer.world_size // self.sp_size

    @property
    def balance_enabled(self) -> bool:
        """Plan each batch by workload (false: the contiguous split)."""
        return bool(self.value_of(self.BALANCE_KEY))

    @property
    def updates_per_step(self) -> int:
        """Engine train steps (optimizer steps) per driver step."""
        return 1

    def engine_config(
        self,
        *,
        total_steps: int,
        keys: Mapping[str, str] | None = None,
        updates_per_step: int | None = None,
        **fixed,
    ) -> EngineConfig:
        """The engine's config for a run of ``total_steps`` driver steps. ``trainer.profile_steps``
        counts driver steps; each runs ``updates_per_step`` engine train steps, all traced.

        ``keys`` (default ``ENGINE_KEYS``) and ``updates_per_step`` (default the recipe's) describe
        another engine of the recipe (e.g. GRPO's critic); ``fixed`` are engine fields no key sets
        (e.g. ``model_type``)."""
        t = self.trainer
        keys = self.ENGINE_KEYS if keys is None else keys
        updates = self.updates_per_step if updates_per_step is None else updates_per_step
        try:
            return EngineConfig(
                **{name: self.value_of(key) for name, key in keys.items()},
                **fixed,
                total_steps=total_steps * updates,
                seed=t.seed,
                profile_steps=engine_profile_steps(t.profile_steps, updates_per_step=updates),
                profile_dir=t.profile_path,
            )
        except ValueError as err:
            raise ConfigError(self._user_keys(str(err), keys)) from err

    def _user_keys(self, message: str, keys: Mapping[str, str]) -> str:
        """An engine error with each engine field name written as the recipe key holding it."""
        names = "|".join(sorted(map(re.escape, keys), key=len, reverse=True))
        return re.sub(rf"(?<![\w.'\"])({names})\b", lambda m: keys[m.group(1)], message)

    @classmethod
    def from_hydra(cls, cfg: DictConfig):
        """The recipe as typed objects; ConfigError naming the key when it is invalid."""
        check_known_keys(cfg)
        config = to_typed(cfg, aliases=cls.ALIASES)
        if not isinstance(config, cls):
            raise ConfigError(f"the config is a {type(config).__name__}, not the {cls.__name__} schema")
        check_writable_dir("trainer.default_local_dir", config.trainer.default_local_dir)
        check_layout(sp_size=config.sp_size, world_size=config.trainer.world_size, sp_key=cls.SP_KEY)
        config.check_sections()
        config.engine_config(total_steps=1)  # an engine error fails here, before any worker starts
        return config

    def check_sections(self) -> None:
        """The recipe's checks that combine several sections (after each section's own)."""
