"""Bounds on what another replica's shared decisions may make this replica count (issue 37, item 5).

Every replica counts the others' decisions in flight on the engines they chose (`RouteDecisions` on
`sy.route.decided.<kind>.<id>`). The bus lets a replica publish only under its own id, but in its own name a leaked
password could invent any number of decisions on any engine with any `prompt_tokens`: 64 phantom decisions every
50 ms moved a gateway's split from 30/30/30 to 45/0/45, and 4,096-entry batches as fast as one client can publish
took it to 81 % CPU. So a sender is believed only up to what an honest replica could decide:

- bytes per second per sender (`peer_decision_bytes_per_s`), checked before decoding (`admit_message`; the
  subject names the sender): a flood of max-size batches is dropped unread, so it costs a replica little CPU;
- per (sender, engine) a token bucket of `peer_decisions_per_s` and a ceiling of `peer_inflight_per_engine` of its
  decisions counted at once (they settle as the fleet's in-flight ledger settles them: with the engine's first
  telemetry `inflight_grace_s` after them); a batch over either is cut there, the rest for that engine dropped;
- `prompt_tokens` per decision at most `peer_max_prompt_tokens` and what the engine can hold (its hello's
  `kv_blocks` × `block_size`): larger ones are counted at the bound.

Each cut is counted by reason (`metrics.PEER_DECISIONS_DROPPED`, `metrics.PEER_MESSAGES_DROPPED`). No I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from switchyard.services.router import metrics

__all__ = ["Bucket", "DecisionBounds", "PeerLimits"]

#: Senders tracked at most (a router's credentials may publish under any router id): beyond it, silent ones go.
MAX_PEERS = 1024
#: A sender silent this long is forgotten when the table is full.
PEER_IDLE_S = 60.0


@dataclass
class Bucket:
    """A token bucket: `rate` per second, holding at most `burst`."""

    rate: float
    burst: float
    tokens: float = -1.0  # full on first use
    at: float = 0.0

    def take(self, wanted: float, now: float) -> bool:
        """Take `wanted` tokens if the bucket holds them (else take none): whether it did."""
        if self.tokens < 0:
            self.tokens = self.burst
        else:
            self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens < wanted:
            return False
        self.tokens -= wanted
        return True


@dataclass(frozen=True)
class PeerLimits:
    """The bounds (`RouterSettings.peer_*`); see the module docstring."""

    decision_bytes_per_s: float
    decisions_per_s: float
    inflight_per_engine: int
    max_prompt_tokens: int
    inflight_grace_s: float


@dataclass
class _PeerEngine:
    bucket: Bucket
    counted: deque[float] = field(default_factory=deque)  # when each decision still counted was taken


class FleetLike(Protocol):
    """What the bounds read of the telemetry view (`TelemetryView`): rows, capacities, report times."""

    index: dict[str, int]
    kv_blocks: Sequence[float]
    block_size: Sequence[int]
    last_telemetry: Sequence[float]


class DecisionBounds:
    """Admits other replicas' decisions within `PeerLimits`; counts what it cuts (`dropped`, by reason)."""

    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self.dropped: dict[str, int] = {}  # reason -> decisions (or messages, for "bytes") cut
        self.admitted_bytes = 0  # bytes of the messages let through to decoding
        self._bytes: dict[str, Bucket] = {}
        self._engines: dict[tuple[str, str], _PeerEngine] = {}
        self._heard: dict[str, float] = {}

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        counter = metrics.PEER_MESSAGES_DROPPED if reason in ("bytes", "peers") else metrics.PEER_DECISIONS_DROPPED
        counter.labels(reason).inc(n)

    def admit_message(self, sender: str, size: int, now: float) -> bool:
        """Whether a message of `size` bytes from `sender` may be decoded (before decoding: a flood stays unread)."""
        if sender not in self._heard and len(self._heard) >= MAX_PEERS and not self._forget_idle(now):
            self._drop("peers")
            return False
        self._heard[sender] = now
        rate = self.limits.decision_bytes_per_s
        bucket = self._bytes.get(sender)
        if bucket is None:
            bucket = self._bytes[sender] = Bucket(rate, rate)
        if not bucket.take(size, now):
            self._drop("bytes")
            return False
        self.admitted_bytes += size
        return True

    def _forget_idle(self, now: float) -> bool:
        idle = [peer for peer, at in self._heard.items() if now - at > PEER_IDLE_S]
        for peer in idle:
            del self._heard[peer]
            self._bytes.pop(peer, None)
        if idle:
            gone = set(idle)
            self._engines = {key: v for key, v in self._engines.items() if key[0] not in gone}
        return bool(idle)

    def admit(
        self,
        sender: str,
        engine_ids: Sequence[str],
        prompt_tokens: Sequence[int],
        now: float,
        fleet: FleetLike,
        grace_s: float,
    ) -> list[tuple[int, int]]:
        """The (row, prompt tokens) of the decisions to count, in order; the others are counted as cut."""
        accepted: list[tuple[int, int]] = []
        cut: dict[str, int] = {}
        for engine_id, tokens in zip(engine_ids, prompt_tokens, strict=True):
            row = fleet.index.get(engine_id)
            if row is None:
                cut["unknown_engine"] = cut.get("unknown_engine", 0) + 1
                continue
            reason = self._take(sender, engine_id, now, float(fleet.last_telemetry[row]) - grace_s)
            if reason is not None:
                cut[reason] = cut.get(reason, 0) + 1
                continue
            bound = self._token_bound(fleet, row)
            if tokens > bound:
                cut["prompt_tokens"] = cut.get("prompt_tokens", 0) + 1  # counted, at the bound
                tokens = bound
            accepted.append((row, tokens))
        for reason, n in cut.items():
            self._drop(reason, n)
        return accepted

    def _take(self, sender: str, engine_id: str, now: float, settled_before: float) -> str | None:
        """One more decision of `sender` on `engine_id`: None when within the bounds, else the reason."""
        key = (sender, engine_id)
        state = self._engines.get(key)
        if state is None:
            limits = self.limits
            state = self._engines[key] = _PeerEngine(Bucket(limits.decisions_per_s, limits.inflight_per_engine))
        counted = state.counted
        while counted and counted[0] < settled_before:  # the engine has reported them since: no longer counted
            counted.popleft()
        if len(counted) >= self.limits.inflight_per_engine:
            return "inflight"
        if not state.bucket.take(1.0, now):
            return "rate"
        counted.append(now)
        return None

    def _token_bound(self, fleet: FleetLike, row: int) -> int:
        """Prompt tokens one decision may count on `row`: the setting, and what the engine can hold."""
        held = int(fleet.kv_blocks[row]) * int(fleet.block_size[row])
        return min(self.limits.max_prompt_tokens, held) if held > 0 else self.limits.max_prompt_tokens

    def forget_engines(self, known: set[str]) -> None:
        """Drop the state of engines the fleet forgot (called from housekeeping)."""
        if any(engine not in known for _, engine in self._engines):
            self._engines = {key: v for key, v in self._engines.items() if key[1] in known}
