"""The recovery path of `make chaos`, CI-sized: the whole loop as separate processes survives a NATS restart,
a router SIGKILL and a gateway SIGKILL with nothing lost, duplicated, stuck or misrouted (requests through the
gateway included).

Before the fix, the placement service's expert-load consumer (an ordered consumer created by start time)
was never recreated after a NATS restart (nats-py kept the start time next to a start sequence, the server
refused it), so placement planned from a frozen window for ever: the harness reports it as stuck.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/ holds scripts, not a package
from chaos import Chaos, ChaosOptions, totals

pytestmark = pytest.mark.slow


async def test_nats_restart_and_router_kill_lose_nothing(tmp_path: Path) -> None:
    options = ChaosOptions(
        faults=("nats", "router", "gateway"),
        fault_s=11.0,  # the last third (from ~7 s after the fault) must see placement folding windows again
        settle_s=3.0,
        retry_after_s=8.0,
        stuck_after_s=20.0,
        database="sqlite",
        workdir=tmp_path,
    )
    results, audit = await Chaos(options).run()
    by_fault = {r.name: r for r in results}
    assert list(by_fault) == ["nats", "router", "gateway"]
    logs = tmp_path / "logs"
    for r in results:
        assert r.sent > 0 and r.probes > 0 and r.gw_sent > 0, r  # both loads and the probes ran through the fault
        assert (r.lost, r.gw_lost, r.lost_rows, r.duplicated, r.stuck, r.misrouted) == (0, 0, 0, 0, 0, 0), (r, logs)
        assert r.resumed, r  # routing came back within the fault's window
    assert by_fault["router"].probe_failures > 0  # the fault did bite: routing was down for a while
    assert by_fault["router"].gw_failed == 0  # the gateway chose locally while the router was away
    assert by_fault["gateway"].gw_failed > 0  # clients saw the gateway go, and their retries all got through
    assert audit.layout_mismatches == []
    assert totals(results, audit)["lost"] == 0
