"""`switchyard up` starts embedded NATS + SQLite, serves the bus contract, and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

SWITCHYARD = [sys.executable, "-m", "services.cli"]


def _nats_children(data_dir: Path) -> list[int]:
    """PIDs of nats-server processes started for this data dir."""
    out = subprocess.run(["pgrep", "-f", f"nats-server -c {data_dir}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    return {**env, "COLUMNS": "200"}


def test_up_runs_for_a_duration_and_stops_cleanly(tmp_path: Path) -> None:
    data = tmp_path / "state"
    result = subprocess.run(
        [*SWITCHYARD, "up", "--data-dir", str(data), "--duration", "2"],
        capture_output=True,
        text=True,
        timeout=90,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    assert "embedded" in result.stdout and "stopped cleanly" in result.stdout
    engine = create_engine(f"sqlite:///{data / 'switchyard.sqlite'}")
    assert "placements" in inspect(engine).get_table_names()
    engine.dispose()
    assert (data / "nats" / "jetstream").is_dir()
    assert _nats_children(data) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_stops_on_signal_with_no_process_left(tmp_path: Path, sig: signal.Signals) -> None:
    data = tmp_path / "state"
    proc = subprocess.Popen(
        [*SWITCHYARD, "up", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    deadline = time.monotonic() + 60
    while not _nats_children(data) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nats_children(data), "embedded nats-server never started"
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped cleanly" in out
    assert _nats_children(data) == []


def test_killed_up_takes_its_nats_server_with_it(tmp_path: Path) -> None:
    data = tmp_path / "state"
    proc = subprocess.Popen(
        [*SWITCHYARD, "up", "--data-dir", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env()
    )
    deadline = time.monotonic() + 60
    while not _nats_children(data) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nats_children(data)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _nats_children(data) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nats_children(data) == []


def test_db_upgrade_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    result = subprocess.run(
        [*SWITCHYARD, "db", "upgrade", "--database-url", url], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert result.returncode == 0, result.stderr
    assert f"schema at {_head_revision()}" in result.stdout


def _head_revision() -> str:
    from alembic.script import ScriptDirectory

    from shared.db.engine import alembic_config

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
