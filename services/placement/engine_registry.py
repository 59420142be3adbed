"""The `engines` table: one row per engine that ever said hello, kept fresh and pruned by the placement service.

The API lists it (`/v1/engines` history, placements' engines); the live view is `services.fleet_view`. Rows
are written at most every `row_every_s` per engine (hellos come every few seconds from every engine), and
rows not seen for `retention_s` are deleted at most once per `prune_every_s`: every engine id that ever
said hello gets a row (20,000 invented ids made 20,009 rows), so without pruning the table only grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import timedelta

from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from switchyard.shared.db import Engine
from switchyard.shared.db.types import utcnow
from switchyard.shared.schemas import Hello

log = logging.getLogger(__name__)

ROW_EVERY_S = 30.0
PRUNE_EVERY_S = 3600.0


class EngineRegistry:
    """Upkeep of the `engines` rows; `on_hello` is a bus handler, `prune` runs on the service's tick."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        retention_s: float,
        row_every_s: float = ROW_EVERY_S,
        prune_every_s: float = PRUNE_EVERY_S,
    ) -> None:
        self.sessions = sessions
        #: Rows not seen for this long are deleted (0: kept forever).
        self.retention_s = retention_s
        self.row_every_s = row_every_s
        self.prune_every_s = prune_every_s
        self._written: dict[str, float] = {}
        self._last_prune = -prune_every_s
        self._writes: set[asyncio.Task[None]] = set()

    async def on_hello(self, hello: Hello, _msg: object = None) -> None:
        """Insert or refresh the engine's row, at most every `row_every_s` per engine, in a task of its own:
        placement's fleet view takes hellos on the same subscription, and a slow database must not hold them up."""
        now = time.monotonic()
        if now - self._written.get(hello.engine_id, -self.row_every_s) < self.row_every_s:
            return
        self._written[hello.engine_id] = now
        task = asyncio.create_task(self._write(hello))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, hello: Hello) -> None:
        fields = {
            "role": hello.role,
            "ep_group": hello.ep_group,
            "agent": hello.agent,
            "model_name": hello.model.name,
            "num_layers": hello.model.num_layers,
            "num_experts": hello.model.num_experts,
            "top_k": hello.model.top_k,
            "last_seen": utcnow(),
            "hello": hello.model_dump(mode="json"),
        }
        try:
            with contextlib.suppress(IntegrityError):  # another replica inserted it first
                async with self.sessions() as session, session.begin():
                    row = await session.get(Engine, hello.engine_id)
                    if row is None:
                        session.add(Engine(engine_id=hello.engine_id, **fields))
                    else:
                        for key, value in fields.items():
                            setattr(row, key, value)
        except Exception as exc:  # e.g. the database is down: the next hello after `row_every_s` tries again
            log.warning("engines row of %s not written: %s", hello.engine_id, exc)

    async def close(self) -> None:
        """Cancel the row writes still in flight (the service is stopping)."""
        for task in list(self._writes):
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)

    async def prune(self, now: float | None = None) -> int:
        """Delete rows not seen for `retention_s`, at most once per `prune_every_s`; returns how many."""
        now = time.monotonic() if now is None else now
        if self.retention_s == 0 or now - self._last_prune < self.prune_every_s:
            return 0
        self._last_prune = now
        cutoff = utcnow() - timedelta(seconds=self.retention_s)
        async with self.sessions() as session, session.begin():
            result = await session.execute(delete(Engine).where(Engine.last_seen < cutoff))
        pruned = int(result.rowcount or 0)  # type: ignore[attr-defined]
        if pruned:
            log.info("pruned %d engines not seen for %.0f s", pruned, self.retention_s)
        return pruned
