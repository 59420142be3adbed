"""Request bodies: the few checks the gateway needs before routing, and OpenAI's error shape.

The gateway forwards bodies unchanged (a DP request's bytes are sent as received); it only reads what
routing needs (model, stream, a prompt-size estimate, a prefix for affinity) and refuses, with status 400 and
OpenAI's error object, what no engine could take. Engines validate the rest themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from switchyard.shared import json_depth

if TYPE_CHECKING:
    from switchyard.services.gateway.prompt_keys import PromptKeys

#: A rough characters-per-token ratio for a text prompt's size (the router only ranks by it).
CHARS_PER_TOKEN = 4


class BadBody(ValueError):
    def __init__(self, message: str, param: str | None = None, reason: str = "invalid") -> None:
        super().__init__(message)
        self.param, self.reason = param, reason


def openai_error(status: int, message: str, kind: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's (and vLLM's) error object; `kind` defaults to a name for the status."""
    kind = kind or {400: "BadRequestError", 408: "RequestTimeoutError", 413: "RequestEntityTooLargeError"}.get(
        status, "Error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    """`openai_error` as a response."""
    return JSONResponse(openai_error(status, message, kind, param), status)


@dataclass
class Parsed:
    body: dict[str, Any]
    model: str | None
    stream: bool
    prompt_tokens: int
    prefix: bytes
    #: The prompt's prefix-cache block keys, once computed for the chosen fleet (`app._name_blocks`).
    keys: PromptKeys | None = None


def _prompt_size_and_prefix(body: dict[str, Any], chat: bool, prefix_chars: int) -> tuple[int, bytes]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadBody("'messages' must be a non-empty list of message objects", "messages")
        text = json.dumps(messages, separators=(",", ":"), ensure_ascii=False)
        return max(1, len(text) // CHARS_PER_TOKEN), text[:prefix_chars].encode()
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return max(1, len(prompt) // CHARS_PER_TOKEN), prompt[:prefix_chars].encode()
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return max(1, sum(len(p) for p in prompt) // CHARS_PER_TOKEN), prompt[0][:prefix_chars].encode()
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt), json.dumps(prompt[:prefix_chars]).encode()
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return sum(len(p) for p in prompt), json.dumps(prompt[0][:prefix_chars]).encode()
    raise BadBody("'prompt' must be a string, a list of strings, or token ids", "prompt")


def parse(raw: bytes, chat: bool, prefix_chars: int = 512) -> Parsed:
    """Validate what routing reads; raises `BadBody` with a message for the client."""
    try:
        body = json_depth.loads(raw)
    except json_depth.TooDeep as exc:
        raise BadBody(str(exc), reason="too_deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadBody(f"request body is not valid JSON: {exc}", reason="not_json") from None
    if not isinstance(body, dict):
        raise BadBody("request body must be a JSON object", reason="not_object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadBody("'model' must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadBody("'stream' must be true or false", "stream")
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BadBody(f"'{field}' must be a positive integer", field)
    tokens, prefix = _prompt_size_and_prefix(body, chat, prefix_chars)
    return Parsed(body, model, stream, tokens, prefix)
