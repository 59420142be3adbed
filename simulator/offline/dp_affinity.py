"""The DP simulator's expert-affinity view (issue 40 item 3; docs/expert-affinity.md).

What a router running the ``gimbal-affinity`` profile would know, fed as it would be fed: when a request's
prefill ends on engine i, the engine publishes the request's prefill signature (`PrefillSignature` on
``sy.engine.<id>.signature``; here the replayed trace request's prefill counts). The signature goes into the
signature cache under the request's prefix block keys and into engine i's recent traffic
(`solver.routing.affinity`). At the next arrival the cache predicts that request's signature from its own keys,
and the profile reads ``expert_affinity`` (`AffinityQuery`).

Control (`AFFINITY_CONTROLS`): "shuffled" feeds, for every request, the signature of another request of the run
(a fixed random permutation, its own seeded stream): the same amount of information on the wrong requests. If
affinity dispatch helps because it groups requests by their real experts, its gain must vanish under it.
"""

from __future__ import annotations

import numpy as np

from switchyard.shared.streams import stream
from switchyard.simulator.offline.dp_fleet import DPFleetConfig
from switchyard.solver.routing.affinity import (
    AffinityQuery,
    EngineTraffic,
    SignatureCache,
    affinity,
    signature_vector,
)

__all__ = ["AFFINITY_CONTROLS", "AffinityFeed", "affinity_feed"]

#: Controls of the signature feed (`DPFleetConfig.affinity_control`).
AFFINITY_CONTROLS: tuple[str, ...] = ("none", "shuffled")


class AffinityFeed:
    """Signature cache + engines' recent traffic, fed by the engines' per-request signatures at first token.

    `signatures[R, F]`: each bank row's signature vector; `replay[N]`: each simulated request's bank row;
    `keys[N]`: each request's prefix block keys (None: no request has keys, and every decision is pressure
    alone)."""

    def __init__(
        self,
        engines: int,
        signatures: np.ndarray,
        replay: np.ndarray,
        keys: list[tuple[int, ...]] | None,
        control: str = "none",
        seed: int = 0,
    ) -> None:
        if control not in AFFINITY_CONTROLS:
            raise ValueError(f"affinity_control must be one of {', '.join(AFFINITY_CONTROLS)}, got {control!r}")
        self.signatures = signatures
        self.source = np.asarray(replay)
        if control == "shuffled":
            self.source = self.source[stream(seed, "dp.affinity-control").permutation(len(self.source))]
        self.keys = keys
        self.cache = SignatureCache()
        self.traffic = EngineTraffic(engines, signatures.shape[1])
        self._engine_of: dict[int, int] = {}
        self.predicted = 0  # decisions that had a prediction and traffic to compare it with

    def query(self, now: float, prompt_tokens: int, rid: int) -> AffinityQuery:
        keys = self.keys[rid] if self.keys is not None and rid >= 0 else ()
        hit = self.cache.predict(keys) if keys else None
        a = affinity(hit[0], self.traffic.at(now)) if hit is not None else None
        self.predicted += a is not None
        return AffinityQuery(prompt_tokens=prompt_tokens, affinity=a)

    def routed(self, rid: int, engine: int) -> None:
        self._engine_of[rid] = engine

    def first_tokens(self, now: float, rids: list[int]) -> None:
        """These requests' prefills ended: their engines publish their signatures."""
        for rid in rids:
            engine = self._engine_of.pop(rid, None)
            if engine is None:
                continue
            sig = self.signatures[self.source[rid]]
            self.traffic.add(engine, now, sig)
            if self.keys is not None and self.keys[rid]:
                self.cache.record(self.keys[rid], sig)


def affinity_feed(
    needs: frozenset[str],
    fleet: DPFleetConfig,
    prefill_counts: np.ndarray | None,
    replay: np.ndarray,
    keys: list[tuple[int, ...]] | None,
    seed: int,
) -> AffinityFeed | None:
    """The feed when the profile reads ``expert_affinity`` and the bank has prefill counts, else None."""
    if "expert_affinity" not in needs or prefill_counts is None:
        return None
    signatures = np.stack([signature_vector(c) for c in prefill_counts]) if len(prefill_counts) else np.zeros((0, 1))
    return AffinityFeed(fleet.engines, signatures, replay, keys, fleet.affinity_control, seed)
