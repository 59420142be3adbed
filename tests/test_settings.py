"""Settings parsing from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from switchyard.shared.bus import connect_options
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import Subjects


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no .env here
    settings = SwitchyardSettings()
    assert settings.nats_servers == []
    assert settings.subject_prefix == "sy"
    assert settings.resolved_database_url().startswith("sqlite:///")
    assert settings.resolved_database_url().endswith("switchyard.sqlite")


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_NATS_SERVERS", "nats://a:4222, nats://b:4222")
    monkeypatch.setenv("SWITCHYARD_NATS_TOKEN", "s3cret")
    monkeypatch.setenv("SWITCHYARD_DATABASE_URL", "postgresql://u@db/switchyard")
    monkeypatch.setenv("SWITCHYARD_SUBJECT_PREFIX", "prod")
    monkeypatch.setenv("SWITCHYARD_DATA_DIR", "/var/lib/switchyard")
    settings = SwitchyardSettings()
    assert settings.nats_servers == ["nats://a:4222", "nats://b:4222"]
    assert settings.resolved_database_url() == "postgresql://u@db/switchyard"
    assert settings.data_dir == Path("/var/lib/switchyard")
    assert settings.subjects.route_decode == "prod.route.decode"
    options = connect_options(settings, settings.nats_servers)
    assert options["token"] == "s3cret" and "user" not in options


def test_user_password_and_nkey_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SWITCHYARD_NATS_USER", "router")
    monkeypatch.setenv("SWITCHYARD_NATS_PASSWORD", "pw")
    options = connect_options(SwitchyardSettings(), ["nats://x:1"])
    assert (options["user"], options["password"]) == ("router", "pw")
    monkeypatch.delenv("SWITCHYARD_NATS_USER")
    monkeypatch.delenv("SWITCHYARD_NATS_PASSWORD")
    seed = tmp_path / "user.nk"
    monkeypatch.setenv("SWITCHYARD_NATS_NKEY_SEED_FILE", str(seed))
    assert connect_options(SwitchyardSettings(), ["nats://x:1"])["nkeys_seed"] == str(seed)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SWITCHYARD_NATS_USER": "only-user"}, "must be given together"),
        ({"SWITCHYARD_NATS_TLS_CERT": "/c.pem"}, "must be given together"),
        ({"SWITCHYARD_NATS_TOKEN": "t", "SWITCHYARD_NATS_NKEY_SEED_FILE": "/s"}, "choose one"),
        ({"SWITCHYARD_NATS_SERVERS": "localhost:4222"}, "needs a scheme"),
        ({"SWITCHYARD_SUBJECT_PREFIX": "a.b"}, "subject prefix"),
        ({"SWITCHYARD_MAX_PAYLOAD_BYTES": "10"}, "greater than or equal"),
    ],
)
def test_invalid_settings_fail_loudly(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError, match=message):
        SwitchyardSettings()


def test_subjects_are_prefixed_and_token_safe() -> None:
    subjects = Subjects("sy")
    assert subjects.hello("d-0") == "sy.engine.d-0.hello"
    assert subjects.all_telemetry == "sy.engine.*.telemetry"
    assert subjects.migrate("e_1") == "sy.engine.e_1.migrate"
    assert subjects.expert_load_stream == "SY_EXPERT_LOAD"
    assert subjects.router_bucket == "sy-router"
    for bad in ("a.b", "*", ">", "a b", ""):
        with pytest.raises(ValueError):
            subjects.telemetry(bad)
    streams = subjects.streams()
    assert streams["SY_EXPERT_LOAD"] == ["sy.engine.*.expert_load"]
