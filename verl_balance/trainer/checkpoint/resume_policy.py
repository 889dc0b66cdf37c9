"""What a resumed run may change: each config key's ``on_resume`` policy, read from the field
metadata of the recipe's dataclass schema (docs/fault_tolerance.md's table is generated from it).

- ``apply``: steers the run but not the meaning of the saved state (learning rate, run length,
  cadences); a new value is used from the next step on.
- ``layout``: parallel layout and micro-batching; the loss contract makes the curve independent of them.
- ``refuse`` (every key without metadata, and keys the schema does not declare): a new value fails
  naming the key, the old and the new value.

A policy on a section field covers every key under it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from verl_balance.engine.config import APPLY_ON_RESUME, LAYOUT_ON_RESUME, ON_RESUME

APPLY, LAYOUT, REFUSE = "apply", "layout", "refuse"
POLICIES = (APPLY, LAYOUT, REFUSE)

__all__ = [
    "APPLY",
    "APPLY_ON_RESUME",
    "LAYOUT",
    "LAYOUT_ON_RESUME",
    "REFUSE",
    "ResumeConfigError",
    "changed_keys",
    "policy_of",
    "policy_table",
    "resume_policies",
]


class ResumeConfigError(ValueError):
    """A resumed run changes a key whose saved state cannot follow the new value."""


def resume_policies(schema: type, prefix: str = "") -> dict[str, str]:
    """``{dotted key: policy}`` of every field of ``schema``; a section with its own policy is one entry."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        policy = f.metadata.get(ON_RESUME)
        if policy is not None:
            assert policy in POLICIES, (key, policy)
            out[key] = policy
            continue
        section = _section_type(f)
        if section is not None:
            out.update(resume_policies(section, key + "."))
        else:
            out[key] = REFUSE
    return out


def _section_type(f: dataclasses.Field) -> type | None:
    """The dataclass a section field holds (from its default), None for a plain value."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    elif f.default is not dataclasses.MISSING:
        value = f.default
    else:
        return None
    return type(value) if dataclasses.is_dataclass(value) else None


def policy_of(key: str, policies: Mapping[str, str]) -> str:
    """The policy of a flattened key: that of its longest declared prefix; refuse when undeclared."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        policy = policies.get(".".join(parts[:end]))
        if policy is not None:
            return policy
    return REFUSE


def changed_keys(old: Mapping, new: Mapping) -> list[str]:
    """Keys of two flattened configs whose values differ (absent counts as a value)."""
    missing = object()
    return sorted(k for k in set(old) | set(new) if old.get(k, missing) != new.get(k, missing))


def policy_table(schemas: Mapping[str, type]) -> str:
    """The markdown table of docs/fault_tolerance.md: per recipe, every key that may change on resume."""
    rows: dict[str, dict[str, str]] = {}
    for recipe, schema in schemas.items():
        for key, policy in resume_policies(schema).items():
            if policy != REFUSE:
                rows.setdefault(key, {})[recipe] = policy
    lines = ["| key | " + " | ".join(schemas) + " |", "|---|" + "---|" * len(schemas)]
    for key in sorted(rows):
        lines.append(f"| `{key}` | " + " | ".join(rows[key].get(r, "-") for r in schemas) + " |")
    return "\n".join(lines)
