"""The DP simulator's dispatcher: a DP profile of the router fed the view of the fleet a real dispatcher has.

What each dispatch rule sees (the delays are the real systems'):

- `rr`: nothing. `jsq`: its own exact count of outstanding (dispatched, unfinished) requests per engine.
- `vllm`: the DP coordinator's (waiting, running) snapshot, published every 100 ms, plus one waiting request
  per choice since the snapshot (vLLM's local increment). `vllm-main`: the snapshot with KV usage, and the
  client's exact in-flight count.
- `gimbal`: each engine's telemetry (KV usage, remaining and waiting prefill tokens, expert pressure), sent
  every 100 ms at an engine-specific phase (the bus contract's `sy.engine.<id>.telemetry`; `telemetry_aligned`
  puts every engine on one phase, as vLLM's coordinator publishes all engines at once), plus the router's
  in-flight compensation: prompt tokens of requests dispatched to the engine count until a report received at
  least `inflight_grace_s` after them (`solver.routing.ledger`, the router's rule and default).
- `gimbal-exact`: the exact ledger (`solver.routing.exact_ledger`) fed from its own sends and the first tokens
  and ends the fleet emits, its sends of the last few tens of ms (``recent_sends``, `RecentSends`), and the
  telemetry's KV usage and expert pressure.
- `llm-d` reads the coordinator's view (waiting, KV usage), `dynamo` the telemetry view with ``kv_blocks``,
  `sglang-cache` the exact outstanding counts, each with ``cached_tokens`` as below.
- `switchyard` (and any profile reading the request input ``cached_tokens``): Gimbal's view plus, per arrival,
  the prompt tokens each engine holds cached, from one of two prefix indexes (`DPFleetConfig.prefix_index`):
  *precise*: what the engines' caches hold at the decision instant (what vLLM's KV events would have told the
  router: blocks stored as their prefill computed them, removed as evicted; `PrefixCache.lookup`), or
  *approximate*: a `solver.routing.prefix.RoutedIndex` fed by the dispatcher's own decisions (each request's
  keys recorded on the engine chosen, expiring after `prefix_ttl_s`, at most an engine's KV capacity of keys).
  ``indexed_blocks`` is the chosen index's blocks per engine (engine KV blocks; on a trace without hash ids,
  the 16-token blocks of every prompt routed there, as SGLang's tree grows); ``kv_blocks`` (each engine's
  KV capacity, from its hello) is exact. When a profile needs ``cached_tokens`` both indexes are kept and
  their predictions for the chosen engine recorded per request (`DPSimResult.prefix_predicted`), to be
  checked against the hit the request found at admission.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from switchyard.shared.signals import need
from switchyard.shared.streams import stream
from switchyard.simulator.core.prefix_cache import PrefixCache
from switchyard.simulator.offline.dp_affinity import AffinityFeed
from switchyard.simulator.offline.dp_fleet import PREFIX_INDEXES
from switchyard.solver.routing.dispatch import GimbalParams, kv_first_applies
from switchyard.solver.routing.exact_ledger import ExactLedger, RecentSends
from switchyard.solver.routing.filters import KvFirst
from switchyard.solver.routing.ledger import InflightLedger
from switchyard.solver.routing.prefix import RoutedIndex
from switchyard.solver.routing.profiles import dp_profile
from switchyard.solver.routing.query import RouteQuery, RouterState
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables

__all__ = [
    "COORDINATOR_COLUMNS",
    "EXACT_COLUMNS",
    "HELLO_COLUMNS",
    "LEDGER_COLUMNS",
    "LEDGER_CONTROLS",
    "PREFIX_COLUMNS",
    "SIM_COLUMNS",
    "TELEMETRY_COLUMNS",
    "Dispatcher",
]

_NO_TABLES = RoutingTables()  # DP profiles read no centroid or label tables
#: Tokens per block of ``indexed_blocks`` on a trace without hash ids (vLLM's KV block): an approximate index
#: (SGLang's tree) still records every routed prompt, unique text included.
_INDEX_BLOCK_TOKENS = 16


#: The engine columns the simulated dispatcher can feed a DP profile, by where a real dispatcher gets them
#: (this module's docstring): its own exact counts, the DP coordinator's snapshot, the engines' telemetry. Each is
#: a registry name (`shared.signals.need`: a misspelt one fails at import).
EXACT_COLUMNS = need("alive", "load", "outstanding")
#: The exact ledger's columns (`solver.routing.exact_ledger`): fed from the dispatcher's own sends and the first
#: tokens and ends it sees, as the gateway's progress reports feed the router's; ``recent_sends`` from its sends.
LEDGER_COLUMNS = need("pending_prefill", "pending", "decoding", "recent_sends")
#: Controls of the exact ledger (`DPFleetConfig.ledger_control`): "shuffled" hands the profile the ledger's
#: rows in a fresh random order at every decision (the facts, on the wrong engines).
LEDGER_CONTROLS: tuple[str, ...] = ("none", "shuffled")
COORDINATOR_COLUMNS = need("waiting", "running")
TELEMETRY_COLUMNS = need("remaining_prefill", "waiting_prefill", "expert_pressure", "inflight_tokens", "inflight")
PREFIX_COLUMNS = need("indexed_blocks")
HELLO_COLUMNS = need("kv_blocks")  # the engine's KV capacity, from its hello: known from the start
SIM_COLUMNS = EXACT_COLUMNS | LEDGER_COLUMNS | COORDINATOR_COLUMNS | TELEMETRY_COLUMNS | PREFIX_COLUMNS | HELLO_COLUMNS
SIM_COLUMNS |= need("kv_usage")


class Dispatcher:
    """A DP profile of the router (`solver.routing.profiles.dp_profile`) fed the view of the fleet it would
    have (see the module docstring).

    The profile's columns decide the view: ``waiting``/``running`` come from the coordinator snapshot (plus
    vLLM's local increment of the chosen engine's waiting count), the prefill columns, ``expert_pressure`` and
    the in-flight ledger (``inflight_tokens``, ``inflight``) from each engine's telemetry; ``outstanding``
    (= ``load``) and ``alive`` are exact. ``kv_usage`` comes from telemetry unless the profile reads the
    coordinator's counts and no telemetry column (vLLM main's rule reads the snapshot's KV usage).
    ``cached_tokens`` (the request input) and ``indexed_blocks`` come from the prefix index `prefix_index`
    (`attach_prefix` gives the engines' caches; without them, or for a request without keys, nothing is cached).
    """

    def __init__(
        self,
        policy: str,
        engines: int,
        params: GimbalParams,
        grace_s: float,
        drain_tokens_per_s: float = 0.0,
        weights: Mapping[str, float] | None = None,
        seed: int = 0,
        prefix_index: str = "precise",
        prefix_ttl_s: float = 600.0,
        kv_blocks: int = 0,
        ledger_control: str = "none",
    ) -> None:
        self.profile = dp_profile(policy, params, weights)
        self.policy = policy
        cols = self.profile.columns
        unknown = sorted(cols - SIM_COLUMNS)
        if unknown:
            raise ValueError(
                f"DP profile {policy!r} reads columns the simulator does not feed: {', '.join(unknown)} "
                f"(it feeds {', '.join(sorted(SIM_COLUMNS))})"
            )
        self.n = engines
        self.params = params
        self.grace_s = grace_s
        self.drain = drain_tokens_per_s
        self.alive = np.ones(engines, dtype=bool)
        self.outstanding = np.zeros(engines)  # exact: dispatched and not finished
        # vLLM coordinator view
        self.snap_waiting = np.zeros(engines)
        self.snap_running = np.zeros(engines)
        self.snap_kv = np.zeros(engines)
        # Gimbal telemetry view
        self.kv = np.zeros(engines)
        self.remaining = np.zeros(engines)
        self.waiting_tokens = np.zeros(engines)
        self.pressure = np.ones(engines)
        self.ledger = InflightLedger(engines)  # the router's in-flight compensation, the same ledger
        self.exact = ExactLedger(engines)  # what was sent and has not reached its first token / its end
        self.recent = RecentSends(engines)  # what was sent in the last few tens of ms (decaying)
        self.kv_first = 0
        self.affinity: AffinityFeed | None = None  # ``expert_affinity`` (`dp_affinity`), set by `simulate_dp`

        self.needs_coordinator = bool(cols & COORDINATOR_COLUMNS)
        kv_from_coordinator = self.needs_coordinator and not cols & TELEMETRY_COLUMNS
        self.needs_telemetry = bool(cols & TELEMETRY_COLUMNS) or ("kv_usage" in cols and not kv_from_coordinator)
        self._ledgered = bool(cols & {"inflight_tokens", "inflight"})
        self._drains = self.drain > 0 and "inflight_tokens" in cols
        self._kv_first = next((f for f in self.profile.filters if isinstance(f, KvFirst)), None)
        self.snap = FleetSnapshot(
            engine_ids=tuple(f"dp{i:06d}" for i in range(engines)),
            load=self.outstanding,
            kv_usage=self.snap_kv if kv_from_coordinator else self.kv,
            alive=self.alive,
            columns={
                "outstanding": self.outstanding,
                "waiting": self.snap_waiting,
                "running": self.snap_running,
                "remaining_prefill": self.remaining,
                "waiting_prefill": self.waiting_tokens,
                "expert_pressure": self.pressure,
                "inflight_tokens": self.ledger.tokens,
                "inflight": self.ledger.count,
            },
        )
        self.state = RouterState(rng=stream(seed, "dp.dispatch"))
        if ledger_control not in LEDGER_CONTROLS:
            raise ValueError(f"ledger_control must be one of {', '.join(LEDGER_CONTROLS)}, got {ledger_control!r}")
        self.tracks_exact = bool(cols & LEDGER_COLUMNS)
        self.tracks_recent = "recent_sends" in cols
        self._shuffle = stream(seed, "dp.ledger-control") if ledger_control == "shuffled" else None
        self._feed_exact()
        # prefix view (see the module docstring); live only once `attach_prefix` gives the engines' caches
        if prefix_index not in PREFIX_INDEXES:
            raise ValueError(f"prefix_index must be one of {', '.join(PREFIX_INDEXES)}, got {prefix_index!r}")
        self.prefix_index = prefix_index
        self.prefix_ttl_s = prefix_ttl_s
        self.needs_cached = "cached_tokens" in self.profile.needs
        self.needs_indexed = "indexed_blocks" in cols
        self.indexed = np.zeros(engines)  # refreshed per decision only when the profile reads it
        self.snap.columns["indexed_blocks"] = self.indexed
        self.snap.columns["kv_blocks"] = np.full(engines, float(kv_blocks))
        self._caches: list[PrefixCache] = []
        self.cpu_weight = 0.0  # the precise view's credit for a CPU-tier block (`attach_prefix`)
        self._trace_block = 0
        self._span = 0
        self.routed: RoutedIndex | None = None
        #: The last decision's predicted cached tokens on the engine chosen: (precise, approximate); -1: none.
        self.predicted = (-1, -1)

    @property
    def prefix_live(self) -> bool:
        """The profile reads the prefix index and the engines cache prefixes."""
        return bool(self._caches) and (self.needs_cached or self.needs_indexed)

    def attach_prefix(
        self, caches: list[PrefixCache], trace_block: int, capacity_blocks: int, cpu_weight: float = 0.0
    ) -> None:
        """The engines' prefix caches (precise view) and the trace block; sizes the approximate index.
        `cpu_weight`: the precise view's credit for a block in an engine's CPU tier (0: not reported)."""
        self._caches = caches
        self.cpu_weight = cpu_weight
        self._trace_block = trace_block
        self._span = caches[0].span if caches else 0
        keys_per_engine = max(capacity_blocks // max(self._span, 1), 1)
        self.routed = RoutedIndex(max_blocks=keys_per_engine, ttl_s=self.prefix_ttl_s)

    def _feed_exact(self) -> None:
        """The exact ledger's columns into the snapshot: the ledger's own arrays, or (control) a permutation."""
        columns = {"pending_prefill": self.exact.pending_prefill, "pending": self.exact.pending}
        columns["decoding"] = self.exact.decoding
        columns["recent_sends"] = self.recent.column
        if self._shuffle is not None:
            perm = self._shuffle.permutation(self.n)
            columns = {name: col[perm] for name, col in columns.items()}
        self.snap.columns.update(columns)

    def choose(self, now: float, prompt_tokens: int, keys: tuple[int, ...] | None = None, rid: int = -1) -> int:
        snap = self.snap
        if self.tracks_recent:
            self.recent.at(now)  # decayed in place (the snapshot holds the array)
        if self._shuffle is not None and self.tracks_exact:
            self._feed_exact()
        if self._kv_first is not None and kv_first_applies(snap.alive, snap.kv_usage, self._kv_first.params):
            self.kv_first += 1
        if self._drains:
            snap.columns["inflight_tokens"] = self._drained(now)
        cached = 0
        if not self.prefix_live:
            aff = self.affinity
            query = aff.query(now, prompt_tokens, rid) if aff else RouteQuery(prompt_tokens=prompt_tokens)
            i = self.profile(snap, query, self.state, _NO_TABLES).index
            if self.needs_indexed:  # no keys: an index of what was routed still grows by the prompt's blocks
                self.indexed[i] += -(-prompt_tokens // _INDEX_BLOCK_TOKENS)
        else:
            i, cached = self._choose_prefix(now, prompt_tokens, keys)
        if self.needs_coordinator:
            self.snap_waiting[i] += 1  # vLLM's local increment, until the next snapshot
        if self._ledgered:  # in flight: the prefill the engine will compute (the router's rule)
            self.ledger.add(i, now, prompt_tokens - cached)
        if self.tracks_exact:
            self.exact.sent(rid, i, prompt_tokens - cached)
        if self.tracks_recent:
            self.recent.sent(i, now)
        self.outstanding[i] += 1
        if self.affinity is not None:
            self.affinity.routed(rid, i)
        return i

    def _choose_prefix(self, now: float, prompt_tokens: int, keys: tuple[int, ...] | None) -> tuple[int, int]:
        """A decision with the prefix view: both indexes asked (one feeds the profile), the routed one fed.
        Returns the engine and the prompt tokens the profile was told it holds cached (0 if not told)."""
        routed = self.routed
        assert routed is not None
        ids = self.snap.engine_ids
        precise = approx = None
        if keys:
            tb = self._trace_block
            limit = (prompt_tokens - 1) // tb  # the scheduler's lookup bound: vLLM recomputes the last token
            w = self.cpu_weight
            precise = np.array([c.credit(keys, limit, w) for c in self._caches], dtype=np.float64) * tb
            approx = routed.match(keys[:limit], ids, now).astype(np.float64) * tb
        else:
            for engine_id in ids:
                routed.expire(engine_id, now)
        if self.needs_indexed:
            if self.prefix_index == "precise":
                self.indexed[:] = [c.cached_keys * self._span for c in self._caches]
            else:
                self.indexed[:] = [routed.blocks(e) * self._span for e in ids]
        cached = precise if self.prefix_index == "precise" else approx
        query = RouteQuery(prompt_tokens=prompt_tokens, cached=cached if self.needs_cached else None)
        i = self.profile(self.snap, query, self.state, _NO_TABLES).index
        if keys:
            assert precise is not None and approx is not None
            self.predicted = (int(precise[i]), int(approx[i]))
            routed.routed(ids[i], keys, now)
        else:
            self.predicted = (-1, -1)
        told = query.cached
        return i, int(told[i]) if told is not None else 0

    def _drained(self, now: float) -> np.ndarray:
        """In-flight tokens if each decision's prompt drains at `drain` tokens/s from the moment it was sent."""
        comp = np.zeros(self.n)
        for i in range(self.n):
            for sent, tokens in self.ledger.entries(i):
                comp[i] += max(tokens - self.drain * (now - sent), 0.0)
        return comp

    @property
    def comp(self) -> np.ndarray:
        """Prompt tokens in flight per engine (Gimbal's comp term): the ledger's token column."""
        return self.ledger.tokens

    def on_finished(self, engine: int, count: int) -> None:
        self.outstanding[engine] -= count

    def on_progress(self, first: list[int], finished: list[int]) -> None:
        """Requests that sampled their first token, and requests that ended, in one step (the gateway sees both)."""
        if self.tracks_exact:
            for rid in first:
                self.exact.first_token(rid)
            for rid in finished:
                self.exact.finished(rid)

    def on_coordinator(self, waiting: np.ndarray, running: np.ndarray, kv: np.ndarray) -> None:
        """A coordinator snapshot replaces the client's counts, local increments included."""
        self.snap_waiting[:] = waiting
        self.snap_running[:] = running
        self.snap_kv[:] = kv

    def on_telemetry(self, i: int, now: float, kv: float, remaining: int, waiting: int, pressure: float) -> None:
        self.kv[i] = kv
        self.remaining[i] = remaining
        self.waiting_tokens[i] = waiting
        self.pressure[i] = max(pressure, 1.0)
        self.ledger.settle(i, now - self.grace_s)
