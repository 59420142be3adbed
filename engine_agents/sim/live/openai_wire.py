"""The OpenAI-compatible request and response shapes a simulated engine speaks, as pure functions.

A simulated engine has no tokenizer and no weights, so it reads from a request only what its physics needs:

- the prompt's length: a list of token ids counts exactly (what `switchyard loadgen --url` sends); text is
  counted as words and punctuation marks (a rough stand-in for a tokenizer); chat messages add 4 tokens each
  for the template;
- `max_tokens` (`max_completion_tokens` for chat; default 16, as vLLM's completions): the engine always
  generates exactly that many tokens (as vLLM with `ignore_eos`), finish reason `length`;
- which real routing-trace request to replay: `switchyard_replay` if given, else a stable hash of the prompt,
  so the same prompt always selects the same experts (and so the same signature);
- `kv_transfer_params`, as vLLM's disaggregated-serving proxy sends them (`do_remote_decode` to a prefill
  engine, the prefill's returned params to a decoder).

Everything else in the body is accepted and ignored. Bad bodies raise `BadRequest`, which the server turns
into OpenAI's error shape with status 400.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

#: vLLM's default `max_tokens` for completions.
DEFAULT_MAX_TOKENS = 16
#: Template tokens a chat message adds around its content (role markers), roughly.
CHAT_TOKENS_PER_MESSAGE = 4
_WORDS = re.compile(r"\w+|[^\w\s]")
#: What the simulated engines "say": the text has no meaning, only a length.
_VOCAB = (" the", " expert", " routes", " every", " token", " to", " a", " decoder", ",", " and", " then", ".")

Kind = Literal["completion", "chat"]


class BadRequest(ValueError):
    """A body the engine cannot serve; `param` names the offending field (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class ParsedRequest:
    kind: Kind
    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    replay_key: bytes  # what the replay row is hashed from, when `replay` is None
    replay: int | None
    kv_transfer_params: dict[str, Any] | None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def remote_decode(self) -> bool:
        """A prefill-only request (vLLM's proxy's first hop): prefill, answer one token and the KV params."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    @property
    def remote_prefill(self) -> bool:
        """A decode hop: the prompt's KV comes from the prefill engine named in the params."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_prefill"))


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (what vLLM answers too)."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def count_text_tokens(text: str) -> int:
    return len(_WORDS.findall(text))


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}", name)
    return value


def _prompt(body: dict[str, Any]) -> tuple[int, bytes]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return count_text_tokens(prompt), prompt.encode()
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return len(prompt), json.dumps(prompt, separators=(",", ":")).encode()
    if prompt is None:
        raise BadRequest("prompt is required", "prompt")
    raise BadRequest("prompt must be a string or a list of token ids (batches are not supported)", "prompt")


def _messages(body: dict[str, Any]) -> tuple[int, bytes]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    tokens = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: count the text ones
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", "messages")
        tokens += count_text_tokens(content) + CHAT_TOKENS_PER_MESSAGE
    return tokens, json.dumps(messages, sort_keys=True, separators=(",", ":")).encode()


def parse_request(raw: bytes, kind: Kind, headers_request_id: str | None = None) -> ParsedRequest:
    """Validate a `/v1/completions` or `/v1/chat/completions` body (raises `BadRequest`)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required", "model")
    prompt_tokens, key = _prompt(body) if kind == "completion" else _messages(body)
    if prompt_tokens < 1:
        raise BadRequest("the prompt is empty", "prompt" if kind == "completion" else "messages")
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int_field(body, name, DEFAULT_MAX_TOKENS)
    assert max_tokens is not None
    if max_tokens < 1:
        raise BadRequest(f"{name} must be at least 1", name)
    n = _int_field(body, "n", 1)
    if n != 1:
        raise BadRequest("only n = 1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest("kv_transfer_params must be an object", "kv_transfer_params")
    replay = _int_field(body, "switchyard_replay", None)
    if replay is not None and replay < 0:
        raise BadRequest("switchyard_replay must be >= 0", "switchyard_replay")
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = body.get("request_id") or headers_request_id or f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(request_id, str) or len(request_id) > 128:
        raise BadRequest("request_id must be a string of at most 128 characters", "request_id")
    return ParsedRequest(
        kind=kind,
        request_id=request_id,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        replay_key=key,
        replay=replay,
        kv_transfer_params=kv,
    )


def replay_row(request: ParsedRequest, rows: int) -> int:
    """The replay-bank row a request reproduces: its own if given, else a stable hash of its prompt."""
    if request.replay is not None:
        if request.replay >= rows:
            raise BadRequest(f"switchyard_replay must be < {rows}", "switchyard_replay")
        return request.replay
    digest = hashlib.blake2b(request.replay_key, digest_size=8).digest()
    return int.from_bytes(digest, "little") % rows


def token_text(start: int, count: int, seed: int = 0) -> str:
    """Text for output tokens `start .. start + count - 1` (one vocabulary word each)."""
    return "".join(_VOCAB[(seed + k) % len(_VOCAB)] for k in range(start, start + count))


def usage(request: ParsedRequest, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": request.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": request.prompt_tokens + completion_tokens,
    }


def response_body(
    request: ParsedRequest, text: str, tokens: int, kv_transfer_params: dict[str, Any] | None
) -> dict[str, Any]:
    """The non-streaming answer (finish reason `length`: the engine generates exactly `max_tokens`)."""
    if request.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        obj = "text_completion"
    return {
        "id": request.request_id,
        "object": obj,
        "created": request.created,
        "model": request.model,
        "choices": [choice],
        "usage": usage(request, tokens),
        "kv_transfer_params": kv_transfer_params,
    }


def chunk_body(
    request: ParsedRequest,
    text: str,
    finished: bool,
    first: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk (`text_completion` or `chat.completion.chunk`)."""
    reason = "length" if finished else None
    if request.kind == "chat":
        delta: dict[str, Any] = {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        obj = "text_completion"
    body: dict[str, Any] = {
        "id": request.request_id,
        "object": obj,
        "created": request.created,
        "model": request.model,
        "choices": [choice],
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def usage_chunk(request: ParsedRequest, tokens: int) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, only usage."""
    return {
        "id": request.request_id,
        "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [],
        "usage": usage(request, tokens),
    }


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` (or a literal such as `[DONE]`) and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
