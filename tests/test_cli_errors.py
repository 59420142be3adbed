"""A user's mistake at the command line is one plain line and a non-zero exit; a bug keeps its traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard.cli.errors import user_error_message
from switchyard.shared.errors import ConfigError
from switchyard.shared.routing_trace import TraceError

SWITCHYARD = [sys.executable, "-m", "switchyard.cli"]


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env["SWITCHYARD_NATS_INITIAL_CONNECT_S"] = "1"
    return subprocess.run([*SWITCHYARD, *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def _bad_npz(tmp_path: Path) -> Path:
    path = tmp_path / "trace.npz"
    path.write_bytes(b"not an npz archive")
    return path


CASES = {
    "missing trace": (["fit", "-k", "4", "--trace", "/nonexistent/trace.npz"], "no such file"),
    "malformed trace": (["fit", "-k", "4", "--trace", "BAD_NPZ"], "trace.npz"),
    "missing sim trace": (["sim", "--trace", "/nonexistent", "--rate", "1"], "no such file"),
    "unknown policy": (["up", "--policy", "bogus", "--duration", "1"], "unknown policy 'bogus'"),
    "unknown option": (["fit", "--bogus"], "No such option"),
    "unreachable NATS": (["router", "--nats-url", "nats://127.0.0.1:1"], "cannot reach NATS"),
    "not a NATS URL": (["router", "--nats-url", "127.0.0.1:4222"], "needs a scheme"),
    "unsupported database": (["db", "upgrade", "--database-url", "mysql://x@127.0.0.1/db"], "unsupported database"),
    "unreachable database": (
        ["db", "upgrade", "--database-url", "postgresql://nobody@127.0.0.1:1/x"],
        "cannot use the database",
    ),
    "missing calibration windows": (["calibrate", "--windows", "/nonexistent/windows.npz"], "/nonexistent"),
    "api with an unreachable NATS": (["api", "--nats-url", "nats://127.0.0.1:1", "--port", "0"], "cannot reach NATS"),
    **{
        f"{command} without a bus": ([command], "no NATS server configured")
        for command in ("placement", "migration", "api", "router", "gateway")
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_user_mistake_is_one_plain_line(case: str, tmp_path: Path) -> None:
    args, expected = CASES[case]
    args = [str(_bad_npz(tmp_path)) if a == "BAD_NPZ" else a for a in args]
    done = _run(*args, tmp_path=tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "╭" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() and "WARNING" not in line]
    assert 1 <= len(errors) <= 2, done.stderr[-2000:]
    assert expected in done.stderr, done.stderr[-2000:]
    if case.endswith("without a bus"):  # refused before any side effect: no state folder, no SQLite migrated
        assert not (tmp_path / ".switchyard").exists()


def test_only_input_errors_are_shortened() -> None:
    assert user_error_message(TraceError("x.npz: no such file")) == "x.npz: no such file"
    wrapped = RuntimeError("while starting")
    wrapped.__cause__ = ConfigError("unsupported database 'foo'")
    assert user_error_message(wrapped) == "unsupported database 'foo'"
    assert user_error_message(ExceptionGroup("tasks", [ConnectionError("cannot reach NATS")])) == "cannot reach NATS"
    assert user_error_message(KeyError("slot")) is None  # a bug: its traceback stays
    assert user_error_message(ValueError("bad shape")) is None
