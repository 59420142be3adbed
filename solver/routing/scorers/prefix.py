"""The request's own prefill on each engine, in tokens: its prompt less what that engine has cached.

Why this form: Gimbal's pressure score counts prefill work queued on an engine in tokens; the prompt the new
request brings is more of the same work, but only its uncached part (cached blocks skip prefill). Adding
``prompt_tokens − cached_tokens`` keeps the score in one unit, as Dynamo's cost adds the prefill blocks not
yet cached to the decode blocks. Without an index answer (`RouteQuery.cached` None) the term is the same on
every engine and changes no choice; with weight 0 the profile is Gimbal's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.shared.signals import need
from switchyard.solver.routing.query import RouteQuery
from switchyard.solver.routing.snapshot import FleetSnapshot
from switchyard.solver.routing.tables import RoutingTables


@dataclass(frozen=True)
class UncachedPrompt:
    name: str = "uncached_prompt"
    needs: frozenset[str] = need("prompt_tokens", "cached_tokens")

    def cost(self, snap: FleetSnapshot, query: RouteQuery, tables: RoutingTables) -> np.ndarray:
        prompt = float(query.prompt_tokens)
        if query.cached is None:
            return np.full(snap.size, prompt)
        return np.maximum(prompt - query.cached, 0.0)
