"""The expert-placement problem: what is given, and the two forms a placement takes.

Given, for one expert-parallel group of G GPUs and a window of traffic:

- `load` B[L, E]: tokens routed to each expert (computation load);
- `source_load` A[L, S, E] (optional): the same tokens split by the source DP rank that sent them;
- `distance` D[S, G]: cost of one token travelling from source s to GPU g (0 local, 1 remote by default);
- `migration_cost` M: cost of changing whether GPU g hosts expert e (scalar or anything broadcastable to
  [L, E, G]); it is charged on both ends of a move, as in the objective `Σ M |x − x⁰|`;
- `current` x⁰: the placement the engines hold now, or None for a fresh placement (no migration term);
- `slots_per_gpu` and `redundant_slots`: each GPU holds at most `slots_per_gpu` experts per layer, and a
  layer may hold up to `redundant_slots` extra copies of (hot) experts beyond one copy of each.

A placement has two forms. The **slot map** `[L, G, slots]` (expert id per slot, -1 empty) is what
engines, plans (`PlacementPlan.placement`) and the database hold. The **host matrix** `[L, E, G]` (copies
of expert e on GPU g, 0 or 1) is the `x` of the objective. `hosts_from_slots` and `slots_from_hosts`
convert; the latter keeps every expert that stays on its GPU in its current slot, so a plan's diff with
the engines' layout contains only the moves the solver chose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import cast

import numpy as np

from switchyard.shared.placement_terms import BUILTIN_TERMS
from switchyard.solver.placement.errors import PlacementError
from switchyard.solver.placement.weights import Weights, check_term_map


def _as_float(name: str, array: object, ndim: int) -> np.ndarray:
    a = np.asarray(array)
    if a.ndim != ndim:
        raise PlacementError(f"{name} must have {ndim} dimensions, got shape {list(a.shape)}")
    if a.dtype.kind not in "biuf":
        raise PlacementError(f"{name} must be numeric, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all() or (a < 0).any():
        raise PlacementError(f"{name} must be finite and non-negative")
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class PlacementProblem:
    """One placement instance. Validated on construction; arrays are stored read-only as float64/int64."""

    load: np.ndarray
    num_gpus: int
    slots_per_gpu: int
    source_load: np.ndarray | None = None
    distance: np.ndarray | None = None
    migration_cost: float | np.ndarray = 0.0
    current: np.ndarray | None = None
    redundant_slots: int = 0
    weights: Weights = field(default_factory=Weights)
    #: Linear terms beyond comm and mig: name → cost of hosting one copy of expert e on GPU g, broadcastable
    #: to [L, E, G], finite and >= 0; weighted by `weights[name]` (`terms.py`).
    extra_terms: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise fields once, here
        set_(self, "load", _as_float("load B", self.load, 2))
        num_layers, num_experts = self.load.shape
        if num_layers == 0 or num_experts == 0:
            raise PlacementError(f"load B must be non-empty, got shape {list(self.load.shape)}")
        for name in ("num_gpus", "slots_per_gpu", "redundant_slots"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool):
                raise PlacementError(f"{name} must be an integer, got {value!r}")
        if self.num_gpus < 1 or self.slots_per_gpu < 1 or self.redundant_slots < 0:
            raise PlacementError("num_gpus and slots_per_gpu must be >= 1 and redundant_slots >= 0")
        if num_experts + self.redundant_slots > self.num_gpus * self.slots_per_gpu:
            raise PlacementError(
                f"{num_experts} experts + {self.redundant_slots} redundant copies do not fit in "
                f"{self.num_gpus} GPUs x {self.slots_per_gpu} slots"
            )
        if self.redundant_slots > num_experts * (self.num_gpus - 1):
            raise PlacementError(f"{self.redundant_slots} redundant copies exceed one copy per expert per GPU")
        self._check_sources(num_layers, num_experts)
        try:
            mig = np.broadcast_to(np.asarray(self.migration_cost, dtype=np.float64), self.shape)
        except (ValueError, TypeError):
            raise PlacementError(
                f"migration_cost of shape {list(np.shape(self.migration_cost))} does not broadcast to "
                f"[L, E, G] = {list(self.shape)}"
            ) from None
        if not np.isfinite(mig).all() or (mig < 0).any():
            raise PlacementError("migration_cost must be finite and non-negative")
        set_(self, "migration_cost", mig)
        set_(self, "extra_terms", self._check_extra_terms())
        if not isinstance(self.weights, Weights):
            set_(self, "weights", Weights(self.weights))
        if self.current is not None:
            set_(self, "current", check_slot_map(self.current, num_layers, num_experts, self.num_gpus))
            if self.current.shape[2] != self.slots_per_gpu:
                raise PlacementError(
                    f"current placement has {self.current.shape[2]} slots per GPU, problem has {self.slots_per_gpu}"
                )

    def _check_extra_terms(self) -> dict[str, np.ndarray]:
        terms: dict[str, np.ndarray] = {}
        check_term_map(dict.fromkeys(self.extra_terms, 0.0), "extra term")
        for name, cost in self.extra_terms.items():
            if name in BUILTIN_TERMS:
                raise PlacementError(f"extra term {name!r} is a built-in term")
            try:
                full = np.broadcast_to(np.asarray(cost, dtype=np.float64), self.shape)
            except (ValueError, TypeError):
                raise PlacementError(
                    f"extra term {name} of shape {list(np.shape(cost))} does not broadcast to [L, E, G] = "
                    f"{list(self.shape)}"
                ) from None
            if not np.isfinite(full).all() or (full < 0).any():
                raise PlacementError(f"extra term {name} must be finite and non-negative")
            terms[name] = full
        return terms

    def _check_sources(self, num_layers: int, num_experts: int) -> None:
        if self.source_load is None:
            if self.distance is not None:
                raise PlacementError("distance D given without source_load A")
            return
        if self.distance is None:
            raise PlacementError("source_load A needs a distance matrix D[S, G]")
        a = _as_float("source_load A", self.source_load, 3)
        d = _as_float("distance D", self.distance, 2)
        if a.shape[0] != num_layers or a.shape[2] != num_experts:
            raise PlacementError(f"source_load A shape {list(a.shape)} is not [{num_layers}, S, {num_experts}]")
        if d.shape != (a.shape[1], self.num_gpus):
            raise PlacementError(f"distance D shape {list(d.shape)} is not [S, G] = [{a.shape[1]}, {self.num_gpus}]")
        object.__setattr__(self, "source_load", a)
        object.__setattr__(self, "distance", d)

    @property
    def num_layers(self) -> int:
        return self.load.shape[0]

    @property
    def num_experts(self) -> int:
        return self.load.shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(L, E, G): the shape of a host matrix."""
        return self.num_layers, self.num_experts, self.num_gpus

    def comm_cost(self) -> np.ndarray:
        """C[L, E, G] = Σ_s A[l,s,e] D[s,g]: communication if expert e's traffic is served on GPU g."""
        if self.source_load is None or self.distance is None:  # `__post_init__` sets both or neither
            return np.zeros(self.shape)
        return np.einsum("lse,sg->leg", self.source_load, self.distance)

    @property
    def mig(self) -> np.ndarray:
        """M[L, E, G]: `migration_cost` as `__post_init__` broadcast it (given as a scalar or any broadcastable)."""
        return cast(np.ndarray, self.migration_cost)

    def current_hosts(self) -> np.ndarray | None:
        return None if self.current is None else hosts_from_slots(self.current, self.num_experts)

    def interchangeable_gpus(self) -> list[list[int]]:
        """Classes (size > 1) of GPUs that no term of the objective tells apart: equal distance columns, equal
        extra-term costs and no migration term. Any relabelling within a class gives an equally good placement."""
        if self.current is not None and self.mig.any():
            return []
        columns = self.distance.T if self.distance is not None else np.zeros((self.num_gpus, 1))
        if self.extra_terms:  # a GPU that an extra term prices differently is not interchangeable either
            per_gpu = [np.moveaxis(cost, 2, 0).reshape(self.num_gpus, -1) for cost in self.extra_terms.values()]
            columns = np.hstack([columns, *per_gpu])
        _, label = np.unique(columns, axis=0, return_inverse=True)
        classes = [np.flatnonzero(label.ravel() == c).tolist() for c in range(label.max() + 1)]
        return [c for c in classes if len(c) > 1]

    def layer(self, index: int) -> PlacementProblem:
        """The single-layer sub-problem (the objective separates by layer)."""
        sl = slice(index, index + 1)
        return replace(
            self,
            load=self.load[sl],
            source_load=None if self.source_load is None else self.source_load[sl],
            migration_cost=self.mig[sl],
            current=None if self.current is None else self.current[sl],
            extra_terms={name: cost[sl] for name, cost in self.extra_terms.items()},
        )

    @classmethod
    def from_counts(
        cls,
        counts: np.ndarray,
        num_gpus: int,
        slots_per_gpu: int,
        *,
        distance: np.ndarray | None = None,
        current: np.ndarray | None = None,
        migration_cost: float | np.ndarray = 0.0,
        redundant_slots: int = 0,
        weights: Mapping[str, float] | None = None,
        extra_terms: Mapping[str, np.ndarray] | None = None,
    ) -> PlacementProblem:
        """A problem in canonical units from raw token counts: B[L, E], or A[L, S, E] with `distance`.

        Counts are divided, per layer, by the mean GPU load (layer total / G), so the mean GPU load is 1,
        the load term is G times the squared coefficient of variation of GPU loads, communication is in
        mean-GPU-loads of remote traffic, and the placement does not change with the window's length.
        `migration_cost` is in the same unit: the remote traffic that changing one host is worth, and so are
        `extra_terms` (the cost of one copy of expert e on GPU g).
        """
        counts = _as_float("counts", counts, np.ndim(counts))
        if counts.ndim != (2 if distance is None else 3):
            raise PlacementError(
                f"counts must be B[L, E], or A[L, S, E] together with a distance matrix; got {list(counts.shape)}"
            )
        totals = counts.reshape(counts.shape[0], -1).sum(axis=1)
        scale = num_gpus / np.where(totals > 0, totals, np.inf)
        normalised = counts * scale.reshape((-1,) + (1,) * (counts.ndim - 1))
        return cls(
            load=normalised if distance is None else normalised.sum(axis=1),
            num_gpus=num_gpus,
            slots_per_gpu=slots_per_gpu,
            source_load=None if distance is None else normalised,
            distance=distance,
            migration_cost=migration_cost,
            current=current,
            redundant_slots=redundant_slots,
            weights=Weights(weights),
            extra_terms=extra_terms or {},
        )


def check_slot_map(slot_map: np.ndarray, num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """Validate a slot map: ids in [-1, E), every expert present, no expert twice on one GPU."""
    s = np.asarray(slot_map)
    if s.ndim != 3 or s.shape[0] != num_layers or s.shape[1] != num_gpus:
        raise PlacementError(f"slot map shape {list(s.shape)} is not [L, G, slots] = [{num_layers}, {num_gpus}, *]")
    if s.dtype.kind not in "iu":
        raise PlacementError(f"slot map must hold integer expert ids, got dtype {s.dtype}")
    s = s.astype(np.int64)
    if ((s < -1) | (s >= num_experts)).any():
        raise PlacementError(f"slot map holds ids outside [-1, {num_experts})")
    hosts = hosts_from_slots(s, num_experts)
    if (hosts > 1).any():
        layer, expert, gpu = np.argwhere(hosts > 1)[0]
        raise PlacementError(f"layer {layer}: expert {expert} occupies two slots of GPU {gpu}")
    missing = hosts.sum(axis=2) == 0
    if missing.any():
        layer, expert = np.argwhere(missing)[0]
        raise PlacementError(f"layer {layer}: expert {expert} has no slot")
    s.setflags(write=False)
    return s


def hosts_from_slots(slot_map: np.ndarray, num_experts: int) -> np.ndarray:
    """Host matrix [L, E, G] (copies of e on g) of a slot map [L, G, slots]."""
    num_layers, num_gpus, _ = slot_map.shape
    layer, gpu, slot = np.nonzero(slot_map >= 0)
    hosts = np.zeros((num_layers, num_experts, num_gpus), dtype=np.int64)
    np.add.at(hosts, (layer, slot_map[layer, gpu, slot], gpu), 1)
    return hosts


def slots_from_hosts(hosts: np.ndarray, slots_per_gpu: int, current: np.ndarray | None = None) -> np.ndarray:
    """Slot map [L, G, slots] of a 0/1 host matrix [L, E, G].

    An expert that `current` already holds on the same GPU keeps its slot; newcomers fill the GPU's
    remaining slots in slot order, by ascending expert id. Vectorised over layers and GPUs.
    """
    hosts = np.asarray(hosts) > 0
    num_layers, _, num_gpus = hosts.shape
    per_gpu = hosts.sum(axis=1)
    if (per_gpu > slots_per_gpu).any():
        layer, gpu = np.argwhere(per_gpu > slots_per_gpu)[0]
        raise PlacementError(f"layer {layer}: GPU {gpu} hosts {per_gpu[layer, gpu]} experts in {slots_per_gpu} slots")
    layer_gpu = (np.arange(num_layers)[:, None, None], np.arange(num_gpus)[None, :, None])
    out = np.full((num_layers, num_gpus, slots_per_gpu), -1, dtype=np.int64)
    newcomers = hosts.transpose(0, 2, 1).copy()  # [L, G, E]
    if current is not None:
        cur = np.asarray(current, dtype=np.int64)
        stays = (cur >= 0) & hosts[layer_gpu[0], np.maximum(cur, 0), layer_gpu[1]]
        out[stays] = cur[stays]
        kept = np.nonzero(stays)
        newcomers[kept[0], kept[1], cur[stays]] = False
    free_slots = np.argsort(out >= 0, axis=2, kind="stable")  # per GPU: free slots first, in slot order
    rank = np.cumsum(newcomers, axis=2) - 1
    layer, gpu, expert = np.nonzero(newcomers)
    out[layer, gpu, free_slots[layer, gpu, rank[layer, gpu, expert]]] = expert
    return out


def contiguous_slots(num_layers: int, num_experts: int, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """The default layout of vLLM/SGLang without EPLB: expert e on GPU e // ceil(E/G), every layer alike."""
    per_gpu = -(-num_experts // num_gpus)
    if per_gpu > slots_per_gpu:
        raise PlacementError(f"{num_experts} experts need {per_gpu} slots per GPU, only {slots_per_gpu} given")
    out = np.full((num_layers, num_gpus, slots_per_gpu), -1, dtype=np.int64)
    experts = np.arange(num_experts)
    out[:, experts // per_gpu, experts % per_gpu] = experts
    return out


def locality_distance(source_node: np.ndarray, gpu_node: np.ndarray) -> np.ndarray:
    """D[S, G] = 0 where source s and GPU g share a node (or DP group), 1 otherwise."""
    return (np.asarray(source_node)[:, None] != np.asarray(gpu_node)[None, :]).astype(np.float64)
