"""Every command, option name, default and help text of the `switchyard` CLI is what `tests/golden/cli_help.txt`
recorded (written by `python -m tests.cli_help`): a refactor of `cli/` must not change the command line."""

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


def test_version_and_short_help_work_everywhere() -> None:
    """`switchyard --version` prints the installed version; `-h` is `--help` at the top and in every command."""
    from importlib.metadata import version

    from typer.testing import CliRunner

    from switchyard.cli import app

    runner = CliRunner()
    shown = runner.invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.output.strip() == f"switchyard {version('switchyard')}"
    for command in ([], ["router"], ["gateway"], ["db", "upgrade"], ["nats-config"]):
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
