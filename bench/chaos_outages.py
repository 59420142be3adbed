"""Two long outages for `make chaos` (issue 37): a NATS cluster that loses its quorum, and PostgreSQL down long.

- `nats-quorum` (with `--nats-cluster 3`): SIGKILL two of the three nodes (the plans' stream leader and one
  other), so no stream or KV bucket has a quorum: nothing can be stored, no lease renewed, while core NATS
  routing on the survivor goes on. Both come back after `--node-down-s` on their ports and stores.
- `postgres-long`: crash PostgreSQL (`pg_ctl -m immediate`) and leave it down `--pg-down-s` (60 s): longer
  than every retry window in the services (the API answers 503, migration and placement wait), then start it.

Each fault's window in `bench/chaos.py` runs `--fault-s` past the recovery, so the closing table says what was
lost, duplicated, stuck or misrouted across the outage and the catch-up after it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class _Node(Protocol):
    name: str

    def kill(self) -> None: ...
    def start(self, timeout: float = 15.0) -> str: ...


class _Cluster(Protocol):
    nodes: list  # the cluster's ClusterNode list

    def node(self, name: str) -> _Node: ...
    def wait_healthy(self, timeout: float = 30.0) -> float: ...


class _Postgres(Protocol):
    def crash(self) -> None: ...
    def start(self) -> None: ...


def quorum_victims(cluster: _Cluster, leader: str | None) -> list[_Node]:
    """Two nodes of three: the plans' stream leader (when known) and the next one, so the stream and every
    R3 bucket lose their quorum."""
    first = cluster.node(leader) if leader else cluster.nodes[0]
    other = next(n for n in cluster.nodes if n.name != first.name)
    return [first, other]


async def kill_quorum(cluster: _Cluster | None, leader: str | None, down_s: float) -> str:
    """SIGKILL two of three nodes, leave them down `down_s`, restart both; the fault's note."""
    if cluster is None or len(cluster.nodes) < 3:
        raise SystemExit("chaos: the nats-quorum fault needs --nats-cluster 3 (or more)")
    victims = quorum_victims(cluster, leader)
    killed = time.monotonic()
    for node in victims:
        await asyncio.to_thread(node.kill)
    await asyncio.sleep(down_s)
    for node in victims:
        await asyncio.to_thread(node.start)
    await asyncio.to_thread(cluster.wait_healthy, 120.0)
    names = " and ".join(n.name for n in victims)
    return (
        f"SIGKILL of {names} of {len(cluster.nodes)} (no quorum: the plans' stream leader among them), down "
        f"{down_s:.0f} s, restarted on their ports and stores; all nodes current {time.monotonic() - killed:.1f} s "
        "after the kill"
    )


async def postgres_outage(pg: _Postgres | None, down_s: float) -> str:
    """Crash PostgreSQL, leave it down `down_s`, start it again; the fault's note."""
    if pg is None:
        raise SystemExit("chaos: the postgres-long fault needs PostgreSQL (--database postgres)")
    await asyncio.to_thread(pg.crash)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(pg.start)
    return f"crashed (immediate), down {down_s:.0f} s, restarted"
