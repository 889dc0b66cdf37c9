"""The merged config as the recipe's typed objects, in one pass.

``open_sections`` admits undeclared keys until ``verl_keys.translate`` rewrites verl's spellings;
``check_known_keys`` then refuses the rest; ``to_typed`` builds each section once, innermost first,
so its ``ConfigError`` names the full key.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl_balance.trainer.config.checks import ConfigError, check_finite_values, did_you_mean, qualify

__all__ = ["check_known_keys", "open_sections", "to_typed"]


def check_known_keys(cfg: DictConfig, path: str = "") -> None:
    """Raise ConfigError naming any key a typed section does not declare (e.g. via Hydra's ``+`` append)."""
    schema = OmegaConf.get_type(cfg)
    if dataclasses.is_dataclass(schema):
        fields = {f.name for f in dataclasses.fields(schema)}
        unknown = sorted(str(k) for k in cfg.keys() if k not in fields)
        if unknown:
            hints = "".join(
                did_you_mean(k, fields).replace("; did you mean", f"; {path}{k}: did you mean") for k in unknown
            )
            raise ConfigError(
                f"unknown config key(s) {[path + k for k in unknown]}{hints}; valid keys of "
                f"{path.rstrip('.') or 'the root'}: {sorted(fields)}"
            )
    for key in cfg.keys():
        if not OmegaConf.is_missing(cfg, key) and isinstance(cfg[key], DictConfig):
            check_known_keys(cfg[key], f"{path}{key}.")


def open_sections(node: DictConfig) -> DictConfig:
    """``node`` with every section open to undeclared keys (its own flag, surviving Hydra's closing of the root)."""
    OmegaConf.set_struct(node, False)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            open_sections(child)
    return node


def _section_prefixes(node: DictConfig, path: str) -> dict[str, str]:
    parent, _, leaf = path.rpartition(".")
    prefixes = {str(key): f"{path}." for key in node.keys()}
    prefixes[leaf] = f"{parent}." if parent else ""
    return prefixes


def _is_section(node) -> bool:
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def instantiate_section(node: DictConfig, path: str):
    """The section object of ``node``, subsections built first once; a ValueError becomes ConfigError with full keys."""
    values = {}
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and child._is_none():
            values[key] = None
        elif _is_section(child):
            values[key] = instantiate_section(child, f"{path}.{key}" if path else str(key))
        elif isinstance(child, (DictConfig, ListConfig)):
            values[key] = OmegaConf.to_object(child)
        else:
            values[key] = node[key]
    try:
        return OmegaConf.get_type(node)(**values)
    except ValueError as err:
        message = qualify(str(err), _section_prefixes(node, path) if path else {})
        raise ConfigError(message if not path or path in message else f"{message} (in {path})") from err


def to_typed(cfg: DictConfig):
    """The merged config as the schema's objects (each ``__post_init__`` check run once, no inf or nan)."""
    config = instantiate_section(cfg, "")
    check_finite_values(config)
    return config
