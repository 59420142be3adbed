"""The engines the gateway can send requests to, learnt from their hellos on the bus.

An engine is a candidate while its hello names an HTTP `base_url` and it is live by the one liveness rule
(`shared/liveness.py`, the router's and the fleet view's too): heard from, by hello or telemetry, within
`misses` of its own intervals, but never more than `max_silence_s` ago (a sender that announces a long interval
cannot keep itself in rotation after it died); one that falls silent leaves by itself (nothing to clean up:
liveness is computed on read). Telemetry never makes an engine known (its hello says where it serves), but
telemetry that came before the hello counts once it comes; as for the router and the fleet view, a message
older than the engine's last one does not count. With
an engine manifest, a hello is believed only when it matches its engine's entry (role, model, base URL): an
engine's credentials prove its id, not where clients' prompts may go. An engine whose hops keep failing (or that
sends one answer no honest engine sends: `upstream.HOSTILE`) is ejected, whatever hellos it sends, until its own
`/health` answers (the gateway's prober), and then only on trial: see `hop_failed`. The registry also
counts the gateway's own requests in flight per engine, which is what the local fallback choice and the prefill
load bound read, and keeps each model's fleet mode (`mode`). Engine ids are the senders' word (on a bus without
credentials anyone can name new ones), so it holds at most `max_engines`: a new id beyond that takes the place
of the least recently heard engine only if that one is dead and has nothing in flight, else its hello is ignored
and counted (`refused`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from yarl import URL

from switchyard.services.gateway import metrics
from switchyard.shared.engine_manifest import EngineManifest
from switchyard.shared.liveness import DEFAULT_MAX_SILENCE_S, DEFAULT_MISSES, DEFAULT_TELEMETRY_INTERVAL_S, Liveness
from switchyard.shared.schemas import Hello, Telemetry
from switchyard.shared.sequence import Seq, classify

log = logging.getLogger(__name__)

#: How a request is served: by one data-parallel engine, or by a prefill and then a decode engine.
MODES = ("dp", "disagg")
#: After a failed trial an ejected engine's next health check waits this long, doubled by each failed trial
#: in a row up to the maximum (`EngineRegistry.hop_failed`).
TRIAL_BACKOFF_S, MAX_TRIAL_BACKOFF_S = 1.0, 60.0


@dataclass
class Engine:
    engine_id: str
    role: str
    model: str
    base_url: str
    hello_interval_s: float
    last_hello: float
    inflight: int = 0
    telemetry_interval_s: float = DEFAULT_TELEMETRY_INTERVAL_S
    #: When its last telemetry arrived (-inf: none yet) and that telemetry's sequence number.
    last_telemetry: float = -math.inf
    last_seq: int | None = None
    #: The liveness rule's answer for its last hello and telemetry (`_expiry`).
    live_until: float = -math.inf
    #: When its current stretch of liveness began (its first hello after being unknown or stale).
    joined: float = 0.0
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
    #: Tokens per KV block (its hello's `capacity.block_size`): the block size of its prefix-cache keys.
    block_size: int = 16
    #: KV blocks it can hold at all (its hello's `capacity.kv_blocks`): the most its KV events may claim.
    kv_blocks: int = 2**31
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
    def __init__(
        self,
        hello_misses: float = DEFAULT_MISSES,
        stale_after_s: float = DEFAULT_MAX_SILENCE_S,
        manifest: EngineManifest | None = None,
        eject_after_failures: int = 2,
        max_engines: int = 4096,
    ) -> None:
        #: The liveness rule: `hello_misses` and `stale_after_s` are its `misses` and `max_silence_s`.
        self.liveness = Liveness(hello_misses, stale_after_s)
        self.manifest = manifest
        self.eject_after_failures = eject_after_failures
        self.max_engines = max_engines
        self.refused = 0  # hellos from a new id while every known engine was live or busy
        #: Called with each engine id the registry drops (the service removes its metric label sets).
        self.on_forget: Callable[[str], None] | None = None
        #: Least recently heard first (each hello moves its engine to the end).
        self.engines: OrderedDict[str, Engine] = OrderedDict()
        self.version = 0  # bumped by every hello, ejection and restoration: liveness may have changed
        self._live: dict[tuple[str | None, str | None], _Live] = {}
        self._modes: dict[str | None, str] = {}
        #: engine id -> (arrival, seq) of the last telemetry from an engine that has not said hello yet.
        self._early: dict[str, tuple[float, int]] = {}

    def on_hello(self, hello: Hello, now: float | None = None) -> None:
        """Add or refresh an engine; a hello without `base_url` (an engine serving no HTTP) is ignored, and one
        the manifest contradicts is refused and counted."""
        now = time.monotonic() if now is None else now
        if hello.base_url is None:
            return
        if self.manifest is not None and (refused := self.manifest.refusal(hello)) is not None:
            metrics.HELLOS_REFUSED.labels(refused).inc()
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
            early = self._early.pop(hello.engine_id, None)
            if early is not None:  # its telemetry came first (a restarted gateway): it counts, as elsewhere
                engine.last_telemetry, engine.last_seq = early
        if engine.joined == 0.0 or not self._fresh(engine, now):
            engine.joined = now
        engine.role, engine.model = hello.role, hello.model.name
        base_url = hello.base_url.rstrip("/")
        if base_url != engine.base_url:
            engine.base_url = base_url
            engine._urls.clear()
        engine.hello_interval_s, engine.last_hello = hello.hello_interval_s, now
        engine.block_size = hello.capacity.block_size
        engine.kv_blocks = hello.capacity.kv_blocks
        engine.telemetry_interval_s = hello.telemetry_interval_s
        self._relive(engine)
        self.version += 1

    def on_telemetry(self, telemetry: Telemetry, now: float | None = None) -> None:
        """Telemetry keeps an engine live (the rule's telemetry window); from an engine not known yet it is kept
        for its hello; a message older than the engine's last is ignored (as the router and the fleet view do)."""
        now = time.monotonic() if now is None else now
        engine = self.engines.get(telemetry.engine_id)
        if engine is None:
            self._remember_early(telemetry, now)
            return
        event, _missed = classify(engine.last_seq, telemetry.seq)
        if event is Seq.LATE:
            return
        revived = not self._fresh(engine, now)
        engine.last_seq, engine.last_telemetry = telemetry.seq, now
        self._relive(engine)
        if revived:  # it joins the live lists (they hold until their first engine expires: a later expiry is fine)
            engine.joined = now
            self.version += 1

    def _remember_early(self, telemetry: Telemetry, now: float) -> None:
        """Telemetry from an engine not known yet: its arrival and sequence number count once its hello comes (the
        router and the fleet view count it too). Ids are the senders' word: at most `max_engines` are kept."""
        last = self._early.get(telemetry.engine_id)
        if last is not None and classify(last[1], telemetry.seq)[0] is Seq.LATE:
            return
        if last is None and len(self._early) >= self.max_engines:
            self._early.clear()
        self._early[telemetry.engine_id] = (now, telemetry.seq)

    @property
    def hello_misses(self) -> float:
        return self.liveness.misses

    @property
    def stale_after_s(self) -> float:
        return self.liveness.max_silence_s

    def _relive(self, engine: Engine) -> None:
        engine.live_until = self.liveness.live_until(
            engine.last_hello, engine.hello_interval_s, engine.last_telemetry, engine.telemetry_interval_s
        )

    def _expiry(self, engine: Engine) -> float:
        return engine.live_until

    def _fresh(self, engine: Engine, now: float) -> bool:
        return Liveness.is_live(engine.live_until, now)

    def _room(self, now: float) -> bool:
        """Whether a new engine fits, making room by dropping the least recently heard one if it is dead and idle."""
        if len(self.engines) < self.max_engines:
            return True
        oldest = next(iter(self.engines.values()))
        if self._fresh(oldest, now) or oldest.inflight:
            return False
        self._forget(oldest.engine_id)
        return True

    def _forget(self, engine_id: str) -> None:
        del self.engines[engine_id]
        self.version += 1
        if self.on_forget is not None:
            self.on_forget(engine_id)

    def alive(self, engine: Engine, now: float) -> bool:
        return not engine.ejected and not engine.trial_busy and self._fresh(engine, now)

    # ----- failures and health -----

    def hop_begun(self, engine: Engine) -> None:
        """A request goes to `engine`: on trial, it leaves the live lists until that request has its verdict."""
        if engine.trial and not engine.trial_busy:
            engine.trial_busy = True
            self.version += 1

    def hop_failed(self, engine: Engine, hostile: bool = False, now: float | None = None) -> None:
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
        self.version += 1
        metrics.EJECTIONS.inc()
        log.warning(
            "engine %s ejected after %d failed hop(s)%s; on trial when its /health answers (checked in %.0f s)",
            engine.engine_id,
            engine.failures,
            " (an answer no honest engine sends)" if hostile else "",
            engine.backoff_s,
        )

    def hop_succeeded(self, engine: Engine) -> None:
        """A hop to `engine` succeeded: on trial, it is fully back."""
        engine.failures = 0
        if engine.trial:
            engine.trial = engine.trial_busy = False
            engine.backoff_s = 0.0
            self.version += 1
            metrics.TRIALS.labels("passed").inc()
            metrics.RESTORATIONS.inc()
            log.warning("engine %s back in rotation: a request on trial succeeded", engine.engine_id)

    def hop_abandoned(self, engine: Engine) -> None:
        """A hop to `engine` ended without a verdict (the client left): on trial, it may take the next request."""
        if engine.trial_busy:
            engine.trial_busy = False
            self.version += 1

    def ejected(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.ejected]

    def due_for_check(self, now: float | None = None) -> list[Engine]:
        """Ejected engines whose health is to be checked now (past their backoff)."""
        now = time.monotonic() if now is None else now
        return [e for e in self.engines.values() if e.ejected and e.check_at <= now]

    def put_on_trial(self, engine: Engine) -> None:
        """Its health check passed: on trial (see `hop_failed`), in rotation for one request at a time."""
        if engine.ejected:
            engine.ejected, engine.trial, engine.failures = False, True, 0
            self.version += 1
            metrics.TRIALS.labels("started").inc()
            log.warning("engine %s on trial: its /health answered", engine.engine_id)

    def live(self, role: str | None = None, model: str | None = None, now: float | None = None) -> list[Engine]:
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
        expiries = (self._expiry(e) for e in engines)
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
        """Drop engines silent for `keep_s` beyond their liveness (bounded memory under churn), and telemetry
        from engines without a hello that is too old to keep anyone live (older than `max_silence_s`)."""
        now = time.monotonic() if now is None else now
        cap = self.liveness.max_silence_s
        self._early = {e: early for e, early in self._early.items() if now - early[0] <= cap}
        for engine_id, e in list(self.engines.items()):
            if e.inflight == 0 and now - self._expiry(e) > keep_s:
                self._forget(engine_id)
