"""No function or method over 80 lines outside benchmarks/ and tests/.

A long function is several steps that want names; past 80 lines, split it into helpers that
say what each step does. A nested function counts inside the function that holds it (moving
a step into a closure does not make the outer function shorter to read). Decorators are not
counted; the docstring is.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = ("gateway", "coordinator", "trainer", "agent_runtime", "examples", "scripts", "lockgate")
MAX_LINES = 80


def python_files() -> list[Path]:
    files: list[Path] = []
    for folder in FOLDERS:
        files.extend(sorted((ROOT / folder).rglob("*.py")))
    return files


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of each outermost function over `limit` lines;
    methods of classes are their own functions, closures count inside their outer function."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                length = child.end_lineno - child.lineno + 1
                if length > limit:
                    found.append((prefix + child.name, child.lineno, length))
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_checker_counts_a_closure_inside_its_function() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    source = f"class A:\n    def f(self):\n        def g():\n            pass\n{body}\n"
    assert long_functions(source) == [("A.f", 2, 83)]
    assert long_functions("def short():\n    return 1\n") == []


def test_no_function_is_over_80_lines() -> None:
    over = []
    for path in python_files():
        for name, line, length in long_functions(path.read_text()):
            over.append(f"{path.relative_to(ROOT)}:{line} {name}: {length} lines")
    assert not over, "split these into named helpers:\n" + "\n".join(over)
