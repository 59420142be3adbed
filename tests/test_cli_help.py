"""Every command, option name, default and help text of the `switchyard` CLI is what `tests/golden/cli_help.txt`
recorded (written by `python -m tests.cli_help`): a refactor of `services/cli` must not change the command line."""

from __future__ import annotations

import difflib

from tests.cli_help import GOLDEN, dump


def test_the_help_of_every_command_is_unchanged() -> None:
    recorded = GOLDEN.read_text()
    now = dump()
    diff = "".join(
        difflib.unified_diff(recorded.splitlines(keepends=True), now.splitlines(keepends=True), "recorded", "now", n=2)
    )
    assert now == recorded, f"the CLI's help changed (rerun `python -m tests.cli_help` if intended):\n{diff[:6000]}"
