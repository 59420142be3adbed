"""Issue 37, items 2, 3 and 7: what an engine's KV events may claim is bounded by what it could honestly say.

On the real nats-server with the generated per-role configuration: each engine speaks on its own raw connection
under its own credential (hello, telemetry, KV events); engines' HTTP is real (uvicorn, answering as vLLM with
`--enable-prompt-tokens-details`: `usage.prompt_tokens_details.cached_tokens` when it found any cached); the
gateway runs in-process (profile `switchyard`, precise prefix index), as in production. What must hold:

- one `KvEvents` message claiming a prompt's 63 blocks draws one probe, not all the traffic sharing it: the
  engine's answer reports nothing cached, the claim is dropped and counted `unconfirmed`;
- an honest claim confirmed by the answers keeps drawing its prompt;
- a claim above the engine's hello's `kv_blocks` is held at `kv_blocks`, counted;
- a KV flood from one credential, over its rate, is dropped before decoding, and honest requests all succeed,
  with every engine live and the ingest connection never cut off;
- one hello at block size 5000 from the engine whose id sorts first leaves prefix routing on for the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.settings import RouterSettings
from switchyard.shared import schemas as s
from switchyard.shared.codec import encode
from switchyard.shared.nats_auth import engine_user
from tests import test_nats_permissions
from tests.gateway_helpers import core_knows, metric, read_body, serving_asgi, wait_for
from tests.test_nats_permissions import SecuredNats
from tests.test_prefix_router import BLOCK, KEYS, PROMPT, FakeEngine, stored
from tests.test_prefix_security import secured_fleet

secured = test_nats_permissions.secured  # the real nats-server with the generated per-role configuration


def trust(outcome: str) -> float:
    return metric("switchyard_router_kv_trust_total", outcome=outcome)


@dataclass
class HttpEngine:
    """An engine: its bus side under its own credential, and its HTTP answers (vLLM's usage fields)."""

    bus: FakeEngine
    cached_tokens: int = 0  # what its answers report as cached (vLLM omits the details at 0)
    served: list[int] = field(default_factory=list)  # prompt lengths of the requests it received

    def app(self) -> Any:
        async def asgi(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            body = await read_body(receive)
            self.served.append(len(body))
            usage: dict[str, Any] = {"prompt_tokens": len(PROMPT), "completion_tokens": 1, "total_tokens": 1025}
            if self.cached_tokens:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
            answer = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "t"}], "usage": usage}
            await asyncio.sleep(0.02)
            payload = httpx.Response(200, json=answer).content
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": payload})

        return asgi


async def hello(engine: FakeEngine, port: int, kv_blocks: int = 4096, block_size: int = BLOCK) -> None:
    message = s.Hello(
        engine_id=engine.engine_id,
        role="dp",
        model=s.ModelShape(name="toy", num_layers=2, num_experts=4, top_k=1),
        ep_group=engine.engine_id,
        gpus=["0"],
        capacity=s.Capacity(max_running=64, kv_blocks=kv_blocks, block_size=block_size),
        ts=time.time(),
        agent="sim",
        base_url=f"http://127.0.0.1:{port}",
        telemetry_interval_s=0.1,
    )
    await engine.nc.publish(engine.subjects.hello(engine.engine_id), encode(message))
    await engine.nc.flush()


@dataclass
class Shape:
    gateway: GatewayService
    engines: dict[str, HttpEngine]

    @property
    def url(self) -> str:
        return self.gateway.url


@contextlib.asynccontextmanager
async def inprocess(
    secured: SecuredNats, ids: tuple[str, ...], block_sizes: dict[str, int] | None = None, **router: Any
) -> AsyncIterator[Shape]:
    """An in-process gateway g1 (profile `switchyard`, precise index) and HTTP engines `ids`, each on the bus as
    its own user, reporting telemetry every 0.1 s until the block ends."""
    sizes = block_sizes or {}
    engines: dict[str, HttpEngine] = {}
    async with contextlib.AsyncExitStack() as stack:
        ports = {}
        for engine_id in ids:
            nc = await secured.raw(engine_user(engine_id))
            stack.push_async_callback(nc.close)
            engines[engine_id] = engine = HttpEngine(FakeEngine(nc, secured.subjects, engine_id))
            ports[engine_id] = await stack.enter_async_context(serving_asgi(engine.app()))
        routing = RouterSettings(dp_profile="switchyard", inflight_grace_s=0.0, fresh_load_s=5.0, **router)
        gateway = GatewayService(
            secured.settings(), GatewaySettings(port=0, gateway_id="g1", router="inprocess"), routing
        )
        await gateway.start()
        stack.push_async_callback(gateway.stop)
        for engine_id, engine in engines.items():
            await hello(engine.bus, ports[engine_id], block_size=sizes.get(engine_id, BLOCK))

        async def report() -> None:
            while True:
                for engine in engines.values():
                    await engine.bus.report()
                await asyncio.sleep(0.1)

        reporter = asyncio.ensure_future(report())
        stack.callback(reporter.cancel)
        await wait_for(lambda: len(gateway.registry.live()) == len(ids))
        assert gateway.core is not None
        await wait_for(lambda: core_knows(gateway.core, ids))  # type: ignore[arg-type]
        yield Shape(gateway, engines)


async def complete(client: httpx.AsyncClient, url: str, n: int, concurrency: int = 6) -> Counter[int]:
    """`n` completions of the shared prompt (token ids: keyed without a tokenizer); their status codes."""
    codes: Counter[int] = Counter()
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            body = {"model": "toy", "prompt": PROMPT.tolist(), "max_tokens": 1}
            codes[(await client.post(f"{url}/v1/completions", json=body, timeout=30)).status_code] += 1

    await asyncio.gather(*(one() for _ in range(n)))
    return codes


def share(shape: Shape, engine_id: str) -> int:
    return len(shape.engines[engine_id].served)


async def test_one_lying_claim_draws_a_probe_not_the_prefix(secured: SecuredNats) -> None:
    """e1 claims the prompt's first 63 blocks (one message); its server holds nothing and says so (no
    `prompt_tokens_details`). Of 60 requests sharing the prefix it takes at most its share and a few probes,
    not all (old code: 60 of 60, prompts included); the claim is dropped and counted."""
    unconfirmed = trust("unconfirmed")
    async with inprocess(secured, ("e0", "e1", "p0")) as shape, httpx.AsyncClient() as client:
        prefix = shape.gateway.core.prefix  # type: ignore[union-attr]
        await shape.engines["e1"].bus.kv(stored(KEYS[:63]))
        await wait_for(lambda: prefix.blocks.blocks("e1") == 63)
        codes = await complete(client, shape.url, 60)
        print("shares", {e: share(shape, e) for e in shape.engines})  # the figure docs/security.md quotes
        assert codes == {200: 60}
        assert share(shape, "e1") <= 30, {e: share(shape, e) for e in shape.engines}
        assert trust("unconfirmed") > unconfirmed
        assert prefix.blocks.match(KEYS.tolist(), ["e1"]).tolist() == [0]


async def test_an_honest_claim_confirmed_by_the_answers_keeps_its_prompt(secured: SecuredNats) -> None:
    """Control: e1 holds the 63 blocks and its answers say so (1008 cached tokens): after the first answer
    confirms the claim, e1 takes the prompt (all 30 of 30 sent one at a time)."""
    confirmed = trust("confirmed")
    async with inprocess(secured, ("e0", "e1", "p0")) as shape, httpx.AsyncClient() as client:
        shape.engines["e1"].cached_tokens = 63 * BLOCK
        prefix = shape.gateway.core.prefix  # type: ignore[union-attr]
        await shape.engines["e1"].bus.kv(stored(KEYS[:63]))
        await wait_for(lambda: prefix.blocks.blocks("e1") == 63)
        assert await complete(client, shape.url, 30, concurrency=1) == {200: 30}
        assert share(shape, "e1") == 30
        assert trust("confirmed") - confirmed == 30
        assert prefix.blocks.blocks("e1") == 63


async def test_a_hello_at_block_size_5000_leaves_prefix_routing_on(secured: SecuredNats) -> None:
    """d0 (its id sorts first) announces 5000-token blocks; e1 holds the prompt's blocks at 16 and confirms
    them. The prompt is keyed at 16 (the size most candidates announce), so e1 takes 30 of 30 (old code: keyed
    at d0's 5000, nothing matched, 10/10/10 and `prompt_keys_failed` 30); d0 is counted as odd."""
    odd = metric("switchyard_gateway_odd_block_size_total")
    failed = metric("switchyard_gateway_prompt_keys_failed_total")
    async with inprocess(secured, ("d0", "e0", "e1"), {"d0": 5000}) as shape, httpx.AsyncClient() as client:
        shape.engines["e1"].cached_tokens = 63 * BLOCK
        prefix = shape.gateway.core.prefix  # type: ignore[union-attr]
        await shape.engines["e1"].bus.kv(stored(KEYS[:63]))
        await wait_for(lambda: prefix.blocks.blocks("e1") == 63)
        assert await complete(client, shape.url, 30, concurrency=1) == {200: 30}
        assert share(shape, "e1") == 30, {e: share(shape, e) for e in shape.engines}
    assert metric("switchyard_gateway_odd_block_size_total") - odd == 30
    assert metric("switchyard_gateway_prompt_keys_failed_total") == failed


async def test_a_claim_above_the_engines_kv_capacity_is_held_at_it(secured: SecuredNats) -> None:
    """e0 announced 4096 KV blocks and claims 6000 distinct ones: the router holds its newest 4096, and the
    1904 past its capacity are counted (old code: all 6000, up to `prefix_max_blocks`, 2 M)."""
    over = trust("over_capacity")
    async with secured_fleet(secured) as fleet:
        e0 = fleet.engines["e0"]
        claimed = np.arange(1, 6001, dtype=np.uint64) * 7919
        await e0.kv(stored(claimed))
        prefix = fleet.router.core.prefix
        await wait_for(lambda: prefix.applier.last("e0") == 0)
        assert fleet.blocks("e0") == 4096
        assert prefix.blocks.match(claimed[-4096:].tolist(), ["e0"]).tolist() == [4096]
        fleet.router.core.housekeeping(asyncio.get_running_loop().time())
    assert trust("over_capacity") - over == 6000 - 4096


FLOOD = """
import asyncio, sys, time
import nats

async def main(url, user, password, subject, path, seconds):
    payload = open(path, "rb").read()
    nc = await nats.connect(url, user=user, password=password, inbox_prefix="_INBOX_" + user,
                            allow_reconnect=False, pending_size=1 << 30)
    end, sent = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(64):
            await nc.publish(subject, payload)
        sent += 64
        await asyncio.sleep(0)
    await nc.flush(timeout=30)
    print(sent)
    await nc.close()

asyncio.run(main(*sys.argv[1:6], float(sys.argv[6])))
"""


async def test_a_kv_flood_degrades_only_prefix_routing(secured: SecuredNats, tmp_path: Any) -> None:
    """p0's credential publishes 8,192-key batches as fast as one client can for 6 s (another process) while
    60 honest requests run: every one is answered 200, no engine goes stale, the gateway's ingest connection
    is never cut off; the flood's messages past p0's rate are dropped before decoding, and counted. Old code:
    the flood was applied on the ingest connection (slow-consumer cut-offs, engines stale, 503s)."""
    dropped = metric("switchyard_gateway_kv_events_total", outcome="rate")
    async with inprocess(secured, ("e0", "e1")) as shape, httpx.AsyncClient() as client:
        flooder = FakeEngine(await secured.raw(engine_user("p0")), secured.subjects, "p0")
        keys = np.random.default_rng(3).integers(1, 2**63, size=s.MAX_KV_EVENT_KEYS, dtype=np.uint64)
        payload = tmp_path / "flood.msgpack"
        payload.write_bytes(encode(flooder.events(stored(keys))))
        await flooder.nc.close()
        creds = secured.credentials.users[engine_user("p0")]
        script = tmp_path / "flood.py"
        script.write_text(FLOOD)
        args = [secured.server.url, creds["user"], creds["password"], secured.subjects.kv_events("p0")]
        flood = await asyncio.create_subprocess_exec(
            sys.executable, str(script), *args, str(payload), "6", stdout=asyncio.subprocess.PIPE
        )
        try:
            await asyncio.sleep(1.0)  # the flood is under way
            stale = []

            async def watch() -> None:
                while flood.returncode is None:
                    live = {e.engine_id for e in shape.gateway.registry.live()}
                    if live != {"e0", "e1"}:
                        stale.append(live)
                    await asyncio.sleep(0.05)

            watcher = asyncio.ensure_future(watch())
            codes = await complete(client, shape.url, 60, concurrency=4)
            out, _ = await asyncio.wait_for(flood.communicate(), 60)
            await watcher
        finally:
            if flood.returncode is None:
                flood.kill()
                await flood.wait()
        sent = int(out.strip() or 0)
        assert codes == {200: 60}
        assert stale == []
        ingest = shape.gateway.ingest
        assert ingest is not None and ingest.nc.stats["reconnects"] == 0 and ingest.nc.is_connected
    print(
        "flood messages sent", sent, "dropped", metric("switchyard_gateway_kv_events_total", outcome="rate") - dropped
    )
    assert sent > 0
    assert metric("switchyard_gateway_kv_events_total", outcome="rate") - dropped > 0
