"""The audit of `make chaos` (`bench/chaos.py`): what each fault cost, judged after the run.

`Auditing` is mixed into `chaos.Chaos`: once the faults are over and the loop has quiesced it reads the
database and the engines (`_audit`: placements and migrations lost, duplicated or stuck, live layouts that
differ from what was applied, routing samples stored twice or given up), then `_score` attributes every
probe, request and row to the fault window it fell in (`FaultResult`): losses, failed probes, resume times,
misrouting (a probe answered with an engine silent longer than `MISROUTE_AFTER_S`).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from chaos_faults import ATTACKER, FINAL
from chaos_load import Probe

STALE_AFTER_S = 1.0
#: A probe reply naming an engine silent for longer than this is misrouted (staleness limit + one telemetry
#: interval + scheduling slack: the router and this process see the same telemetry a few ms apart).
MISROUTE_AFTER_S = STALE_AFTER_S + 0.35


@dataclass
class FaultResult:
    name: str
    start: float
    injected: float
    end: float
    note: str = ""
    sent: int = 0
    retried: int = 0
    lost: int = 0
    probes: int = 0
    probe_failures: int = 0
    resume_s: float = 0.0
    resumed: bool = True  # a probe succeeded after the last failed one, within the window
    misrouted: int = 0
    api_failed: int = 0  # API probes not answered 2xx (refused connection, timeout, any 5xx: 503 too)
    api_500: int = 0  # API probes answered with a 5xx other than 503 (an outage must say 503)
    api_resume_s: float = 0.0  # seconds until the API answered again (its own restart)
    gw_sent: int = 0  # requests through the gateway
    gw_failed: int = 0  # ... whose first attempt failed (then retried every 0.5 s)
    gw_lost: int = 0  # ... that never succeeded within `retry_after_s`
    gw_resume_s: float = 0.0  # seconds until the gateway answered again after its last failed attempt
    hijacked: int = 0  # requests that reached the attacker's server (role-claim): counted as misrouted
    extra_lost: int = 0  # the fault's own losses (stream-flood: other engines' windows evicted from the stream)
    extra_stuck: int = 0  # the fault's own (migration-active: the killed replica's migration not finished)
    placements: int = 0
    migrations: int = 0
    lost_rows: int = 0
    duplicated: int = 0
    stuck: int = 0


@dataclass
class Audit:
    """The database and the engines after the run, attributed to the fault window each row was created in."""

    placements: list[tuple[int, str, str, float]] = field(default_factory=list)  # id, plan_id, status, created
    migrations: list[tuple[int, int, str, float]] = field(default_factory=list)  # id, placement_id, state, updated
    lost: list[float] = field(default_factory=list)  # created_at of each lost row
    duplicated: list[float] = field(default_factory=list)
    stuck: list[float] = field(default_factory=list)
    layout_mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Routing samples in the stream, those stored twice (same engine and request), and those the fleet gave up
    #: publishing (its log's "not published" warnings: lost).
    samples: int = 0
    samples_duplicated: int = 0
    samples_lost: int = 0


class Auditing:
    """The audit half of `chaos.Chaos` (a mixin: it reads the harness's records after the run)."""

    async def _wait_migrations(self, within_s: float) -> None:
        """Until no migration is pending or running (or `within_s` passes: the audit then calls them stuck)."""
        from sqlalchemy import func, select

        from switchyard.shared.db import Migration, create_async_db

        engine, sessions = create_async_db(self.database_url)
        deadline = time.monotonic() + within_s
        try:
            while time.monotonic() < deadline:
                async with sessions() as session:
                    open_ = await session.scalar(select(func.count()).where(Migration.state.not_in(FINAL)))
                if not open_:
                    return
                await asyncio.sleep(0.5)
        finally:
            await engine.dispose()

    async def _audit(self) -> Audit:
        from sqlalchemy import func, select

        from switchyard.services.history import applied_placement, load_layout
        from switchyard.shared.db import Migration, Placement, create_async_db
        from switchyard.shared.schemas import LayoutReply, LayoutRequest
        from switchyard.solver.placement.layouts import default_layout

        audit = Audit()
        now = time.time()
        engine, sessions = create_async_db(self.database_url)
        try:
            async with sessions() as session:
                for row in (await session.scalars(select(Placement))).all():
                    created = row.created_at.timestamp() if row.created_at.tzinfo else _utc(row.created_at)
                    audit.placements.append((row.id, row.plan_id, row.status, created))
                for m in (await session.scalars(select(Migration))).all():
                    updated = m.updated_at.timestamp() if m.updated_at.tzinfo else _utc(m.updated_at)
                    created = m.created_at.timestamp() if m.created_at.tzinfo else _utc(m.created_at)
                    audit.migrations.append((m.id, m.placement_id, m.state, created))
                    if m.state not in FINAL and now - updated > self.o.stuck_after_s:
                        audit.stuck.append(created)
                migrated = {pid for _, pid, _, _ in audit.migrations}
                for pid, _plan, status, created in audit.placements:
                    old = now - created > self.o.stuck_after_s
                    if status == "proposed" and old:
                        audit.stuck.append(created)
                    elif status not in ("rejected", "proposed") and pid not in migrated:
                        audit.lost.append(created)  # published (or later) yet never taken up
                doubles = (
                    await session.execute(
                        select(Migration.engine_group, Migration.plan_version, func.count())
                        .group_by(Migration.engine_group, Migration.plan_version)
                        .having(func.count() > 1)
                    )
                ).all()
                audit.duplicated += [now] * len(doubles)
                for group in self.config.decode_ids():
                    placement = await applied_placement(session, group)
                    try:
                        live = await self.bus.request(
                            self.bus.subjects.layout(group), LayoutRequest(engine_group=group), LayoutReply, timeout=5
                        )
                    except Exception as exc:
                        audit.notes.append(f"{group}: layout not readable ({exc})")
                        continue
                    num_experts = self.scenario.model.num_experts
                    if placement is not None:
                        want = await load_layout(session, placement)
                    else:
                        want = default_layout(live.layout.shape[0], num_experts, live.layout.shape[1])
                    if want.shape != live.layout.shape or not np.array_equal(want, live.layout):
                        audit.layout_mismatches.append(group)
        finally:
            await engine.dispose()
        await self._audit_samples(audit)
        return audit

    async def _audit_samples(self, audit: Audit) -> None:
        """Every routing sample in the stream read by sequence: none stored twice, none given up by the fleet."""
        from nats.js.errors import NotFoundError

        from switchyard.shared.codec import decode
        from switchyard.shared.schemas import RoutingSample

        stream = self.bus.subjects.routing_samples_stream
        state = (await self.bus.js.stream_info(stream)).state
        seen: Counter[tuple[str, str]] = Counter()
        for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
            try:
                sample = decode((await self.bus.js.get_msg(stream, seq)).data, RoutingSample)
            except NotFoundError:  # a gap (deleted message): nothing to count
                continue
            seen[(sample.engine_id, sample.request_id)] += 1
        audit.samples = sum(seen.values())
        audit.samples_duplicated = sum(n - 1 for n in seen.values())
        fleet_log = self.root / "logs" / "fleet.log"
        text = fleet_log.read_text(errors="replace") if fleet_log.exists() else ""
        audit.samples_lost = sum("routing sample" in line and "not published" in line for line in text.splitlines())
        audit.notes.append(
            f"routing samples: {audit.samples} stored, {audit.samples_duplicated} stored twice, "
            f"{audit.samples_lost} given up by the fleet (not published)"
        )

    def _misrouted(self, p: Probe) -> bool:
        """Routed to the attacker (no engine of the fleet), or to an engine that had sent no telemetry for longer
        than the staleness limit (+ slack)."""
        if p.ok and p.engine == ATTACKER:
            return True
        if not p.ok or self._blind(p.answered):
            return False
        stamps = self.telemetry.get(p.engine, [])
        i = bisect.bisect_right(stamps, p.answered)
        return i == 0 or p.answered - stamps[i - 1] > MISROUTE_AFTER_S

    def _blind(self, t: float) -> bool:
        return any(down <= t <= up + MISROUTE_AFTER_S + 1.0 for down, up in self.blind)

    def _windows_stalled(self, r: FaultResult) -> bool:
        """No expert-load window folded by any placement replica in the last third of the fault's window."""
        tails = [
            [v for t, v in samples if r.end - (r.end - r.injected) / 3 <= t <= r.end]
            for samples in self.windows_by.values()
        ]
        tails = [tail for tail in tails if len(tail) >= 2]
        return bool(tails) and all(tail[-1] == tail[0] for tail in tails)

    def _score(self, results: list[FaultResult], audit: Audit) -> None:
        startups = iter(self._router_startups())
        for r in results:
            if r.name == "router":
                r.note += f"; the restarted process served after {next(startups, '(not seen)')}"

        def window(t: float) -> FaultResult | None:
            for r in results:
                if r.start <= t < r.end:
                    return r
            return None

        for r in results:
            in_window = [p for p in self.probes if r.start <= p.sent < r.end]
            r.probes = len(in_window)
            r.probe_failures = sum(not p.ok for p in in_window)
            r.misrouted = sum(self._misrouted(p) for p in in_window) + r.hijacked
            r.stuck += r.extra_stuck
            r.lost_rows += r.extra_lost
            unjudged = sum(p.ok and self._blind(p.answered) for p in in_window)
            if unjudged:
                r.note += f"; {unjudged} probes not judged for misrouting (this process was reconnecting)"
            if self._windows_stalled(r):
                r.stuck += 1
                r.note += "; placement stopped folding expert-load windows"
            failed = [p.sent for p in in_window if not p.ok]
            if failed:  # from the first failed probe to the first success after the last one
                after = [p.sent for p in in_window if p.ok and p.sent > failed[-1]]
                r.resume_s = (after[0] if after else r.end) - failed[0]
                why = Counter(p.error for p in in_window if not p.ok)
                r.note += "; failed probes: " + ", ".join(f"{k} {v}" for k, v in why.most_common())
                r.resumed = bool(after)
            api = [(t, code) for t, code in self.api_probes if r.start <= t < r.end]
            r.api_failed = sum(not answered_2xx(code) for _, code in api)
            r.api_500 = sum(code is not None and code >= 500 and code != 503 for _, code in api)
            if r.name == "api":  # its own restart, however long it takes (later windows included)
                answered = [t for t, code in self.api_probes if t > r.injected and answered_2xx(code)]
                last = self.api_probes[-1][0] if self.api_probes else r.end
                r.api_resume_s = (answered[0] if answered else last) - r.injected
                r.resumed = r.resumed and bool(answered)
                r.note += f"; the API answered again {r.api_resume_s:.2f} s after its SIGKILL"
            else:  # an outage that began in this window (one carried over from an earlier fault is not its own)
                up = [t for t, code in api if answered_2xx(code)]
                before = [code for t, code in self.api_probes if t < r.start][-1:]
                was_down = bool(before) and not answered_2xx(before[0])
                down = [t for t, code in api if not answered_2xx(code) and (not was_down or (up and t > up[0]))]
                if down:  # the first 2xx after the last refused connection or 5xx (a 503 is an outage too)
                    after = [t for t, code in api if answered_2xx(code) and t > down[-1]]
                    r.api_resume_s = (after[0] if after else r.end) - r.injected
                    r.resumed = r.resumed and bool(after)
                    r.note += f"; the API did not answer 2xx to {r.api_failed} probes, again {r.api_resume_s:.2f} s in"
            gw = [(first, ok) for t, first, ok in self.gw_requests if r.start <= t < r.end]
            r.gw_sent, r.gw_failed = len(gw), sum(not first for first, _ in gw)
            r.gw_lost = sum(not ok for _, ok in gw)
            attempts = [(t, ok) for t, ok in self.gw_attempts if r.start <= t < r.end]
            down = [t for t, ok in attempts if not ok]
            if down:
                after = [t for t, ok in attempts if ok and t > down[-1]]
                r.gw_resume_s = (after[0] if after else r.end) - r.injected
                # With several gateways the failed attempts are the killed one's (until it is back); clients
                # were served again once their retry reached another: resumed unless a request was lost.
                failover = len(self.gateway_urls) > 1 and r.gw_lost == 0
                r.resumed = r.resumed and (bool(after) or failover)
            if r.name in ("router", "gateway") and self.gateway_urls:
                r.note += self._gateway_clients(r)
            sent = [rid for rid, t in self.sent.items() if r.start <= t < r.end]
            r.sent = len(sent)
            r.retried = sum(rid in self.retried for rid in sent)
            r.lost = sum(rid not in self.done for rid in sent)
        for _, _, _, created in audit.placements:
            if (r := window(created)) is not None:
                r.placements += 1
        for _, _, _, created in audit.migrations:
            if (r := window(created)) is not None:
                r.migrations += 1
        for attr, times in (("lost_rows", audit.lost), ("duplicated", audit.duplicated), ("stuck", audit.stuck)):
            for t in times:
                r = window(t) or (results[-1] if results else None)
                if r is not None:
                    setattr(r, attr, getattr(r, attr) + 1)
        if audit.layout_mismatches and results:
            results[-1].duplicated += len(audit.layout_mismatches)


def answered_2xx(code: int | None) -> bool:
    """An API probe answered: a 2xx. A refused connection (None) and any 5xx, 503 included, are an outage: an
    API that answers 503 to every request for 15 s while PostgreSQL is down is down for its clients."""
    return code is not None and 200 <= code < 300


def _utc(naive: object) -> float:
    from datetime import UTC

    return naive.replace(tzinfo=UTC).timestamp()  # type: ignore[attr-defined]
