"""The gateway's progress reports to the routers (`sy.route.progress.<reporter>`, `RouteProgress`): which requests
it routed with ``progress`` reached their first token, and which ended.

`reporter` is the gateway's NATS user (`gateway-<id>`, or the shared `gateway`): only that user may publish on its
subject, and the gateway's asks name it (`RouteDpRequest.reporter`), so a router settles a request only from the
reports of the gateway that asked for it (issue 37, item 8: a forged end for every request emptied the ledgers).

The gateway relays every answer, so it knows both facts exactly; a router that has them keeps an exact ledger of
what each engine still owes (`solver.routing.exact_ledger`) instead of guessing it from telemetry timing
(docs/gimbal-exact-ledger.md). Reports are batched: everything noted in one turn of the event loop goes in one
message, published on the loop's next turn, so a burst of answers costs one publish and a request path never
waits on it. A lost report only leaves a request counted on its engine; the sender never retries.
"""

from __future__ import annotations

import asyncio
import contextlib

from switchyard.shared.bus import Bus
from switchyard.shared.codec import encode_unchecked
from switchyard.shared.schemas import MAX_SHARED_DECISIONS, RouteProgress

__all__ = ["ProgressReporter"]


class ProgressReporter:
    """Collects first tokens and ends, publishes them as `RouteProgress` once per loop turn (split at the cap)."""

    def __init__(self, bus: Bus, reporter: str = "gateway") -> None:
        self.bus, self.reporter = bus, reporter
        self.subject = bus.subjects.progress(reporter)
        self.first_ids: list[str] = []
        self.done_ids: list[str] = []
        self.batches = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    def first(self, request_id: str) -> None:
        """`request_id`'s first token reached the gateway."""
        self.first_ids.append(request_id)
        self._schedule()

    def done(self, request_id: str) -> None:
        """`request_id` ended (answered, failed or abandoned)."""
        self.done_ids.append(request_id)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    def _start_flush(self) -> None:
        task = asyncio.get_running_loop().create_task(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Publish everything noted so far (ids the gateway made: no re-validation)."""
        self._scheduled = False
        first, done = self.first_ids, self.done_ids
        self.first_ids, self.done_ids = [], []
        cap = MAX_SHARED_DECISIONS
        for start in range(0, max(len(first), len(done)), cap):
            fields = {"first": first[start : start + cap], "done": done[start : start + cap]}
            with contextlib.suppress(Exception):  # a bus hiccup loses a report, never a request
                await self.bus.nc.publish(self.subject, encode_unchecked(RouteProgress, fields))
                self.batches += 1

    async def close(self) -> None:
        """Publish what is pending (the gateway is stopping)."""
        await self.flush()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
