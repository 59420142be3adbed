"""Who a request is (priority band, tenant, session) and what it weighs in tokens: a pure module (no I/O, no clock
of its own), read by the gateway's flow control (`flow.py`) before a request may queue.

Why a queue in the gateway at all: past saturation an engine queues requests itself, first come first served,
where nothing can reorder them. Holding the excess here instead lets an interactive product overtake batch jobs
(bands) and keeps one tenant from starving the others (fairness), and sheds what cannot be served in time with a
clear 429 rather than a timeout.

The order and what a request costs its tenant (the `tokens` and `expert-load` policies) are
`solver/fairness.py`'s, shared with the simulator; this module names who a request is, its weighted tokens, and
the `Refusal` flow control answers with instead of a route (rendered as HTTP by the gateway, as an ImmediateResponse
by the endpoint picker).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from switchyard.services.gateway.body import openai_error
from switchyard.solver.fairness import weighted_tokens

__all__ = [
    "BANDS",
    "PRIORITY_HEADER",
    "SESSION_HEADERS",
    "TENANT_HEADER",
    "BadClass",
    "Refusal",
    "RequestClass",
    "classify",
    "request_cost",
]

#: The priority bands, lowest first: a header names one (or its number, 0 to 2).
BANDS = ("low", "normal", "high")
PRIORITY_HEADER = b"x-switchyard-priority"
TENANT_HEADER = b"x-switchyard-tenant"
#: Session id headers, the first present wins: Switchyard's own, then what agents and other routers send
#: (`x-session-id`: vLLM's router's consistent-hash key and many agent SDKs; `x-session-affinity`; `session_id`
#: and `session-id`: Codex-style clients). Without one, OpenAI's `prompt_cache_key` body field names the session.
SESSION_HEADERS = (b"x-switchyard-session", b"x-session-id", b"x-session-affinity", b"session_id", b"session-id")
#: Longest tenant or session id kept as given; ids are printable ASCII without spaces.
MAX_ID_CHARS = 128
_ID = re.compile(r"[!-~]{1,128}")


class BadClass(ValueError):
    """A priority, tenant or session header the gateway refuses (400), naming the header."""

    def __init__(self, message: str, header: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True, slots=True)
class RequestClass:
    band: int
    tenant: str
    session: str | None = None


def _id(raw: bytes, header: str) -> str:
    """A header's id: printable ASCII, at most `MAX_ID_CHARS`; anything else is refused."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadClass(f"header {header} must be printable ASCII", header) from None
    if not _ID.fullmatch(text):
        raise BadClass(f"header {header} must be 1 to {MAX_ID_CHARS} printable ASCII characters, no spaces", header)
    return text


def _user(value: Any) -> str:
    """OpenAI's `user` field as a tenant: kept as given when it is a short printable id, else (an e-mail in another
    script, a long string) a stable digest of it, so any valid OpenAI body is served and memory stays bounded."""
    if not isinstance(value, str) or not value:
        return ""
    if len(value) <= MAX_ID_CHARS and _ID.fullmatch(value):
        return value
    return "user#" + hashlib.blake2b(value.encode("utf-8", "replace"), digest_size=12).hexdigest()


def _band(raw: bytes) -> int:
    text = raw.decode("latin-1").strip().lower()
    if text in BANDS:
        return BANDS.index(text)
    if text.isdigit() and len(text) == 1 and int(text) < len(BANDS):
        return int(text)
    header = PRIORITY_HEADER.decode()
    raise BadClass(f"header {header} must be one of {', '.join(BANDS)} (or 0 to 2)", header)


def classify(headers: list[tuple[bytes, bytes]], body: dict[str, Any], default_band: int) -> RequestClass:
    """The request's band, tenant (its header, else the body's `user`, else "") and session id, from the ASGI
    scope's headers (names already lower case): one pass, no mapping built. Raises `BadClass`."""
    band, tenant, session, rank = default_band, None, None, len(SESSION_HEADERS)
    for name, value in headers:
        if not name.startswith((b"x-", b"session")):
            continue
        if name == PRIORITY_HEADER:
            band = _band(value)
        elif name == TENANT_HEADER:
            tenant = _id(value, "x-switchyard-tenant")
        elif name in SESSION_HEADERS:
            at = SESSION_HEADERS.index(name)
            if at < rank:
                session, rank = _id(value, name.decode("ascii")), at
    if tenant is None:
        tenant = _user(body.get("user"))
    if session is None:
        key = body.get("prompt_cache_key")
        if isinstance(key, str) and key:
            session = _user(key)
    return RequestClass(band, tenant, session)


def request_cost(prompt_tokens: int, body: dict[str, Any], output_weight: float, default_output: int) -> float:
    """What a request costs its tenant in weighted tokens: its prompt plus `output_weight` x its expected output
    (`max_completion_tokens` or `max_tokens`, else `default_output`)."""
    output = body.get("max_completion_tokens") or body.get("max_tokens") or default_output
    if not isinstance(output, int) or isinstance(output, bool):
        output = default_output
    return weighted_tokens(prompt_tokens, output, output_weight)


#: What each shed reason tells the client.
SHED_MESSAGES = {
    "queue_full": "the fleet is saturated and the gateway's queue is full; retry later",
    "tenant_full": "the fleet is saturated and this tenant's queued requests are at their limit; retry later",
    "shed": "the fleet is saturated and a higher-priority request took this one's place; retry later",
    "expired": "the fleet stayed saturated past the longest a request may wait; retry later",
}


@dataclass(frozen=True)
class Refusal:
    """Flow control's answer instead of a route: the status, OpenAI's message and error type, a 429's
    `Retry-After`. The gateway renders it as HTTP (`response`), the endpoint picker as an ImmediateResponse."""

    status: int
    message: str = ""
    kind: str = ""
    retry_after_s: int | None = None

    @classmethod
    def shed(cls, reason: str, retry_after_s: int) -> Refusal:
        """429 `RateLimitError` (what OpenAI's clients back off on) with `Retry-After`."""
        return cls(429, SHED_MESSAGES[reason], "RateLimitError", retry_after_s)

    def response(self) -> Response:
        if not self.message:  # 499: the client left, nobody reads a body
            return Response(status_code=self.status)
        headers = {"retry-after": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(openai_error(self.status, self.message, self.kind), self.status, headers=headers)
