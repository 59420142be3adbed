"""The request's prefill on each engine, discounted by how well the engine's recent experts match its own.

Why this form: Gimbal's pressure score is in prefill tokens, so the pull towards an engine whose recent traffic
used the same experts is too: ``prompt_tokens · (1 − a) / 2`` with ``a`` the request input ``expert_affinity``
(`solver.routing.affinity`: the centered cosine of the request's predicted signature and each engine's recent
traffic, in [-1, 1]). The best-matching engine is charged nothing, the opposite one the whole prompt; the
weight sets how many prefill tokens of pressure one prompt's worth of affinity is worth. Without a prediction
(no shared prefix, no traffic yet) the term is the same on every engine and changes no choice: pressure alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class ExpertAffinity:
    name: str = "expert_affinity"
    needs: frozenset[str] = need("prompt_tokens", "expert_affinity")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        prompt = float(query.prompt_tokens)
        a = query.affinity
        if a is None:
            return np.full(snap.size, prompt / 2)
        return prompt * (1.0 - np.clip(a, -1.0, 1.0)) / 2
