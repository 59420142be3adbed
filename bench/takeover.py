"""Takeover, measured: the SIGKILL tests of issue 28 item 2, repeated, with the figures each prints.

- placement: the active replica (the group's lease holder) killed mid-migration, a standby running; seconds from
  the SIGKILL to the standby holding the lease (`tests/test_placement_takeover.py`, lease TTL 3 s);
- migration: the active replica killed mid-step, a standby running; seconds from the SIGKILL to the standby's
  resend of the step in flight, and to the migration's end (`tests/test_migration_takeover.py`, TTL 3 s);
- router / gateway: one of two killed under a few seconds of load; what the clients lost
  (`tests/test_replica_kill.py`).

Each repeat is one pytest run of those tests (real nats-server, real database, the services as processes); the
tests assert correctness (no step twice, one stored plan per decision, nothing stuck, nothing lost with retries),
this script collects their printed lines.

    python bench/takeover.py                          # 3 repeats on SQLite
    python bench/takeover.py --repeats 5 --database postgresql
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = (
    "tests/test_placement_takeover.py",
    "tests/test_migration_takeover.py::test_a_standby_replica_takes_over_after_the_owner_is_killed",
    "tests/test_replica_kill.py",
)
#: The lines the tests print, by what they measure.
FIGURES = {
    "placement": re.compile(r"placement takeover: lease taken by the standby ([\d.]+) s"),
    "migration resend": re.compile(r"^takeover: step resent ([\d.]+) s"),
    "migration finished": re.compile(r"^takeover: .* migration finished ([\d.]+) s"),
}
CLIENTS = ("router SIGKILL", "gateway SIGKILL")


def run_once(database: str) -> tuple[dict[str, float], list[str], bool]:
    other = "postgresql" if database == "sqlite" else "sqlite"
    command = [sys.executable, "-m", "pytest", *TESTS, "-s", "-q", "-p", "no:cacheprovider", "-k", f"not {other}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    figures: dict[str, float] = {}
    clients = []
    for line in done.stdout.splitlines():
        line = line.lstrip(".")
        for name, pattern in FIGURES.items():
            if (match := pattern.search(line)) is not None:
                figures[name] = float(match.group(1))
        if line.startswith(CLIENTS):
            clients.append(line)
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    return figures, clients, done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--database", choices=("sqlite", "postgresql"), default="sqlite")
    args = parser.parse_args(argv)
    runs: list[dict[str, float]] = []
    failed = 0
    for repeat in range(1, args.repeats + 1):
        figures, clients, ok = run_once(args.database)
        failed += not ok
        runs.append(figures)
        shown = ", ".join(f"{name} {value:.2f} s" for name, value in figures.items())
        print(f"run {repeat}{'' if ok else ' (FAILED)'}: {shown}")
        for line in clients:
            print(f"  {line}")
    for name in FIGURES:
        values = [run[name] for run in runs if name in run]
        if values:
            print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} s after the SIGKILL (lease TTL 3 s)")
    print(f"takeover: {args.repeats} runs on {args.database}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
