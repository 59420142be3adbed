"""`switchyard epp` and `nats-config --epps` from the command line (the picker itself: tests/test_epp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from switchyard.shared.embedded import find_nats_server
from switchyard.shared.nats_auth import SERVICE_ROLES


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    return subprocess.run([sys.executable, "-m", "switchyard.cli", *args], capture_output=True, text=True, env=env)


def test_nats_config_makes_one_user_per_picker(tmp_path: Path) -> None:
    out = tmp_path / "conf"
    result = _cli("nats-config", "--out", str(out), "--gateways", "g1", "--epps", "e1,e2")
    assert result.returncode == 0, result.stderr
    assert set(json.loads((out / "credentials.json").read_text())) == {*SERVICE_ROLES, "gateway-g1", "epp-e1", "epp-e2"}
    assert "SWITCHYARD_EPP_EPP_ID=e2" in result.stdout  # how each picker finds its own user
    checked = subprocess.run([str(find_nats_server()), "-c", str(out / "nats-server.conf"), "-t"], capture_output=True)
    assert checked.returncode == 0, checked.stderr
    same = _cli("nats-config", "--out", str(out), "--gateways", "x", "--epps", "x")
    assert same.returncode == 2 and "also named in --gateways" in same.stderr, same.stderr
    bad = _cli("nats-config", "--out", str(out), "--epps", "e.1")
    assert bad.returncode == 2 and "--epps: picker id 'e.1'" in bad.stderr, bad.stderr


def test_epp_refuses_half_a_tls_pair_in_one_line(tmp_path: Path) -> None:
    result = _cli("epp", "--nats-url", "nats://127.0.0.1:1", "--tls-cert", str(tmp_path / "cert.pem"))
    assert result.returncode == 2, result.stderr
    assert "SWITCHYARD_EPP_TLS_CERT and SWITCHYARD_EPP_TLS_KEY go together" in result.stderr
    assert "Traceback" not in result.stderr
