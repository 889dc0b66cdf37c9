"""Column and meta keys are spelled once, in ``verl_balance/batch_keys.py``: library code names a key
only through its constant. An AST scan of ``verl_balance/`` finds every string literal equal to a
key; Hugging Face keyword arguments (``forward(input_ids=...)``) are keywords, not literals, and a
literal naming an attribute (``getattr(obj, "on_policy")``) is not a key."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import verl_balance
from verl_balance import batch_keys

PACKAGE = Path(verl_balance.__file__).parent
KEYS = {value: name for name, value in vars(batch_keys).items() if name.endswith("_KEY")}
"""Every column / meta key -> the name of its constant."""

ALLOWED = {
    ("models/attention.py", "position_ids"): "a keyword Hugging Face passes to every attention function",
    ("integrations/verl/cpu_shims/rollout.py", "temperature"): "a key of verl's sampling params",
    ("trainer/grpo/trainer.py", "temperature"): "a key of the rollout's sampling params",
    ("data/synthetic.py", "index"): "the extra_info field of verl's data files",
    ("algorithms/policy_loss.py", "entropy"): "a metric name (actor/entropy)",
    ("utils/progress.py", "values"): "the label of the critic's values pass on the progress line",
}
"""(file under verl_balance/, literal) -> why that literal there is another namespace."""

PENDING: dict[str, set[str]] = {}
"""Files other branches of issue 32 edit at the same time: replace their literals with the constants
after the merge and delete the entry (the stale-entry test below fails once a literal is gone)."""


def literal_keys(source: str) -> list[tuple[int, str]]:
    """(line, key) of every string literal in ``source`` equal to a column or meta key, except the
    attribute-name argument of getattr / hasattr / setattr."""
    tree = ast.parse(source)
    attribute_names = {
        id(node.args[1])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) > 1
    }
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in KEYS and id(node) not in attribute_names
    )


def package_literals() -> dict[tuple[str, str], list[int]]:
    """(file under verl_balance/, key) -> the lines spelling that key as a literal (batch_keys.py aside)."""
    found: dict[tuple[str, str], list[int]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != "batch_keys.py":
            for line, key in literal_keys(path.read_text()):
                found[(rel, key)].append(line)
    return found


def test_every_key_has_one_constant():
    names = [name for name in vars(batch_keys) if name.endswith("_KEY")]
    assert len(KEYS) == len(names), "two constants spell the same key"
    assert {"input_ids", "attention_mask", "loss_mask", "log_probs", "values", "temperature"} <= set(KEYS)


def test_no_column_or_meta_key_literal_in_library_code():
    found = package_literals()
    bad = [
        f"verl_balance/{rel}:{','.join(map(str, lines))}: {key!r} -> batch_keys.{KEYS[key]}"
        for (rel, key), lines in sorted(found.items())
        if (rel, key) not in ALLOWED and key not in PENDING.get(rel, set())
    ]
    assert not bad, "use the constants of verl_balance/batch_keys.py:\n" + "\n".join(bad)


def test_allow_lists_name_only_literals_that_are_still_there():
    found = package_literals()
    stale = [entry for entry in ALLOWED if entry not in found]
    stale += [(rel, key) for rel, keys in PENDING.items() for key in keys if (rel, key) not in found]
    assert not stale, f"remove these entries: {stale}"


def test_the_scan_finds_a_key_literal_and_skips_keywords_and_attribute_names():
    # Negative control: the scan is not blind; keywords and attribute names are another namespace.
    source = (
        "x = batch['loss_mask']\n"
        "y = model(input_ids=ids, attention_mask=mask)\n"
        "z = getattr(loss_fn, 'on_policy', False)\n"
        "w = {'temperature': 1.0, 'entropy_coeff': 0.0}\n"
    )
    assert literal_keys(source) == [(1, "loss_mask"), (4, "temperature")]
