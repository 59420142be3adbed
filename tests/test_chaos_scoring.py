"""How `make chaos` scores what it saw (no processes: the harness's records filled in by hand).

The closing line keeps its form; the API's resume counts in `max resume` and is measured to its first answer
however long its restart takes, without later windows claiming the rest of its outage; requests that reached
the attacker's server (role-claim) and probes answered with the attacker are misrouted; a fault's own stuck
and lost counts (migration-active, stream-flood) reach the totals.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/ holds scripts, not a package
from chaos import ATTACKER, Audit, Chaos, ChaosOptions, FaultResult, Probe, closing_line, totals


def _chaos(tmp_path: Path) -> Chaos:
    chaos = Chaos(ChaosOptions(workdir=tmp_path))
    chaos.root = tmp_path  # no router log: no restart to describe
    return chaos


def test_the_apis_resume_runs_past_its_window_and_counts_in_max_resume(tmp_path: Path) -> None:
    chaos = _chaos(tmp_path)
    t0 = 1000.0
    api = FaultResult("api", t0, t0 + 1, t0 + 12)
    gateway = FaultResult("gateway", t0 + 12, t0 + 13, t0 + 24)
    # Up, killed at t0 + 1, refused until t0 + 16.5 (into the gateway's window), then up again.
    chaos.api_probes = [(t0 + 0.25 * i, None if t0 + 1 < t0 + 0.25 * i < t0 + 16.5 else 200) for i in range(96)]
    chaos.probes = [Probe(t0 + 0.05 * i, True, "sim-d0", t0 + 0.05 * i) for i in range(480)]
    chaos.telemetry = {"sim-d0": [t0 + 0.1 * i for i in range(250)]}
    chaos._score([api, gateway], Audit())
    assert abs(api.api_resume_s - 15.5) < 0.3, api  # from the kill to the first answer, past the window
    assert gateway.api_resume_s == 0.0, gateway  # the API's own outage, carried over, is not the gateway's
    assert totals([api, gateway], Audit())["max_resume_s"] == api.api_resume_s
    line = closing_line([api, gateway], Audit())
    assert re.fullmatch(r"chaos: 2 faults, lost 0, duplicated 0, stuck 0, misrouted 0, max resume \d+\.\d s", line), (
        line
    )


def test_attacks_count_as_misrouted_stuck_and_lost(tmp_path: Path) -> None:
    chaos = _chaos(tmp_path)
    t0 = 2000.0
    claim = FaultResult("role-claim", t0, t0 + 1, t0 + 12, hijacked=5)
    killed = FaultResult("migration-active", t0 + 12, t0 + 13, t0 + 40, extra_stuck=1)
    flood = FaultResult("stream-flood", t0 + 40, t0 + 41, t0 + 52, extra_lost=2)
    # One probe answered with the attacker (it sends telemetry, so staleness alone would not catch it).
    chaos.probes = [Probe(t0 + 2, True, ATTACKER, t0 + 2.01), Probe(t0 + 3, True, "sim-d0", t0 + 3.01)]
    chaos.telemetry = {ATTACKER: [t0 + 2.0], "sim-d0": [t0 + 3.0]}
    results = [claim, killed, flood]
    chaos._score(results, Audit())
    assert (claim.misrouted, killed.stuck, flood.lost_rows) == (6, 1, 2)
    assert closing_line(results, Audit()) == (
        "chaos: 3 faults, lost 2, duplicated 0, stuck 1, misrouted 6, max resume 0.0 s"
    )


def test_an_api_answering_503_is_down_until_its_first_2xx(tmp_path: Path) -> None:
    """Issue 37, item 11: during a 15 s PostgreSQL crash the API answered 503 to 59 of 59 probes for 15.2 s, and
    chaos reported resume 0.00 s (it counted a 503 as answered). A 5xx, 503 included, is not an answer."""
    chaos = _chaos(tmp_path)
    t0 = 3000.0
    crash = FaultResult("postgres", t0, t0 + 1, t0 + 20)
    # 200 until the crash at t0 + 1, 503 for 15.2 s, then 200 again.
    chaos.api_probes = [(t0 + 0.25 * i, 503 if t0 + 1 < t0 + 0.25 * i < t0 + 16.2 else 200) for i in range(80)]
    chaos.probes = [Probe(t0 + 0.05 * i, True, "sim-d0", t0 + 0.05 * i) for i in range(400)]
    chaos.telemetry = {"sim-d0": [t0 + 0.1 * i for i in range(200)]}
    chaos._score([crash], Audit())
    assert crash.api_failed == 60, crash  # every 503 probe, none taken as answered
    assert abs(crash.api_resume_s - 15.25) < 0.3, crash  # from the crash to the first 2xx
    assert crash.api_500 == 0  # a 503 is the honest outage answer: not the "other 5xx" note
    assert totals([crash], Audit())["max_resume_s"] == crash.api_resume_s
    assert re.search(r"max resume 15\.[23] s$", closing_line([crash], Audit()))


def test_the_quorum_fault_kills_the_plans_leader_and_one_more() -> None:
    """`nats-quorum` takes 2 of 3 nodes, the plans' stream leader among them: no stream keeps a quorum."""
    from chaos_outages import quorum_victims

    class Node:
        def __init__(self, name: str) -> None:
            self.name = name

    class Cluster:
        def __init__(self) -> None:
            self.nodes = [Node("n1"), Node("n2"), Node("n3")]

        def node(self, name: str) -> Node:
            return next(n for n in self.nodes if n.name == name)

    victims = [n.name for n in quorum_victims(Cluster(), "n3")]  # type: ignore[arg-type]
    assert victims[0] == "n3" and len(set(victims)) == 2
    assert len(quorum_victims(Cluster(), None)) == 2  # type: ignore[arg-type]
