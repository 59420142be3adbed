"""The load and the watches of `make chaos` (`bench/chaos.py`): what its audit and report measure.

`Load` is mixed into `chaos.Chaos`: client requests into the simulated fleet (`sy.sim.submit`, resent once
after `retry_after_s`), routing probes (`sy.route.decode`, `Probe`), the history API probed as a dashboard does,
HTTP completions through the gateways (retried every 0.5 s), the placement replicas' folded windows, and every
engine's telemetry stamps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np
from chaos_faults import STUB_MODEL

log = logging.getLogger("chaos")


@dataclass
class Probe:
    sent: float
    ok: bool
    engine: str = ""
    answered: float = 0.0
    error: str = ""  # why it failed: the router's error code, or the exception (timeout, no responders)


class Load:
    """The load half of `chaos.Chaos` (a mixin: it appends to the harness's records)."""

    async def _watch(self) -> None:
        from switchyard.engine_agents.sim.live.protocol import SimCompleted
        from switchyard.shared.schemas import Telemetry

        def on_telemetry(t: Telemetry, _msg: object) -> None:
            self.telemetry.setdefault(t.engine_id, []).append(t.ts)

        def on_done(done: SimCompleted, _msg: object) -> None:
            self.done.setdefault(done.request_id, time.time())

        await self.watch_bus.subscribe(self.bus.subjects.all_telemetry, Telemetry, on_telemetry)
        await self.bus.subscribe(self.bus.subjects.sim_completed, SimCompleted, on_done)

    async def _load(self) -> None:
        from switchyard.engine_agents.sim.live.protocol import SimSubmit
        from switchyard.shared.codec import encode

        w = self.scenario.workload(4096, seed=self.o.seed + 1, rate=self.o.rate, max_tokens=self.max_tokens)
        # Short replies keep the final drain short: the faults are about the control plane, not long decodes.
        output = np.minimum(w.output, 64)
        prefills = self.config.prefill_ids()
        rng = np.random.default_rng(self.o.seed + 2)
        i = 0
        while not self._stop.is_set():
            k = i % w.size
            rid = f"c{i}"
            submit = SimSubmit(
                request_id=rid,
                replay=int(w.replay[k]),
                prompt_tokens=int(w.prompt[k]),
                output_tokens=int(output[k]),
                sent_at=time.time(),
            )
            self.sent[rid] = time.time()
            subject = self.bus.subjects.sim_submit(prefills[i % len(prefills)])
            self.submits[rid] = (subject, encode(submit))
            try:
                await self.bus.publish(subject, submit)
            except Exception as exc:  # the client could not even send: counted as lost by the audit
                log.warning("load: %s not sent: %s", rid, exc)
            i += 1
            await asyncio.sleep(float(rng.exponential(1.0 / self.o.rate)))

    async def _retry(self) -> None:
        """A client whose request has not finished after `retry_after_s` sends it once more, as a real one would:
        the simulated request path (submit and completion) rides core NATS, which drops what is in flight
        while the server restarts. A request still unfinished after its retry is lost."""
        while True:
            now = time.time()
            for rid, sent in list(self.sent.items()):
                if now - sent > self.o.retry_after_s and rid not in self.done and rid not in self.retried:
                    self.retried.add(rid)
                    subject, payload = self.submits[rid]
                    with contextlib.suppress(Exception):
                        await self.bus.nc.publish(subject, payload)
            await asyncio.sleep(1.0)

    async def _probe_once(self, i: int) -> None:
        from switchyard.shared.errors import RemoteError
        from switchyard.shared.schemas import RouteDecodeReply, RouteDecodeRequest

        sent = time.time()
        request = RouteDecodeRequest(
            request_id=f"probe-{i}", prompt_tokens=1, signature=self.signatures[i % len(self.signatures)]
        )
        try:
            reply = await self.bus.request(self.bus.subjects.route_decode, request, RouteDecodeReply, timeout=0.5)
        except RemoteError as exc:
            self.probes.append(Probe(sent, False, error=exc.code))
            return
        except Exception as exc:
            self.probes.append(Probe(sent, False, error=type(exc).__name__))
            return
        self.probes.append(Probe(sent, True, reply.engine_id, time.time()))

    async def _probes(self) -> None:
        pending: set[asyncio.Task[None]] = set()
        i = 0
        down_since: float | None = None
        while not self._stop.is_set():
            connected = self.bus.nc.is_connected and self.watch_bus.nc.is_connected
            if not connected and down_since is None:
                down_since = time.time()
            elif connected and down_since is not None:
                self.blind.append((down_since, time.time()))
                down_since = None
            task = asyncio.create_task(self._probe_once(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            await asyncio.sleep(1.0 / self.o.probe_hz)
        if pending:
            await asyncio.wait(pending)

    async def _wait_routing(self, within_s: float = 60.0) -> float:
        """Seconds until a probe succeeds (the loop is up)."""
        start = time.monotonic()
        n = len(self.probes)
        while time.monotonic() - start < within_s:
            if any(p.ok for p in self.probes[n:]):
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        raise RuntimeError("routing never answered: see the logs under " + str(self.root / "logs"))

    async def _probe_api(self) -> None:
        """The history API as a dashboard uses it: a page of placements every 0.25 s."""

        def get() -> int | None:
            try:
                with urllib.request.urlopen(f"{self.api_url}/v1/placements?limit=1", timeout=2) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code
            except OSError:
                return None

        while not self._stop.is_set():
            sent = time.time()
            self.api_probes.append((sent, await asyncio.to_thread(get)))
            await asyncio.sleep(0.25)

    async def _gateway_request(self, client: object, i: int, body: dict[str, object] | None = None) -> str:
        """One OpenAI completion through the gateway, retried every 0.5 s for `retry_after_s` as a client with
        retries would; lost if it never succeeds (a refused connection, a timeout or a 5xx is a failure). Returns
        the engine that served it (the stub's `served_by`; "" if none did)."""
        import httpx

        assert isinstance(client, httpx.AsyncClient)
        body = body or {"model": STUB_MODEL, "prompt": f"chaos request {i}", "max_tokens": 8}
        sent = time.time()
        first: bool | None = None
        attempt = 0
        while True:
            at = time.time()
            # Requests go round robin over the gateways; a retry goes to the next one (a client that knows them
            # all, or a load balancer that takes a refusing one out).
            index = (i + attempt) % len(self.gateway_urls)
            attempt += 1
            status: int | None = None
            served = ""
            try:
                answer = await client.post(f"{self.gateway_urls[index]}/v1/completions", json=body)
                status = answer.status_code
                served = served_by(answer.content) if status == 200 else ""
            except httpx.HTTPError:
                pass
            ok = status == 200
            self.gw_attempts.append((at, ok))
            self.gw_answers.append((at, index, status, served))
            first = ok if first is None else first
            if ok or time.time() - sent > self.o.retry_after_s:
                self.gw_requests.append((sent, first, ok))
                return served
            await asyncio.sleep(0.5)

    async def _gateway_load(self) -> None:
        """Client requests through the gateways (HTTP, to the stub DP engines), at `gateway_rate` per second."""
        import httpx

        rng = np.random.default_rng(self.o.seed + 3)
        pending: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(timeout=5.0) as client:
            i = 0
            while not self._stop.is_set():
                task = asyncio.create_task(self._gateway_request(client, i))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
                await asyncio.sleep(float(rng.exponential(1.0 / self.o.gateway_rate)))
            if pending:
                await asyncio.wait(pending)

    async def _sample_windows(self, name: str, port: int) -> None:
        def scrape() -> float | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
                    text = response.read().decode()
            except OSError:
                return None
            for line in text.splitlines():
                if line.startswith("switchyard_placement_windows_total "):
                    return float(line.split()[1])
            return None

        while not self._stop.is_set():
            value = await asyncio.to_thread(scrape)
            if value is not None:
                self.windows_by.setdefault(name, []).append((time.time(), value))
            await asyncio.sleep(0.5)


def served_by(body: bytes) -> str:
    """The engine a stub's answer names (`served_by`); "?" for an answer that is not one (junk, no field)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return "?"
    engine = answer.get("served_by") if isinstance(answer, dict) else None
    return engine if isinstance(engine, str) else "?"
