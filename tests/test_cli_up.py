"""`switchyard up` starts embedded NATS + SQLite, serves the bus contract, and leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from switchyard.shared.embedded import free_port

SWITCHYARD = [sys.executable, "-m", "switchyard.cli"]


def _nats_children(data_dir: Path) -> list[int]:
    """PIDs of nats-server processes started for this data dir."""
    out = subprocess.run(["pgrep", "-f", f"nats-server -c {data_dir}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    return {**env, "COLUMNS": "200"}


def _up(data: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SWITCHYARD, "up", "--data-dir", str(data), "--api-port", "0", "--gateway-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**_env(), **(env or {})},
    )


#: A layout credited over an hour pays for its migration inside these seconds-long runs (placement's payoff rule,
#: docs/placement-loop.md; by default a layout is credited until the next plan), so they do migrate.
MIGRATING = {"SWITCHYARD_PLACEMENT_HORIZON_S": "3600"}


def test_up_runs_the_whole_loop_and_keeps_its_state_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "state"
    first = _up(data, "--duration", "6", env=MIGRATING)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert "embedded" in out and "stopped cleanly" in out
    # off a terminal the credentials path users copy is printed whole (the table may fold it, never cut it)
    assert f"SWITCHYARD_NATS_CREDENTIALS={(data / 'nats' / 'credentials.json').resolve()}\n" in out
    assert "routing artifact v1 (fitted now)" in out
    sent, completed = re.search(r"(\d+) sent, (\d+) completed", out).groups()  # type: ignore[union-attr]
    assert int(sent) > 15 and completed == sent  # every request of the load came back (through the gateway)
    # The gateway decided in-process as its own user (`gateway-up`): the shared `gateway` may not share decisions.
    assert "(in-process, sharing its decisions)" in out
    assert re.search(r"TPOT p50 / p99 +│ [0-9.]+ / [0-9.]+ ms", out)
    engine = create_engine(f"sqlite:///{data / 'switchyard.sqlite'}")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM routing_artifacts")).scalar_one() == 1
        placements = conn.execute(text("SELECT count(*) FROM placements")).scalar_one()
    engine.dispose()
    assert (data / "nats" / "jetstream").is_dir() and (data / "switchyard.log").is_file()
    assert _nats_children(data) == []
    second = _up(data, "--duration", "2", "--policy", "jsq", env=MIGRATING)  # KV and SQLite survived the restart
    assert second.returncode == 0, second.stderr[-3000:]
    assert "routing artifact v1 (reused)" in second.stdout and "policy jsq" in second.stdout
    engine = create_engine(f"sqlite:///{data / 'switchyard.sqlite'}")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM placements")).scalar_one() >= placements
        # The restarted engines run their boot layout, not the one the database says was applied: migrations
        # are planned from what the engines report, so none is refused by them and rolled back.
        states = conn.execute(text("SELECT state, error FROM migrations")).all()
    engine.dispose()
    assert states and not [s for s in states if s[0] in ("rolled_back", "failed")], states
    assert _nats_children(data) == []


def _gateway_children(port: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"cli gateway .*--port {port}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _curl(url: str) -> tuple[int, str]:
    """curl's status code and body for a GET."""
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", url], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    body, _, code = out.stdout.rpartition("\n")
    return int(code), body


def _probe_as_vllm_clients_do(base: str, model: str, streamed: int) -> None:
    """What load harnesses and Prometheus ask `vllm serve`, asked of `up`'s gateway with curl: /health (200, no
    body), /version, an unknown endpoint (OpenAI's error JSON), and /metrics with vLLM's metrics under the
    gateway's prefix, labelled `model_name` as vLLM's are, the streamed tokens counted (issue 41)."""
    assert _curl(f"{base}/health") == (200, "")
    code, body = _curl(f"{base}/version")
    assert code == 200 and json.loads(body)["version"]
    code, body = _curl(f"{base}/v1/nothing")
    assert code == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    code, body = _curl(f"{base}/metrics")
    labelled = f'model_name="{model}"'
    assert code == 200
    for name in ("time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_bucket", "prompt_tokens_total"):
        assert any(line.startswith(f"switchyard_gateway_{name}{{") and labelled in line for line in body.splitlines())
    generated = sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("switchyard_gateway_generation_tokens_total{") and labelled in line
    )
    assert generated >= streamed  # the stream above, and whatever else `up` sent through it


def test_curl_streams_through_the_gateway_while_up_runs(tmp_path: Path) -> None:
    """The issue's done-when check, verbatim: curl -N a model from /v1/models, get SSE chunks and [DONE]."""
    data, port = tmp_path / "state", free_port()
    proc = subprocess.Popen(
        [*SWITCHYARD, "up", "--data-dir", str(data), "--api-port", "0", "--gateway-port", str(port), "--duration", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        base, models = f"http://127.0.0.1:{port}", None
        deadline = time.monotonic() + 120
        while models is None and time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                models = httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["id"]
            time.sleep(0.2)
        assert models, "the gateway never listed a model"
        body = json.dumps({"model": models, "prompt": "hi", "max_tokens": 8, "stream": True})
        curl = subprocess.run(
            ["curl", "-sN", f"{base}/v1/completions", "-d", body, "-H", "content-type: application/json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert curl.returncode == 0, curl.stderr
        events = [line[len("data: ") :] for line in curl.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", curl.stdout[-2000:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks).strip()
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert _gateway_children(port)
        _probe_as_vllm_clients_do(base, models, len(chunks))
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped cleanly" in out and "completed at the HTTP clients" in out
    assert _nats_children(data) == [] and _gateway_children(port) == []


def test_a_busy_gateway_port_is_one_plain_line(tmp_path: Path) -> None:
    data = tmp_path / "state"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = _up(data, "--duration", "5", "--gateway-port", str(busy.getsockname()[1]))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "the gateway did not start" in result.stderr and "Address already in use" in result.stderr
    assert _nats_children(data) == []


def test_up_services_only(tmp_path: Path) -> None:
    result = _up(tmp_path / "state", "--services-only", "--duration", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "control plane only" in result.stdout and "stopped cleanly" in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_stops_on_signal_with_no_process_left(tmp_path: Path, sig: signal.Signals) -> None:
    data = tmp_path / "state"
    proc = subprocess.Popen(
        [*SWITCHYARD, "up", "--data-dir", str(data), "--api-port", "0", "--gateway-port", "0"],
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


def test_killed_up_takes_its_nats_server_and_gateway_with_it(tmp_path: Path) -> None:
    data, port = tmp_path / "state", free_port()
    proc = subprocess.Popen(
        [*SWITCHYARD, "up", "--data-dir", str(data), "--api-port", "0", "--gateway-port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    deadline = time.monotonic() + 120
    while not (_nats_children(data) and _gateway_children(port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nats_children(data) and _gateway_children(port)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while (_nats_children(data) or _gateway_children(port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nats_children(data) == [] and _gateway_children(port) == []


def test_db_upgrade_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    result = subprocess.run(
        [*SWITCHYARD, "db", "upgrade", "--database-url", url], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert result.returncode == 0, result.stderr
    assert f"schema at {_head_revision()}" in result.stdout


def _head_revision() -> str:
    from alembic.script import ScriptDirectory

    from switchyard.shared.db.engine import alembic_config

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
