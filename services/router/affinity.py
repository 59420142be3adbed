"""Expert-affinity dispatch in the live router: the signature cache and the engines' recent traffic, fed from the bus.

The pure parts are `solver.routing.affinity` (the cache, the centered cosine) and the scorer
`solver.routing.scorers.affinity.ExpertAffinity`; the simulator feeds them in `simulator.offline.dp_affinity`.
Here the router feeds them from what it sees:

- each DP decision it makes (`routed`): the request id, the engine chosen, the prompt's block keys;
- each engine's `PrefillSignature` on ``sy.engine.<id>.signature`` (`on_signature`): matched to a routed request
  by its id (exactly, or the gateway's `sygw-…` id inside vLLM's `cmpl-<id>-0`), the signature, as per-layer
  distributions, is filed in the cache under the request's block keys and added to the engine's traffic.

Trust (issue 40: signatures come from engines). A signature counts only when the engine its subject names (only
that engine's NATS user may publish there) is the engine this router sent the request to, once per request: an
engine can describe only its own traffic, which is what its own row of traffic is, and can file signatures only
under the prefixes of prompts it was sent (the predictions for those prefixes are what a lying engine can skew;
no other engine's row). Everything is bounded: routed requests awaiting a signature (count and age), the cache
(keys and bytes), the features of one signature, the engines with traffic (those of the fleet only).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from switchyard.shared.schemas import PrefillSignature
from switchyard.solver.routing.affinity import SignatureCache, affinity, signature_vector

__all__ = ["REFUSALS", "AffinityLimits", "AffinityState"]

#: The gateway's request ids (`services.gateway.signatures.REQUEST_ID`), which vLLM embeds in its own.
_GATEWAY_ID = re.compile(r"sygw-[0-9a-f]{32}")
#: Why a signature was not used (the `router_affinity_signatures_total` metric's `outcome` label, besides "used").
REFUSALS = ("not_routed", "other_engine", "shape")


@dataclass(frozen=True)
class AffinityLimits:
    """The bounds (`RouterSettings.affinity_*`)."""

    cache_keys: int = 4096
    cache_bytes: int = 64 * 1024 * 1024
    half_life_s: float = 10.0
    pending: int = 16384
    pending_ttl_s: float = 120.0
    max_features: int = 65536


class AffinityState:
    """One router replica's signature cache, its routed requests awaiting their signature, and each engine's
    recent traffic (the decayed sum of its requests' signatures, per-layer distributions)."""

    def __init__(self, limits: AffinityLimits) -> None:
        self.limits = limits
        self.cache = SignatureCache(limits.cache_keys, limits.cache_bytes)
        #: request id -> (engine id, block keys or None, when routed), oldest first
        self._pending: OrderedDict[str, tuple[str, tuple[int, ...] | None, float]] = OrderedDict()
        #: engine id -> (traffic vector, the time it is decayed to)
        self._traffic: dict[str, tuple[np.ndarray, float]] = {}
        self.counts: dict[str, int] = {"used": 0, **{reason: 0 for reason in REFUSALS}}

    def routed(self, request_id: str, engine_id: str, keys: np.ndarray | None, now: float) -> None:
        """A DP decision of this replica: its engine's signature for it will be believed (once)."""
        pending = self._pending
        pending.pop(request_id, None)
        pending[request_id] = (engine_id, tuple(int(k) for k in keys) if keys is not None and len(keys) else None, now)
        horizon = now - self.limits.pending_ttl_s
        while pending and (len(pending) > self.limits.pending or next(iter(pending.values()))[2] < horizon):
            pending.popitem(last=False)

    def _routed_id(self, engine_request_id: str) -> str | None:
        """The routed request an engine's request id names: itself, or the gateway id inside it."""
        if engine_request_id in self._pending:
            return engine_request_id
        match = _GATEWAY_ID.search(engine_request_id)
        return match.group(0) if match is not None and match.group(0) in self._pending else None

    def on_signature(self, message: PrefillSignature, sender: str, now: float) -> str:
        """File `message` (from the engine `sender`, the one its subject names): "used", or why not (`REFUSALS`)."""
        routed = self._routed_id(message.request_id)
        entry = self._pending[routed] if routed is not None else None
        if routed is None or entry is None:
            outcome = "not_routed"
        elif entry[0] != sender or message.engine_id != sender:
            outcome = "other_engine"  # kept: the engine it was sent to may still answer for it
        elif message.signature.size > self.limits.max_features or message.signature.size == 0:
            outcome = "shape"
        else:
            del self._pending[routed]
            vector = signature_vector(message.signature)
            if entry[1] is not None:
                self.cache.record(entry[1], vector)
            self._add(sender, vector, now)
            outcome = "used"
        self.counts[outcome] += 1
        return outcome

    def _decayed(self, engine_id: str, now: float) -> np.ndarray | None:
        held = self._traffic.get(engine_id)
        if held is None:
            return None
        rows, at = held
        if now > at:
            rows = rows * 0.5 ** ((now - at) / self.limits.half_life_s)
            self._traffic[engine_id] = (rows, now)
        return rows

    def _add(self, engine_id: str, vector: np.ndarray, now: float) -> None:
        rows = self._decayed(engine_id, now)
        if rows is None or rows.shape != vector.shape:  # a first signature, or the engine's model changed
            rows = np.zeros_like(vector)
        self._traffic[engine_id] = (rows + vector, now)

    def predict(self, keys: np.ndarray | None, engine_ids: Sequence[str], now: float) -> np.ndarray | None:
        """The request input ``expert_affinity`` for `engine_ids` (snapshot order): None without a prediction
        (no key held, or fewer than two engines with traffic of the prediction's shape)."""
        if keys is None or not len(keys):
            return None
        found = self.cache.predict([int(k) for k in keys])
        if found is None:
            return None
        signature = found[0]
        traffic = np.zeros((len(engine_ids), signature.size))
        for i, engine_id in enumerate(engine_ids):
            rows = self._decayed(engine_id, now)
            if rows is not None and rows.shape == signature.shape:
                traffic[i] = rows
        return affinity(signature, traffic)

    def forget(self, engine_ids: set[str]) -> None:
        """Keep traffic only for `engine_ids` (the fleet's known engines)."""
        for engine_id in [e for e in self._traffic if e not in engine_ids]:
            del self._traffic[engine_id]

    @property
    def pending(self) -> int:
        return len(self._pending)

    def traffic_mass(self, engine_id: str, now: float) -> float:
        """The engine's decayed traffic (each signature adds its layers with counts): for tests and metrics."""
        rows = self._decayed(engine_id, now)
        return 0.0 if rows is None else float(rows.sum())
