"""The gateway's projection of the engine book: the engines it can send requests to, their URLs, its requests in
flight to each, and its ejections and trials.

An engine is a candidate while the book holds its hello, that hello names an HTTP `base_url`, it is live by the
one liveness rule (the book's stamp, `shared/liveness.py`: the router's and the fleet view's too) and the gateway
has not taken it out of rotation. The book (`services.engine_book`) admits engines (the manifest: a hello is
believed only when it matches its engine's entry, since an engine's credentials prove its id, not where clients'
prompts may go; the id cap), checks telemetry sequence numbers and keeps telemetry that came before a hello.
An engine whose hops keep failing (or that sends one answer no honest engine sends: `upstream.HOSTILE`) is
ejected, whatever hellos it sends, until its own `/health` answers (the gateway's prober), and then only on
trial: see `hop_failed`. Ejected, on-trial-and-busy and URL-less engines are *held* in the book, so the router's
core fed by the same book never chooses one. The registry counts the gateway's own requests in flight per engine,
which is what the local fallback choice and the prefill load bound read (the book keeps an engine with requests
in flight however long it is dead), and keeps each model's fleet mode (`mode`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from yarl import URL

from switchyard.services.engine_book import BookEntry, BookListenerBase, EngineBook, HelloChange
from switchyard.services.gateway import metrics
from switchyard.shared.engine_manifest import REFUSALS, EngineManifest
from switchyard.shared.liveness import Liveness
from switchyard.shared.schemas import Hello, Telemetry
from switchyard.shared.sequence import Seq

__all__ = ["MAX_TRIAL_BACKOFF_S", "MODES", "TRIAL_BACKOFF_S", "GatewayRegistry", "HttpEngine"]

log = logging.getLogger(__name__)

#: How a request is served: by one data-parallel engine, or by a prefill and then a decode engine.
MODES = ("dp", "disagg")
#: After a failed trial an ejected engine's next health check waits this long, doubled by each failed trial
#: in a row up to the maximum (`GatewayRegistry.hop_failed`).
TRIAL_BACKOFF_S, MAX_TRIAL_BACKOFF_S = 1.0, 60.0


@dataclass
class HttpEngine:
    """An engine as the gateway reaches it: its book entry (who it is, its liveness) and the gateway's own state."""

    entry: BookEntry
    inflight: int = 0
    #: Hops failed in a row; at `eject_after_failures` the engine is ejected until its health check passes.
    failures: int = 0
    ejected: bool = False
    #: Back on trial after its health check passed: in rotation while no trial request is in flight (`trial_busy`),
    #: fully back once one succeeds. Ejected engines are checked from `check_at` on; `backoff_s` is the wait
    #: after its last failed trial (doubled by each).
    trial: bool = False
    trial_busy: bool = False
    backoff_s: float = 0.0
    check_at: float = 0.0
    _urls: dict[str, URL] = field(default_factory=dict, repr=False)
    _base_url: str = ""

    @property
    def engine_id(self) -> str:
        return self.entry.engine_id

    @property
    def role(self) -> str:
        return self.entry.role or ""

    @property
    def model(self) -> str:
        return self.entry.model

    @property
    def base_url(self) -> str:
        return self.entry.base_url or ""

    @property
    def block_size(self) -> int:
        """Tokens per KV block (its hello's `capacity.block_size`): the block size of its prefix-cache keys."""
        return self.entry.block_size

    @property
    def kv_blocks(self) -> int:
        """KV blocks it can hold at all (its hello's `capacity.kv_blocks`): the most its KV events may claim."""
        return self.entry.kv_blocks

    @property
    def live_until(self) -> float:
        return self.entry.live_until

    @property
    def joined(self) -> float:
        """When its current stretch of liveness began (its first word after being unknown or dead)."""
        return self.entry.live_since

    @property
    def hello_interval_s(self) -> float:
        return self.entry.hello_interval_s

    @property
    def telemetry_interval_s(self) -> float:
        return self.entry.telemetry_interval_s

    @property
    def last_hello(self) -> float:
        at = self.entry.hello_at
        return -math.inf if at is None else at

    @property
    def last_telemetry(self) -> float:
        at = self.entry.telemetry_at
        return -math.inf if at is None else at

    @property
    def last_seq(self) -> int | None:
        return self.entry.last_seq

    @property
    def out(self) -> bool:
        """Out of rotation: ejected, or on trial with its one request in flight."""
        return self.ejected or self.trial_busy

    def url(self, path: str) -> URL:
        """`base_url + path`, parsed once (aiohttp would parse the string on every request)."""
        if self._base_url != self.base_url:
            self._urls.clear()
            self._base_url = self.base_url
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url


class _Live(NamedTuple):
    """One cached answer of `GatewayRegistry.live`: valid for `version` until the first engine in it expires."""

    engines: list[HttpEngine]
    valid_until: float
    version: int


class GatewayRegistry(BookListenerBase):
    def __init__(
        self,
        book: EngineBook | None = None,
        eject_after_failures: int = 2,
        *,
        liveness: Liveness | None = None,
        manifest: EngineManifest | None = None,
        max_engines: int = 4096,
    ) -> None:
        #: The engine book it projects (None: a book of its own, from `liveness`, `manifest` and `max_engines`).
        self.book = book if book is not None else EngineBook(liveness, manifest, max_engines=max_engines, claims=False)
        self.liveness = self.book.liveness
        self.eject_after_failures = eject_after_failures
        self.refused = 0  # hellos from a new id while every known engine was live or busy
        #: Called with each engine id the registry drops (the service removes its metric label sets).
        self.on_forget: Callable[[str], None] | None = None
        #: Engines whose hello names a base URL, by id.
        self.engines: dict[str, HttpEngine] = {}
        self.version = 0  # bumped by every hello, ejection and restoration: liveness may have changed
        self._live: dict[tuple[str | None, str | None], _Live] = {}
        self._modes: dict[str | None, str] = {}
        for entry in self.book.entries.values():
            if entry.hello is not None:
                self.hello_accepted(entry, HelloChange.JOIN, None)
        self.book.listen(self, keeps=self._busy)

    # ----- the book's messages (a registry with a book of its own is fed here) -----

    def on_hello(self, hello: Hello, now: float | None = None) -> None:
        self.book.on_hello(hello, time.monotonic() if now is None else now)

    def on_telemetry(self, telemetry: Telemetry, now: float | None = None) -> None:
        self.book.on_telemetry(telemetry, time.monotonic() if now is None else now)

    # ----- what the book tells it -----

    def hello_accepted(self, entry: BookEntry, change: str, previous: Hello | None) -> None:
        engine = self.engines.get(entry.engine_id)
        if entry.base_url is None:  # an engine serving no HTTP: not the gateway's, and never the core's here
            if engine is not None and not engine.inflight:
                self._drop(entry.engine_id)
            self.book.hold(entry.engine_id, True)
            return
        if engine is None:
            engine = self.engines[entry.engine_id] = HttpEngine(entry)
        self._hold(engine)
        self.version += 1

    def telemetry_accepted(self, entry: BookEntry, telemetry: Telemetry, event: Seq, revived: bool) -> None:
        if revived and entry.engine_id in self.engines:  # it joins the live lists (a later expiry is fine)
            self.version += 1

    def refusal(self, reason: str, engine_id: str) -> None:
        if reason in REFUSALS:
            metrics.HELLOS_REFUSED.labels(reason).inc()
        elif reason == "max_engines":
            self.refused_count()

    def refused_count(self) -> None:
        self.refused += 1
        metrics.ENGINES_REFUSED.inc()

    def entries_left(self, engine_ids: list[str]) -> None:
        for engine_id in engine_ids:
            if engine_id in self.engines:
                self._drop(engine_id)

    def _drop(self, engine_id: str) -> None:
        del self.engines[engine_id]
        self.version += 1
        if self.on_forget is not None:
            self.on_forget(engine_id)

    def _busy(self, engine_id: str) -> bool:
        engine = self.engines.get(engine_id)
        return engine is not None and engine.inflight > 0

    def _hold(self, engine: HttpEngine) -> None:
        """Tell the book whether the engine is out of rotation here (the router's core then skips it too)."""
        self.book.hold(engine.engine_id, engine.out)

    @property
    def max_engines(self) -> int:
        return self.book.max_engines

    def _fresh(self, engine: HttpEngine, now: float) -> bool:
        return Liveness.is_live(engine.live_until, now)

    def alive(self, engine: HttpEngine, now: float) -> bool:
        return not engine.out and self._fresh(engine, now)

    # ----- failures and health -----

    def hop_begun(self, engine: HttpEngine) -> None:
        """A request goes to `engine`: on trial, it leaves the live lists until that request has its verdict."""
        if engine.trial and not engine.trial_busy:
            engine.trial_busy = True
            self._hold(engine)
            self.version += 1

    def hop_failed(self, engine: HttpEngine, hostile: bool = False, now: float | None = None) -> None:
        """A hop to `engine` failed. It leaves rotation (counted, logged) at `eject_after_failures` in a row, at once
        for a `hostile` answer (one past a bound, or not JSON: no honest engine sends one), and at once on trial.

        Re-admission: an ejected engine's health is checked (`due_for_check`); when it answers, the engine is put
        on trial (`put_on_trial`), not back: one real request at a time goes to it (a request already routed there
        may still go), and only a success (`hop_succeeded`) puts it fully back. A failed trial ejects it again, and
        its next health check waits `TRIAL_BACKOFF_S`, doubled by each failed trial up to `MAX_TRIAL_BACKOFF_S`:
        an engine that answers `/health` but not requests costs a request now and then, ever less often."""
        engine.failures += 1
        if engine.ejected or not (engine.trial or hostile or engine.failures >= self.eject_after_failures):
            return
        now = time.monotonic() if now is None else now
        if engine.trial:
            engine.backoff_s = min(max(2 * engine.backoff_s, TRIAL_BACKOFF_S), MAX_TRIAL_BACKOFF_S)
            metrics.TRIALS.labels("failed").inc()
        engine.ejected, engine.trial, engine.trial_busy = True, False, False
        engine.check_at = now + engine.backoff_s
        self._hold(engine)
        self.version += 1
        metrics.EJECTIONS.inc()
        log.warning(
            "engine %s ejected after %d failed hop(s)%s; on trial when its /health answers (checked in %.0f s)",
            engine.engine_id,
            engine.failures,
            " (an answer no honest engine sends)" if hostile else "",
            engine.backoff_s,
        )

    def hop_succeeded(self, engine: HttpEngine) -> None:
        """A hop to `engine` succeeded: on trial, it is fully back."""
        engine.failures = 0
        if engine.trial:
            engine.trial = engine.trial_busy = False
            engine.backoff_s = 0.0
            self._hold(engine)
            self.version += 1
            metrics.TRIALS.labels("passed").inc()
            metrics.RESTORATIONS.inc()
            log.warning("engine %s back in rotation: a request on trial succeeded", engine.engine_id)

    def hop_abandoned(self, engine: HttpEngine) -> None:
        """A hop to `engine` ended without a verdict (the client left): on trial, it may take the next request."""
        if engine.trial_busy:
            engine.trial_busy = False
            self._hold(engine)
            self.version += 1

    def ejected(self) -> list[HttpEngine]:
        return [e for e in self.engines.values() if e.ejected]

    def due_for_check(self, now: float | None = None) -> list[HttpEngine]:
        """Ejected engines whose health is to be checked now (past their backoff)."""
        now = time.monotonic() if now is None else now
        return [e for e in self.engines.values() if e.ejected and e.check_at <= now]

    def put_on_trial(self, engine: HttpEngine) -> None:
        """Its health check passed: on trial (see `hop_failed`), in rotation for one request at a time."""
        if engine.ejected:
            engine.ejected, engine.trial, engine.failures = False, True, 0
            self._hold(engine)
            self.version += 1
            metrics.TRIALS.labels("started").inc()
            log.warning("engine %s on trial: its /health answered", engine.engine_id)

    def live(self, role: str | None = None, model: str | None = None, now: float | None = None) -> list[HttpEngine]:
        """Live engines, optionally of one role and serving one model, in engine-id order (deterministic).

        The same list is returned until a hello arrives or one of its engines expires (callers must not change
        it), so a request costs no scan, sort or allocation of the fleet. Telemetry that only extends a listed
        engine's liveness leaves the list as it is; a hello, or telemetry reviving an expired engine, renews it.
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
        expiries = (e.live_until for e in engines)
        if len(self._live) > 256:  # model names come from requests: bound the cache
            self._live.clear()
        self._live[key] = _Live(engines, min(expiries, default=math.inf), self.version)
        return engines

    def get_live(self, engine_id: str, now: float | None = None) -> HttpEngine | None:
        engine = self.engines.get(engine_id)
        now = time.monotonic() if now is None else now
        return engine if engine is not None and self.alive(engine, now) else None

    def models(self, now: float | None = None) -> list[str]:
        return sorted({e.model for e in self.live(now=now)})

    def max_model_len(self, model: str, now: float | None = None) -> int | None:
        """The longest request every live engine of `model` accepts (the least any announces; None: none says),
        so a client sized by `/v1/models` fits wherever the request is routed."""
        said = [
            e.entry.hello.capacity.max_model_len
            for e in self.live(now=now)
            if e.model == model and e.entry.hello is not None and e.entry.hello.capacity.max_model_len is not None
        ]
        return min(said) if said else None

    def mode(self, model: str | None, now: float | None = None) -> str | None:
        """How to serve `model` now: "dp", "disagg", or None when no live engines can.

        A fleet keeps its mode while it can serve in it: one new hello (an engine claiming `dp` beside a live
        prefill/decode fleet) never switches a live fleet. Only when the current mode has no live engines left
        does the mode change, and where both could serve, the mode whose engines have been live the longest
        wins (the incumbents, not a newcomer)."""
        now = time.monotonic() if now is None else now
        current = self._modes.get(model)
        if current == "dp" and self.live("dp", model, now):  # the usual case: one cached lookup
            return current
        prefill, decode = self.live("prefill", model, now), self.live("decode", model, now)
        if current == "disagg" and prefill and decode:
            return current
        dp = self.live("dp", model, now)
        if dp and prefill and decode:
            dp_since = min(e.joined for e in dp)
            disagg_since = max(min(e.joined for e in prefill), min(e.joined for e in decode))
            chosen = "dp" if dp_since < disagg_since else "disagg"
        elif dp:
            chosen = "dp"
        elif prefill and decode:
            chosen = "disagg"
        else:
            return None
        if current is not None:
            metrics.MODE_SWITCHES.labels(chosen).inc()
            log.warning("model %s: no live engine to serve it as %s; now served as %s", model, current, chosen)
        if len(self._modes) > 256:  # only models a live engine serves get here; bounded all the same
            self._modes.clear()
        self._modes[model] = chosen
        return chosen

    def forget_dead(self, now: float | None = None, keep_s: float = 600.0) -> None:
        """Have the book forget engines silent for `keep_s` (bounded memory under churn) and telemetry from
        engines without a hello too old to keep anyone live; engines with requests in flight stay."""
        self.book.forget_silent(time.monotonic() if now is None else now, keep_s)
