"""How far an engine's KV-cache events are believed (issue 37, items 2 and 3).

An engine's events say which prompt blocks it holds cached, and the prefix scorers send it the requests whose
prompts begin with them. Nothing in an event proves the engine holds those blocks: block keys are computable by
anyone who knows a prefix (a system prompt), so one credential could draw all of a prefix's traffic, prompts
included. Three bounds, each counted:

- *Rate* (`KvRate`): a token bucket of keys per second per engine (a message costs 1 + its keys). A message
  over it is dropped; a dropped message leaves the index stale, so the engine's blocks are cleared (as for a
  sequence gap) and its next message starts afresh.
- *Capacity*: an engine's blocks in the index never exceed its hello's `capacity.kv_blocks` (the caller passes
  it to `BlockIndex.stored`); a claim past it evicts the engine's own oldest blocks.
- *Confirmation* (`Claims`): a claim earns credit only once an answer routed by it confirms it. The answer's
  `usage.prompt_tokens_details.cached_tokens` (vLLM, `--enable-prompt-tokens-details`) is compared with what
  the claim promised. Until one claim of an engine is confirmed (per claimed prefix: the key of its deepest
  claimed block), at most `probes` requests at a time ride on that engine's unconfirmed claims; past that the
  claim counts as nothing cached there. A contradicted claim (reported < `ratio` × claimed) is dropped from the
  index (`unconfirmed`); `strikes` contradictions in a row (no confirmation between) within `quarantine_s` clear
  the engine's blocks and ignore its events for `quarantine_s` (`quarantined`). Confirmed claims stay checked:
  every answer a claim was credited for is compared. An answer that reports no usage at all (a stream without
  `stream_options.include_usage`) confirms nothing and contradicts nothing: its probe slot is freed.

vLLM leaves `prompt_tokens_details` out when nothing was cached, so usage without it reads as 0 cached tokens:
an engine run without `--enable-prompt-tokens-details` contradicts every claim (its prefix routing then stays
off, counted); the operator enables the flag, or turns confirmation off (`prefix_confirm`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

__all__ = ["Claims", "Expected", "KvRate", "reported_cached_tokens"]

#: An honest engine's peak: prefill of ~50K tokens/s at 16-token blocks stores ~3K blocks/s, as many removed
#: under pressure, plus decode's new blocks: under 10K keys/s. The default bound is 5x that; the burst holds a
#: refill after a cleared cache (24 full 8192-key messages).
DEFAULT_KEYS_PER_S = 50_000.0
DEFAULT_BURST_KEYS = 200_000.0
#: Engines a bucket is kept for at most (ids come from subjects, which NATS permissions bind to credentials).
_MAX_BUCKETS = 8192

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})')
_USAGE = re.compile(rb'"usage"\s*:\s*\{')


def reported_cached_tokens(body: bytes) -> int | None:
    """The cached tokens an OpenAI-style answer (or stream chunk) reports: the last `cached_tokens` in it; 0 for
    usage without it (vLLM omits `prompt_tokens_details` at 0); None when it carries no usage at all.

    A regex on the bytes, not a parse: an answer is an engine's, untrusted and maybe large; the model's own text
    cannot fake the field (its quotes are escaped in JSON)."""
    found = _CACHED.findall(body)
    if found:
        return int(found[-1])
    return 0 if _USAGE.search(body) else None


class KvRate:
    """Per engine, a token bucket of KV keys per second: `admit` says whether a message of `cost` keys fits."""

    def __init__(self, keys_per_s: float = DEFAULT_KEYS_PER_S, burst: float = DEFAULT_BURST_KEYS) -> None:
        self.keys_per_s, self.burst = keys_per_s, max(burst, 1.0)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # engine -> (tokens, at)

    def admit(self, engine_id: str, cost: int, now: float) -> bool:
        tokens, at = self._buckets.pop(engine_id, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.keys_per_s)
        admitted = tokens >= cost
        if admitted:
            tokens -= cost
        self._buckets[engine_id] = (tokens, now)
        if len(self._buckets) > _MAX_BUCKETS:
            self._buckets.popitem(last=False)
        return admitted

    def forget(self, engine_id: str) -> None:
        self._buckets.pop(engine_id, None)


@dataclass(slots=True)
class Expected:
    """What a request routed by a claim expects to find cached on its engine."""

    engine_id: str
    claim: int  # the key of the deepest claimed block: names the claim
    keys: np.ndarray  # the claimed blocks' keys (dropped from the index if contradicted)
    tokens: float  # cached tokens the claim promised
    probe: bool  # rode on an unconfirmed claim (holds one of the engine's probe slots)
    at: float


class Claims:
    """Which engines' claims are confirmed, the requests testing them, strikes and quarantines (module doc)."""

    def __init__(
        self,
        probes: int = 2,
        ratio: float = 0.5,
        strikes: int = 3,
        quarantine_s: float = 60.0,
        confirmed_per_engine: int = 4096,
        expect_ttl_s: float = 300.0,
        max_expected: int = 100_000,
    ) -> None:
        self.probes, self.ratio, self.strikes, self.quarantine_s = probes, ratio, strikes, quarantine_s
        self.confirmed_per_engine, self.expect_ttl_s, self.max_expected = (
            confirmed_per_engine,
            expect_ttl_s,
            max_expected,
        )
        self.confirmed: dict[str, OrderedDict[int, None]] = {}
        self.probing: dict[str, int] = {}
        self.expected: OrderedDict[str, Expected] = OrderedDict()
        self._strikes: dict[str, list[float]] = {}
        self.quarantine: dict[str, float] = {}  # engine -> until

    def quarantined(self, engine_id: str, now: float) -> bool:
        until = self.quarantine.get(engine_id)
        if until is None:
            return False
        if now < until:
            return True
        del self.quarantine[engine_id]
        return False

    def credit(self, engine_id: str, claim: int) -> bool:
        """Whether a request may be credited this engine's claim: confirmed, or a probe slot is free."""
        confirmed = self.confirmed.get(engine_id)
        if confirmed is not None and claim in confirmed:
            return True
        return self.probing.get(engine_id, 0) < self.probes

    def routed(self, request_id: str, engine_id: str, claim: int, keys: np.ndarray, tokens: float, now: float) -> None:
        """The request went to the engine by its claim: expect the answer to report about `tokens` cached."""
        confirmed = self.confirmed.get(engine_id)
        probe = confirmed is None or claim not in confirmed
        if probe:
            self.probing[engine_id] = self.probing.get(engine_id, 0) + 1
        self.expected[request_id] = Expected(engine_id, claim, keys, tokens, probe, now)
        self._expire(now)

    def answered(self, request_id: str, reported: int | None) -> tuple[str, Expected] | None:
        """The request's answer reported `reported` cached tokens (None: no usage): its outcome (`confirmed`,
        `contradicted`, `unreported`) and what it expected; None when it rode on no claim."""
        expected = self.expected.pop(request_id, None)
        if expected is None:
            return None
        self._release(expected)
        if reported is None:
            return "unreported", expected
        if reported >= self.ratio * expected.tokens:
            confirmed = self.confirmed.setdefault(expected.engine_id, OrderedDict())
            confirmed[expected.claim] = None
            confirmed.move_to_end(expected.claim)
            if len(confirmed) > self.confirmed_per_engine:
                confirmed.popitem(last=False)
            self._strikes.pop(expected.engine_id, None)  # strikes count contradictions in a row
            return "confirmed", expected
        confirmed = self.confirmed.get(expected.engine_id)
        if confirmed is not None:
            confirmed.pop(expected.claim, None)
        return "contradicted", expected

    def strike(self, engine_id: str, now: float) -> bool:
        """Count a contradiction; True when it puts the engine in quarantine."""
        recent = [t for t in self._strikes.get(engine_id, []) if now - t < self.quarantine_s]
        recent.append(now)
        if len(recent) < self.strikes:
            self._strikes[engine_id] = recent
            return False
        self._strikes.pop(engine_id, None)
        self.quarantine[engine_id] = now + self.quarantine_s
        self.confirmed.pop(engine_id, None)
        return True

    def forget(self, engine_id: str) -> None:
        """The engine's index is gone (dead, restarted, quarantined): so are its confirmations."""
        self.confirmed.pop(engine_id, None)

    def _release(self, expected: Expected) -> None:
        if expected.probe:
            left = self.probing.get(expected.engine_id, 0) - 1
            if left > 0:
                self.probing[expected.engine_id] = left
            else:
                self.probing.pop(expected.engine_id, None)

    def _expire(self, now: float) -> None:
        """Expectations never answered (a path that did not report) free their probe slots after a while."""
        expected = self.expected
        while expected:
            request_id, oldest = next(iter(expected.items()))
            if now - oldest.at < self.expect_ttl_s and len(expected) <= self.max_expected:
                return
            del expected[request_id]
            self._release(oldest)
