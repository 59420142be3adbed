"""The faults of `make chaos` (`bench/chaos.py`): what each one does to the loop and how it is undone.

`Faults` is mixed into `chaos.Chaos` and works on its state (processes, buses, credentials, the running
attack's `_attack`): `_inject(fault)` returns the fault's note, `_after(fault)` undoes it and returns what to add
to the note and the fault's own counts. Issue 37's attacks on the gateways are `chaos_attacks.py`'s, the long
outages `chaos_outages.py`'s. The fleet's extra engines are named here too: the ghost decoder (a process of
its own, `run_ghost`, so that SIGKILL makes it vanish for real), the HTTP stub engines and the attacker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from chaos_attacks import NAMED_FAULTS, QUICK_FAULTS
from chaos_outages import kill_quorum, postgres_outage

SERVICE_FAULTS = ("router", "placement", "migration", "api")
#: Issue 29: the production shape's own faults (an active migration replica killed mid-migration, an engine
#: credential claiming another role, one engine flooding its own expert-load subject into the stream).
ATTACK_FAULTS = ("migration-active", "role-claim", "stream-flood")
#: Issue 37's attacks on the gateways (`chaos_attacks.py`): a hostile engine's answers, a lying KV claim (quick,
#: in the default set); a KV-event flood and a leaked replica's decision flood (named only: each keeps a core busy).
FAULTS = (*SERVICE_FAULTS, "gateway", "nats", "postgres", "engine-vanish", "slow-engine", *ATTACK_FAULTS, *QUICK_FAULTS)
#: Faults run only when asked for (`--faults flood`): issue 15 finding 3, near-limit payloads on the engines'
#: wildcard subjects.
#: `nats-node` (with --nats-cluster): SIGKILL the cluster node leading the plans' stream, restart it after
#: `--node-down-s` (issue 28: a NATS cluster loses one node under load and nothing stored is lost).
#: `nats-quorum` and `postgres-long` (issue 37): 2 of 3 NATS nodes killed, PostgreSQL down --pg-down-s.
EXTRA_FAULTS = ("flood", "nats-node", "nats-quorum", "postgres-long", *NAMED_FAULTS)
#: Faults that need the gateway (its load, its engines).
GATEWAY_FAULTS = ("gateway", "role-claim", *QUICK_FAULTS, *NAMED_FAULTS)

GHOST = "ghost-d0"
GHOST_MODEL = "deepseek-v2-lite"
#: Stub engines (engine_agents/stub.py) behind the gateway: its load goes gateway -> router -> engine over HTTP.
HTTP_ENGINES = ("http-e0", "http-e1")
STUB_MODEL = "stub-model"
#: An engine with valid credentials of its own (`engine-attacker`) and no place in the engine manifest: it claims
#: roles (`role-claim`) and floods its expert-load subject (`stream-flood`, `flood`).
ATTACKER = "attacker"
#: The migration lease's TTL (the services' default): a standby takes a lapsed group over after at most this.
MIGRATION_LEASE_TTL_S = 10.0
#: The stream flood stops after this many bytes even if its window is not over (the store is on this disk).
STREAM_FLOOD_CAP_BYTES = 2 << 30
#: A migration's final states: one in none of them after `stuck_after_s` is stuck.
FINAL = ("succeeded", "failed", "rolled_back", "refused")


def gateway_user_of(process: str) -> str:
    """The NATS user of the gateway process `process` (`gateway`, `gateway-2`, ...)."""
    from switchyard.shared.nats_auth import gateway_user

    replica = 1 if process == "gateway" else int(process.rsplit("-", 1)[1])
    return gateway_user(gateway_id(replica))


def gateway_id(replica: int) -> str:
    """Gateway replica `replica`'s id (1-based): its NATS user is `gateway-<id>`, its decisions'
    subject `sy.route.decided.gateway.<id>`."""
    return f"g{replica}"


class Faults:
    """The fault half of `chaos.Chaos` (a mixin: it reads and writes the harness's state)."""

    async def _restart(self, name: str) -> None:
        proc = self.procs[name]
        await asyncio.to_thread(proc.kill)
        proc.start()  # not waited for: the probes measure when it answers again

    async def _lease_holders(self, kind: str) -> dict[str, str]:
        """Group -> the replica id holding `kind`'s lease of it, as the leases bucket says now."""
        holders: dict[str, str] = {}
        try:
            kv = await self.bus.js.key_value(self.bus.subjects.lease_bucket)
            keys = await kv.keys()
        except Exception:  # no bucket or no key yet
            return holders
        for key in keys:
            if key.startswith(f"{kind}."):
                with contextlib.suppress(Exception):
                    entry = await kv.get(key)
                    if entry.value:
                        holders[key.removeprefix(f"{kind}.")] = entry.value.decode()
        return holders

    async def _active(self, kind: str, wait_s: float = 6.0) -> tuple[str, str]:
        """The replica of `kind` ("placement", "migration") holding the most group leases: (process, why).

        A migration replica holds a group's lease while it migrates the group, so this waits (up to `wait_s`)
        for one to be held."""
        deadline = time.monotonic() + wait_s
        while True:
            holders = await self._lease_holders(kind)
            counts = Counter(self.replica_proc[owner] for owner in holders.values() if owner in self.replica_proc)
            if counts or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        if not counts:
            return kind, f"no {kind} lease held for {wait_s:.0f} s, the first replica"
        name, n = counts.most_common(1)[0]
        return name, f"{name}, holding {n} of {len(holders)} group leases"

    async def _raw(self, role: str, name: str) -> object:
        """A plain nats-py connection as `role` (what a holder of those credentials would use)."""
        import nats

        from switchyard.shared.nats_auth import inbox_prefix

        async def ignore(_exc: Exception) -> None:
            pass

        creds = self.credentials.users[role]
        return await nats.connect(
            self.nats_urls,
            name=name,
            user=creds["user"],
            password=creds["password"],
            inbox_prefix=inbox_prefix(creds["user"]),
            max_reconnect_attempts=-1,
            error_cb=ignore,
        )

    async def _inject(self, fault: str) -> str:
        if fault == "router":
            await self._restart("router")
            spares = self.o.router_replicas - 1
            return f"SIGKILL of one router ({spares} more replica(s) running), restarted at once"
        if fault in ("placement", "migration"):
            name, why = await self._active(fault)
            await self._restart(name)
            return f"SIGKILL of the active replica ({why}), restarted at once"
        if fault == "gateway":
            await self._restart("gateway")
            return (
                f"SIGKILL of gateway 1 of {len(self.gateway_urls)} ({self.o.gateway_router}; the load goes round "
                "robin), restarted at once"
            )
        if fault == "api":
            await self._restart("api")
            return "SIGKILL, restarted at once"
        if fault == "nats":
            for node in self.nats_nodes:
                await asyncio.to_thread(node.stop)
            await asyncio.sleep(1.0)
            for node in self.nats_nodes:
                await asyncio.to_thread(node.start)
            if self.cluster is not None:
                await asyncio.to_thread(self.cluster.wait_healthy, 60.0)
            return "stopped 1 s, restarted (same port, same JetStream store)" + (
                f" (all {len(self.nats_nodes)} nodes)" if self.cluster is not None else ""
            )
        if fault == "nats-node":
            return await self._kill_nats_node()
        if fault in ("nats-quorum", "postgres-long"):
            return await self._long_outage(fault)
        if fault == "postgres":
            assert self.pg is not None
            await asyncio.to_thread(self.pg.crash)
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.pg.start)
            return "crashed (immediate), down 2 s, restarted"
        if fault == "flood":
            self._attack["log_offset"] = self._server_log_size()
            self._attack["flood"] = asyncio.create_task(self._flood(max(self.o.fault_s - 3.0, 1.0)))
            return f"payloads of {self.bus.max_payload - 512} bytes on engine-{ATTACKER}'s hello and telemetry"
        if fault == "migration-active":
            return await self._kill_active_migration()
        if fault == "role-claim":
            return await self._claim_roles()
        if fault == "stream-flood":
            return await self._start_stream_flood()
        if fault in QUICK_FAULTS or fault in NAMED_FAULTS:
            return await self.attacks.inject(fault)
        ghost = self.procs[GHOST]
        if fault == "engine-vanish":
            await asyncio.to_thread(ghost.kill)
            return "ghost decoder SIGKILLed (no goodbye)"
        if fault == "slow-engine":
            ghost.argv = self._ghost_argv(late_s=1.5)
            ghost.start()
            return "ghost decoder back, telemetry every 1.5 s (limit 1 s)"
        raise ValueError(f"unknown fault {fault!r}")

    async def _long_outage(self, fault: str) -> str:
        """`nats-quorum` or `postgres-long` (bench/chaos_outages.py); the window runs `fault_s` past recovery."""
        if fault == "nats-quorum":
            leader = None
            if self.cluster is not None:
                info = await self.bus.js.stream_info(self.bus.subjects.placement_stream)
                leader = info.cluster.leader if info.cluster is not None else None
            note = await kill_quorum(self.cluster, leader, self.o.node_down_s)
        else:
            note = await postgres_outage(self.pg, self.o.pg_down_s)
        self._attack["until"] = time.time() + self.o.fault_s
        return note

    async def _after(self, fault: str) -> tuple[str, dict[str, int]]:
        """Undo the fault; returns what to add to its note, and the fault's own counts (FaultResult fields)."""
        attack, self._attack = self._attack, {}
        if fault == "slow-engine":
            await asyncio.to_thread(self.procs[GHOST].kill)
        if fault == "flood":
            started = time.time()
            sent = await attack["flood"]  # type: ignore[misc]
            cut_off = self._cut_offs(attack["log_offset"])  # type: ignore[arg-type]
            who = ", ".join(f"{name} {n}" for name, n in cut_off.most_common()) or "none"
            note = f"; {sent} flood messages; slow-consumer cut-offs: {who}"
            if cut_off["chaos-watch"]:  # this script missed telemetry the router saw: it cannot judge misrouting
                self.blind.append((started - self.o.fault_s, time.time()))
                note += "; this script's telemetry watch was cut off too"
            return note, {}
        if fault == "migration-active":
            return await self._after_migration_kill(attack)
        if fault == "role-claim":
            return await self._after_role_claim(attack)
        if fault == "stream-flood":
            return await self._after_stream_flood(attack)
        if fault in QUICK_FAULTS or fault in NAMED_FAULTS:
            return await self.attacks.after(fault)
        return "", {}

    def _server_log_size(self) -> int:
        path = self.nats_nodes[0].log_path
        return path.stat().st_size if path.exists() else 0

    def _server_log_since(self, offset: int, node: int = 0) -> list[str]:
        """Node `node`'s log from `offset` (the flood's cut-offs: the first node's; on a cluster, clients on the
        other nodes are cut off in their logs)."""
        with self.nats_nodes[node].log_path.open("rb") as server_log:
            server_log.seek(offset)
            return server_log.read().decode(errors="replace").splitlines()

    async def _kill_nats_node(self) -> str:
        """SIGKILL the cluster node leading the plans' stream, leave it down `node_down_s`, restart it on its port
        and store; the note says which node it was and when the cluster was current again."""
        if self.cluster is None:
            raise SystemExit("chaos: the nats-node fault needs --nats-cluster N (N >= 3)")
        info = await self.bus.js.stream_info(self.bus.subjects.placement_stream)
        leader = info.cluster.leader if info.cluster is not None else None
        victim = self.cluster.node(leader) if leader else self.cluster.nodes[0]
        meta = await asyncio.to_thread(self.cluster.meta_leader)
        killed = time.monotonic()
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(self.o.node_down_s)
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(self.cluster.wait_healthy, 60.0)
        role = "also the meta leader" if meta == victim.name else f"meta leader {meta}"
        return (
            f"SIGKILL of {victim.name} of {len(self.cluster.nodes)} (leader of the plans' stream, "
            f"R{info.config.num_replicas}; {role}), down "
            f"{self.o.node_down_s:.0f} s, restarted on its port and store; all nodes current "
            f"{time.monotonic() - killed:.1f} s after the kill"
        )

    def _cut_offs(self, offset: int) -> Counter[str]:
        """nats-server's slow-consumer cut-offs since `offset` of its log, by client connection name."""
        cut_off: Counter[str] = Counter()
        for line in self._server_log_since(offset):
            if "Slow Consumer" in line:
                name = line.split('"')[1].rsplit(":", 1)[-1] if line.count('"') >= 2 else "unnamed"
                cut_off[name] += 1
        return cut_off

    async def _flood(self, seconds: float) -> int:
        """Near-limit garbage on the attacker's own hello and telemetry (the wildcard subjects every service
        ingests; its credentials allow nothing else) for `seconds`; returns the messages sent."""
        from switchyard.shared.nats_auth import engine_user

        nc = await self._raw(engine_user(ATTACKER), "chaos-flood")
        payload = bytes(self.bus.max_payload - 512)  # not msgpack: refused by size before anything is read
        s = self.bus.subjects
        subjects = [s.hello(ATTACKER), s.telemetry(ATTACKER)]
        sent = 0
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                await nc.publish(subjects[sent % len(subjects)], payload)  # type: ignore[attr-defined]
                sent += 1
                if sent % 4 == 0:  # keep the client's own buffer bounded: the server takes what it can
                    with contextlib.suppress(Exception):
                        await nc.flush(timeout=5)  # type: ignore[attr-defined]
        finally:
            with contextlib.suppress(Exception):
                await nc.close()  # type: ignore[attr-defined]
        return sent

    # migration-active: the replica holding a running migration's group lease is SIGKILLed; the standby must
    # take the group over (after the lease's TTL at most) and finish the migration.

    async def _kill_active_migration(self) -> str:
        from sqlalchemy import select

        from switchyard.shared.db import Migration, create_async_db

        engine, sessions = create_async_db(self.database_url)
        self._attack["db"] = engine
        deadline = time.time() + max(self.o.fault_s, 15.0)  # placement plans every 6 s: one comes
        while time.time() < deadline:
            rows: list[tuple[int, str, str]] = []
            with contextlib.suppress(Exception):
                async with sessions() as session:
                    query = (
                        select(Migration.id, Migration.engine_group, Migration.state)
                        .where(Migration.state.in_(("pending", "running")))
                        .order_by(Migration.id.desc())
                    )
                    rows = [tuple(row) for row in (await session.execute(query)).all()]  # type: ignore[misc]
            holders = await self._lease_holders("migration") if rows else {}
            for migration_id, group, state in rows:
                name = self.replica_proc.get(holders.get(group, ""))
                if name is None or not self.procs[name].alive():
                    continue
                await asyncio.to_thread(self.procs[name].kill)
                killed = time.time()
                self._attack.update(migration=migration_id, group=group, killed=name, at=killed)
                # The window lasts until the lease has lapsed and the standby has had time to finish.
                self._attack["until"] = killed + MIGRATION_LEASE_TTL_S + self.o.fault_s / 2
                self._attack["watch"] = asyncio.create_task(self._watch_migration(migration_id, sessions, self._attack))
                return (
                    f"SIGKILL of {name} (holding group {group}'s lease) while migration {migration_id} was {state}; "
                    "not restarted in the window"
                )
            await asyncio.sleep(0.1)
        return "no migration ran in the window: nothing killed"

    async def _watch_migration(self, migration_id: int, sessions: object, into: dict[str, object]) -> None:
        """Record in `into` when the migration reaches a final state (polled every 0.25 s)."""
        from sqlalchemy import select

        from switchyard.shared.db import Migration

        while True:
            with contextlib.suppress(Exception):
                async with sessions() as session:  # type: ignore[operator]
                    state = await session.scalar(select(Migration.state).where(Migration.id == migration_id))
                into["state"] = state
                if state in FINAL:
                    into["finished"] = time.time()
                    return
            await asyncio.sleep(0.25)

    async def _after_migration_kill(self, attack: dict[str, object]) -> tuple[str, dict[str, int]]:
        watch = attack.get("watch")
        if isinstance(watch, asyncio.Task):
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        counts: dict[str, int] = {}
        note = ""
        if "killed" in attack:
            killed_at = float(attack["at"])  # type: ignore[arg-type]
            if "finished" in attack:
                took = float(attack["finished"]) - killed_at  # type: ignore[arg-type]
                note = f"; migration {attack['migration']} {attack['state']} {took:.1f} s after the kill"
            else:
                waited = time.time() - killed_at
                note = (
                    f"; migration {attack['migration']} still {attack.get('state', '?')} {waited:.1f} s after the kill "
                    f"(lease TTL {MIGRATION_LEASE_TTL_S:.0f} s): the standby did not finish it (stuck)"
                )
                counts["extra_stuck"] = 1
            self.procs[str(attack["killed"])].start()  # back to two replicas for what follows
            note += f"; {attack['killed']} restarted after the window"
        engine = attack.get("db")
        if engine is not None:
            await engine.dispose()  # type: ignore[attr-defined]
        return note, counts

    # role-claim: the attacker's credentials (a valid engine user, not in the manifest) announce it as a DP engine,
    # then as a prefill engine, with the base URL of an HTTP server this process runs.

    async def _claim_roles(self) -> str:
        from switchyard.engine_agents.stub import StubConfig, StubEngine
        from switchyard.shared.bus import Bus
        from switchyard.shared.nats_auth import engine_user

        role = engine_user(ATTACKER)
        bus = await Bus.connect(self.role_settings(role), name=ATTACKER, role=role)
        config = StubConfig(engine_id=ATTACKER, role="dp", model=STUB_MODEL, tokens=8, token_interval_s=0.01)
        stub = StubEngine(config, bus)
        await stub.start(0)
        self._attack.update(stub=stub, bus=bus)
        self._attack["flip"] = asyncio.create_task(self._flip_role(stub, self._attack))
        return (
            f"engine-{ATTACKER} (valid credentials, not in the manifest) says hello as role dp with base_url "
            f"{stub.base_url} (this process's server), then as prefill"
        )

    async def _flip_role(self, stub: object, into: dict[str, object]) -> None:
        half = max((self.o.fault_s - 1.0) / 2, 1.0)
        await asyncio.sleep(half)
        into["as_dp"] = len(stub.received)  # type: ignore[attr-defined]
        stub.config.role = "prefill"  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):  # at once, not at its next hello
            await stub.bus.publish(stub.bus.subjects.hello(ATTACKER), stub.hello())  # type: ignore[attr-defined]
        await asyncio.sleep(max(half - 3.5, 0.5))
        stub.saying_hello = False  # type: ignore[attr-defined]  # it keeps serving what the gateways still send

    async def _after_role_claim(self, attack: dict[str, object]) -> tuple[str, dict[str, int]]:
        flip, stub, bus = attack["flip"], attack["stub"], attack["bus"]
        flip.cancel()  # type: ignore[attr-defined]
        await asyncio.gather(flip, return_exceptions=True)  # type: ignore[arg-type]
        await stub.stop()  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            await bus.close()  # type: ignore[attr-defined]
        hits = len(stub.received)  # type: ignore[attr-defined]
        as_dp = int(attack.get("as_dp", hits))  # type: ignore[call-overload]
        note = (
            f"; {hits} client requests reached the attacker's server ({as_dp} while it claimed dp, "
            f"{hits - as_dp} after it claimed prefill): counted as misrouted"
        )
        return note, {"hijacked": hits}

    # stream-flood: the attacker's credentials flood its own expert-load subject (captured by the stream).

    async def _start_stream_flood(self) -> str:
        s = self.bus.subjects
        stream = s.expert_load_stream
        before = await self.bus.js.stream_info(stream)
        latest: dict[str, int] = {}
        for engine_id in [*self.fleet_ids, GHOST]:
            with contextlib.suppress(Exception):
                latest[engine_id] = (await self.bus.js.get_last_msg(stream, s.expert_load(engine_id))).seq
        self._attack.update(before=before.state, latest=latest, log_offset=self._server_log_size())
        self._attack["flood"] = asyncio.create_task(self._stream_flood(max(self.o.fault_s - 3.0, 1.0)))
        size = self.bus.max_payload - 512
        return f"engine-{ATTACKER}'s credentials: {size}-byte payloads on its own {s.expert_load(ATTACKER)}"

    async def _stream_flood(self, seconds: float) -> tuple[int, int]:
        """(messages, bytes) sent on the attacker's expert-load subject for `seconds` (or up to the cap)."""
        from switchyard.shared.nats_auth import engine_user

        nc = await self._raw(engine_user(ATTACKER), "chaos-stream-flood")
        payload = bytes(self.bus.max_payload - 512)
        subject = self.bus.subjects.expert_load(ATTACKER)
        sent = 0
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and sent * len(payload) < STREAM_FLOOD_CAP_BYTES:
                await nc.publish(subject, payload)  # type: ignore[attr-defined]
                sent += 1
                if sent % 2 == 0:
                    with contextlib.suppress(Exception):
                        await nc.flush(timeout=5)  # type: ignore[attr-defined]
        finally:
            with contextlib.suppress(Exception):
                await nc.close()  # type: ignore[attr-defined]
        return sent, sent * len(payload)

    async def _after_stream_flood(self, attack: dict[str, object]) -> tuple[str, dict[str, int]]:
        sent, sent_bytes = await attack["flood"]  # type: ignore[misc]
        s = self.bus.subjects
        stream = s.expert_load_stream
        before = attack["before"]
        after = (await self.bus.js.stream_info(stream)).state
        latest: dict[str, int] = attack["latest"]  # type: ignore[assignment]
        evicted = []
        for engine_id, seq in latest.items():
            try:
                await self.bus.js.get_msg(stream, seq)
            except Exception:  # the window it had before the flood is gone: was anything newer kept?
                evicted.append(engine_id)
        cut_off = self._cut_offs(attack["log_offset"])  # type: ignore[arg-type]
        who = ", ".join(f"{name} {n}" for name, n in cut_off.most_common()) or "none"
        mib = 1 << 20
        note = (
            f"; {sent} messages ({sent_bytes / mib:.0f} MiB) sent; {stream}: {before.bytes / mib:.1f} MiB, "  # type: ignore[attr-defined]
            f"{before.messages} msgs before, {after.bytes / mib:.1f} MiB, {after.messages} msgs after; "  # type: ignore[attr-defined]
            f"other engines' latest windows kept: {len(latest) - len(evicted)} of {len(latest)}"
            + (f" (evicted: {', '.join(evicted)}; counted as lost)" if evicted else "")
            + f"; slow-consumer cut-offs: {who}"
        )
        return note, {"extra_lost": len(evicted)}

    def _enabled(self) -> list[str]:
        enabled = []
        for fault in self.o.faults:
            if fault in GATEWAY_FAULTS and "gateway" not in self.procs:
                self.notes.append(f"{fault} fault skipped: switchyard.services.gateway is not installed")
            elif fault in ("postgres", "postgres-long") and self.pg is None:
                continue
            else:
                enabled.append(fault)
        return enabled


# ----- the ghost decoder (a process of its own, so that SIGKILL makes it vanish for real) -----


async def run_ghost(nats_url: str, engine_id: str, late_s: float | None) -> None:
    from switchyard.engine_agents.core import EngineAgent
    from switchyard.shared.bus import Bus
    from switchyard.shared.nats_auth import engine_user
    from switchyard.shared.schemas import Capacity, Hello, ModelShape
    from switchyard.shared.settings import SwitchyardSettings

    settings = SwitchyardSettings(nats_servers=nats_url.split(","))  # credentials: SWITCHYARD_NATS_CREDENTIALS
    bus = await Bus.connect(settings, name=engine_id, role=engine_user(engine_id))
    hello = Hello(
        engine_id=engine_id,
        role="decode",
        model=ModelShape(name=GHOST_MODEL, num_layers=26, num_experts=64, top_k=6),
        ep_group=engine_id,
        gpus=[f"{engine_id}-gpu0", f"{engine_id}-gpu1"],
        capacity=Capacity(max_running=256, kv_blocks=4096, block_size=16),
        ts=time.time(),
        agent="sim",
        agent_version="chaos-ghost",
        hello_interval_s=5.0,
        telemetry_interval_s=0.1,
    )
    idle = {
        "kv_usage": 0.0,
        "num_running": 0,
        "num_waiting": 0,
        "waiting_prefill_tokens": 0,
        "remaining_prefill_tokens": 0,
        "step_time_ema": 0.02,
    }
    agent = EngineAgent(bus, hello, lambda: idle)
    if late_s:  # announces 100 ms telemetry, sends it every `late_s`
        agent.hello = hello.model_copy(update={"telemetry_interval_s": late_s})
        agent.say_hello = _announce_fast(agent, hello)  # type: ignore[method-assign]
    await agent.start()
    await asyncio.Event().wait()


def _announce_fast(agent: object, hello: object):
    from switchyard.shared.schemas import Hello

    async def say_hello() -> None:
        assert isinstance(hello, Hello)
        bus = agent.bus  # type: ignore[attr-defined]
        await bus.publish(bus.subjects.hello(hello.engine_id), hello.model_copy(update={"ts": time.time()}))

    return say_hello
