"""The `--help` of the `switchyard` app and of every command and subcommand, as one text, so that a refactor of
the CLI can prove it changed no command, option name, default or help text.

`python -m tests.cli_help` rewrites `tests/golden/cli_help.txt`; do that only when a change of the command line
is intended and explained in the commit message. `tests/test_cli_help.py` compares against it. The help is
rendered at a fixed width (120 columns), without colour, under the program name `switchyard`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer.main
from typer.testing import CliRunner

GOLDEN = Path(__file__).parent / "golden" / "cli_help.txt"
WIDTH = 120
ENV = {
    "COLUMNS": str(WIDTH),
    "LINES": "50",
    "TERMINAL_WIDTH": str(WIDTH),
    "NO_COLOR": "1",
    "TERM": "dumb",
    "_TYPER_FORCE_DISABLE_TERMINAL": "1",
}


def _command_paths(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path under `command` (a click command, of typer's own click or the system's), depth first,
    in the order the help lists them."""
    paths = [path]
    if hasattr(command, "list_commands"):  # a group
        ctx = command.make_context("switchyard", ["--help"], resilient_parsing=True)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                paths += _command_paths(sub, (*path, name))
    return paths


def dump() -> str:
    """`switchyard [PATH…] --help` for every command path, each under a `=== switchyard PATH --help ===` line."""
    from switchyard.cli import app

    runner = CliRunner()
    sections = []
    for path in _command_paths(typer.main.get_command(app)):
        result = runner.invoke(
            app,
            [*path, "--help"],
            prog_name="switchyard",
            env=ENV,
            color=False,
            terminal_width=WIDTH,
            max_content_width=WIDTH,
        )
        assert result.exit_code == 0, (path, result.output)
        sections.append(f"=== {' '.join(['switchyard', *path, '--help'])} ===\n{result.output.rstrip()}\n")
    return "\n".join(sections)


if __name__ == "__main__":
    GOLDEN.write_text(dump())
    print(f"wrote {GOLDEN}")
