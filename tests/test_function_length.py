"""No function in ``verl_balance/`` is longer than ``MAX_LINES`` lines (``def`` line to its last line,
decorators excluded, nested functions counted in their parent and on their own)."""

from __future__ import annotations

import ast
import os
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO_ROOT, "verl_balance")
MAX_LINES = 60


def long_functions(source: str, *, max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of each function in ``source`` longer than ``max_lines``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > max_lines:
                        found.append((name, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_function_in_the_library_is_over_60_lines():
    offenders = []
    for dirpath, _, files in os.walk(PACKAGE):
        for file in sorted(files):
            if file.endswith(".py"):
                path = os.path.join(dirpath, file)
                with open(path) as f:
                    source = f.read()
                rel = os.path.relpath(path, REPO_ROOT)
                offenders += [f"{rel}:{name}:{lines}" for name, lines in long_functions(source)]
    assert not offenders, f"functions over {MAX_LINES} lines (split them): {sorted(offenders)}"


def test_the_scan_flags_a_long_method_and_a_long_nested_function_but_not_one_at_the_limit():
    body = "\n".join(f"    x{i} = {i}" for i in range(59))  # def line + 59 = 60 lines
    at_limit = f"def ok():\n{body}\n"
    over = f"def too_long():\n{body}\n    return 1\n"
    nested = "class C:\n    def method(self):\n" + textwrap.indent(over, "        ") + "        return 0\n"
    assert long_functions(at_limit) == []
    assert long_functions(over) == [("too_long", 61)]
    assert long_functions(nested) == [("C.method", 63), ("C.method.too_long", 61)]
