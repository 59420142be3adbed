"""Issue 37's attacks for `make chaos`: what one engine credential, or one leaked gateway-replica password, can do
to the gateways' honest load. `bench/chaos_faults.py` only wires them in (`Attacks.inject` / `Attacks.after`).

- `engine-bigbody`, `engine-hugeheader` (in the default set): a manifest-listed DP engine (`hostile-bigbody`,
  `hostile-hugeheader`: valid credentials and a place in the fleet, as a compromised engine has) answers every
  completion with `content-length: 2^30` and junk, or with a header that never ends (`chaos_hostile_engines.py`).
  Started when the fault begins, stopped when it ends. Each hop that reaches it must fail at its bound, be retried
  on an honest engine, and eject it; the note gives the hops it got and the most bytes it wrote on one.
- `kv-claim` (in the default set): `http-e0`'s credential publishes one `KvEvents` claiming the 63 blocks of a
  1,024-token prefix it never held (the issue's lie: it drew 60 of 60 requests sharing the prefix). 60 requests
  with that prompt go through the gateways before the claim (the control) and 60 after; the note says how many
  `http-e0` served each time.
- `kv-flood` (only when named): `http-e1`'s credential publishes 8,192-key `KvEvents` batches on its own subject as
  fast as one client (a process of its own) can, for the window less 3 s; the note counts the honest attempts
  answered 503, the gateways' view of live DP engines and stale engines during the flood, and nats-server's
  slow-consumer cut-offs.
- `decision-flood` (only when named): with `gateway-g2`'s password (a second connection beside the real g2),
  4,096-entry `RouteDecisions` batches naming `http-e0` with 10^6 prompt tokens each, on g2's own decided subject,
  as fast as one client can, for the window less 3 s, after a 5 s control inside the window; the note gives g1's
  split (its answers' share served by `http-e0`) in the control and under the flood, and what g1 dropped.

What counts as misrouted (the table's column):

- hostile engines: a client answer (200) not served by an honest engine (`served_by` of the stub's answer is
  not `http-e0`/`http-e1`). A hop the gateway cut and retried elsewhere served nobody: it is in the note;
- `kv-claim`: the requests `http-e0` served after the claim beyond its share, where its share is the larger of
  its count in the control and an even split (60 / live DP engines), plus the requests the fix lets ride on an
  unconfirmed claim before the first answer refutes it (`prefix_confirm_probes` per gateway);
- the floods: a client answer not served by an honest engine (their harm shows as failed attempts, 503s, stale
  engines and skew, all in the note).

Every one of these faults also records each gateway process's RSS (`/proc/<pid>/status` VmRSS, sampled every
0.25 s for the whole run) at the injection, its peak during the window and at the end, its VmHWM (the kernel's
peak) at the injection and at the end, and its CPU share over the 3 s before the injection and during the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from chaos_hostile_engines import HostileAgent, HostileServer, manifest_entry, start_hostile, stop_hostile

#: Quick (one 12 s window each, no process saturating a core): in `make chaos`'s default set.
QUICK_FAULTS = ("engine-bigbody", "engine-hugeheader", "kv-claim")
#: Floods that keep a core busy for the window: run only when named, as `flood` is.
NAMED_FAULTS = ("kv-flood", "decision-flood")
FAULTS = (*QUICK_FAULTS, *NAMED_FAULTS)
#: fault -> (the hostile engine's id, its server's mode).
HOSTILE = {"engine-bigbody": ("hostile-bigbody", "bigbody"), "engine-hugeheader": ("hostile-hugeheader", "hugeheader")}
HOSTILE_ENGINES = tuple(engine_id for engine_id, _ in HOSTILE.values())
#: The honest DP engines whose credentials lie (kv-claim) and flood (kv-flood); the target of decision-flood.
CLAIMANT, FLOODER = "http-e0", "http-e1"
#: The gateway replica whose password leaked (decision-flood); gateway index 0 (`g1`) is the one watched.
LEAKED_REPLICA = "g2"
#: The stub engines' hello: 16-token blocks (`engine_agents/stub.py`).
STUB_BLOCK = 16
#: A 1,024-token prompt (64 blocks of 16) of token ids, so the gateway keys it exactly without a tokenizer.
PREFIX = (np.arange(1024) * 7 + 11) % 30_000 + 100
CLAIMED_BLOCKS = 63
PREFIX_REQUESTS = 60
PREFIX_CONCURRENCY = 6
#: How far from even pressure routing may leave one burst's split with nothing cached: about half the burst's
#: concurrency (the requests in flight when it ends). The two controls show the noise of each run.
SPLIT_SLACK = PREFIX_CONCURRENCY // 2
#: decision-flood: seconds of honest load inside the window before the flood (the control split).
CONTROL_S = 5.0
PHANTOM_PROMPT_TOKENS = 1_000_000
SAMPLE_S = 0.25
PEER_DROPS = ("switchyard_router_peer_messages_dropped_total{", "switchyard_router_peer_decisions_dropped_total{")

#: One client publishing a file's payload on a subject as fast as it can for N seconds (a process of its own, so
#: the flood is one client's, not this harness's event loop's); prints the messages sent.
FLOOD_SCRIPT = """
import asyncio, sys, time
import nats
from nats.errors import OutboundBufferLimitError

async def main(urls, user, password, subject, path, seconds):
    payload = open(path, "rb").read()
    nc = await nats.connect(urls.split(","), user=user, password=password, inbox_prefix="_INBOX_" + user,
                            name="chaos-" + user + "-flood", max_reconnect_attempts=-1, pending_size=1 << 24)
    end, sent = time.monotonic() + float(seconds), 0
    while time.monotonic() < end:
        try:
            await nc.publish(subject, payload)
            sent += 1
        except OutboundBufferLimitError:  # 16 MiB not yet taken by the server: let the flusher write
            await asyncio.sleep(0.001)
        if sent % 16 == 0:
            await asyncio.sleep(0)
    try:
        await nc.flush(timeout=30)
    finally:
        print(sent, flush=True)
        await nc.close()

asyncio.run(main(*sys.argv[1:7]))
"""


# ----- the gateways' processes and metrics -----


def proc_sample(pid: int) -> tuple[float, float, float] | None:
    """(VmRSS MiB, VmHWM MiB, CPU seconds) of process `pid` now; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = float(fields.get("VmRSS", "0 kB").split()[0]) / 1024
    hwm = float(fields.get("VmHWM", "0 kB").split()[0]) / 1024
    ticks = stat.rsplit(")", 1)[1].split()  # after the command name: state is field 3, utime 14, stime 15
    cpu = (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")
    return rss, hwm, cpu


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as `name{labels}` -> value ({} if it does not answer)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[key] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples carrying every label given."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        value
        for key, value in samples.items()
        if key.split("{", 1)[0] == name and all(label in key for label in wanted)
    )


def served_share(answers: list[tuple[float, int, int | None, str]], engine_id: str) -> tuple[int, int]:
    """(answers served by `engine_id`, answers 200) among `answers`."""
    ok = [served for _, _, status, served in answers if status == 200]
    return sum(served == engine_id for served in ok), len(ok)


def claim_misrouted(after: int, controls: list[int], requests: int, engines: int, allowance: int) -> int:
    """kv-claim's misrouted: what the claimant served after the claim beyond its share (the largest of its control
    counts and an even split) and `allowance` (the requests the fix lets ride on an unconfirmed claim, and the
    noise of one burst's split)."""
    share = max(*controls, -(-requests // max(engines, 1)))
    return max(0, after - share - allowance)


class Attacks:
    """Issue 37's faults on a running `Chaos` harness (`chaos`): its bus, credentials, gateways and load."""

    def __init__(self, chaos: Any, honest: tuple[str, ...], model: str) -> None:
        self.c = chaos
        self.honest, self.model = honest, model
        self.ports: dict[str, int] = {}
        #: gateway process -> [(time, VmRSS MiB, VmHWM MiB, CPU s)], the whole run.
        self.procs: dict[str, list[tuple[float, float, float, float]]] = {}
        self.state: dict[str, Any] = {}

    # ----- wiring: credentials, manifest, sampling -----

    def reserve_ports(self, free_port: Any) -> None:
        self.ports = {engine_id: free_port() for engine_id in HOSTILE_ENGINES}

    def manifest(self) -> dict[str, dict[str, object]]:
        """The hostile engines' manifest entries: listed, as a compromised engine is."""
        return {engine_id: manifest_entry(engine_id, port, self.model) for engine_id, port in self.ports.items()}

    def gateways(self) -> dict[str, str]:
        """Gateway process name -> its URL (the load's order: index 0 is g1)."""
        names = [name for name in self.c.procs if name.split("-")[0] == "gateway"]
        return dict(zip(names, self.c.gateway_urls, strict=False))

    def sampled(self) -> list[str]:
        """The processes whose RSS and CPU are sampled: the gateways and the routers."""
        return [name for name in self.c.procs if name.split("-")[0] in ("gateway", "router")]

    async def sample(self) -> None:
        """Every gateway and router process's RSS, peak RSS and CPU time every `SAMPLE_S`, until the load stops."""
        while not self.c._stop.is_set():
            now = time.time()
            for name in self.sampled():
                proc = self.c.procs[name].process
                got = proc_sample(proc.pid) if proc is not None else None
                if got is not None:
                    self.procs.setdefault(name, []).append((now, *got))
            await asyncio.sleep(SAMPLE_S)

    def resources(self, injected: float, end: float) -> str:
        """Each gateway's RSS (at the injection / peak in the window / at its end), VmHWM and CPU share; each
        router's CPU share."""
        parts, routers = [], []
        for name, samples in self.procs.items():
            before = [s for s in samples if s[0] <= injected]
            during = [s for s in samples if injected <= s[0] <= end]
            if not before or not during:
                continue
            b, last = before[-1], during[-1]
            earlier = [s for s in before if s[0] >= injected - 3.0] or before[-1:]
            cpu_before = (b[3] - earlier[0][3]) / max(b[0] - earlier[0][0], 1e-9) * 100
            cpu_during = (last[3] - b[3]) / max(last[0] - b[0], 1e-9) * 100
            peak = max(s[1] for s in during)
            if name.startswith("router"):
                routers.append(f"{name} {cpu_before:.0f} % -> {cpu_during:.0f} %")
                continue
            parts.append(
                f"{name} {b[1]:.0f} / {peak:.0f} / {last[1]:.0f} MiB (VmHWM {b[2]:.0f} -> {last[2]:.0f}), "
                f"CPU {cpu_before:.0f} % -> {cpu_during:.0f} %"
            )
        note = "; gateway RSS at the injection / peak / end: " + ("; ".join(parts) if parts else "not sampled")
        return note + (f"; routers' CPU before -> during: {', '.join(routers)}" if routers else "")

    def answers(self, start: float, end: float) -> list[tuple[float, int, int | None, str]]:
        return [a for a in self.c.gw_answers if start <= a[0] < end]

    def not_honest(self, start: float, end: float) -> int:
        """Client answers (200) in [start, end) that no honest engine served: misrouted."""
        return sum(status == 200 and served not in self.honest for _, _, status, served in self.answers(start, end))

    async def scrape_all(self) -> dict[str, dict[str, float]]:
        return {name: await asyncio.to_thread(scrape, url) for name, url in self.gateways().items()}

    # ----- the faults -----

    async def inject(self, fault: str) -> str:
        self.state = {"injected": time.time()}
        if fault in HOSTILE:
            return await self._start_hostile(fault)
        if fault == "kv-claim":
            return await self._kv_claim()
        if fault == "kv-flood":
            return await self._kv_flood()
        if fault == "decision-flood":
            return await self._decision_flood()
        raise ValueError(f"unknown fault {fault!r}")

    async def after(self, fault: str) -> tuple[str, dict[str, int]]:
        state, self.state = self.state, {}
        end = time.time()
        if fault in HOSTILE:
            note, counts = await self._stop_hostile(state)
        elif fault == "kv-claim":
            note, counts = await self._after_kv_claim(state)
        elif fault == "kv-flood":
            note, counts = await self._after_kv_flood(state)
        else:
            note, counts = await self._after_decision_flood(state)
        return note + self.resources(state.get("flood_at", state["injected"]), end), counts

    async def teardown(self) -> None:
        """A fault interrupted by an error: its hostile engine and its flood process."""
        state, self.state = self.state, {}
        if "server" in state:
            with contextlib.suppress(Exception):
                await stop_hostile(state["server"], state["agent"])
            with contextlib.suppress(Exception):
                await state["bus"].close()
        for key in ("flood", "watch"):
            task = state.get(key)
            if isinstance(task, asyncio.Task):
                task.cancel()
        process = state.get("process")
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    # engine-bigbody, engine-hugeheader

    async def _start_hostile(self, fault: str) -> str:
        from switchyard.shared.bus import Bus
        from switchyard.shared.nats_auth import engine_user

        engine_id, mode = HOSTILE[fault]
        role = engine_user(engine_id)
        bus = await Bus.connect(self.c.role_settings(role), name=engine_id, role=role)
        server, agent = await start_hostile(mode, engine_id, bus, self.model, self.ports[engine_id])
        self.state.update(server=server, agent=agent, bus=bus, engine=engine_id, metrics=await self.scrape_all())
        return f"{engine_id} (listed in the manifest, its own credentials) says hello as dp; its server answers {mode}"

    async def _stop_hostile(self, state: dict[str, Any]) -> tuple[str, dict[str, int]]:
        server: HostileServer = state["server"]
        agent: HostileAgent = state["agent"]
        await stop_hostile(server, agent)
        with contextlib.suppress(Exception):
            await state["bus"].close()
        gone = await self._until_gone(state["engine"])
        after = await self.scrape_all()
        engine = state["engine"]
        errors: Counter[str] = Counter()
        ejected = trials = 0.0
        for name, samples in after.items():
            before = state["metrics"].get(name, {})
            for key, value in samples.items():
                if key.startswith("switchyard_gateway_upstream_errors_total{") and f'engine="{engine}"' in key:
                    reason = key.split('reason="', 1)[1].split('"', 1)[0]
                    errors[reason] += int(value - before.get(key, 0.0))
            ejected += metric(samples, "switchyard_gateway_engine_ejections_total") - metric(
                before, "switchyard_gateway_engine_ejections_total"
            )
            trials += metric(samples, "switchyard_gateway_engine_trials_total", outcome="failed") - metric(
                before, "switchyard_gateway_engine_trials_total", outcome="failed"
            )
        misrouted = self.not_honest(state["injected"], time.time())
        why = ", ".join(f"{reason} {n}" for reason, n in errors.most_common()) or "none counted"
        note = (
            server.note()
            + f"; the gateways' upstream errors on it: {why}; ejections (any engine) {ejected:.0f}, "
            + f"failed trials {trials:.0f}"
            + f"; client answers not served by an honest engine: {misrouted} (misrouted); it left the gateways' "
            + (f"live engines {gone:.1f} s after it stopped" if gone is not None else "live engines: not seen leaving")
        )
        return note, {"hijacked": misrouted}

    async def _until_gone(self, engine_id: str, within_s: float = 15.0) -> float | None:
        """Seconds until no gateway's core lists `engine_id` among its live engines (its per-engine gauges go with
        it), so the next fault starts without it; None if it is still listed after `within_s`."""
        start = time.monotonic()
        key = f'engine="{engine_id}"'
        while time.monotonic() - start < within_s:
            pages = await self.scrape_all()
            listed = any(
                key in sample and sample.startswith("switchyard_router_engine_running")
                for page in pages.values()
                for sample in page
            )
            if pages and not listed:
                return time.monotonic() - start
            await asyncio.sleep(0.25)
        return None

    # kv-claim

    async def _prefix_burst(self) -> Counter[str]:
        """`PREFIX_REQUESTS` completions of the shared prompt through the gateways (the load's client: round robin,
        retried); which engine served each."""
        import httpx

        body = {"model": self.model, "prompt": PREFIX.tolist(), "max_tokens": 8}
        gate = asyncio.Semaphore(PREFIX_CONCURRENCY)
        served: Counter[str] = Counter()

        async def one(client: httpx.AsyncClient, i: int) -> None:
            async with gate:
                served[await self.c._gateway_request(client, i, body)] += 1

        async with httpx.AsyncClient(timeout=5.0) as client:
            await asyncio.gather(*(one(client, i) for i in range(PREFIX_REQUESTS)))
        return served

    async def _kv_claim(self) -> str:
        from switchyard.shared import schemas as s
        from switchyard.shared.codec import encode
        from switchyard.shared.nats_auth import engine_user
        from switchyard.shared.prefix_keys import block_keys

        live = await self.scrape_all()
        engines = int(max((metric(m, "switchyard_router_live_engines", role="dp") for m in live.values()), default=2))
        controls = [await self._prefix_burst(), await self._prefix_burst()]
        keys = block_keys(np.asarray(PREFIX, dtype=np.int64), STUB_BLOCK)[:CLAIMED_BLOCKS]
        claim = s.KvEvents(
            engine_id=CLAIMANT,
            seq=0,
            ts=time.time(),
            block_size=STUB_BLOCK,
            ops=[s.KvOp(kind="stored", keys=keys)],
        )
        before = await self.scrape_all()
        nc = await self.c._raw(engine_user(CLAIMANT), f"chaos-{CLAIMANT}-claim")
        try:
            await nc.publish(self.c.bus.subjects.kv_events(CLAIMANT), encode(claim))
            await nc.flush(timeout=5)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        # Until both gateways' cores have applied the claim (their metrics fold once a second), at most 5 s.
        applied, deadline = 0, time.monotonic() + 5.0
        while time.monotonic() < deadline:
            now = await self.scrape_all()
            applied = sum(
                metric(now[n], "switchyard_router_kv_events_total", op="stored")
                - metric(before.get(n, {}), "switchyard_router_kv_events_total", op="stored")
                >= CLAIMED_BLOCKS
                for n in now
            )
            if applied == len(now):
                break
            await asyncio.sleep(0.25)
        attacked = await self._prefix_burst()
        self.state.update(controls=controls, attacked=attacked, engines=engines, before=before, applied=applied)
        return (
            f"engine-{CLAIMANT}'s credential: one KvEvents claiming the {CLAIMED_BLOCKS} blocks of a "
            f"{len(PREFIX)}-token prompt it never held; twice {PREFIX_REQUESTS} requests with that prompt before the "
            f"claim and {PREFIX_REQUESTS} after (concurrency {PREFIX_CONCURRENCY}, round robin over the gateways)"
        )

    async def _after_kv_claim(self, state: dict[str, Any]) -> tuple[str, dict[str, int]]:
        from switchyard.services.router.settings import RouterSettings

        controls: list[Counter[str]] = state["controls"]
        attacked: Counter[str] = state["attacked"]
        after = await self.scrape_all()
        trust: Counter[str] = Counter()
        for name, samples in after.items():
            for outcome in ("confirmed", "unconfirmed", "probe_full", "quarantined", "ignored"):
                now = metric(samples, "switchyard_router_kv_trust_total", outcome=outcome)
                trust[outcome] += int(
                    now - metric(state["before"].get(name, {}), "switchyard_router_kv_trust_total", outcome=outcome)
                )
        probes = RouterSettings.model_fields["prefix_confirm_probes"].default
        allowance = probes * len(after) + SPLIT_SLACK
        engines = state["engines"]
        mine = [control[CLAIMANT] for control in controls]
        beyond = claim_misrouted(attacked[CLAIMANT], mine, PREFIX_REQUESTS, engines, allowance)
        misrouted = beyond + self.not_honest(state["injected"], time.time())

        def split(served: Counter[str]) -> str:
            return ", ".join(f"{e or 'failed'} {n}" for e, n in sorted(served.items()))

        note = (
            f"; claim applied by {state['applied']} of {len(after)} gateways' cores; {CLAIMANT} served "
            f"{' and '.join(map(str, mine))} of {PREFIX_REQUESTS} in the controls "
            f"({'; '.join(split(c) for c in controls)}) and {attacked[CLAIMANT]} of {PREFIX_REQUESTS} after the "
            f"claim ({split(attacked)}); share allowed max(controls, {PREFIX_REQUESTS}/{engines} live DP engines) "
            f"+ {probes * len(after)} probes ({probes} per gateway) + {SPLIT_SLACK} (a burst's noise); beyond it: "
            f"{beyond} (misrouted); the gateways' KV trust: " + ", ".join(f"{k} {v}" for k, v in trust.items() if v)
        )
        return note, {"hijacked": misrouted}

    # kv-flood, decision-flood: one client in a process of its own

    async def _spawn_flood(self, role: str, subject: str, payload: bytes, seconds: float) -> Any:
        creds = self.c.credentials.users[role]
        root: Path = self.c.root
        (root / "flood.py").write_text(FLOOD_SCRIPT)
        (root / f"{role}.payload").write_bytes(payload)
        args = [",".join(self.c.nats_urls), creds["user"], creds["password"], subject, str(root / f"{role}.payload")]
        return await asyncio.create_subprocess_exec(
            sys.executable,
            str(root / "flood.py"),
            *args,
            f"{seconds:.1f}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )

    async def _flood_sent(self, process: Any) -> int:
        try:
            out, _ = await asyncio.wait_for(process.communicate(), 60)
        except TimeoutError:
            process.kill()
            return 0
        return int(out.decode().strip() or 0)

    async def _watch_gateways(self, into: list[tuple[float, dict[str, dict[str, float]]]]) -> None:
        """The gateways' metrics every 0.5 s (liveness gauges, per-engine in-flight) while a flood runs."""
        while True:
            into.append((time.time(), await self.scrape_all()))
            await asyncio.sleep(0.5)

    async def _kv_flood(self) -> str:
        from switchyard.shared import schemas as s
        from switchyard.shared.codec import encode
        from switchyard.shared.nats_auth import engine_user

        keys = np.random.default_rng(3).integers(1, 2**63, size=s.MAX_KV_EVENT_KEYS, dtype=np.uint64)
        batch = s.KvEvents(
            engine_id=FLOODER, seq=1, ts=time.time(), block_size=STUB_BLOCK, ops=[s.KvOp(kind="stored", keys=keys)]
        )
        payload = encode(batch)
        seconds = max(self.c.o.fault_s - 3.0, 1.0)
        watched: list[tuple[float, dict[str, dict[str, float]]]] = []
        self.state.update(before=await self.scrape_all(), log_offset=self.c._server_log_size(), watched=watched)
        self.state["watch"] = asyncio.create_task(self._watch_gateways(watched))
        self.state["process"] = await self._spawn_flood(
            engine_user(FLOODER), self.c.bus.subjects.kv_events(FLOODER), payload, seconds
        )
        return (
            f"engine-{FLOODER}'s credential: {s.MAX_KV_EVENT_KEYS}-key KvEvents batches ({len(payload)} bytes) on its "
            f"own {self.c.bus.subjects.kv_events(FLOODER)} as fast as one client (a process of its own) publishes, "
            f"{seconds:.0f} s"
        )

    def _liveness(self, state: dict[str, Any]) -> str:
        """The gateways' view of live DP engines and stale engines before and during a flood."""
        parts = []
        for name, before in state["before"].items():
            live0 = metric(before, "switchyard_router_live_engines", role="dp")
            stale0 = metric(before, "switchyard_router_stale_engines")
            during = [m[name] for _, m in state["watched"] if m.get(name)]
            live = min((metric(m, "switchyard_router_live_engines", role="dp") for m in during), default=float("nan"))
            stale = max((metric(m, "switchyard_router_stale_engines") for m in during), default=float("nan"))
            parts.append(
                f"{name}: live DP engines {live0:.0f} before, min {live:.0f} during ({len(during)} scrapes); "
                f"stale engines {stale0:.0f} before, max {stale:.0f} during"
            )
        return "; ".join(parts)

    async def _stop_watch(self, state: dict[str, Any]) -> int:
        sent = await self._flood_sent(state["process"])
        state["watch"].cancel()
        await asyncio.gather(state["watch"], return_exceptions=True)
        return sent

    def _refused(self, state: dict[str, Any]) -> tuple[int, int, str]:
        """(honest attempts answered 503, honest attempts failed, slow-consumer cut-offs) since the injection."""
        answers = self.answers(state["injected"], time.time())
        unavailable = sum(status == 503 for _, _, status, _ in answers)
        failed = sum(status != 200 for _, _, status, _ in answers)
        cut_off = self.c._cut_offs(state["log_offset"])
        return unavailable, failed, ", ".join(f"{name} {n}" for name, n in cut_off.most_common()) or "none"

    async def _after_kv_flood(self, state: dict[str, Any]) -> tuple[str, dict[str, int]]:
        sent = await self._stop_watch(state)
        after = await self.scrape_all()
        dropped = sum(
            metric(m, "switchyard_gateway_kv_events_total", outcome="rate")
            - metric(state["before"].get(n, {}), "switchyard_gateway_kv_events_total", outcome="rate")
            for n, m in after.items()
        )
        unavailable, failed, cut_off = self._refused(state)
        note = (
            f"; {sent} batches sent, {dropped:.0f} dropped undecoded by the gateways (rate); honest attempts answered "
            f"503: {unavailable}, failed in all: {failed}; {self._liveness(state)}; slow-consumer cut-offs: {cut_off}"
        )
        return note, {"hijacked": self.not_honest(state["injected"], time.time())}

    async def _decision_flood(self) -> str:
        from switchyard.shared import schemas as s
        from switchyard.shared.codec import encode_unchecked
        from switchyard.shared.nats_auth import gateway_user

        n = s.MAX_SHARED_DECISIONS
        payload = encode_unchecked(
            s.RouteDecisions,
            {
                "replica_id": LEAKED_REPLICA,
                "kinds": ["dp"] * n,
                "request_ids": [f"phantom-{i}" for i in range(n)],
                "engine_ids": [CLAIMANT] * n,
                "prompt_tokens": [PHANTOM_PROMPT_TOKENS] * n,
            },
        )
        await asyncio.sleep(CONTROL_S)  # the control: honest load, no flood
        flood_at = time.time()
        seconds = max(self.c.o.fault_s - 3.0, 1.0)
        watched: list[tuple[float, dict[str, dict[str, float]]]] = []
        self.state.update(
            control=(self.state["injected"], flood_at),
            before=await self.scrape_all(),
            log_offset=self.c._server_log_size(),
            watched=watched,
            flood_at=flood_at,
        )
        self.state["watch"] = asyncio.create_task(self._watch_gateways(watched))
        subject = self.c.bus.subjects.decided("gateway", LEAKED_REPLICA)
        self.state["process"] = await self._spawn_flood(gateway_user(LEAKED_REPLICA), subject, payload, seconds)
        self.c._attack["until"] = flood_at + seconds + 2.0
        return (
            f"gateway-{LEAKED_REPLICA}'s password (a second connection beside the real {LEAKED_REPLICA}): "
            f"{CONTROL_S:.0f} s of control, then {n}-entry RouteDecisions batches ({len(payload)} bytes) naming "
            f"{CLAIMANT} with {PHANTOM_PROMPT_TOKENS} prompt tokens each, on its own {subject}, as fast as one client "
            f"publishes, {seconds:.0f} s"
        )

    async def _after_decision_flood(self, state: dict[str, Any]) -> tuple[str, dict[str, int]]:
        sent = await self._stop_watch(state)
        after = await self.scrape_all()
        gateways = list(self.gateways())
        splits = []
        for index, name in enumerate(gateways):
            c0, c1 = state["control"]
            control = [a for a in self.answers(c0, c1) if a[1] == index]
            flood = [a for a in self.answers(state["flood_at"], time.time()) if a[1] == index]
            (a, n), (b, m) = served_share(control, CLAIMANT), served_share(flood, CLAIMANT)
            phantom = max(
                (
                    metric(ms[name], "switchyard_router_engine_inflight", engine=CLAIMANT)
                    for _, ms in state["watched"]
                    if ms.get(name)
                ),
                default=float("nan"),
            )
            splits.append(
                f"{name}: {CLAIMANT} served {a} of {n} answers in the control, {b} of {m} under the flood "
                f"(max in flight on it by the gateway's core {phantom:.0f})"
            )
        dropped = Counter[str]()
        g1 = gateways[0] if gateways else ""
        for key, value in after.get(g1, {}).items():
            if key.startswith(PEER_DROPS):
                reason = key.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in key else "?"
                kind = "messages" if "messages" in key else "decisions"
                dropped[f"{kind} {reason}"] += int(value - state["before"].get(g1, {}).get(key, 0.0))
        unavailable, failed, cut_off = self._refused(state)
        note = (
            f"; {sent} batches sent; {g1} dropped: "
            + (", ".join(f"{k} {v}" for k, v in dropped.items() if v) or "nothing counted")
            + f"; {'; '.join(splits)}; honest attempts answered 503: {unavailable}, failed in all: {failed}; "
            f"{self._liveness(state)}; slow-consumer cut-offs: {cut_off}"
        )
        return note, {"hijacked": self.not_honest(state["injected"], time.time())}
