"""The gateway's added latency and throughput against a fast stub upstream, side by side with direct access and a
minimal pass-through proxy on the same HTTP stack; plus the prefill signature's JSON size and codec latency.

Budgets (issue 12): added TTFT p50 ≤ 2 ms over direct (router round trip included), added inter-token p50
≤ 0.1 ms, ≥ 500 non-streaming requests/s through one gateway process.

Two shapes (issue 27), timed in the same run beside the proxy: "gateway" asks a `switchyard router` process
(`--router remote`), "gateway-inprocess" decides with the router's core in its own process (`--router
inprocess`, the default), under the same `SWITCHYARD_*` environment as the router. Targets for the in-process
shape: added TTFT p50 within 0.3 ms of the proxy's, p99 within 1 ms of the proxy's, added ITL p50 ≤ 0.1 ms,
≥ 2,000 non-streaming req/s per gateway process; `--json` has them per shape under "shapes", the handoff's
too, and the in-process decode decision alone (`RouterCore.route_decode`, 26 × 64 signature: what the handoff
adds between the prefill answer and the decode hop when the router is in the gateway).

Set-up, every part in its own process (so no two share an event loop):

- a private nats-server;
- the stub engine (`engine_agents.stub`, Starlette on uvicorn), role `dp`, with its engine agent's part:
  hello (with its base URL) and telemetry on the bus; it streams `--tokens` SSE chunks `--token-interval-ms`
  apart and answers non-streaming requests at once;
- a prefill stub and a decode stub serving another model name (`stub-pd`), so the same gateway hands those
  requests off (the prefill answer carries a 26 × 64 uint16 signature in `kv_transfer_params`);
- `switchyard router` (Gimbal's DP rule; ELDR's decode policy, without an artifact here, so by load) and
  `switchyard gateway` twice, once per shape (`--router remote`, `--router inprocess`), configured by
  environment only;
- the pass-through proxy (`--role proxy`): what vLLM's example disaggregation proxy is, reduced to one
  upstream: Starlette on uvicorn, aiohttp to the stub (`--role proxy-httpx`: httpx), the body parsed for
  `stream` and forwarded, the answer relayed chunk by chunk;
- the client: this process, a raw HTTP/1.1 client on keep-alive sockets (so the client's own cost stays
  small next to what it measures).

Latency: one streaming request at a time, the targets taking turns request by request (load drift on this shared
machine hits all alike), in a new random order every round (`--order shuffled`, the default: its own seeded
stream), each request after the same `--idle-ms` of quiet (10 ms). TTFT is send → first chunk, inter-token latency
the gaps between chunks. The added figures are a target's p50 minus direct's p50. Why the order and the quiet:
until 2026-12-03 the targets went in one fixed order back to back (`--order fixed --idle-ms 0`), so the in-process
gateway always followed the remote one and started while that request's tail (its progress report, the router
settling it, nats-server passing it on) still held the two cores; that cost the in-process gateway's TTFT
~0.3-0.4 ms at p50 that was not its own, and never the proxy's, which always followed direct (docs/gateway.md,
"What each costs"). After each round the client times one `sy.route.dp` round
trip and one to a bare nats-py responder, each after the same 20 ms idle and in alternating order: the first
NATS request after a pause costs ~0.3 ms more here than one right behind another (nats-server and the
responder are still awake), and the gateway's own route request is always a first one. (Until 2026-12-02 the
bare one always came second, which understated the floor by that much.)

Throughput: `--concurrency` connections each keep one non-streaming request in flight for `--duration` s per
target; requests/s, and the CPU seconds the target process spent per request (from /proc), and the router's and
nats-server's in the same window (the router's is the remote shape's decision cost; idle otherwise).

Handoff: the same streaming request with model `stub-pd`, through each gateway and straight to the decode stub,
alternating; the added TTFT is the whole handoff (prefill hop, signature decode, the decode choice: a
`sy.route.decode` round trip or an in-process `RouterCore.route_decode`, decode hop) over a direct decode.

Prefix keys (issue 25), remote shape: a second remote gateway runs with `SWITCHYARD_GATEWAY_PREFIX_KEYS=false`
("gateway-off"), the first with a tokenizer for the stub's model (`SWITCHYARD_GATEWAY_TOKENIZERS`; `--tokenizer
PATH` for a real one, else a byte-level BPE trained here on synthetic words, with a BOS post-processor, which
`tokenizers` encodes at about the speed of a real one per token). Both serve DP requests of four prompt shapes,
alternating shape by shape and target by target in one run beside direct and the proxy: 1K and 8K tokens, each
"fresh" (a new prompt every request: tokenized in full) and "shared" (the first 90 % the same every request, as a
system prompt or the earlier turns of a chat: its pieces come from the gateway's piece cache). Budgets: the
gateway's added TTFT p50 with prefix keys on, over the same run with them off, ≤ +0.3 ms at 1K tokens and ≤ +1.5 ms
at 8K, tokenization included. Where the time goes is measured in this process too (`tokenize`: encode, pieces,
cache, block keys, the thread hop).

Envoy (issue 39): `envoy` (plain Envoy to the stub), `envoy-noop` (Envoy asking a do-nothing ext_proc processor:
the protocol's floor) and `envoy-epp` (Envoy asking `switchyard epp`) take their turns in the same rounds and
throughput windows as every target (bench/envoy_targets.py; "epp" in the JSON: the picker's budgets, met or not);
`--floor-attempts` adds two noop targets that try to lower the floor (a BUFFERED body; no body at all).
`--profile-epp PATH` runs the picker under cProfile. `--peers` adds vLLM's and SGLang's Rust routers (`vllm-router`,
`sglang-router` from PyPI, each in a venv of its own: bench/peer_routers.py) in front of the same stub.

Usage: .venv/bin/python bench/bench_gateway.py [--requests 300] [--duration 5] [--concurrency 32] [--json PATH]
                                                [--profile PATH] [--profile-shape inprocess|remote]
                                                [--prefix-requests 100] [--tokenizer PATH] [--compare PYTHON]
                                                [--order shuffled|fixed] [--idle-ms 10] [--floor-attempts]
                                                [--profile-epp PATH] [--peers]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import timeit
from pathlib import Path

import _single_core
import envoy_targets
import numpy as np
import peer_routers

REPO = Path(__file__).resolve().parent.parent
PREFIX = "benchgw"
TICKS = os.sysconf("SC_CLK_TCK")
HANDOFF_MODEL = "stub-pd"
#: Idle time before each timed round trip: long enough for nats-server and the responder to fall asleep, as they
#: have by the time the gateway's own route request comes (each streamed request to a target takes ~35 ms).
IDLE_BEFORE_RTT_S = 0.02
#: Quiet before each timed streaming request (`--idle-ms`): the previous request's tail work (another target's
#: progress report, its router's bookkeeping) is over, so a target's TTFT is its own.
IDLE_BEFORE_REQUEST_MS = 10.0
#: The seed of the round orders' random stream (`--order shuffled`).
ORDER_SEED = 27
BODY = {"model": "stub-model", "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 16}
#: Prompt shapes of the prefix-keys latency: (name, tokens, share of the prompt that is the same every request).
SHAPES = (("1k-fresh", 1024, 0.0), ("8k-fresh", 8192, 0.0), ("1k-shared", 1024, 0.9), ("8k-shared", 8192, 0.9))
#: Latency targets of the prefix-keys part.
PREFIX_TARGETS = ("direct", "proxy", "gateway", "gateway-off")
#: The gateway process of each shape (issue 27): "gateway" asks the router process, the other decides itself.
SHAPE_TARGETS = {"remote": "gateway", "inprocess": "gateway-inprocess"}
#: `--compare`'s target: the in-process shape run by another checkout's Python.
COMPARE = "gateway-compare"
#: Issue 27's targets for the in-process shape, on this machine.
SHAPE_TARGETS_MS = {"ttft_p50_over_proxy_ms": 0.3, "ttft_p99_over_proxy_ms": 1.0, "itl_p50_ms": 0.1}
SHAPE_TARGET_REQ_S = 2000.0


# ----- prompts and their tokenizer -----------------------------------------------------------------------------


class Words:
    """Synthetic text: words of 1-3 syllables, so a BPE learns subwords, with some punctuation and newlines."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        syllables = "ka to ri men sa lo pe tri an dor el qu is ne ur ba ch st ion ing ed er th ou al in re"
        syllables = syllables.split(" ")
        self.words = np.array(["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(30000)])
        self.rng = rng

    def text(self, n_words: int) -> str:
        words = self.rng.choice(self.words, size=n_words).tolist()
        for i in range(11, n_words, 13):
            words[i] += "," if i % 2 else ".\n"
        return " ".join(words)


def build_tokenizer(where: Path, words: Words) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenizer) trained on the synthetic words, with a BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|bos|>", "<|eos|>"],
        show_progress=False,
    )
    tok.train_from_iterator((words.text(2000) for _ in range(200)), trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    where.mkdir(parents=True, exist_ok=True)
    tok.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    return where


class Prompts:
    """Prompts of about `tokens` tokens under the tokenizer; `shared` of them the same in every prompt."""

    def __init__(self, tokenizer_dir: Path, words: Words) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.words = words
        sample = words.text(4000)
        self.tokens_per_word = len(self.tok.encode(sample).ids) / 4000
        self.shared: dict[tuple[int, float], str] = {}

    def prompt(self, tokens: int, shared: float) -> str:
        n = int(tokens / self.tokens_per_word)
        head = int(n * shared)
        if head and (tokens, shared) not in self.shared:
            self.shared[(tokens, shared)] = self.words.text(head)
        parts = [self.shared[(tokens, shared)]] if head else []
        return " ".join([*parts, self.words.text(n - head)])

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids)


# ----- helper processes ------------------------------------------------------------------------------------


async def run_stub(url: str, port: int, tokens: int, interval_s: float, engine_id: str, engine_role: str) -> None:
    """A stub engine; a prefill one answers with a DeepSeek-V2-Lite-sized signature (26 x 64, uint16)."""
    from switchyard.engine_agents.stub import StubConfig, StubEngine
    from switchyard.shared.bus import Bus
    from switchyard.shared.settings import SwitchyardSettings

    bus = await Bus.connect(SwitchyardSettings(nats_servers=[url], subject_prefix=PREFIX), name="bench-stub")
    config = StubConfig(
        engine_id,
        role=engine_role,
        model=HANDOFF_MODEL if engine_role != "dp" else "stub-model",
        tokens=tokens,
        token_interval_s=interval_s,
        answer_delay_s=0.0,
        signature=np.random.default_rng(0).integers(0, 500, size=(26, 64)).astype(np.uint16),
        hello_interval_s=1.0,
        telemetry_interval_s=0.1,
    )
    engine = StubEngine(config, bus)
    await engine.start(port)
    await asyncio.Event().wait()


async def run_proxy(port: int, upstream: str, client_kind: str) -> None:
    """The minimal pass-through proxy: Starlette on uvicorn, aiohttp upstream (the stack a hand-written proxy
    such as vLLM's disaggregation proxy example uses, and the gateway's own until issue 27, when its engine hops
    moved to `services/gateway/engine_http.py` and its responses' heads to one write with their first chunk),
    none of its routing; with `client_kind` httpx, the same proxy on httpx (vLLM's toy proxy's client)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    url = upstream + "/v1/completions"
    if client_kind == "httpx":
        import httpx

        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256), timeout=60)

        async def completions(request: Request) -> Response:
            raw = await request.body()
            if json.loads(raw).get("stream"):
                response = await client.send(
                    client.build_request("POST", url, content=raw, headers=headers), stream=True
                )

                async def relay():
                    try:
                        async for chunk in response.aiter_raw():
                            yield chunk
                    finally:
                        await response.aclose()

                return StreamingResponse(relay(), response.status_code, media_type="text/event-stream")
            response = await client.post(url, content=raw, headers=headers)
            return Response(response.content, response.status_code, media_type="application/json")

    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False)

        async def completions(request: Request) -> Response:
            raw = await request.body()
            if json.loads(raw).get("stream"):
                response = await session.post(url, data=raw, headers=headers)

                async def relay():
                    try:
                        async for chunk in response.content.iter_any():
                            yield chunk
                    finally:
                        response.release()

                return StreamingResponse(relay(), response.status, media_type="text/event-stream")
            async with session.post(url, data=raw, headers=headers) as response:
                return Response(await response.read(), response.status, media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")
    await uvicorn.Server(config).serve()


async def run_echo(url: str) -> None:
    """A bare nats-py responder on uvloop (as the router runs): it answers `<prefix>.bench.echo` with the bytes
    of a `RouteDpReply` and does nothing else, so its round trip is the floor under the router's."""
    import nats

    from switchyard.shared.codec import encode
    from switchyard.shared.schemas import RouteDpReply

    reply = encode(
        RouteDpReply(request_id="cmpl-sygw-" + "0" * 32 + "-0", engine_id="stub0", priority=90, decision_us=9.0)
    )
    nc = await nats.connect(url)

    async def answer(msg) -> None:
        await msg.respond(reply)

    await nc.subscribe(f"{PREFIX}.bench.echo", cb=answer)
    await asyncio.Event().wait()


# ----- a raw HTTP/1.1 client -----------------------------------------------------------------------------------


class Conn:
    """One keep-alive connection: POST a JSON body, read a Content-Length or chunked answer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    def send(self, body: bytes) -> None:
        assert self.writer is not None
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)

    async def head(self) -> tuple[int, dict[str, str]]:
        assert self.reader is not None
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
        return status, headers

    async def chunks(self):
        """Chunk payloads of a chunked answer, with the time each arrived."""
        assert self.reader is not None
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return
            data = await self.reader.readexactly(size + 2)
            yield time.perf_counter(), data[:-2]

    async def post(self, body: bytes) -> int:
        self.send(body)
        status, headers = await self.head()
        assert self.reader is not None
        if "content-length" in headers:
            await self.reader.readexactly(int(headers["content-length"]))
        else:
            async for _ in self.chunks():
                pass
        return status


class Turns:
    """Who goes when: the round's order of the targets, and the quiet before each request (module docstring)."""

    def __init__(
        self, order: str = "shuffled", idle_ms: float = IDLE_BEFORE_REQUEST_MS, seed: int = ORDER_SEED
    ) -> None:
        self.shuffled, self.idle_s = order == "shuffled", idle_ms / 1e3
        self.rng = np.random.default_rng(seed)

    def order(self, names: list[str], i: int) -> list[str]:
        """A new random order every round; `fixed`: as given on even rounds, reversed on odd ones."""
        if self.shuffled:
            return [names[k] for k in self.rng.permutation(len(names))]
        return names if i % 2 == 0 else names[::-1]

    async def quiet(self) -> None:
        if self.idle_s > 0:
            await asyncio.sleep(self.idle_s)


async def stream_once(conn: Conn, body: bytes) -> tuple[float, list[float], bool]:
    """TTFT and inter-chunk gaps of one streaming request; whether it ended with [DONE]."""
    start = time.perf_counter()
    conn.send(body)
    status, _ = await conn.head()
    assert status == 200, status
    times, last = [], b""
    async for at, data in conn.chunks():
        times.append(at)
        last = data
    return times[0] - start, list(np.diff(times)), last.rstrip().endswith(b"[DONE]")


async def latency(ports: dict[str, int], requests: int, nats_url: str, turns: Turns) -> dict[str, dict[str, float]]:
    """Streaming TTFT/ITL per target, and the bare `sy.route.dp` round trip the gateway makes per request."""
    from switchyard.shared.bus import Bus
    from switchyard.shared.codec import encode
    from switchyard.shared.schemas import RouteDpReply, RouteDpRequest
    from switchyard.shared.settings import SwitchyardSettings

    bus = await Bus.connect(SwitchyardSettings(nats_servers=[nats_url], subject_prefix=PREFIX), name="bench-client")
    body = json.dumps({**BODY, "stream": True}).encode()
    conns = {name: Conn(port) for name, port in ports.items()}
    for conn in conns.values():
        await conn.open()
    ttft: dict[str, list[float]] = {n: [] for n in ports}
    itl: dict[str, list[float]] = {n: [] for n in ports}
    rtt: dict[str, list[float]] = {"route": [], "echo": []}
    echo_request = encode(RouteDpRequest(request_id="cmpl-sygw-" + "0" * 32 + "-0", prompt_tokens=90))

    async def ask_router(i: int) -> None:
        await bus.request(bus.subjects.route_dp, RouteDpRequest(request_id=f"b{i}", prompt_tokens=90), RouteDpReply)

    async def ask_echo(_i: int) -> None:
        await bus.nc.request(f"{PREFIX}.bench.echo", echo_request, timeout=5)

    round_trips = {"route": ask_router, "echo": ask_echo}
    for i in range(requests + 20):
        for name in turns.order(list(conns), i) if turns.shuffled else list(conns):  # fixed: one order, as before
            await turns.quiet()
            first, gaps, done = await stream_once(conns[name], body)
            assert done, name
            if i >= 20:  # warm-up
                ttft[name].append(first)
                itl[name].extend(gaps)
        # Each after the same idle gap, in alternating order (the module docstring says why).
        for name in ("route", "echo") if i % 2 else ("echo", "route"):
            await asyncio.sleep(IDLE_BEFORE_RTT_S)
            start = time.perf_counter()
            await round_trips[name](i)
            if i >= 20:
                rtt[name].append(time.perf_counter() - start)
    await bus.close()
    router = {
        "route_dp_rtt_p50_ms": float(np.percentile(rtt["route"], 50) * 1e3),
        "echo_rtt_p50_ms": float(np.percentile(rtt["echo"], 50) * 1e3),
    }
    result: dict[str, dict[str, float]] = {
        n: {
            "ttft_p50_ms": float(np.percentile(ttft[n], 50) * 1e3),
            "ttft_p99_ms": float(np.percentile(ttft[n], 99) * 1e3),
            "itl_p50_ms": float(np.percentile(itl[n], 50) * 1e3),
            "itl_p99_ms": float(np.percentile(itl[n], 99) * 1e3),
        }
        for n in ports
    }
    return {**result, "router": router}


async def handoff_latency(
    gateway_ports: dict[str, int], decode_port: int, requests: int, turns: Turns
) -> dict[str, object]:
    """TTFT of a streaming request handed off through each gateway (prefill stub, the decode choice, decode stub)
    against the same request sent straight to the decode stub; taking turns as the latency rounds do (`Turns`), after
    a warm-up. The first shape's
    figures also sit at the top level under the names of the one-gateway bench (for older readers)."""
    body = json.dumps({**BODY, "model": HANDOFF_MODEL, "stream": True}).encode()
    conns = {name: Conn(port) for name, port in gateway_ports.items()} | {"direct": Conn(decode_port)}
    for conn in conns.values():
        await conn.open()
    ttft: dict[str, list[float]] = {name: [] for name in conns}
    for i in range(requests + 20):
        for name in turns.order(list(conns), i + 1):  # fixed: reversed first, as before
            await turns.quiet()
            first, _gaps, done = await stream_once(conns[name], body)
            assert done, name
            if i >= 20:
                ttft[name].append(first)
    p50 = {n: float(np.percentile(t, 50) * 1e3) for n, t in ttft.items()}
    p99 = {n: float(np.percentile(t, 99) * 1e3) for n, t in ttft.items()}
    shapes = {
        name: {
            "gateway_ttft_p50_ms": p50[name],
            "gateway_ttft_p99_ms": p99[name],
            "added_ttft_p50_ms": p50[name] - p50["direct"],
            "added_ttft_p99_ms": p99[name] - p99["direct"],
        }
        for name in gateway_ports
    }
    first = shapes[next(iter(gateway_ports))]
    return {
        "gateway_ttft_p50_ms": first["gateway_ttft_p50_ms"],
        "direct_decoder_ttft_p50_ms": p50["direct"],
        "direct_decoder_ttft_p99_ms": p99["direct"],
        "added_ttft_p50_ms": first["added_ttft_p50_ms"],
        "shapes": shapes,
    }


def decode_decision_figures(decoders: int = 8, calls: int = 2000) -> dict[str, dict[str, float]]:
    """What the in-process decode choice costs alone, in this process: a 26 x 64 uint16 signature's
    `RouteDecodeRequest` (validated, as `InProcessRouter.route_decode` builds it) and `RouterCore.route_decode` over
    `decoders` decoders, with ELDR's artifact (fitted here on synthetic 26 x 64 counts) and without (by load, as in
    this bench's fleet), and with the artifact but no signature (what choosing before the prefill answer would do:
    load only). Median and p99 per call, warm (a tight loop), so a lower bound of the cost inside the bench."""
    from switchyard.services.router.core import RouterCore
    from switchyard.services.router.settings import RouterSettings
    from switchyard.shared.schemas import Capacity, Hello, ModelShape, RouteDecodeRequest, Telemetry
    from switchyard.solver.eldr_fit import fit_routing_artifact
    from switchyard.solver.signatures import RequestCounts

    rng = np.random.default_rng(0)
    layers, experts, top_k = 26, 64, 6
    ids = [f"d{i}" for i in range(decoders)]
    # Synthetic counts: each request favours a few experts per layer (its "domain"), as real routing does.
    domains = rng.dirichlet(np.full(experts, 0.3), size=(decoders, layers))
    label = rng.integers(decoders, size=400)
    tokens = rng.integers(200, 2000, size=400)
    prefill = np.stack([
        np.stack([rng.multinomial(int(n) * top_k, domains[t, layer]) for layer in range(layers)])
        for t, n in zip(label, tokens, strict=True)
    ])  # fmt: skip
    counts = RequestCounts(
        prefill=prefill, decode=prefill // 4, top_k=top_k, prefill_gate=None, label=label,
        label_names=tuple(f"t{i}" for i in range(decoders)), model_name="bench-26x64",
    )  # fmt: skip
    artifact, _ = fit_routing_artifact(counts, decoders, decoder_ids=ids)
    shape = ModelShape(name=HANDOFF_MODEL, num_layers=layers, num_experts=experts, top_k=top_k)
    signatures = prefill.astype(np.uint16)

    def core_with(with_artifact: bool) -> RouterCore:
        core = RouterCore(RouterSettings(policy="eldr", replica_id="bench"))
        if with_artifact:
            core.set_artifact(artifact.model_copy(update={"model": shape}))
        capacity = Capacity(max_running=64, kv_blocks=4096, block_size=16)
        for i, engine in enumerate(ids):
            hello = Hello(engine_id=engine, role="decode", model=shape, ep_group=engine, gpus=["0"],
                          capacity=capacity, ts=0.0, agent="sim")  # fmt: skip
            core.on_hello(hello, 1000.0)
            core.on_telemetry(
                Telemetry(engine_id=engine, seq=1, ts=0.0, kv_usage=0.2, num_running=i % 5, num_waiting=0,
                          waiting_prefill_tokens=0, remaining_prefill_tokens=0, step_time_ema=0.02),
                1000.0,
            )  # fmt: skip
        return core

    cases = {
        "eldr_artifact_signature": (True, True),
        "eldr_artifact_no_signature": (True, False),
        "no_artifact_signature": (False, True),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (with_artifact, with_signature) in cases.items():
        core = core_with(with_artifact)
        build, route = np.empty(calls), np.empty(calls)
        clock = time.perf_counter
        for n in range(calls):
            signature = signatures[n % len(signatures)] if with_signature else None
            start = clock()
            request = RouteDecodeRequest(
                request_id=f"r{n}", prompt_tokens=500, signature=signature, prefill_engine_id="p0", model=HANDOFF_MODEL
            )
            built = clock()
            routed = core.route_decode(request, 1000.0 + n * 1e-4)
            route[n], build[n] = clock() - built, built - start
            assert routed.decision is not None, routed.reply
            core.fleet.on_progress((), [f"r{n}"])  # the request ends: loads stay where telemetry put them
        out[name] = {
            "request_build_p50_us": float(np.percentile(build, 50) * 1e6),
            "route_decode_p50_us": float(np.percentile(route, 50) * 1e6),
            "route_decode_p99_us": float(np.percentile(route, 99) * 1e6),
            "total_p50_us": float(np.percentile(build + route, 50) * 1e6),
            "fallback": routed.reply.fallback,  # type: ignore[union-attr]
        }
    return out


async def prefix_latency(ports: dict[str, int], prompts: Prompts, requests: int, turns: Turns) -> dict[str, object]:
    """Streaming TTFT per prompt shape and target (direct, proxy, gateway with prefix keys on, and off); shapes
    alternate and targets take turns (`Turns`) request by request (drift on this shared machine hits all alike).
    Each shape's prompt is made anew per round (a fresh one differs in full, a shared one in its last 10 %), and
    every target gets it."""
    conns = {name: Conn(ports[name]) for name in PREFIX_TARGETS}
    for conn in conns.values():
        await conn.open()
    ttft: dict[str, dict[str, list[float]]] = {shape[0]: {n: [] for n in PREFIX_TARGETS} for shape in SHAPES}
    tokens: dict[str, list[int]] = {shape[0]: [] for shape in SHAPES}
    warm = 10
    for i in range(requests + warm):
        for name, size, shared in SHAPES if i % 2 == 0 else SHAPES[::-1]:
            prompt = prompts.prompt(size, shared)
            if i < 3:
                tokens[name].append(prompts.count(prompt))
            body = json.dumps({**BODY, "prompt": prompt, "stream": True}).encode()
            for target in turns.order(list(PREFIX_TARGETS), i // 2):
                await turns.quiet()
                first, _gaps, done = await stream_once(conns[target], body)
                assert done, target
                if i >= warm:
                    ttft[name][target].append(first)
    out: dict[str, object] = {}
    for name, _size, _shared in SHAPES:
        p50 = {t: float(np.percentile(ttft[name][t], 50) * 1e3) for t in PREFIX_TARGETS}
        out[name] = {
            "prompt_tokens": int(np.mean(tokens[name])),
            "ttft_p50_ms": p50,
            "ttft_p99_ms": {t: float(np.percentile(ttft[name][t], 99) * 1e3) for t in PREFIX_TARGETS},
            "added_by_prefix_keys_p50_ms": p50["gateway"] - p50["gateway-off"],
            "gateway_added_vs_proxy_p50_ms": p50["gateway"] - p50["proxy"],
            "gateway_off_added_vs_proxy_p50_ms": p50["gateway-off"] - p50["proxy"],
        }
    return out


async def tokenize_figures(tokenizer_dir: Path, prompts: Prompts, n: int = 40) -> dict[str, object]:
    """Where a request's prefix-keys time goes, in this process: the tokenizer on one text whole (`encode`, on
    the calling thread), the gateway's keys as it computes them (`PromptKeyer.keys`: thread hop, pieces, piece
    cache, block keys), block keys alone, and the bare thread hop."""
    from concurrent.futures import ThreadPoolExecutor

    from switchyard.services.gateway.prompt_keys import PromptKeyer
    from switchyard.shared.prefix_keys import block_keys

    keyer = PromptKeyer(f"stub-model={tokenizer_dir}")
    keyer_all = PromptKeyer(f"stub-model={tokenizer_dir}", tokenize_all=True)
    model = keyer.tokenizers["stub-model"]
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1)
    hops = []
    for _ in range(200):
        start = time.perf_counter()
        await loop.run_in_executor(pool, int)
        hops.append(time.perf_counter() - start)
    out: dict[str, object] = {
        "pieces": model.pieces,
        "inline_chars": keyer.inline_chars,
        "piece_chars": model.piece_chars,
        "thread_hop_p50_us": float(np.percentile(hops, 50) * 1e6),
    }
    for name, size, shared in SHAPES:
        whole, keys, keys_all, bare = [], [], [], []
        for _ in range(n):
            text = prompts.prompt(size, shared)
            body = {"prompt": text}
            start = time.perf_counter()
            ids = model.tokenizer.encode(text).ids
            whole.append(time.perf_counter() - start)
            start = time.perf_counter()
            await keyer.keys(body, False, "stub-model", 16)
            keys.append(time.perf_counter() - start)
            start = time.perf_counter()
            got = await keyer_all.keys(body, False, "stub-model", 16)
            keys_all.append(time.perf_counter() - start)
            assert got.kind == "tokens" and got.tokens == len(ids)
            start = time.perf_counter()
            block_keys(np.asarray(ids), 16)
            bare.append(time.perf_counter() - start)
        out[name] = {
            "chars": len(text),
            "encode_whole_p50_ms": float(np.percentile(whole, 50) * 1e3),
            "gateway_keys_p50_ms": float(np.percentile(keys, 50) * 1e3),
            "gateway_keys_tokenize_all_p50_ms": float(np.percentile(keys_all, 50) * 1e3),
            "block_keys_p50_us": float(np.percentile(bare, 50) * 1e6),
        }
    pieces = keyer_all.tokenizers["stub-model"]  # the seen-text keyer remembers keys: its pieces are rarely asked
    out["piece_cache_tokenize_all"] = {"hits": pieces.cache_hits, "misses": pieces.cache_misses}
    keyer.close()
    keyer_all.close()
    pool.shutdown()
    return out


async def throughput(
    port: int, duration: float, concurrency: int, pid: int | None, others: dict[str, int] | None = None
) -> dict[str, float]:
    """Requests/s and CPU ms per request of the target process; and of `others` (name → pid: the router, whose
    share the remote shape adds, and nats-server) as `<name>_cpu_ms_per_req`, for sizing (docs/deploy.md)."""
    others = others or {}
    body = json.dumps(BODY).encode()
    conns = [Conn(port) for _ in range(concurrency)]
    for conn in conns:
        await conn.open()
    for conn in conns:  # warm-up
        await conn.post(body)
    done, errors = 0, 0
    stop_at = time.perf_counter() + duration
    cpu0 = cpu_seconds(pid) if pid else 0.0
    others0 = {name: cpu_seconds(other) for name, other in others.items()}

    async def worker(conn: Conn) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            if await conn.post(body) == 200:
                done += 1
            else:
                errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - start
    cpu = (cpu_seconds(pid) - cpu0) if pid else float("nan")
    out = {"req_per_s": done / elapsed, "errors": errors, "cpu_ms_per_req": cpu / max(done, 1) * 1e3}
    for name, other in others.items():
        out[f"{name}_cpu_ms_per_req"] = (cpu_seconds(other) - others0[name]) / max(done, 1) * 1e3
    return out


# ----- signatures --------------------------------------------------------------------------------------------


def signature_figures() -> list[dict[str, object]]:
    from switchyard.shared.codec import decode, encode
    from switchyard.shared.schemas import PrefillSignature
    from switchyard.shared.signature_json import signature_from_json, signature_to_json

    rng = np.random.default_rng(0)
    rows = []
    for layers, experts in ((26, 64), (58, 256)):
        for dtype in (np.uint16, np.uint32):
            counts = rng.integers(0, 2000, size=(layers, experts)).astype(dtype)
            obj = signature_to_json(counts)
            text = json.dumps(obj)
            n = 2000
            enc = min(timeit.repeat(lambda c=counts: json.dumps(signature_to_json(c)), number=n, repeat=3)) / n
            dec = min(timeit.repeat(lambda t=text: signature_from_json(json.loads(t)), number=n, repeat=3)) / n
            assert np.array_equal(signature_from_json(json.loads(text)), counts)
            message = PrefillSignature(
                engine_id="p0", request_id="cmpl-sygw-" + "0" * 32 + "-0", ts=0.0, prompt_tokens=1, signature=counts
            )
            wire = encode(message)
            bus_enc = min(timeit.repeat(lambda m=message: encode(m), number=n, repeat=3)) / n
            bus_dec = min(timeit.repeat(lambda w=wire: decode(w, PrefillSignature), number=n, repeat=3)) / n
            rows.append(
                {
                    "shape": f"{layers}x{experts}",
                    "dtype": np.dtype(dtype).str,
                    "json_bytes": len(text),
                    "encode_us": enc * 1e6,
                    "decode_us": dec * 1e6,
                    "bus_bytes": len(wire),
                    "bus_encode_us": bus_enc * 1e6,
                    "bus_decode_us": bus_dec * 1e6,
                }
            )
    return rows


# ----- orchestration -----------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def wait_http(port: int, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listening on port {port}")


def wait_ready(port: int, timeout: float = 60.0) -> None:
    """Until the gateway lists both models (every stub said hello)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).json()["data"]
            if {m["id"] for m in models} == {"stub-model", HANDOFF_MODEL}:
                return
        time.sleep(0.1)
    raise RuntimeError("the gateway never saw every stub engine")


def shape_figures(
    lat: dict[str, dict[str, float]],
    tput: dict[str, dict[str, float]],
    handoff: dict[str, object],
    proxy_added: dict[str, float],
) -> dict[str, dict[str, object]]:
    """Issue 27's figures per gateway shape, "added" over direct as everywhere here, and each target met or not
    (the targets are the in-process shape's; the remote one is measured against the same for comparison)."""
    direct = lat["direct"]
    per_handoff: dict[str, dict[str, float]] = handoff["shapes"]  # type: ignore[assignment]
    out: dict[str, dict[str, object]] = {}
    for shape, name in SHAPE_TARGETS.items():
        added = {q: lat[name][f"ttft_{q}_ms"] - direct[f"ttft_{q}_ms"] for q in ("p50", "p99")}
        figures: dict[str, object] = {
            "target": name,
            "added_ttft_p50_ms": added["p50"],
            "added_ttft_p99_ms": added["p99"],
            "added_itl_p50_ms": lat[name]["itl_p50_ms"] - direct["itl_p50_ms"],
            "req_s": tput[name]["req_per_s"],
            "cpu_ms_per_req": tput[name]["cpu_ms_per_req"],
            "router_cpu_ms_per_req": tput[name]["router_cpu_ms_per_req"],
            "nats_cpu_ms_per_req": tput[name]["nats_cpu_ms_per_req"],
            "proxy_added_ttft_p50_ms": proxy_added["p50"],
            "proxy_added_ttft_p99_ms": proxy_added["p99"],
            "over_proxy_ttft_p50_ms": added["p50"] - proxy_added["p50"],
            "over_proxy_ttft_p99_ms": added["p99"] - proxy_added["p99"],
            "handoff_added_ttft_p50_ms": per_handoff[name]["added_ttft_p50_ms"],
            "handoff_added_ttft_p99_ms": per_handoff[name]["added_ttft_p99_ms"],
        }
        figures["targets_met"] = {
            "ttft_p50_within_0.3_ms_of_proxy": figures["over_proxy_ttft_p50_ms"]
            <= SHAPE_TARGETS_MS["ttft_p50_over_proxy_ms"],
            "ttft_p99_within_1_ms_of_proxy": figures["over_proxy_ttft_p99_ms"]
            <= SHAPE_TARGETS_MS["ttft_p99_over_proxy_ms"],
            "itl_p50_at_most_0.1_ms": figures["added_itl_p50_ms"] <= SHAPE_TARGETS_MS["itl_p50_ms"],
            "at_least_2000_req_s": figures["req_s"] >= SHAPE_TARGET_REQ_S,
        }
        out[shape] = figures
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["main", "stub", "proxy", "proxy-httpx", "echo", "noop"], default="main")
    parser.add_argument("--url", default="")
    parser.add_argument("--engine-id", default="stub0")
    parser.add_argument("--engine-role", choices=["dp", "prefill", "decode"], default="dp")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", default="")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-interval-ms", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--order", choices=["shuffled", "fixed"], default="shuffled", help="The targets' order in each latency round."
    )
    parser.add_argument(
        "--idle-ms", type=float, default=IDLE_BEFORE_REQUEST_MS, help="Quiet before each timed streaming request."
    )
    parser.add_argument("--profile", type=Path, default=None, help="Run a gateway under cProfile, stats to PATH.")
    parser.add_argument("--profile-shape", choices=list(SHAPE_TARGETS), default="inprocess", help="... this one.")
    parser.add_argument("--prefix-requests", type=int, default=100, help="Rounds of the prefix-keys latency.")
    parser.add_argument("--tokenizer", type=Path, default=None, help="A real tokenizer (dir or tokenizer.json).")
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="Also time an in-process gateway run by this Python (another checkout's venv): before and after, one run.",
    )
    parser.add_argument(
        "--floor-attempts", action="store_true", help="Also time the Envoy floor attempts (bench/envoy_targets.py)."
    )
    parser.add_argument("--profile-epp", type=Path, default=None, help="Run the picker under cProfile, stats to PATH.")
    parser.add_argument(
        "--peers", action="store_true", help="Also time vllm-router and sglang-router (bench/peer_routers.py)."
    )
    args = parser.parse_args()
    if args.role == "noop":  # the do-nothing ext_proc processor, naming --upstream (ip:port)
        asyncio.run(envoy_targets.run_noop(args.port, args.upstream))
        return
    if args.role == "stub":
        interval = args.token_interval_ms / 1e3
        asyncio.run(run_stub(args.url, args.port, args.tokens, interval, args.engine_id, args.engine_role))
        return
    if args.role == "echo":
        import uvloop

        uvloop.run(run_echo(args.url))
        return
    if args.role in ("proxy", "proxy-httpx"):
        asyncio.run(run_proxy(args.port, args.upstream, "httpx" if args.role == "proxy-httpx" else "aiohttp"))
        return

    import tempfile

    from switchyard.shared.embedded import EmbeddedNats, free_port

    here = [sys.executable, str(Path(__file__).resolve())]
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env |= {"SWITCHYARD_SUBJECT_PREFIX": PREFIX, "SWITCHYARD_LOG_LEVEL": "WARNING"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        nats = EmbeddedNats(Path(tmp))
        url = nats.start()
        ports = {
            "direct": free_port(),
            "proxy": free_port(),
            "proxy-httpx": free_port(),
            "gateway": free_port(),
            "gateway-off": free_port(),
            "gateway-inprocess": free_port(),
        }
        if args.compare:
            ports[COMPARE] = free_port()
        envoys = envoy_targets.EnvoyTargets(Path(tmp), url, ports["direct"], args.floor_attempts)
        ports |= envoys.ports
        words = Words()
        if args.tokenizer is not None:
            tokenizer_dir = args.tokenizer if args.tokenizer.is_dir() else args.tokenizer.parent
        else:
            tokenizer_dir = build_tokenizer(Path(tmp) / "tokenizer", words)
        prompts = Prompts(tokenizer_dir, words)
        try:
            procs["stub"] = subprocess.Popen(
                [
                    *here,
                    "--role",
                    "stub",
                    "--url",
                    url,
                    "--port",
                    str(ports["direct"]),
                    "--tokens",
                    str(args.tokens),
                    "--token-interval-ms",
                    str(args.token_interval_ms),
                ],
                env=env,
            )
            handoff_ports = {"p0": free_port(), "d0": free_port()}
            for engine_id, role in (("p0", "prefill"), ("d0", "decode")):
                stub = ["--role", "stub", "--url", url, "--port", str(handoff_ports[engine_id]), "--tokens"]
                stub += [str(args.tokens), "--token-interval-ms", str(args.token_interval_ms)]
                stub += ["--engine-id", engine_id, "--engine-role", role]
                procs[engine_id] = subprocess.Popen([*here, *stub], env=env)
            procs["router"] = subprocess.Popen([str(bin_dir / "switchyard"), "router", "--nats-url", url], env=env)
            procs["echo"] = subprocess.Popen([*here, "--role", "echo", "--url", url], env=env)
            upstream = f"http://127.0.0.1:{ports['direct']}"
            for role in ("proxy", "proxy-httpx"):
                procs[role] = subprocess.Popen(
                    [*here, "--role", role, "--port", str(ports[role]), "--upstream", upstream], env=env
                )
            # Every gateway gets the router's environment (`env`: its SWITCHYARD_ROUTER_* too, were any set), so the
            # in-process one decides by the same settings; the prefix-keys pair and "gateway" ask the router.
            keyed = env | {"SWITCHYARD_GATEWAY_TOKENIZERS": f"stub-model={tokenizer_dir}"}
            gateways = {
                "gateway": ("remote", keyed),
                "gateway-off": ("remote", keyed | {"SWITCHYARD_GATEWAY_PREFIX_KEYS": "false"}),
                "gateway-inprocess": ("inprocess", keyed),
            }
            if args.compare:
                gateways[COMPARE] = ("inprocess", keyed)
            for name, (shape, gateway_env) in gateways.items():
                cli = ["-m", "switchyard.cli", "gateway", "--nats-url", url, "--port", str(ports[name])]
                cli += ["--router", shape]
                if args.profile and name == SHAPE_TARGETS[args.profile_shape]:
                    cli = ["-m", "cProfile", "-o", str(args.profile), *cli]
                python = str(args.compare) if name == COMPARE else sys.executable
                procs[name] = subprocess.Popen([python, *cli], env=gateway_env)
            envoys.start(procs, here, keyed, args.profile_epp)  # the picker decides as the in-process gateway
            for port in [*ports.values(), *handoff_ports.values()]:
                wait_http(port)
            for name in gateways:
                wait_ready(ports[name])
            envoys.wait_ready()
            if args.peers:  # vLLM's and SGLang's routers, those that install and start here
                peers = peer_routers.PeerRouters(Path(tmp), ports["direct"])
                peers.start(procs, env)
                ports |= peers.wait_ready(procs)
            time.sleep(1.5)  # the router has every stub's hello (announce, or the next periodic one) and telemetry
            load_before = os.getloadavg()
            turns = Turns(args.order, args.idle_ms)
            lat = asyncio.run(latency(ports, args.requests, url, turns))
            shape_ports = {name: ports[name] for name in SHAPE_TARGETS.values()}
            handoff = asyncio.run(handoff_latency(shape_ports, handoff_ports["d0"], args.requests, turns))
            prefix = asyncio.run(prefix_latency(ports, prompts, args.prefix_requests, turns))
            pids = {name: procs["stub" if name == "direct" else name].pid for name in ports}
            assert nats.process is not None
            others = {"router": procs["router"].pid, "nats": nats.process.pid}
            processors = envoys.processor_pids(procs)  # an Envoy target's ext_proc processor, beside Envoy's CPU
            tput = {
                name: asyncio.run(
                    throughput(port, args.duration, args.concurrency, pids[name], others | processors.get(name, {}))
                )
                for name, port in ports.items()
            }
            load_after = os.getloadavg()
            tokenize = asyncio.run(tokenize_figures(tokenizer_dir, prompts))  # the other processes idle now
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            nats.stop()
    sigs = signature_figures()
    decode_decision = decode_decision_figures()
    rtts = lat.pop("router")
    router_rtt, echo_rtt = rtts["route_dp_rtt_p50_ms"], rtts["echo_rtt_p50_ms"]
    direct = lat["direct"]
    proxy_added = {q: lat["proxy"][f"ttft_{q}_ms"] - direct[f"ttft_{q}_ms"] for q in ("p50", "p99")}
    shapes = shape_figures(lat, tput, handoff, proxy_added)
    epp = envoy_targets.figures(lat, tput)
    report = {
        "machine": _single_core.machine(),
        "load_avg_1m_before_after": [load_before[0], load_after[0]],
        "settings": {k: v for k, v in vars(args).items() if k not in ("role", "url", "port", "upstream", "json")},
        "latency": lat,
        "added_vs_direct": {
            name: {
                "ttft_p50_ms": lat[name]["ttft_p50_ms"] - direct["ttft_p50_ms"],
                "itl_p50_ms": lat[name]["itl_p50_ms"] - direct["itl_p50_ms"],
            }
            for name in ports
            if name != "direct"
        },
        "route_dp_rtt_p50_ms": router_rtt,
        "echo_rtt_p50_ms": echo_rtt,
        # what any gateway that asks a router over NATS adds at least: a proxy hop plus a bare NATS round trip
        "floor_added_ttft_p50_ms": lat["proxy"]["ttft_p50_ms"] - direct["ttft_p50_ms"] + echo_rtt,
        "handoff": handoff,
        "throughput": tput,
        "proxy_added_ttft_p50_ms": proxy_added["p50"],
        "proxy_added_ttft_p99_ms": proxy_added["p99"],
        "shapes": shapes,
        "epp": epp,
        # --compare: the same in-process shape from another checkout, timed in this run
        "compare": None
        if not args.compare
        else {
            "python": str(args.compare),
            "added_ttft_p50_ms": lat[COMPARE]["ttft_p50_ms"] - direct["ttft_p50_ms"],
            "added_ttft_p99_ms": lat[COMPARE]["ttft_p99_ms"] - direct["ttft_p99_ms"],
            "over_proxy_ttft_p50_ms": lat[COMPARE]["ttft_p50_ms"] - lat["proxy"]["ttft_p50_ms"],
            "over_proxy_ttft_p99_ms": lat[COMPARE]["ttft_p99_ms"] - lat["proxy"]["ttft_p99_ms"],
            "req_s": tput[COMPARE]["req_per_s"],
            "cpu_ms_per_req": tput[COMPARE]["cpu_ms_per_req"],
        },
        "decode_decision_in_process": decode_decision,
        "signature_json": sigs,
        "prefix_keys": {
            "budgets_ms": {"1k": 0.3, "8k": 1.5},
            "tokenizer": str(args.tokenizer) if args.tokenizer else "byte-level BPE trained on synthetic words",
            "latency": prefix,
            "tokenize": tokenize,
        },
    }
    print(f"# {report['machine']}; load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(
        f"{'target':17} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'added TTFT':>10} {'added ITL':>9}"
        f" {'req/s':>7} {'CPU ms/req':>10} {'router':>7} {'nats':>7}"
    )
    for name in ports:
        added = report["added_vs_direct"].get(name, {"ttft_p50_ms": 0.0, "itl_p50_ms": 0.0})
        print(
            f"{name:17} {lat[name]['ttft_p50_ms']:9.3f} {lat[name]['ttft_p99_ms']:7.2f} {lat[name]['itl_p50_ms']:8.3f}"
            f" {lat[name]['itl_p99_ms']:7.2f} {added['ttft_p50_ms']:10.3f} {added['itl_p50_ms']:9.3f}"
            f" {tput[name]['req_per_s']:7.0f} {tput[name]['cpu_ms_per_req']:10.3f}"
            f" {tput[name]['router_cpu_ms_per_req']:7.3f} {tput[name]['nats_cpu_ms_per_req']:7.3f}"
        )
    print(
        f"sy.route.dp round trip alone (bench client -> router), p50: {router_rtt:.3f} ms; a bare nats-py responder's "
        f"round trip (the floor under it): {echo_rtt:.3f} ms"
    )
    gateway_added = report["added_vs_direct"]["gateway"]["ttft_p50_ms"]
    print(
        f"floor for a gateway that asks a router over NATS (added proxy TTFT + bare round trip): "
        f"{report['floor_added_ttft_p50_ms']:.3f} ms; the gateway adds {gateway_added:.3f} ms"
    )
    print(
        f"handoff (prefill stub, 26x64 signature, the decode choice, decode stub): TTFT p50 / p99 straight to the "
        f"decoder {handoff['direct_decoder_ttft_p50_ms']:.3f} / {handoff['direct_decoder_ttft_p99_ms']:.2f} ms; "
        "added by"
    )
    for shape, name in SHAPE_TARGETS.items():
        row = handoff["shapes"][name]  # type: ignore[index]
        print(f"  {shape:9} gateway: +{row['added_ttft_p50_ms']:.3f} ms p50, +{row['added_ttft_p99_ms']:.2f} ms p99")
    print(
        f"two shapes (issue 27; targets: TTFT p50 ≤ proxy + {SHAPE_TARGETS_MS['ttft_p50_over_proxy_ms']} ms, p99 ≤ "
        f"proxy + {SHAPE_TARGETS_MS['ttft_p99_over_proxy_ms']} ms, ITL ≤ {SHAPE_TARGETS_MS['itl_p50_ms']} ms, "
        f"≥ {SHAPE_TARGET_REQ_S:.0f} req/s); the proxy adds {proxy_added['p50']:.3f} ms p50, {proxy_added['p99']:.2f} "
        "ms p99"
    )
    print(
        f"  {'shape':9} {'added TTFT p50':>14} {'over proxy':>10} {'p99':>7} {'over proxy':>10} {'ITL p50':>8}"
        f" {'req/s':>6} {'handoff p50':>11} {'p99':>6}  targets missed"
    )
    for shape, row in shapes.items():
        missed = [k for k, ok in row["targets_met"].items() if not ok]  # type: ignore[union-attr]
        print(
            f"  {shape:9} {row['added_ttft_p50_ms']:14.3f} {row['over_proxy_ttft_p50_ms']:+10.3f}"
            f" {row['added_ttft_p99_ms']:7.2f} {row['over_proxy_ttft_p99_ms']:+10.2f} {row['added_itl_p50_ms']:8.3f}"
            f" {row['req_s']:6.0f} {row['handoff_added_ttft_p50_ms']:11.3f} {row['handoff_added_ttft_p99_ms']:6.2f}"
            f"  {', '.join(missed) or 'none'}"
        )
    print("\n".join(envoy_targets.report_lines(epp)))
    print("in-process decode choice alone (8 decoders, 26x64 signature, warm loop): µs p50 (request + route_decode)")
    for name, row in decode_decision.items():
        print(
            f"  {name:27} {row['total_p50_us']:6.1f} (route_decode p50 {row['route_decode_p50_us']:.1f}, p99 "
            f"{row['route_decode_p99_us']:.1f}; fallback {row['fallback']})"
        )
    print("signature: in kv_transfer_params (JSON) | as a PrefillSignature on the bus (msgpack)")
    for row in sigs:
        print(
            f"  {row['shape']:7} {row['dtype']}: {row['json_bytes']:6d} B, encode {row['encode_us']:6.1f} µs, "
            f"decode {row['decode_us']:6.1f} µs | {row['bus_bytes']:6d} B, encode {row['bus_encode_us']:6.1f} µs, "
            f"decode {row['bus_decode_us']:6.1f} µs"
        )
    print(
        f"prefix keys (DP, stub {args.tokens} tokens): TTFT p50 ms per target; added by prefix keys = gateway - "
        "gateway-off (budget 1K ≤ 0.3 ms, 8K ≤ 1.5 ms)"
    )
    print(
        f"  {'shape':10} {'tokens':>6} " + " ".join(f"{t:>11}" for t in PREFIX_TARGETS) + f" {'added':>7} {'p99s':>9}"
    )
    for name, _size, _shared in SHAPES:
        row = prefix[name]
        p99 = row["ttft_p99_ms"]
        print(
            f"  {name:10} {row['prompt_tokens']:6d} "
            + " ".join(f"{row['ttft_p50_ms'][t]:11.3f}" for t in PREFIX_TARGETS)
            + f" {row['added_by_prefix_keys_p50_ms']:+7.3f} {p99['gateway']:4.1f}/{p99['gateway-off']:4.1f}"
        )
    print(
        f"tokenization in this process (pieces: {tokenize['pieces']}; thread hop p50 "
        f"{tokenize['thread_hop_p50_us']:.0f} µs; piece cache with tokenize_all {tokenize['piece_cache_tokenize_all']})"
    )
    for name, _size, _shared in SHAPES:
        row = tokenize[name]
        print(
            f"  {name:10} {row['chars']:6d} chars: encode whole {row['encode_whole_p50_ms']:7.3f} ms, the gateway's "
            f"keys {row['gateway_keys_p50_ms']:7.3f} ms (tokenize_all {row['gateway_keys_tokenize_all_p50_ms']:7.3f}"
            f" ms), block keys alone {row['block_keys_p50_us']:6.1f} µs"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
