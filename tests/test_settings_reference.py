"""docs/settings.md is the settings classes rendered (`switchyard settings --markdown`): every setting is in it,
documented, under the name the code reads, so the reference cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from switchyard.cli import app
from switchyard.services.settings_reference import markdown, reference
from tests.test_deploy_material import settings_classes

REPO = Path(__file__).resolve().parents[1]


def test_the_reference_file_is_the_code_rendered() -> None:
    text = (REPO / "docs" / "settings.md").read_text()
    assert text == markdown(), "docs/settings.md is stale: run `switchyard settings --markdown > docs/settings.md`"
    printed = CliRunner().invoke(app, ["settings", "--markdown"])
    assert printed.exit_code == 0 and printed.stdout == text


def test_every_settings_class_is_in_it_and_every_setting_documented() -> None:
    listed = {class_name for class_name, _, _ in reference()}
    assert listed == {cls.__name__ for cls in settings_classes()}  # a new settings class must be added to CLASSES
    undocumented = [s.env for _, _, entries in reference() for s in entries if not s.doc]
    assert undocumented == [], f"settings without a `#:` comment: {undocumented}"


def test_the_names_are_the_ones_the_settings_read(monkeypatch) -> None:
    """Each variable the reference names changes its setting when set (an alias the class ignores would not)."""
    from switchyard.shared.settings import SwitchyardSettings

    names = {s.env for _, _, entries in reference() for s in entries}
    assert "SWITCHYARD_NATS_SERVERS" in names and "SWITCHYARD_GATEWAY_PORT" in names
    monkeypatch.setenv("SWITCHYARD_SUBJECT_PREFIX", "probe")
    assert SwitchyardSettings().subject_prefix == "probe"
    assert all(re.fullmatch(r"SWITCHYARD_[A-Z0-9_]+", n) for n in names), sorted(names)


def test_the_env_listing_names_every_setting_once() -> None:
    printed = CliRunner().invoke(app, ["settings"])
    assert printed.exit_code == 0
    assigned = re.findall(r"^# (SWITCHYARD_[A-Z0-9_]+)=", printed.stdout, re.M)
    names = [s.env for _, _, entries in reference() for s in entries]
    assert assigned == names
