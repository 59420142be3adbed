"""Expert affinity for DP dispatch: send a request where recent traffic used the same experts (issue 40 item 3).

Why: source-aware placement (`solver.placement`) can only keep a DP engine's tokens on that engine's GPUs if
the engines' expert profiles differ. When every engine serves the same mix (the ESFT trace under pressure-only
dispatch), there is nothing to exploit. Dispatch that sends requests with similar experts to the same engine
makes each engine's profile skewed; placement can then put those experts on that engine's GPUs.

A request's experts are known only after its prefill, so dispatch predicts them from what is already known:

- `SignatureCache`: the recorded prefill signature (`PrefillSignature` on ``sy.engine.<id>.signature``) of the
  latest earlier request that shares the longest part of its prefix, keyed by the prefix's block keys
  (`shared.prefix_keys`; in the simulator, the trace's chained hash keys). Bounded: least recently used keys
  go first. No shared prefix: no prediction, and the decision falls back to pressure alone.
- `EngineTraffic`: each engine's recent expert traffic, the decayed sum of the signatures its requests
  computed (per-layer distributions, so a long prompt counts once).
- `affinity(signature, traffic)`: the request input ``expert_affinity``, per engine in [-1, 1]: the cosine of
  the request's signature and each engine's traffic, both *centered* on the fleet's mean traffic. Centering
  keeps what distinguishes an engine: every task selects the same few hot experts, so plain cosines are all
  close to 1 and say nothing.

The scorer `scorers.affinity.ExpertAffinity` turns it into prefill tokens. Pure data structures and functions
over arrays; no clock (callers pass `now`), no randomness, no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from switchyard.solver.routing.query import RouteQuery

__all__ = [
    "DEFAULT_CACHE_KEYS",
    "DEFAULT_TRAFFIC_HALF_LIFE_S",
    "AffinityQuery",
    "EngineTraffic",
    "SignatureCache",
    "affinity",
    "signature_vector",
]

#: Block keys the signature cache holds (each points at one request's signature vector; at 26 x 64 experts a
#: vector is 6.5 KiB, so the worst case, every key a different request's, is 26 MiB).
DEFAULT_CACHE_KEYS = 4096
#: Half-life of an engine's recent traffic (s): long enough to hold a few hundred requests at the loads the
#: seed's fleet runs, short enough to follow a change of mix within a minute.
DEFAULT_TRAFFIC_HALF_LIFE_S = 10.0


def signature_vector(counts: np.ndarray) -> np.ndarray:
    """`[L, E]` prefill expert counts → float64 `[L·E]`: each layer's counts as a distribution (a layer with no
    counts stays zero), so a signature's weight does not grow with its prompt."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"a signature is [layers, experts], got shape {c.shape}")
    per_layer = c.sum(axis=1, keepdims=True)
    return np.divide(c, per_layer, out=np.zeros_like(c), where=per_layer > 0).ravel()


def affinity(signature: np.ndarray | None, traffic: np.ndarray) -> np.ndarray | None:
    """float64 `[D]` in [-1, 1]: centered cosine of `signature` `[F]` with each engine's `traffic` row `[D, F]`.

    Each traffic row is scaled to unit mass per layer first (its mean distribution); the centre is the mean of
    those rows over the engines that have traffic. An engine with no traffic, or a signature equal to the
    centre, scores 0. None without a signature or with fewer than two engines carrying traffic (nothing to
    tell apart): the scorer then adds the same cost everywhere."""
    if signature is None:
        return None
    t = np.asarray(traffic, dtype=np.float64)
    mass = t.sum(axis=1)
    has = mass > 0
    if int(has.sum()) < 2:
        return None
    s = np.asarray(signature, dtype=np.float64)
    layers = max(s.sum(), 1e-12)  # a signature vector sums to its layers with counts
    rows = np.zeros_like(t)
    rows[has] = t[has] * (layers / mass[has])[:, None]
    centre = rows[has].mean(axis=0)
    u = s - centre
    v = rows - centre
    un = math.sqrt(float(u @ u))
    vn = np.sqrt(np.einsum("ij,ij->i", v, v))
    out = np.zeros(len(t))
    ok = has & (vn > 0)
    if un > 0:
        out[ok] = (v[ok] @ u) / (vn[ok] * un)
    return np.clip(out, -1.0, 1.0)


class SignatureCache:
    """Block key → the latest recorded signature of a request whose prompt contains that block (LRU-bounded).

    `record(keys, sig)` files one request's signature under each of its prompt's block keys (chained keys: key i
    names the whole prefix up to block i). `predict(keys)` answers with the signature under the longest of the
    request's keys that is held, and how many blocks matched. Bounded in keys and, since a request's keys share
    one vector, in the bytes of the distinct vectors held (`max_bytes`; None: keys only)."""

    def __init__(self, max_keys: int = DEFAULT_CACHE_KEYS, max_bytes: int | None = None) -> None:
        if max_keys <= 0 or (max_bytes is not None and max_bytes <= 0):
            raise ValueError("max_keys and max_bytes must be positive")
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self._sig: OrderedDict[int, np.ndarray] = OrderedDict()
        self._refs: dict[int, int] = {}  # id of a vector held -> keys pointing at it
        self.nbytes = 0  # the distinct vectors' bytes
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._sig)

    def _hold(self, vector: np.ndarray) -> None:
        n = self._refs.get(id(vector), 0)
        if n == 0:
            self.nbytes += vector.nbytes
        self._refs[id(vector)] = n + 1

    def _release(self, vector: np.ndarray) -> None:
        n = self._refs[id(vector)] - 1
        if n:
            self._refs[id(vector)] = n
        else:
            del self._refs[id(vector)]
            self.nbytes -= vector.nbytes

    def record(self, keys: Sequence[int], signature: np.ndarray) -> None:
        if self.max_bytes is not None and signature.nbytes > self.max_bytes:
            return  # could not be held without evicting everything
        sig = self._sig
        for k in keys:
            old = sig.get(k)
            if old is not None:
                self._release(old)
            sig[k] = signature
            sig.move_to_end(k)
            self._hold(signature)
        while len(sig) > self.max_keys or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            self._release(sig.popitem(last=False)[1])

    def predict(self, keys: Sequence[int]) -> tuple[np.ndarray, int] | None:
        sig = self._sig
        for depth in range(len(keys), 0, -1):
            found = sig.get(keys[depth - 1])
            if found is not None:
                sig.move_to_end(keys[depth - 1])
                self.hits += 1
                return found, depth
        self.misses += 1
        return None


@dataclass
class EngineTraffic:
    """Each engine's recent expert traffic `[D, F]`: signatures added as they are recorded, halved every
    `half_life_s` (decayed lazily, to the time of the latest call)."""

    engines: int
    features: int
    half_life_s: float = DEFAULT_TRAFFIC_HALF_LIFE_S

    def __post_init__(self) -> None:
        if self.half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self.rows = np.zeros((self.engines, self.features))
        self._at = -math.inf

    def at(self, now: float) -> np.ndarray:
        """The traffic decayed to `now` (earlier times do not un-decay it)."""
        if now > self._at:
            if math.isfinite(self._at):
                self.rows *= 0.5 ** ((now - self._at) / self.half_life_s)
            self._at = now
        return self.rows

    def add(self, engine: int, now: float, signature: np.ndarray) -> None:
        self.at(now)[engine] += signature


#: The query with the request input ``expert_affinity`` is a plain `RouteQuery` since the router core carries it
#: (`RouteQuery.affinity`); the name stays for the simulator's and the tests' callers.
AffinityQuery = RouteQuery
