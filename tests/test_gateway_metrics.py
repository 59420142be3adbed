"""The gateway's token counts from the answers it relays (`metrics.usage_of`, `metrics.StreamTokens`): vLLM's usage
where an answer has one, else one token per streamed choice event (issue 41; docs/gateway.md#metrics)."""

from __future__ import annotations

import json
from typing import Any

from switchyard.services.gateway import metrics


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event as vLLM writes it (compact JSON, as pydantic dumps it)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return event(
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    )


def vllm_chat_stream(tokens: list[str], usage: bool) -> list[bytes]:
    """vLLM's chat stream: the role-only opening event, one event per token, the last with its finish reason, then
    (asked `include_usage`) a usage chunk without choices, then `[DONE]`."""
    chunks = [chat_chunk({"role": "assistant", "content": ""})]
    chunks += [chat_chunk({"content": t}, "length" if i == len(tokens) - 1 else None) for i, t in enumerate(tokens)]
    if usage:
        counts = {"prompt_tokens": 11, "completion_tokens": len(tokens), "total_tokens": 11 + len(tokens)}
        chunks.append(event({"object": "chat.completion.chunk", "choices": [], "usage": counts}))
    return [*chunks, b"data: [DONE]\n\n"]


def tally(chunks: list[bytes]) -> tuple[metrics.StreamTokens, list[bool]]:
    tokens = metrics.StreamTokens()
    return tokens, [tokens.see(c) for c in chunks]


def test_a_stream_without_usage_counts_one_token_per_event_and_not_chat_s_opening_one() -> None:
    tokens, carried = tally(vllm_chat_stream(["a", "b", "c", "d"], usage=False))
    assert (tokens.events, tokens.completion, tokens.prompt) == (4, None, None)
    assert carried == [False, True, True, True, True, False]  # ITL: gaps between token chunks only


def test_a_stream_with_usage_takes_the_engine_s_counts() -> None:
    tokens, carried = tally(vllm_chat_stream(["a", "b"], usage=True))
    assert (tokens.completion, tokens.prompt) == (2, 11)
    assert carried[-2:] == [False, False]  # the usage chunk and [DONE] carry no token


def test_events_merged_into_one_chunk_are_all_counted() -> None:
    merged = b"".join(vllm_chat_stream(["x", "y", "z"], usage=False))  # a lagging reader, or a proxy's buffering
    tokens, carried = tally([merged])
    assert tokens.events == 3 and carried == [True]


def test_a_completion_stream_and_a_role_event_that_carries_content() -> None:
    # Completions have no role event; an engine that puts the role and the first token in one event counts it.
    text = [event({"choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in ("p", "q")]
    with_role = chat_chunk({"role": "assistant", "content": "r"})
    tokens, _ = tally([*text, with_role])
    assert tokens.events == 3


def test_usage_is_read_from_keys_only_not_from_generated_text() -> None:
    # A model that writes `"completion_tokens": 99` in its text: inside a JSON string the quotes are escaped.
    text = '{"usage": {"prompt_tokens": 5, "completion_tokens": 99}}'
    answer = {"choices": [{"index": 0, "text": text}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    assert metrics.usage_of(json.dumps(answer).encode()) == (3, 2)
    no_usage = {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}]}
    assert metrics.usage_of(json.dumps(no_usage).encode()) == (None, None)


def test_vllm_names_map_each_mirrored_metric_to_vllm_s_with_the_prefix_swapped() -> None:
    assert len(metrics.VLLM_NAMES) == 5
    for ours, theirs in metrics.VLLM_NAMES.items():
        assert ours.removeprefix("switchyard_gateway_") == theirs.removeprefix("vllm:")
