"""What a client of `vllm serve` uses, pointed at the gateway instead: the official `openai` client (completions,
chat, streaming, models with `max_model_len`) and a Prometheus scrape of `/metrics` (issue 41)."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from switchyard.engine_agents.stub import StubConfig
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment


async def test_the_official_openai_client_and_a_prometheus_scrape(bus: Bus, settings: SwitchyardSettings) -> None:
    async with deployment(settings, bus, [StubConfig("a", tokens=3)]) as (gw, engines):
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
            scraped = (await http.get("/metrics")).text
    (card,) = models.data
    assert card.id == "stub-model" and card.model_extra["max_model_len"] == 4096  # as the engine's hello says
    assert completion.choices[0].text and completion.usage.completion_tokens == 3
    assert chat.choices[0].message.content
    assert len(pieces) == 3 and all(pieces)
    assert refused.status_code == 501 and "/v1/embeddings" in refused.message  # OpenAI's error, parsed as such
    assert len(engines["a"].received) == 3
    families = {f.name: f for f in text_string_to_metric_families(scraped)}  # the exposition format parses
    ttft = families["switchyard_gateway_ttft_seconds"]
    assert sum(s.value for s in ttft.samples if s.name.endswith("_count")) >= 1
