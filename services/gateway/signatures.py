"""Prefill signatures that arrive on the bus (`sy.engine.<id>.signature`), matched to waiting handoffs.

An engine whose counts live in a worker process (vLLM) publishes each request's `PrefillSignature` when its
prefill ends, keyed by the engine's request id, which embeds the `X-Request-Id` the gateway sent (vLLM makes
`cmpl-<id>-0` of it). The gateway's ids have one recognisable shape, so the match is a regex search, not a
guess. A signature may arrive before the handoff starts waiting (the prefill response and the bus message
race): it is kept for a short while in a bounded buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from nats.aio.msg import Msg

from switchyard.shared.schemas import PrefillSignature

#: The gateway's request ids: `sygw-` and 32 hex digits; sent upstream as `X-Request-Id`.
REQUEST_ID = re.compile(r"sygw-[0-9a-f]{32}")


#: 64 random bits per process, then a counter: as unique as a UUID across gateways and restarts, without a
#: `urandom` system call per request (a slow one in a VM).
_ID_PREFIX = secrets.token_hex(8)
_ID_COUNTER = itertools.count(secrets.randbits(32))


def new_request_id() -> str:
    return f"sygw-{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


#: After this many handoffs in a row without a bus signature from a prefill engine, the gateway stops waiting
#: for that engine's signatures (an engine without the signature capture would otherwise cost every request
#: the whole wait); the next signature it publishes makes the gateway wait again.
MISSES_BEFORE_NO_WAIT = 3
#: What the early signatures' arrays may weigh together: one may be up to the 8 MiB payload limit (a real one,
#: [layers, experts] counts, is tens of KB), so 4,096 of them could be 32 GiB.
KEEP_BYTES = 64 * 1024 * 1024


class SignatureBox:
    """Waiters keyed by gateway request id, plus early arrivals (at most `keep` of them, `keep_bytes` of arrays,
    `keep_s` old; the oldest dropped first)."""

    def __init__(self, keep: int = 4096, keep_s: float = 30.0, keep_bytes: int = KEEP_BYTES) -> None:
        self.waiting: dict[str, asyncio.Future[PrefillSignature]] = {}
        self.early: OrderedDict[str, tuple[float, PrefillSignature]] = OrderedDict()
        self.keep, self.keep_s, self.keep_bytes = keep, keep_s, keep_bytes
        self.early_bytes = 0  # the early signatures' array bytes
        self.misses: dict[str, int] = {}  # prefill engine id -> handoffs in a row without its bus signature
        #: Called with every signature first (the flow control's expert-load fairness reads each request's).
        self.listeners: list[Callable[[PrefillSignature], None]] = []

    def wait_for(self, engine_id: str, wait_s: float) -> float:
        """How long to wait for `engine_id`'s signature: `wait_s`, or 0 while it publishes none."""
        return wait_s if self.misses.get(engine_id, 0) < MISSES_BEFORE_NO_WAIT else 0.0

    def on_signature(self, message: PrefillSignature, _msg: Msg | None = None) -> None:
        for listener in self.listeners:
            listener(message)
        self.misses.pop(message.engine_id, None)
        match = REQUEST_ID.search(message.request_id)
        if match is None:
            return  # a request that did not come through a gateway
        key = match.group(0)
        future = self.waiting.get(key)
        if future is not None and not future.done():
            future.set_result(message)
            return
        now = time.monotonic()
        self._pop_early(key)
        self.early[key] = (now, message)
        self.early_bytes += message.signature.nbytes
        while self.early and (
            len(self.early) > self.keep
            or self.early_bytes > self.keep_bytes
            or now - next(iter(self.early.values()))[0] > self.keep_s
        ):
            self._pop_early(next(iter(self.early)))

    def _pop_early(self, request_id: str) -> tuple[float, PrefillSignature] | None:
        early = self.early.pop(request_id, None)
        if early is not None:
            self.early_bytes -= early[1].signature.nbytes
        return early

    def expect(self, request_id: str) -> None:
        """Start listening for `request_id` (before the prefill is sent, so no message is missed)."""
        self.waiting[request_id] = asyncio.get_running_loop().create_future()

    async def wait(self, request_id: str, timeout_s: float, engine_id: str | None = None) -> np.ndarray | None:
        """The signature for `request_id`, or None after `timeout_s`; always stops listening.

        With `engine_id`, a miss counts towards that engine's streak (see `MISSES_BEFORE_NO_WAIT`).
        """
        try:
            early = self._pop_early(request_id)
            if early is not None:
                return early[1].signature
            future = self.waiting.get(request_id)
            if future is not None and future.done() and not future.cancelled():
                return future.result().signature
            if future is not None and timeout_s > 0:
                with contextlib.suppress(TimeoutError):
                    return (await asyncio.wait_for(future, timeout_s)).signature
            if engine_id is not None:
                self.misses[engine_id] = self.misses.get(engine_id, 0) + 1
            return None
        finally:
            self.discard(request_id)

    def discard(self, request_id: str) -> None:
        future = self.waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self._pop_early(request_id)
