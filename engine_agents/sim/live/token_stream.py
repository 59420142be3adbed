"""The tokens of one HTTP request as a simulated engine produces them, handed to its HTTP handler in chunks.

The engine's step loop calls `advance` after every step (cheap: it only wakes the handler when a chunk is
due); the handler iterates `chunks()`. As vLLM's `--stream-interval N`, the first token goes out at once and
then every `interval` tokens, plus whatever is left at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


class StreamFailed(RuntimeError):
    """The engine could not finish the request (it is stopping, or the request was dropped)."""


class TokenStream:
    def __init__(self, total: int, interval: int = 1) -> None:
        if total < 1 or interval < 1:
            raise ValueError("a stream has at least one token and an interval of at least one")
        self.total = total
        self.interval = interval
        self.generated = 0
        self.finished = False
        self.cancelled = False
        self.error: str | None = None
        #: What a prefill-only request answers in `kv_transfer_params` (set before it finishes).
        self.kv_transfer_params: dict[str, Any] | None = None
        self._notified = 0
        self._event = asyncio.Event()

    def advance(self, generated: int, finished: bool = False) -> None:
        """The engine generated `generated` tokens so far (and is done with the request if `finished`)."""
        self.generated = generated
        self.finished = self.finished or finished
        due = self.finished or generated - self._notified >= self.interval or (self._notified == 0 and generated > 0)
        if due:
            self._notified = generated
            self._event.set()

    def fail(self, message: str) -> None:
        if not self.finished:
            self._notified = self.generated
            self.error = message
            self.finished = True
            self._event.set()

    def cancel(self) -> None:
        """The client went away: the engine drops the request at its next step boundary."""
        self.cancelled = True

    async def done(self) -> int:
        """Wait for the last token; returns how many were generated."""
        while not self.finished:
            self._event.clear()
            await self._event.wait()
        if self.error:
            raise StreamFailed(self.error)
        return self.generated

    async def chunks(self) -> AsyncIterator[tuple[int, int, bool]]:
        """Yield `(first token index, tokens, last)` as chunks become due."""
        sent = 0
        while True:
            if not self._event.is_set() and not self.finished:
                await self._event.wait()
            self._event.clear()
            if self.error:
                raise StreamFailed(self.error)
            count = self._notified - sent  # chunk edges are where `advance` made one due, however late we are
            if count > 0 or self.finished:
                yield sent, count, self.finished
                sent += count
            if self.finished:
                return
