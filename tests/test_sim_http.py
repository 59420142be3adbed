"""The simulated engines' OpenAI-compatible HTTP: a real fleet on a real nats-server, real sockets, httpx.

What a gateway (or vLLM's disaggregated-serving proxy) does is done here by hand: the prefill hop with
`do_remote_decode`, the signature in the answer, the decode hop with the returned `kv_transfer_params`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import REGISTRY

from switchyard.engine_agents.sim.live.engines import LiveFleet, LiveFleetConfig
from switchyard.engine_agents.sim.live.http_loadgen import HttpLoadGenerator
from switchyard.engine_agents.sim.live.loadgen import LoadGenerator
from switchyard.engine_agents.sim.live.migration import MigrationCost
from switchyard.engine_agents.sim.live.openai_wire import BadRequest, count_text_tokens, parse_request, replay_row
from switchyard.engine_agents.sim.live.protocol import SimCompleted
from switchyard.engine_agents.sim.live.token_stream import TokenStream
from switchyard.services.gateway.service import GatewayService
from switchyard.services.gateway.settings import GatewaySettings
from switchyard.services.router.service import RouterService
from switchyard.services.router.settings import RouterSettings
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import Hello
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.signature_json import ENGINE_KEY, SIGNATURE_KEY, signature_from_json
from switchyard.simulator.offline.scenario import Scenario, prepare
from tests.conftest import SHIPPED_DATA
from tests.gateway_helpers import metric, wait_for

ESFT = SHIPPED_DATA / "routing" / "esft_deepseek_v2_lite"


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return prepare(ESFT, gpu="H100", seed=0)


@pytest.fixture
async def fleet(bus: Bus, settings: SwitchyardSettings, scenario: Scenario) -> AsyncIterator[LiveFleet]:
    router = RouterService(settings, RouterSettings(policy="jsq"))
    await router.start()
    config = LiveFleetConfig(
        prefill=1,
        decode=2,
        speed=4.0,
        http=True,
        stream_interval=4,
        routing_sample_fraction=0.0,
        migration=MigrationCost(time_scale=0.0),
    )
    fleet = LiveFleet(scenario, config)
    await fleet.start(bus)
    try:
        yield fleet
    finally:
        await fleet.stop()
        await router.stop()


async def _sse(response: httpx.Response) -> list[dict | str]:
    events: list[dict | str] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ----- pure parts -----


def test_parse_reads_what_the_physics_needs() -> None:
    ids = parse_request(b'{"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "stream": true}', "completion")
    assert (ids.prompt_tokens, ids.max_tokens, ids.stream) == (3, 9, True)
    text = parse_request(b'{"model": "m", "prompt": "hi there, you"}', "completion")
    assert text.prompt_tokens == 4 and text.max_tokens == 16 and not text.stream
    chat = parse_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}', "chat"
    )
    assert chat.prompt_tokens == 1 + 4 and chat.max_tokens == 3
    again = parse_request(b'{"model": "m", "prompt": "hi there, you", "max_tokens": 2}', "completion")
    assert replay_row(text, 1000) == replay_row(again, 1000)  # same prompt, same replayed experts
    other = parse_request(b'{"model": "m", "prompt": "something else"}', "completion")
    assert replay_row(other, 1 << 30) != replay_row(text, 1 << 30)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"prompt": "hi"}', "model"),
        (b'{"model": "m"}', "prompt"),
        (b'{"model": "m", "prompt": ""}', "prompt"),
        (b'{"model": "m", "prompt": [[1], [2]]}', "prompt"),
        (b'{"model": "m", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
        (b'{"model": "m", "prompt": "hi", "max_tokens": "8"}', "max_tokens"),
        (b'{"model": "m", "prompt": "hi", "n": 2}', "n"),
        (b'{"model": "m", "prompt": "hi", "stream": "yes"}', "stream"),
        (b'{"model": "m", "prompt": "hi", "kv_transfer_params": [1]}', "kv_transfer_params"),
    ],
)
def test_parse_names_what_is_wrong(body: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(body, "completion")
    assert caught.value.param == param and caught.value.status == 400


async def test_token_stream_chunks_like_vllms_stream_interval() -> None:
    stream = TokenStream(10, interval=4)
    got: list[tuple[int, int, bool]] = []

    async def read() -> None:
        async for chunk in stream.chunks():
            got.append(chunk)

    reader = asyncio.create_task(read())
    for generated in range(1, 11):
        stream.advance(generated, finished=generated == 10)
        await asyncio.sleep(0)
    await reader
    assert got == [(0, 1, False), (1, 4, False), (5, 4, False), (9, 1, True)]
    late = TokenStream(10, interval=4)  # a reader that wakes late merges chunks at their edges
    for generated in range(1, 8):
        late.advance(generated)
    assert (await anext(late.chunks())) == (0, 5, False)


# ----- a live fleet over HTTP -----


async def test_engines_announce_their_url_and_serve_the_openai_api(
    bus: Bus, fleet: LiveFleet, scenario: Scenario
) -> None:
    hellos: list[Hello] = []
    await bus.subscribe(bus.subjects.all_hello, Hello, lambda m, _: hellos.append(m))
    urls = fleet.base_urls()
    assert set(urls) == {"sim-p0", "sim-d0", "sim-d1"}
    for engine in [*fleet.prefills.values(), *fleet.decoders.values()]:
        await engine.agent.say_hello()
    await bus.nc.flush()
    await asyncio.sleep(0.1)
    announced = {h.engine_id: (h.base_url, h.role, h.model.name) for h in hellos}
    assert announced["sim-p0"] == (urls["sim-p0"], "prefill", scenario.model.name)
    assert announced["sim-d1"] == (urls["sim-d1"], "decode", scenario.model.name)
    model = scenario.model.name
    async with httpx.AsyncClient(base_url=urls["sim-p0"], timeout=30) as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [model]
        assert (await client.get("/health")).status_code == 200
        body = {"model": model, "prompt": "hi there", "max_tokens": 10, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = await _sse(response)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict)]
        sizes = [count_text_tokens(c["choices"][0]["text"]) for c in chunks]
        edges = list(np.cumsum(sizes))
        # Chunk edges fall where vLLM's would (the first token at once, then every 4); a reader that is late
        # under load gets neighbouring chunks merged, as vLLM's output collector merges them.
        assert edges[-1] == 10 and set(edges) <= {1, 5, 9, 10}
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        whole = await client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3})
        assert whole.status_code == 200
        answer = whole.json()
        assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 3
        assert count_text_tokens(answer["choices"][0]["text"]) == 3
        assert answer["usage"]["prompt_tokens"] == 2
    assert fleet.counters.completed == 2 and fleet.in_flight() == 0


async def test_disaggregated_hops_carry_the_signature_and_the_kv_params(
    bus: Bus, fleet: LiveFleet, scenario: Scenario
) -> None:
    done: list[SimCompleted] = []
    await bus.subscribe(bus.subjects.sim_completed, SimCompleted, lambda m, _: done.append(m))
    urls, model = fleet.base_urls(), scenario.model.name
    prompt = list(range(100, 400))
    request = {"model": model, "prompt": prompt, "max_tokens": 12, "stream": True}
    prefill_hop = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    async with httpx.AsyncClient(timeout=30) as client:
        first = (await client.post(f"{urls['sim-p0']}/v1/completions", json=prefill_hop)).json()
        again = (await client.post(f"{urls['sim-p0']}/v1/completions", json=prefill_hop)).json()
        kv = first["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "sim-p0" and kv[ENGINE_KEY] == "sim-p0"
        assert first["usage"]["completion_tokens"] == 1 and first["usage"]["prompt_tokens"] == 300
        signature = signature_from_json(kv[SIGNATURE_KEY])
        replay = replay_row(parse_request(json.dumps(request).encode(), "completion"), scenario.bank.num_requests)
        np.testing.assert_array_equal(signature, fleet.signatures[replay])
        np.testing.assert_array_equal(signature, signature_from_json(again["kv_transfer_params"][SIGNATURE_KEY]))
        pinned = {**prefill_hop, "switchyard_replay": 7}
        seventh = (await client.post(f"{urls['sim-p0']}/v1/completions", json=pinned)).json()
        np.testing.assert_array_equal(
            signature_from_json(seventh["kv_transfer_params"][SIGNATURE_KEY]), fleet.signatures[7]
        )
        stripped = {k: v for k, v in kv.items() if not k.startswith("switchyard_")}  # as the gateway does
        decode_hop = {**request, "kv_transfer_params": stripped}
        decode_sent = time.time()
        async with client.stream("POST", f"{urls['sim-d1']}/v1/completions", json=decode_hop) as response:
            events = await _sse(response)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if isinstance(e, dict))
    assert count_text_tokens(text) == 12
    await bus.nc.flush()
    for _ in range(50):
        if done:
            break
        await asyncio.sleep(0.02)
    # Three prefill-only hops; one request decoded, reported once, on the decoder the "gateway" chose.
    assert fleet.counters.prefilled_only == 3 and fleet.counters.completed == 1 and fleet.in_flight() == 0
    assert len(done) == 1 and (done[0].prefill_engine, done[0].decode_engine) == ("sim-p0", "sim-d1")
    assert done[0].output_tokens == 12
    # TTFT runs from the prefill hop's arrival (found by remote_request_id), not the decode hop's.
    assert done[0].sent_at < decode_sent and done[0].ttft_s > 0


async def test_chat_and_a_decoder_without_kv_params(fleet: LiveFleet, scenario: Scenario) -> None:
    url, model = fleet.base_urls()["sim-d0"], scenario.model.name
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            events = await _sse(response)
        whole = (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5  # include_usage
    assert events[-1] == "[DONE]"
    assert whole["object"] == "chat.completion" and whole["choices"][0]["finish_reason"] == "length"
    assert count_text_tokens(whole["choices"][0]["message"]["content"]) == 5
    assert fleet.counters.completed == 2  # the decoder prefilled both prompts itself


async def test_bad_requests_get_openais_error_shape(fleet: LiveFleet, scenario: Scenario) -> None:
    url, model = fleet.base_urls()["sim-p0"], scenario.model.name
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        broken = await client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        too_long = await client.post(
            "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": fleet.max_tokens}
        )
    assert broken.status_code == 400 and broken.json()["error"]["code"] == 400
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    assert fleet.counters.submitted == 0 and fleet.counters.rejected == 1


async def test_a_client_that_goes_away_frees_its_decoder(fleet: LiveFleet, scenario: Scenario) -> None:
    decoder = fleet.decoders["sim-d0"]
    body = {"model": scenario.model.name, "prompt": "a long answer", "max_tokens": 4000, "stream": True}
    url = fleet.base_urls()["sim-d0"]
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # the first token came; hang up
    for _ in range(200):
        if fleet.counters.aborted:
            break
        await asyncio.sleep(0.02)
    assert fleet.counters.aborted == 1 and fleet.counters.completed == 0 and fleet.in_flight() == 0
    assert decoder.engine.num_running == 0 and decoder.engine.used_blocks == 0 and not decoder.streams


# ----- the HTTP load generator -----


async def test_http_loadgen_measures_what_the_clients_see(bus: Bus, fleet: LiveFleet, scenario: Scenario) -> None:
    simulated = LoadGenerator(bus, scenario.workload(1, seed=0, rate=1.0), fleet.config.prefill_ids())
    await simulated.listen()  # only to collect the fleet's own (simulated-time) completions
    workload = scenario.workload(24, seed=5, rate=30.0, max_tokens=min(fleet.max_tokens, 2048))
    url = fleet.base_urls()["sim-p0"]
    async with HttpLoadGenerator(url, workload, speed=fleet.config.speed) as loadgen:
        assert loadgen.model == scenario.model.name  # found on /v1/models
        await loadgen.run()
        assert await loadgen.drain(timeout_s=60)
    client = loadgen.stats.summary(scale=fleet.config.speed)
    assert loadgen.sent == 24 and client["completed"] == 24 and not loadgen.stats.failed
    assert loadgen.stats.tokens == int(workload.output.sum())  # every token of every answer
    for _ in range(100):
        if len(simulated.completions) == 24:
            break
        await asyncio.sleep(0.02)
    sim = simulated.completions.summary()
    assert sim["completed"] == 24
    # Each client sees its first token no earlier than the engine emits it, so percentile by percentile
    # the client's TTFT (in simulated seconds) bounds the simulated one from above.
    assert client["ttft_p50_ms"] >= sim["ttft_p50_ms"] and client["ttft_p99_ms"] >= sim["ttft_p99_ms"]
    assert client["tpot_p50_ms"] > 0


async def test_http_loadgen_counts_failures(fleet: LiveFleet, scenario: Scenario) -> None:
    workload = scenario.workload(3, seed=5, rate=100.0, max_tokens=min(fleet.max_tokens, 2048))
    url = fleet.base_urls()["sim-p0"]
    async with HttpLoadGenerator(url, workload, model="not-served") as loadgen:
        await loadgen.run()
        assert await loadgen.drain(timeout_s=30)
    assert loadgen.stats.failed == {"http_404": 3} and len(loadgen.stats) == 0


async def test_loadgen_command_with_url(fleet: LiveFleet, tmp_path: Path) -> None:
    args = ["loadgen", "--url", fleet.base_urls()["sim-p0"], "--prefill", "1", "--decode", "2"]
    args += ["--speed", "4", "--num-requests", "8", "--rate", "40"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "switchyard.cli", *args, stdout=PIPE, stderr=PIPE, cwd=tmp_path
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["sent"] == 8 and result["completed"] == 8 and result["failed"] == 0
    assert result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] > 0
    bad = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "switchyard.cli",
        "loadgen",
        "--url",
        "http://127.0.0.1:9",
        "--num-requests",
        "1",
        stdout=PIPE,
        stderr=PIPE,
        cwd=tmp_path,
    )
    _, err = await asyncio.wait_for(bad.communicate(), timeout=120)
    assert bad.returncode != 0 and "cannot list the models" in err.decode() and "Traceback" not in err.decode()


# ----- behind the gateway -----


async def test_through_the_gateway_the_routed_decoder_serves_and_a_hang_up_frees_it(
    bus: Bus, settings: SwitchyardSettings, fleet: LiveFleet, scenario: Scenario
) -> None:
    """The request path `switchyard up` uses: gateway -> prefill engine -> sy.route.decode -> decoder."""
    done: list[SimCompleted] = []
    await bus.subscribe(bus.subjects.sim_completed, SimCompleted, lambda m, _: done.append(m))
    service = GatewayService(settings, GatewaySettings(port=0, route_timeout_s=2.0))
    await service.start()
    try:
        await wait_for(lambda: len(service.registry.live()) == 3)

        def served() -> dict[str, float]:
            return {
                d: metric("switchyard_gateway_time_to_first_token_seconds_count", engine=d, kind="disagg")
                for d in fleet.decoders
            }

        def fallbacks() -> float:  # local choices instead of the router's, whatever the reason
            return sum(
                sample.value
                for family in REGISTRY.collect()
                if family.name == "switchyard_gateway_routing_fallbacks"
                for sample in family.samples
                if sample.name.endswith("_total")
            )

        before, fallbacks_before = served(), fallbacks()
        body = {"model": scenario.model.name, "prompt": "route me", "max_tokens": 6, "stream": True}
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                events = await _sse(response)
            assert events[-1] == "[DONE]"
            await wait_for(lambda: len(done) == 1)
            # The decoder the gateway sent the decode hop to, on the router's word (no local fallback), is
            # the one the fleet says served the request, after the prefill on the only prefill engine.
            after = served()
            assert [d for d in after if after[d] > before[d]] == [done[0].decode_engine]
            assert fallbacks() == fallbacks_before and done[0].prefill_engine == "sim-p0"
            long = {**body, "max_tokens": 4000}
            async with client.stream("POST", "/v1/completions", json=long) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # hang up on the gateway after the first token
        await wait_for(lambda: fleet.counters.aborted == 1, timeout_s=30)
        assert fleet.counters.completed == 1 and fleet.in_flight() == 0
        assert all(d.engine.num_running == 0 and not d.streams for d in fleet.decoders.values())
    finally:
        await service.stop()
