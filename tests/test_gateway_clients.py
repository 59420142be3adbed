"""What a client of `vllm serve` uses, pointed at the gateway instead: the official `openai` client (completions,
chat, streaming, models with `max_model_len`) and a Prometheus scrape of `/metrics`, whose metrics that mirror
vLLM's have vLLM's names (prefix swapped), labels and buckets, and count what the answers said (issue 41)."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from switchyard.engine_agents.stub import StubConfig
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment

#: vLLM's own (vllm/v1/metrics/loggers.py), written out here so that a drift in the gateway's fails this test.
VLLM_BUCKETS = {
    "time_to_first_token_seconds": [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0,
    ],
    "inter_token_latency_seconds": [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ],
    "e2e_request_latency_seconds": [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0,
    ],
}  # fmt: skip
PREFIX = "switchyard_gateway_"


def scrape_samples(text: str) -> list[Sample]:
    """Every sample of a text exposition (which must parse as Prometheus' format)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


async def test_the_official_openai_client_and_a_prometheus_scrape(bus: Bus, settings: SwitchyardSettings) -> None:
    async with deployment(settings, bus, [StubConfig("a", tokens=3)]) as (gw, engines):
        async with httpx.AsyncClient(base_url=gw.url) as http:
            before = scrape_samples((await http.get("/metrics")).text)  # the registry is the test process's
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        try:
            models = await client.models.list()
            completion = await client.completions.create(model="stub-model", prompt="hello", max_tokens=3)
            chat = await client.chat.completions.create(
                model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            stream = await client.completions.create(model="stub-model", prompt="hey", max_tokens=3, stream=True)
            pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
            try:
                await client.embeddings.create(model="stub-model", input="x")
            except openai.APIStatusError as exc:
                refused = exc
        finally:
            await client.close()
        async with httpx.AsyncClient(base_url=gw.url) as http:
            scrape = await http.get("/metrics")
    (card,) = models.data
    assert card.id == "stub-model" and card.model_extra["max_model_len"] == 4096  # as the engine's hello says
    assert completion.choices[0].text and completion.usage.completion_tokens == 3
    assert chat.choices[0].message.content
    assert len(pieces) == 3 and all(pieces)
    assert refused.status_code == 501 and "/v1/embeddings" in refused.message  # OpenAI's error, parsed as such
    assert len(engines["a"].received) == 3
    assert scrape.headers["content-type"].startswith("text/plain; version=")  # prometheus_client's, as vllm serve's
    after = scrape_samples(scrape.text)  # the exposition format parses

    def added(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    ours = {"model_name": "stub-model", "engine": "a", "kind": "dp"}  # vLLM's label names, and the route's kind
    for suffix, buckets in VLLM_BUCKETS.items():
        bounds = sorted(
            float(s.labels["le"])
            for s in after
            if s.name == f"{PREFIX}{suffix}_bucket" and s.labels.items() >= ours.items()
        )
        assert bounds == [*buckets, float("inf")], suffix
    assert added(f"{PREFIX}time_to_first_token_seconds_count", **ours) == 3  # one per answer, streamed or whole
    assert added(f"{PREFIX}e2e_request_latency_seconds_count", **ours) == 3
    assert added(f"{PREFIX}inter_token_latency_seconds_count", **ours) == 2  # the stream's 3 token chunks: 2 gaps
    # Generation: each whole answer's usage (3 and 3), the stream's three token events (it carried no usage).
    assert added(f"{PREFIX}generation_tokens_total", model_name="stub-model") == 3 + 3 + 3
    # Prompt: the whole answers' usage, the stream's as the gateway counted "hey" (~4 characters a token: 1).
    assert completion.usage.prompt_tokens + chat.usage.prompt_tokens == 14
    assert added(f"{PREFIX}prompt_tokens_total", model_name="stub-model") == 14 + 1
    assert total(after, f"{PREFIX}inflight_requests") == 0  # every answer is over
