"""What a resumed run may change: each config key's ``on_resume`` policy, read from the field
metadata of the recipe's dataclass schema (the single source; docs/fault_tolerance.md's table is
generated from it and checked by a test).

Policies:

- ``apply``: the key steers the run but not the meaning of the saved state (learning rate and
  schedule, run length, checkpoint and logging cadence, ...). A resume with a new value uses it
  from the next step on (the engine rebuilds the learning rate from the new ``optim`` section).
- ``layout``: parallel layout and micro-batching; the loss contract makes the curve independent
  of them, so they may change freely.
- ``refuse`` (every key without metadata): the model, the data, seeds, the loss... A resume with a
  new value fails naming the key, the old and the new value.

A field declares its policy with ``field(default=..., metadata=APPLY_ON_RESUME)`` (or
``LAYOUT_ON_RESUME``); a policy on a section field covers every key under it. Keys the schema does
not declare (the inside of a free-form dict, a key of an older version) are refused.
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
    """``{dotted key: policy}`` of every field of ``schema`` (a dataclass) and its nested sections;
    a section with its own policy is one entry covering its subtree."""
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
    """The markdown table of docs/fault_tolerance.md: every key that may change on resume, per
    recipe (``{"sft": SFTConfig, ...}``); every other key is refused."""
    rows: dict[str, dict[str, str]] = {}
    for recipe, schema in schemas.items():
        for key, policy in resume_policies(schema).items():
            if policy != REFUSE:
                rows.setdefault(key, {})[recipe] = policy
    lines = ["| key | " + " | ".join(schemas) + " |", "|---|" + "---|" * len(schemas)]
    for key in sorted(rows):
        lines.append(f"| `{key}` | " + " | ".join(rows[key].get(r, "-") for r in schemas) + " |")
    return "\n".join(lines)
