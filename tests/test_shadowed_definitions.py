"""No definition is shadowed by a later one of the same name (dead code: the first never runs).

The check is ruff's F811 (redefinition of an unused name), which CI's ``ruff check .`` runs over
``verl_balance/``, ``tests/`` and ``benchmarks/``. ruff exempts "dummy" names from F811, and its
default dummy pattern matches every name that starts with ``_``, so a private function defined twice
(``trainer/checkpoint.py``'s ``_start_from_path``) went unreported; ``pyproject.toml`` narrows the
pattern to ``_`` alone. These tests run ruff with the project's configuration on planted modules
(shadowed private and public functions, methods and classes must be reported; ``@overload``, a
property setter and conditional definitions must not) and on the tree itself.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.slow,  # runs ruff in a subprocess
    pytest.mark.skipif(
        importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e .[lint])"
    ),
]

REPO = pathlib.Path(__file__).resolve().parents[1]

SHADOWED = textwrap.dedent(
    """\
    def _start(x):
        return x


    def _start(run):
        return run


    def public(x):
        return x


    def public(y):
        return y


    class Holder:
        def _method(self):
            return 1

        def _method(self):
            return 2


    class Holder:
        pass
    """
)

ALLOWED = textwrap.dedent(
    """\
    import sys
    from typing import overload


    @overload
    def _one(x: int) -> int: ...
    @overload
    def _one(x: str) -> str: ...
    def _one(x):
        return x


    class Box:
        @property
        def _value(self):
            return self._v

        @_value.setter
        def _value(self, v):
            self._v = v


    if sys.platform == "win32":

        def _path_sep():
            return "\\\\"

    else:

        def _path_sep():
            return "/"


    try:
        from tomllib import loads as _loads
    except ImportError:

        def _loads(text):
            return {}


    def _registered():
        return 1


    REGISTRY = {"first": _registered}


    def _registered():
        return 2
    """
)


def _f811(*paths: pathlib.Path, config: list[str]) -> list[tuple[str, int, str]]:
    """(file name, line, redefined name) of every F811 ruff reports under ``paths``."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F811", "--output-format", "concise"]
        + config
        + [str(p) for p in paths],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode in (0, 1), proc.stderr
    found = re.findall(r"^(.+?):(\d+):\d+: F811 Redefinition of unused `([^`]+)`", proc.stdout, re.M)
    return sorted((pathlib.Path(f).name, int(line), name) for f, line, name in found)


PROJECT_CONFIG = ["--config", str(REPO / "pyproject.toml")]


def test_shadowed_private_and_public_definitions_are_reported(tmp_path):
    (tmp_path / "shadowed.py").write_text(SHADOWED)
    assert _f811(tmp_path / "shadowed.py", config=PROJECT_CONFIG) == [
        ("shadowed.py", 5, "_start"),
        ("shadowed.py", 13, "public"),
        ("shadowed.py", 21, "_method"),
        ("shadowed.py", 25, "Holder"),
    ]


def test_overloads_setters_and_conditional_or_used_definitions_are_not_reported(tmp_path):
    (tmp_path / "allowed.py").write_text(ALLOWED)
    compile(ALLOWED, "allowed.py", "exec")  # the planted module is valid Python
    assert _f811(tmp_path / "allowed.py", config=PROJECT_CONFIG) == []


def test_negative_control_ruffs_default_dummy_pattern_misses_the_private_ones(tmp_path):
    """Why the pyproject setting exists: with ruff's defaults only the public names are reported."""
    (tmp_path / "shadowed.py").write_text(SHADOWED)
    assert _f811(tmp_path / "shadowed.py", config=["--isolated"]) == [
        ("shadowed.py", 13, "public"),
        ("shadowed.py", 25, "Holder"),
    ]


def test_no_definition_in_the_tree_is_shadowed():
    roots = [REPO / name for name in ("verl_balance", "tests", "benchmarks")]
    assert _f811(*roots, config=PROJECT_CONFIG) == []
