"""The house's sizes, read from the source: no Python file outside `bench/` and `tests/` over 650 lines, no
function (or method) over 150 lines (issue 38 item 7). A file or function that grows past them is split where
it falls apart into named parts, not waved through: the limits are what keep a module readable in one sitting.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 650
MAX_FUNCTION_LINES = 150
#: Folders the limits do not apply to: the benches and the tests, and what is not the project's own source
#: (virtual environments, caches, build output: hidden folders and these names).
EXEMPT = {"bench", "tests", "build", "dist", "__pycache__", "node_modules"}


def _sources() -> list[Path]:
    """Every Python file of the checkout that the limits apply to (exempt folders are not entered)."""
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in EXEMPT and not d.startswith(".") and not d.endswith(".egg-info")]
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return sorted(found)


def oversized(path: Path) -> list[str]:
    """What in `path` is over the limits: the file itself, and each function with its length."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found = []
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{rel}: {lines} lines (limit {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} {node.name}: {length} lines (limit {MAX_FUNCTION_LINES})")
    return found


def test_the_walk_sees_the_packages_and_skips_benches_tests_and_environments() -> None:
    sources = {p.relative_to(REPO).parts[0] for p in _sources()}
    assert {"shared", "services", "solver", "simulator", "engine_agents", "cli"} <= sources
    assert not sources & {"bench", "tests", ".venv"}


def test_no_file_over_650_lines_and_no_function_over_150() -> None:
    found = [item for path in _sources() for item in oversized(path)]
    assert not found, "over the house's sizes (split them):\n" + "\n".join(found)


def test_the_check_catches_a_long_file_and_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long_function = tmp_path / "long_function.py"
    long_function.write_text(f"def f() -> None:\n{body}\n")
    assert [item.split(" ", 1)[1] for item in oversized(long_function)] == ["f: 151 lines (limit 150)"]
    long_file = tmp_path / "long_file.py"
    long_file.write_text("\n".join(f"x{i} = {i}" for i in range(MAX_FILE_LINES + 1)) + "\n")
    assert oversized(long_file) == [f"{long_file}: 651 lines (limit 650)"]
    short = tmp_path / "short.py"
    short.write_text(f"def f() -> None:\n{body[: body.rindex(chr(10))]}\n")
    assert oversized(short) == []
