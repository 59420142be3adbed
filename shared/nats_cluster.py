"""A JetStream cluster of N nats-servers on loopback, from the shipped binary, for tests and `make chaos`.

Why: a single server is a single point of failure for every plan, migration step and routing sample; with
`SWITCHYARD_STREAM_REPLICAS=3` on a 3-node cluster, losing one node must lose nothing. Checking that needs a
real cluster that a test can build in a second and whose nodes it can kill (SIGKILL, no goodbye) and restart
on the same ports and store, which is what this gives: each node an `EmbeddedNats` with its own store,
client port, route port and monitoring port, all nodes routed to each other under one cluster name.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from switchyard.shared.embedded import EmbeddedNats, free_port

HOST = "127.0.0.1"


class ClusterNode(EmbeddedNats):
    """One node: an `EmbeddedNats` with a server name, cluster routes and a monitoring port."""

    def __init__(self, store_dir: Path, name: str, route_port: int, monitor_port: int, **kwargs: object) -> None:
        super().__init__(store_dir, **kwargs)  # type: ignore[arg-type]
        self.name, self.route_port, self.monitor_port = name, route_port, monitor_port

    def kill(self) -> None:
        """SIGKILL: the node vanishes mid-write, as a crashed machine would (no leadership hand-off)."""
        process = self.process
        self.process = None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def jsz(self) -> dict[str, object]:
        """The node's JetStream report (`/jsz`): its view of the meta leader and cluster."""
        with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/jsz", timeout=2) as answer:
            return json.loads(answer.read())

    def healthy(self) -> bool:
        """Whether the node's JetStream is current with the cluster (`/healthz`, 200 only then)."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/healthz", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False


class NatsCluster:
    """`nodes` JetStream servers routed into one cluster; `urls` lists every client URL (give clients all)."""

    def __init__(self, root: Path, nodes: int = 3, *, name: str = "switchyard", extra_config: str = "") -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        root = Path(root)
        ports = [(free_port(HOST), free_port(HOST), free_port(HOST)) for _ in range(nodes)]
        routes = ", ".join(f"nats://{HOST}:{route}" for _, route, _ in ports)
        self.name = name
        self.nodes: list[ClusterNode] = []
        for i, (client, route, monitor) in enumerate(ports):
            node_name = f"n{i + 1}"
            block = (
                f"server_name: {node_name}\n"
                f"http: {HOST}:{monitor}\n"
                f"cluster {{\n  name: {name}\n  listen: {HOST}:{route}\n  routes: [{routes}]\n}}\n"
            )
            self.nodes.append(
                ClusterNode(root / node_name, node_name, route, monitor, port=client, extra_config=block + extra_config)
            )

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self, timeout: float = 30.0) -> list[str]:
        """Start every node, then wait until JetStream has a meta leader and every node is current."""
        for node in self.nodes:
            node.start()
        self.wait_healthy(timeout)
        return self.urls

    def wait_healthy(self, timeout: float = 30.0) -> float:
        """Seconds until every running node reports JetStream current and one meta leader is known."""
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            running = [node for node in self.nodes if node.running]
            if running and all(node.healthy() for node in running) and self.meta_leader() is not None:
                return time.monotonic() - began
            time.sleep(0.1)
        raise RuntimeError(f"NATS cluster {self.name} not healthy after {timeout:.0f} s")

    def meta_leader(self) -> str | None:
        """The JetStream meta leader's server name, as a running node reports it."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                cluster = node.jsz().get("meta_cluster") or {}
            except OSError:
                continue
            leader = cluster.get("leader") if isinstance(cluster, dict) else None
            if leader:
                return str(leader)
        return None

    def node(self, name: str) -> ClusterNode:
        return next(node for node in self.nodes if node.name == name)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
