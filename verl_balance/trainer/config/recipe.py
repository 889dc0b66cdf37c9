"""``RecipeConfig``: the base of the recipe schemas (``SFTConfig``, ``GRPOConfig``), which hand
their components finished configs.

A recipe declares ``ENGINE_SECTIONS`` (sections holding the engine's key groups, from which
``engine_keys()`` maps each ``EngineConfig`` field to the user's key, so engine errors name it),
``SP_KEY``, ``BALANCE_KEY`` and ``RECIPE`` (its ``verl_keys`` rows and ``config/<RECIPE>.yaml``).
``from_hydra`` translates verl's spellings, refuses unknown keys and runs the cross-section checks.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from verl_balance.engine.config import ENGINE_FIELD, ENGINE_KEY_GROUPS, EngineConfig
from verl_balance.trainer.config.checks import ConfigError, check_layout, check_writable_dir
from verl_balance.trainer.config.sections import TrainerSection, engine_profile_steps
from verl_balance.trainer.config.typed import check_known_keys, open_sections, to_typed
from verl_balance.trainer.config.verl_keys import startup_line, translate

__all__ = ["RecipeConfig", "engine_keys"]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
"""The recipes' YAML files (``<RECIPE>.yaml``)."""


@functools.cache
def engine_keys(schema: type, sections: tuple[str, ...]) -> Mapping[str, str]:
    """``{EngineConfig field: dotted recipe key}`` for the engine key groups ``schema``'s sections inherit."""
    out: dict[str, str] = {}
    for path in sections:
        section = _section_class(schema, path)
        groups = [group for group in section.__mro__ if group in ENGINE_KEY_GROUPS]
        grouped = {name for group in groups for name in vars(group).get("__annotations__", {})}
        for f in dataclasses.fields(section):
            if f.name in grouped:
                name = f.metadata.get(ENGINE_FIELD, f.name)
                assert name not in out, f"engine field {name} in both {out[name]} and {path}.{f.name}"
                out[name] = f"{path}.{f.name}" if path else f.name
    return out


def _section_class(schema: type, path: str) -> type:
    """The dataclass of the section at a dotted path (its field's default factory)."""
    for name in filter(None, path.split(".")):
        schema = {f.name: f for f in dataclasses.fields(schema)}[name].default_factory
    assert dataclasses.is_dataclass(schema), (path, schema)
    return schema


class RecipeConfig:
    """Mixin of the recipe dataclasses: component configs and validation from the class-level key maps."""

    ENGINE_SECTIONS: ClassVar[tuple[str, ...]]
    """Dotted paths of the sections holding the engine's keys ("" = the top level); see engine_keys."""
    SP_KEY: ClassVar[str]
    """Dotted key of the Ulysses degree (null = 1)."""
    BALANCE_KEY: ClassVar[str]
    """Dotted key of the one switch of the workload balancer."""
    RECIPE: ClassVar[str]
    """'grpo' or 'sft': the recipe's rows of ``verl_keys.VERL_KEYS`` and its ``config/<RECIPE>.yaml``."""
    trainer: TrainerSection

    @classmethod
    def engine_keys(cls) -> dict[str, str]:
        """``EngineConfig`` field -> dotted recipe key of its value (the key an error names)."""
        return dict(engine_keys(cls, cls.ENGINE_SECTIONS))

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
        """The engine's config for a run of ``total_steps`` driver steps (``trainer.profile_steps`` counts
        driver steps). ``keys``/``updates_per_step`` describe another engine of the recipe (GRPO's critic);
        ``fixed`` are engine fields no key sets."""
        t = self.trainer
        keys = self.engine_keys() if keys is None else keys
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
    def schema_node(cls) -> DictConfig:
        """The schema as Hydra composes it, every section open to undeclared keys (``from_hydra`` refuses leftovers)."""
        return open_sections(OmegaConf.structured(cls))

    @classmethod
    def from_hydra(cls, cfg: DictConfig | Mapping):
        """The recipe as typed objects from the merged config (or a mapping of overrides); ConfigError naming
        the key when invalid. verl's keys are translated and the no-effect ones named in one line."""
        cfg, no_effect = cls.translate(cfg)
        check_known_keys(cfg)
        config = to_typed(cfg)
        if not isinstance(config, cls):
            raise ConfigError(f"the config is a {type(config).__name__}, not the {cls.__name__} schema")
        check_writable_dir("trainer.default_local_dir", config.trainer.default_local_dir)
        check_layout(sp_size=config.sp_size, world_size=config.trainer.world_size, sp_key=cls.SP_KEY)
        config.check_sections()
        config.engine_config(total_steps=1)  # an engine error fails here, before any worker starts
        line = startup_line(no_effect, recipe=cls.RECIPE)
        if line:
            print(line, flush=True)
        return config

    @classmethod
    def translate(cls, cfg: DictConfig | Mapping) -> tuple[DictConfig, list[str]]:
        """(``cfg`` with verl's keys written as ours, the no-effect keys)."""
        return translate(cls._typed_node(cfg), recipe=cls.RECIPE, defaults=_defaults(cls))

    @classmethod
    def _typed_node(cls, cfg: DictConfig | Mapping) -> DictConfig:
        """``cfg`` typed by a schema: Hydra's composed config as is, anything else merged over ``schema_node()``."""
        if isinstance(cfg, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(cfg)):
            return cfg
        try:
            return OmegaConf.merge(cls.schema_node(), cfg)
        except OmegaConfBaseException as err:
            raise ConfigError(f"{err.full_key}: {err.msg}") from None

    def check_sections(self) -> None:
        """The recipe's checks that combine several sections (after each section's own)."""


@functools.cache
def _defaults(schema: type) -> tuple[DictConfig, DictConfig]:
    """The values a key holds when no user set it: the schema's defaults and the recipe file's."""
    recipe_file = OmegaConf.load(CONFIG_DIR / f"{schema.RECIPE}.yaml")
    return OmegaConf.structured(schema), recipe_file
