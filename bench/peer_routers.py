"""The peers of `bench_gateway.py --peers` (issue 39 item 4): vLLM's and SGLang's Rust routers in front of the same
stub engine, in the same shuffled latency rounds and throughput windows as every other target.

- `vllm-router` (PyPI `vllm-router`): `vllm-router --host H --port P --worker-urls URL`;
- `sglang-router` (PyPI `sglang-router`): `sglang-router launch --host H --port P --worker-urls URL`.

Each one is installed with pip into a venv of its own (their dependency pins are not the project's), under
`$SWITCHYARD_BENCH_PEERS_DIR` when set (kept between runs: installed once), else under the bench's temp dir. Both
serve a Prometheus exporter on a default port of their own choosing (the same one for both): each gets a free one.
Retries are off (a stub that fails is a failure to count, not to hide) and the default policy is kept: one worker,
so every policy picks the same one. A peer that fails to install or to start is left out of the run with its error
on stderr; the others run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import venv
from pathlib import Path

#: Target name → (PyPI package, the command under the venv's bin/ and its first arguments).
PEERS: dict[str, tuple[str, list[str]]] = {
    "vllm-router": ("vllm-router", ["vllm-router"]),
    "sglang-router": ("sglang-router", ["sglang-router", "launch"]),
}
CACHE_ENV = "SWITCHYARD_BENCH_PEERS_DIR"
#: Log level flag per peer (their choices differ: "warning" against "warn").
LOG_LEVEL = {"vllm-router": "warning", "sglang-router": "warn"}


def install(name: str, root: Path) -> Path | None:
    """`root/<name>/bin/<command>` once its package is installed (pip into a new venv); None, said, if not."""
    package, command = PEERS[name]
    where = root / name
    binary = where / "bin" / command[0]
    if binary.exists():
        return binary
    try:
        venv.create(where, with_pip=True, clear=True)
        subprocess.run(
            [str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", package],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        print(f"peer {name}: `pip install {package}` failed, left out: {detail.strip()[-2000:]}", file=sys.stderr)
        return None
    return binary if binary.exists() else None


class PeerRouters:
    """Installs and starts the peers (into the bench's `procs`) and knows their ports."""

    def __init__(self, tmp: Path, stub_port: int) -> None:
        from switchyard.shared.embedded import free_port

        cache = os.environ.get(CACHE_ENV)
        self.root = Path(cache) if cache else tmp / "peers"
        self.root.mkdir(parents=True, exist_ok=True)
        self.stub = f"http://127.0.0.1:{stub_port}"
        self.binaries = {name: b for name in PEERS if (b := install(name, self.root)) is not None}
        self.ports = {name: free_port() for name in self.binaries}
        self.metrics_ports = {name: free_port() for name in self.binaries}
        self.logs = {name: tmp / f"{name}.log" for name in self.binaries}

    def start(self, procs: dict[str, subprocess.Popen[bytes]], env: dict[str, str]) -> None:
        for name, binary in self.binaries.items():
            args = [str(binary), *PEERS[name][1][1:], "--host", "127.0.0.1", "--port", str(self.ports[name])]
            args += ["--worker-urls", self.stub, "--prometheus-port", str(self.metrics_ports[name])]
            args += ["--disable-retries", "--log-level", LOG_LEVEL[name]]
            with self.logs[name].open("wb") as log:
                procs[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, procs: dict[str, subprocess.Popen[bytes]], timeout: float = 60.0) -> dict[str, int]:
        """Until a completion comes back through each peer; one that exits or never answers is dropped (its log's
        tail on stderr) and the others' ports returned."""
        import httpx

        body = {"model": "stub-model", "prompt": "ready?", "max_tokens": 1}
        deadline = time.monotonic() + timeout
        ready: dict[str, int] = {}
        for name, port in self.ports.items():
            while True:
                try:
                    url = f"http://127.0.0.1:{port}/v1/completions"
                    if httpx.post(url, json=body, timeout=2).status_code == 200:
                        ready[name] = port
                        break
                except httpx.TransportError:
                    pass
                if procs[name].poll() is not None or time.monotonic() > deadline:
                    tail = self.logs[name].read_text(errors="replace")[-2000:]
                    print(f"peer {name} did not start, left out:\n{tail}", file=sys.stderr)
                    procs.pop(name).kill()
                    break
                time.sleep(0.2)
        return ready
