"""The processes `bench/chaos.py` starts, kills and restarts: a throwaway PostgreSQL cluster and the services.

Every piece is a real process on loopback, started the way an operator would (`switchyard router` ...), so a
SIGKILL here is what a crash is in production. The PostgreSQL cluster lives in a temp dir on a free port and
is never the machine's shared server; when no PostgreSQL binaries are installed the run falls back to SQLite
and says so.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from switchyard.shared.embedded import _die_with_parent, _port_open, free_port


def find_postgres_bin() -> Path | None:
    """The newest /usr/lib/postgresql/<v>/bin holding initdb and pg_ctl (None: not installed)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]), reverse=True)
    for pg_ctl in found:
        bin_dir = Path(pg_ctl).parent
        if (bin_dir / "initdb").is_file():
            return bin_dir
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path and shutil.which("initdb") else None


class ThrowawayPostgres:
    """A private PostgreSQL cluster: initdb in `root`, started on a free loopback port, removed by `stop()`.

    PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres` system user.
    """

    def __init__(self, root: Path, bin_dir: Path) -> None:
        self.root = Path(root)
        self.bin_dir = bin_dir
        self.data = self.root / "pgdata"
        self.port = free_port()
        self.log = self.root / "postgres.log"
        self._user = "postgres" if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self._user is not None:
            command = ["runuser", "-u", self._user, "--", *command]
        return subprocess.run(command, check=check, capture_output=True, timeout=120)

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self._user is not None:
            info = pwd.getpwnam(self._user)
            os.chown(self.root, info.pw_uid, info.pw_gid)
            self.root.chmod(0o755)
            # The cluster's user must reach its folder: a temporary directory above it is 0700 (ours). Let it
            # pass through (execute only, no listing: the credentials beside it stay unreadable, 0600).
            for parent in self.root.resolve().parents:
                mode = parent.stat().st_mode
                if mode & 0o001 or parent.stat().st_uid != os.geteuid():
                    break
                parent.chmod(mode | 0o011)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def crash(self) -> None:
        """Stop the way a crash does (immediate: no checkpoint, clients cut off)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)


@dataclass
class ServiceProcess:
    """One `switchyard <command>` process (or any argv), restartable, its output appended to `log`."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    ready_port: int | None = None  # for HTTP services: the port that answers once it is up
    extra: dict[str, object] = field(default_factory=dict)

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def pause(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not stop in time; the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode

    def wait_port(self, timeout: float = 30.0) -> bool:
        if self.ready_port is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _port_open("127.0.0.1", self.ready_port):
                return True
            time.sleep(0.05)
        return False


def service_env(overrides: dict[str, str]) -> dict[str, str]:
    """The caller's environment without its SWITCHYARD_* settings, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env.update(overrides)
    return env


def cli(command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "switchyard.cli", command, *args]


def gateway_available() -> bool:
    """The gateway fault runs once `switchyard.services.gateway` exists (it is built on another branch)."""
    with contextlib.suppress(ImportError):
        import switchyard.services.gateway  # noqa: F401

        return True
    return False
