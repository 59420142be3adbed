"""The engines the gateway can send requests to, learnt from their hellos on the bus.

An engine is a candidate while its last hello is younger than `hello_misses` of its own hello intervals
and its hello names an HTTP `base_url`; one that stops saying hello leaves by itself (nothing to clean up:
liveness is computed on read). The registry also counts the gateway's own requests in flight per engine,
which is what the local fallback choice and the prefill load bound read.

Engine ids are the senders' word (on a bus without credentials anyone can name new ones), so it holds at most
`max_engines`: a new id beyond that takes the place of the least recently heard engine only if that one is
dead and has nothing in flight, else its hello is ignored and counted (`refused`).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from yarl import URL

from switchyard.shared.schemas import Hello


@dataclass
class Engine:
    engine_id: str
    role: str
    model: str
    base_url: str
    hello_interval_s: float
    last_hello: float
    inflight: int = 0
    _urls: dict[str, URL] = field(default_factory=dict, repr=False)

    def url(self, path: str) -> URL:
        """`base_url + path`, parsed once (aiohttp would parse the string on every request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url


class _Live(NamedTuple):
    """One cached answer of `EngineRegistry.live`: valid for `version` until the first engine in it expires."""

    engines: list[Engine]
    valid_until: float
    version: int


class EngineRegistry:
    def __init__(self, hello_misses: float = 3.0, max_engines: int = 4096) -> None:
        self.hello_misses = hello_misses
        self.max_engines = max_engines
        self.refused = 0  # hellos from a new id while every known engine was live or busy
        #: Called with each engine id the registry drops (the service removes its metric label sets).
        self.on_forget: Callable[[str], None] | None = None
        #: Least recently heard first (each hello moves its engine to the end).
        self.engines: OrderedDict[str, Engine] = OrderedDict()
        self.version = 0  # bumped by every hello: liveness and membership may have changed
        self._live: dict[tuple[str | None, str | None], _Live] = {}

    def on_hello(self, hello: Hello, now: float | None = None) -> None:
        """Add or refresh an engine; a hello without `base_url` (an engine serving no HTTP) is ignored."""
        now = time.monotonic() if now is None else now
        if hello.base_url is None:
            return
        engine = self.engines.get(hello.engine_id)
        if engine is not None:
            self.engines.move_to_end(hello.engine_id)
        elif not self._room(now):
            self.refused += 1
            return
        else:
            engine = Engine(hello.engine_id, hello.role, hello.model.name, hello.base_url.rstrip("/"), 0.0, now)
            self.engines[hello.engine_id] = engine
        engine.role, engine.model = hello.role, hello.model.name
        base_url = hello.base_url.rstrip("/")
        if base_url != engine.base_url:
            engine.base_url = base_url
            engine._urls.clear()
        engine.hello_interval_s, engine.last_hello = hello.hello_interval_s, now
        self.version += 1

    def _room(self, now: float) -> bool:
        """Whether a new engine fits, making room by dropping the least recently heard one if it is dead and idle."""
        if len(self.engines) < self.max_engines:
            return True
        oldest = next(iter(self.engines.values()))
        if self.alive(oldest, now) or oldest.inflight:
            return False
        self._forget(oldest.engine_id)
        return True

    def _forget(self, engine_id: str) -> None:
        del self.engines[engine_id]
        self.version += 1
        if self.on_forget is not None:
            self.on_forget(engine_id)

    def alive(self, engine: Engine, now: float) -> bool:
        return now - engine.last_hello <= self.hello_misses * engine.hello_interval_s

    def live(self, role: str | None = None, model: str | None = None, now: float | None = None) -> list[Engine]:
        """Live engines, optionally of one role and serving one model, in engine-id order (deterministic).

        The same list is returned until a hello arrives or one of its engines expires (callers must not change
        it), so a request costs no scan, sort or allocation of the fleet. Only an engine's hello can revive it.
        """
        now = time.monotonic() if now is None else now
        key = (role, model)
        cached = self._live.get(key)
        if cached is not None and cached.version == self.version and now < cached.valid_until:
            return cached.engines
        engines = sorted(
            (
                e
                for e in self.engines.values()
                if self.alive(e, now) and (role is None or e.role == role) and (model is None or e.model == model)
            ),
            key=lambda e: e.engine_id,
        )
        expiries = (e.last_hello + self.hello_misses * e.hello_interval_s for e in engines)
        if len(self._live) > 256:  # model names come from requests: bound the cache
            self._live.clear()
        self._live[key] = _Live(engines, min(expiries, default=math.inf), self.version)
        return engines

    def get_live(self, engine_id: str, now: float | None = None) -> Engine | None:
        engine = self.engines.get(engine_id)
        now = time.monotonic() if now is None else now
        return engine if engine is not None and self.alive(engine, now) else None

    def models(self, now: float | None = None) -> list[str]:
        return sorted({e.model for e in self.live(now=now)})

    def forget_dead(self, now: float | None = None, keep_s: float = 600.0) -> None:
        """Drop engines silent for `keep_s` beyond their liveness (bounded memory under churn)."""
        now = time.monotonic() if now is None else now
        for engine_id, e in list(self.engines.items()):
            if e.inflight == 0 and now - e.last_hello > self.hello_misses * e.hello_interval_s + keep_s:
                self._forget(engine_id)
