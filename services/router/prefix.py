"""The router's prefix-cache state: which engine holds a request's leading blocks, as `cached_tokens`.

Two indexes (`solver.routing.prefix`), one in use per `SWITCHYARD_ROUTER_PREFIX_INDEX`:

- `precise`: a `BlockIndex` fed by the engines' KV events (`sy.engine.<id>.kv`, `KvEvents`), applied in order;
- `approximate`: a `RoutedIndex` of this replica's own DP decisions (a request's keys recorded on the engine it
  was sent to, expiring);
- `off`: no index; prefix scorers see nothing cached.

Keys of kind "text" (the gateway had no tokenizer) name byte blocks no engine reports, so they are matched
against the `RoutedIndex` whatever the mode (except `off`), and a matched text block counts as the prompt's
tokens per key (`prompt_tokens / len(keys)`: the router does not know the text's block size in tokens).

Nothing an engine sends is trusted beyond its own blocks (the caller, `RouterCore.on_kv`, checks that the engine
is known and live and that the events' block size is its hello's; the bus has checked that the subject's engine
is the message's). Events are applied by the one `KvApplier` (`solver.routing.prefix.applier`, the gateway's too,
on `shared.sequence`): a late message is dropped, a gap or restart clears the engine's blocks first (events were
lost, or a new process numbers from 0 with an empty cache); each engine holds at most `max_blocks` blocks, and at
most its hello's `kv_blocks`. A per-engine rate bound drops messages past it (the engine's blocks then cleared),
and, where the answers are seen (the in-process gateway: `confirm`), a claim earns credit only once an answer
confirms it (`services.router.kv_trust`).

Cache tiers: an engine's events name the tier each block is in (`KvOp.tier`: its KV cache, or a CPU or disk
offload tier); the precise index credits each matched block at its tier's weight (`SWITCHYARD_ROUTER_PREFIX_TIER_*`,
`solver.routing.prefix.tiers`), so `cached_tokens` is the weighted blocks times the block size. A claim's trust
check (`kv_trust`) covers the blocks of every tier it credits.

Keys name blocks at one block size: the prompt's keys are taken at the block size most of the asked engines
announce (`key_block_size`, as the gateway keys them), and an engine at another block size is credited nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from switchyard.services.router import metrics
from switchyard.services.router.ask import DpAsk
from switchyard.services.router.kv_trust import DEFAULT_BURST_KEYS, DEFAULT_KEYS_PER_S, Claims, KvRate
from switchyard.shared.schemas import KvEvents
from switchyard.shared.sequence import Seq
from switchyard.solver.routing.prefix import DEFAULT_WEIGHTS, BlockIndex, KvApplier, RoutedIndex, TierWeights

__all__ = ["PrefixState", "key_block_size"]


def key_block_size(sizes: Sequence[int] | np.ndarray) -> int:
    """The block size a prompt's keys are taken at for these engines: the one most of them announce (ties: the
    smallest). One engine announcing an odd size cannot turn prefix routing off for the others (issue 37, 7)."""
    values, counts = np.unique(np.asarray(sizes, dtype=np.int64), return_counts=True)
    return int(values[int(np.argmax(counts))])


class PrefixState:
    """The index in use, the engines' KV-event sequence numbers, and what was counted (see the module doc)."""

    def __init__(
        self,
        mode: str,
        max_blocks: int,
        routed_max_blocks: int,
        routed_ttl_s: float,
        keys_per_s: float = DEFAULT_KEYS_PER_S,
        burst_keys: float = DEFAULT_BURST_KEYS,
        weights: TierWeights = DEFAULT_WEIGHTS,
    ) -> None:
        if mode not in ("precise", "approximate", "off"):
            raise ValueError(f"prefix index {mode!r}: choose precise, approximate or off")
        self.mode = mode
        self.weights = weights.check()  # the precise match's credit per cache tier
        self.blocks = BlockIndex(max_blocks)
        self.applier = KvApplier(self.blocks)  # the engines' events, in their order (one rule with the gateway)
        self.routed = RoutedIndex(routed_max_blocks, routed_ttl_s)
        self.rate = KvRate(keys_per_s, burst_keys)
        #: Confirmation of claims by answers (None: claims are believed as sent; see `confirm`).
        self.claims: Claims | None = None
        self._events = {op: metrics.KV_EVENTS.labels(op) for op in ("stored", "removed", "cleared")}
        self._trust = {
            o: metrics.KV_TRUST.labels(o)
            for o in ("rate", "confirmed", "unconfirmed", "unreported", "probe_full", "quarantined", "ignored")
        }
        self._dropped_seen = self._over_capacity_seen = 0

    def confirm(self, claims: Claims) -> None:
        """Credit claims only as answers confirm them (the owner sees the answers and calls `answered`)."""
        self.claims = claims

    # ----- the precise index: engine events -----

    def apply(self, events: KvEvents, capacity: int | None = None, now: float = 0.0) -> bool:
        """Apply one engine's message, whose sender the caller has checked, its blocks bounded by `capacity` (its
        hello's kv_blocks), by the one sequence rule (`KvApplier`). False when it was dropped: late, over the
        engine's rate (its blocks cleared) or from a quarantined engine."""
        engine_id = events.engine_id
        if self.claims is not None and self.claims.quarantined(engine_id, now):
            self._trust["ignored"].inc()
            return False
        if not self.rate.admit(engine_id, 1 + sum(len(op.keys) for op in events.ops), now):
            self.dropped(engine_id)
            return False
        applied = self.applier.apply(events, capacity)
        if applied.event is Seq.LATE:
            metrics.KV_REJECTED.labels("late").inc()
            return False
        if applied.event is Seq.GAP or applied.event is Seq.RESTART:
            self._reset(engine_id, "seq_gap" if applied.event is Seq.GAP else "seq_back")
        self._events["stored"].inc(applied.stored)
        self._events["removed"].inc(applied.removed)
        self._events["cleared"].inc(applied.cleared)
        return True

    def dropped(self, engine_id: str) -> None:
        """One of the engine's messages was dropped over its rate: what the index holds of it may be stale, so
        it goes (as for a sequence gap), and its next message starts afresh."""
        self._trust["rate"].inc()
        self.applier.restart(engine_id)
        self._reset(engine_id, "rate")

    def _reset(self, engine_id: str, reason: str) -> None:
        """The engine's blocks were cleared (the applier did): what was claimed of them goes too; counted."""
        if self.claims is not None:
            self.claims.forget(engine_id)
        metrics.KV_RESETS.labels(reason).inc()

    def forget(self, engine_id: str, reason: str) -> None:
        """The engine is gone (dead, forgotten, or a new process): drop it from both indexes."""
        if self.applier.reports(engine_id) or self.blocks.blocks(engine_id) or self.routed.blocks(engine_id):
            metrics.KV_RESETS.labels(reason).inc()
        self.applier.forget(engine_id)
        self.routed.forget(engine_id)
        if self.claims is not None:
            self.claims.forget(engine_id)

    def engines(self) -> set[str]:
        """Every engine either index (or the sequence check) holds anything for."""
        return {*self.applier.engines(), *self.blocks.engines(), *self.routed.engines()}

    # ----- deciding -----

    def cached(self, request: DpAsk, engine_ids: Sequence[str], block_size: np.ndarray, now: float):
        """float64[D]: the request's prompt tokens each engine holds cached (snapshot order), capped at the
        prompt; None without keys or index."""
        keys = request.block_keys
        if keys is None or not len(keys) or self.mode == "off":
            return None
        listed = keys.tolist()
        prompt = float(request.prompt_tokens)
        if request.key_kind == "text":
            matched = self.routed.match(listed, engine_ids, now)
            cached = matched * (prompt / len(listed))
        elif self.mode == "precise":
            matched, credit = self.blocks.credit(listed, engine_ids, self.weights)
            if block_size.min() != block_size.max():  # keys at another size than most name other blocks
                matched[block_size != key_block_size(block_size)] = 0
            if self.claims is not None:
                self._gate(matched, listed, engine_ids)
            cached = np.where(matched > 0, credit, 0.0) * block_size
        else:
            cached = self.routed.match(listed, engine_ids, now) * block_size
        return np.minimum(cached, prompt, dtype=np.float64)

    def fresh(self, request: DpAsk, engine_ids: Sequence[str]) -> bool:
        """True when no asked engine holds the prompt's first block, so none holds any of it: `cached` would be
        all zeros, and the caller can skip it (one dict lookup, where `cached` makes a few numpy calls: ~70 µs of
        a cold request's decision here)."""
        keys = request.block_keys
        if keys is None or not len(keys) or self.mode == "off":
            return True
        index = self.blocks if self.mode == "precise" and request.key_kind != "text" else self.routed
        return not index.holds(int(keys[0]), engine_ids)

    def _gate(self, matched: np.ndarray, listed: list[int], engine_ids: Sequence[str]) -> None:
        """Zero the claims that may not be credited: unconfirmed, with the engine's probe slots taken."""
        claims = self.claims
        assert claims is not None
        for i in np.flatnonzero(matched).tolist():
            if not claims.credit(engine_ids[i], listed[int(matched[i]) - 1]):
                matched[i] = 0
                self._trust["probe_full"].inc()

    def record(self, engine_id: str, request: DpAsk, now: float, cached: float = 0.0) -> bool:
        """The request went to `engine_id`, credited `cached` tokens there: the approximate index learns its
        keys (text keys in every mode but off); a precise claim credited is expected to be confirmed by the
        answer (`answered`). True when an index changed."""
        keys = request.block_keys
        if keys is None or not len(keys) or self.mode == "off":
            return False
        if self.mode == "approximate" or request.key_kind == "text":
            self.routed.routed(engine_id, keys.tolist(), now)
            return True
        if self.claims is not None and cached > 0:
            listed = keys.tolist()
            held = int(self.blocks.credit(listed, [engine_id], self.weights)[0][0])
            if held:
                self.claims.routed(request.request_id, engine_id, listed[held - 1], keys[:held], cached, now)
        return False

    def answered(self, request_id: str, reported: int | None, now: float) -> str | None:
        """The answer to a request routed by a claim reported `reported` cached tokens (None: no usage): the
        claim is confirmed, or dropped (and, repeated, the engine quarantined). Returns the outcome."""
        if self.claims is None:
            return None
        result = self.claims.answered(request_id, reported)
        if result is None:
            return None
        outcome, expected = result
        self._trust[outcome if outcome != "contradicted" else "unconfirmed"].inc()
        if outcome == "contradicted":
            self.blocks.removed(expected.engine_id, expected.keys.tolist())
            if self.claims.strike(expected.engine_id, now):
                self._trust["quarantined"].inc()
                self.applier.restart(expected.engine_id)
                self._reset(expected.engine_id, "quarantined")
        return outcome

    def blocks_of(self, engine_ids: Sequence[str]) -> np.ndarray:
        """Blocks the index in use holds per engine (the `indexed_blocks` signal)."""
        if self.mode == "precise":
            count = self.blocks.blocks
        elif self.mode == "approximate":
            count = self.routed.blocks
        else:
            return np.zeros(len(engine_ids))
        return np.array([count(e) for e in engine_ids], dtype=np.float64)

    def export(self) -> None:
        """Gauges and the over-cap counter (housekeeping)."""
        metrics.PREFIX_BLOCKS.labels("precise").set(self.blocks.held())
        metrics.PREFIX_BLOCKS.labels("routed").set(self.routed.held())
        dropped, over = self.blocks.dropped_over_cap, self.blocks.dropped_over_capacity
        metrics.PREFIX_DROPPED.inc(dropped - self._dropped_seen)
        metrics.KV_TRUST.labels("over_capacity").inc(over - self._over_capacity_seen)
        self._dropped_seen, self._over_capacity_seen = dropped, over
