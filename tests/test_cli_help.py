"""Every command, option name, default and help text of the `switchyard` CLI is what `tests/golden/cli_help.txt`
recorded (written by `python -m tests.cli_help`): a refactor of `cli/` must not change the command line."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import typer.main

from tests.cli_help import GOLDEN, _command_paths, dump

ROOT = Path(__file__).resolve().parent.parent


def test_the_help_of_every_command_is_unchanged() -> None:
    recorded = GOLDEN.read_text()
    now = dump()
    diff = "".join(
        difflib.unified_diff(recorded.splitlines(keepends=True), now.splitlines(keepends=True), "recorded", "now", n=2)
    )
    assert now == recorded, f"the CLI's help changed (rerun `python -m tests.cli_help` if intended):\n{diff[:6000]}"


def test_version_and_short_help_work_everywhere() -> None:
    """`switchyard --version` prints the installed version; `-h` is `--help` at the top and in every command."""
    from importlib.metadata import version

    from typer.testing import CliRunner

    from switchyard.cli import app

    runner = CliRunner()
    shown = runner.invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.output.strip() == f"switchyard {version('switchyard')}"
    paths = _command_paths(typer.main.get_command(app))
    assert len(paths) > 20  # every command and subcommand, the app itself first
    for command in paths:
        short, long = runner.invoke(app, [*command, "-h"]), runner.invoke(app, [*command, "--help"])
        assert short.exit_code == 0, (command, short.output)
        assert short.output == long.output and "Usage:" in short.output


def test_every_setting_a_help_names_exists() -> None:
    """A `--help` line that names a `SWITCHYARD_*` setting names one the code reads (or a prefix some settings
    share, such as `SWITCHYARD_ROUTER_`): a renamed or removed setting cannot linger in the help."""
    import re

    from switchyard.services.settings_reference import reference

    names = {name for _, _, entries in reference() for s in entries for name in (s.env, *s.aliases)}
    named = set(re.findall(r"SWITCHYARD_[A-Z0-9_]*", dump()))
    assert len(named) > 10  # the scan found the help's settings
    unknown = sorted(
        n for n in named if (n not in names) if not (n.endswith("_") and any(m.startswith(n) for m in names))
    )
    assert unknown == [], f"--help names settings that do not exist: {unknown}"


def _subcommand(command: Any, name: str) -> Any:
    if not hasattr(command, "list_commands"):
        return None
    return command.get_command(command.make_context("switchyard", ["--help"], resilient_parsing=True), name)


def _options(command: Any) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}


#: `switchyard <words> <arguments and options>` as a page writes a command line (up to a backtick, a table's bar or
#: the line's end).
_COMMAND_LINE = re.compile(r"(?<![\w/.-])switchyard((?: [a-z][a-z0-9-]*)+)((?: +[^\s`|]+)*)")


def wrong_options(text: str, where: str = "") -> list[str]:
    """Each `switchyard <command> ... --option` in `text` whose command has no such option."""
    from switchyard.cli import app

    root, wrong = typer.main.get_command(app), []
    for n, line in enumerate(text.splitlines(), 1):
        for match in _COMMAND_LINE.finditer(line):
            command, words, path = root, match.group(1).split(), []
            while words and (sub := _subcommand(command, words[0])) is not None:
                command = sub
                path.append(words.pop(0))
            if not path:  # prose ("switchyard is ..."), not a command line
                continue
            for option in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", " ".join(words) + match.group(2)):
                if option not in _options(command):
                    wrong.append(f"{where}:{n}: switchyard {' '.join(path)} {option}")
    return wrong


def test_every_option_a_help_or_a_page_names_exists() -> None:
    """An option named in a `--help` text exists in some command, and every `switchyard <command> --option` the
    README or a page of docs/ writes is an option of that command (the README once said every service takes
    `--data-dir`, which `router` refused)."""
    from switchyard.cli import app

    declared: set[str] = set()
    root = typer.main.get_command(app)
    for path in _command_paths(root):
        command = root
        for name in path:
            command = _subcommand(command, name)
        declared |= _options(command)
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", dump())) - declared == set()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert sum(len(_COMMAND_LINE.findall(p.read_text())) for p in pages) > 100  # the scan finds the command lines
    assert [w for p in pages for w in wrong_options(p.read_text(), str(p.relative_to(ROOT)))] == []
    # The check can fail: an option the command lacks, after arguments and other options.
    assert wrong_options("run `switchyard sim --seed 5 --no-such-option` then") == [
        ":1: switchyard sim --no-such-option"
    ]
