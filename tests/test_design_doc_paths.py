"""docs/design.md names only files and functions that exist, and its walk of one GRPO step names each
file once, in numbered order.

- Every backticked ``*.py`` path resolves under ``verl_balance/`` (or the repository root for
  ``verl_balance/...``, ``tests/...`` and ``benchmarks/...`` paths); every ``path.py::Name.attr``
  names a class, function or method defined in that file.
- In the section "Walk of one GRPO step" the stops are numbered 1, 2, ... and no file appears in two
  stops.
"""

from __future__ import annotations

import ast
import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(REPO_ROOT, "docs", "design.md")
WALK_TITLE = "## Walk of one GRPO step"
_PATH = re.compile(r"`([A-Za-z0-9_./]+\.py)(?:::([A-Za-z0-9_.]+))?`")
_STOP = re.compile(r"^(\d+)\. ", re.M)
# `package/module.name` (a module path without .py, then a name in it), e.g. `algorithms/advantages.compute_gae`
_DOTTED = re.compile(r"`((?:[a-z_]+/)+[a-z_0-9]+)\.([A-Za-z_][A-Za-z0-9_.]*)`")
# `package/` or `package/sub/`: a folder of the library
_FOLDER = re.compile(r"`((?:[a-z_]+/)+)`")
_FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "toml", "txt", "sh", "png", "safetensors"}
RUN_DIR_FOLDERS = {"critic/"}  # folders of a checkpoint directory, not of the repository


def _resolve(path: str) -> str | None:
    for base in (os.path.join(REPO_ROOT, "verl_balance"), REPO_ROOT):
        full = os.path.join(base, path)
        if os.path.isfile(full):
            return full
    return None


def defined_names(source: str) -> set[str]:
    """Qualified names (``f``, ``C``, ``C.m``) of the classes and functions defined in ``source``."""
    names = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return names


def doc_problems(text: str) -> list[str]:
    """Paths that do not exist and names their file does not define."""
    problems = []
    for path, name in _PATH.findall(text):
        full = _resolve(path)
        if full is None:
            problems.append(f"{path}: no such file")
        elif name:
            with open(full) as f:
                if name not in defined_names(f.read()):
                    problems.append(f"{path}::{name}: not defined there")
    for module, name in _DOTTED.findall(text):
        if name in _FILE_SUFFIXES:
            continue
        full = _resolve(module + ".py")
        if full is None:
            problems.append(f"{module}.py: no such file")
            continue
        with open(full) as f:
            defined = defined_names(f.read())
        if name not in defined and name.split(".")[0] not in _module_level_names(full):
            problems.append(f"{module}.{name}: not defined there")
    for folder in _FOLDER.findall(text):
        if folder not in RUN_DIR_FOLDERS and not any(
            os.path.isdir(os.path.join(base, folder)) for base in (os.path.join(REPO_ROOT, "verl_balance"), REPO_ROOT)
        ):
            problems.append(f"{folder}: no such folder")
    return problems


def _module_level_names(path: str) -> set[str]:
    """Names assigned at a module's top level (constants such as ``INLINE_ARGUMENT_BYTES``)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def walk_problems(text: str) -> list[str]:
    """Stops out of order or a file named in two stops, in the walk section of ``text``."""
    if WALK_TITLE not in text:
        return [f"no section {WALK_TITLE!r}"]
    section = text.split(WALK_TITLE, 1)[1].split("\n## ", 1)[0]
    starts = list(_STOP.finditer(section))
    problems = []
    numbers = [int(m.group(1)) for m in starts]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"stops numbered {numbers}")
    first_stop = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(section)
        for path in dict.fromkeys(p for p, _ in _PATH.findall(section[match.start() : end])):
            if path in first_stop:
                problems.append(f"{path} in stops {first_stop[path]} and {match.group(1)}")
            first_stop.setdefault(path, match.group(1))
    return problems


def _design() -> str:
    with open(DESIGN) as f:
        return f.read()


def test_every_path_and_name_in_design_md_exists():
    assert doc_problems(_design()) == []


def test_the_grpo_walk_names_each_file_once_in_numbered_stops():
    text = _design()
    assert walk_problems(text) == []
    section = text.split(WALK_TITLE, 1)[1].split("\n## ", 1)[0]
    assert len(_STOP.findall(section)) >= 14


def test_the_checks_catch_a_missing_file_a_missing_name_a_repeated_file_and_a_skipped_stop():
    text = (
        "`trainer/driver.py::DriverBase._train_loop` `trainer/no_such.py` `loss.py::no_such_function`\n"
        "`algorithms/advantages.compute_gae` `algorithms/advantages.no_such` `trainer/grpo/` `no_such_dir/`\n"
        f"{WALK_TITLE}\n\n1. `loss.py::compute_token_weights`\n3. `loss.py` again\n"
    )
    assert doc_problems(text) == [
        "trainer/no_such.py: no such file",
        "loss.py::no_such_function: not defined there",
        "algorithms/advantages.no_such: not defined there",
        "no_such_dir/: no such folder",
    ]
    assert walk_problems(text) == ["stops numbered [1, 3]", "loss.py in stops 1 and 3"]
