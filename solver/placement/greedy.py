"""The online placement heuristic: place expert copies heaviest first, each on its cheapest GPU.

The score of putting the next copy (expert e, per-copy load b = B_e / r_e) on GPU g is

    S(e, g) = α·comm(e, g) + β·load(e, g) + γ·mig(e, g)  (+ k_t·t(e, g) for every further term t)

with each term the exact increase of the matching weighted objective term (`objective.py`) that this one
decision causes: load(e, g) = w_load·[(L_g + b − L̄)² − (L_g − L̄)²], and the linear terms of `terms.py`
weighted by w_t — comm(e, g) = w_comm·Σ_s A_{s,e} D_{s,g} / r_e, mig(e, g) = w_mig·M_{e,g} (1 − 2 x⁰_{e,g})
(keeping an expert where it is refunds the cost of having moved it away). The multipliers are
`GreedyParams`, one per term by name (α, β, γ are Gimbal's names for comm, load and mig; others default to
1, the exact marginal). With α = β = γ = 1 the greedy is therefore a myopic descent on the true
objective (with the problem's weights all 1, S is the seed's score literally). It is myopic in one known
direction: early, heavy copies cannot see the imbalance later ones will cause, so α, β, γ are calibrated
against the MINLP (`calibrate.py`) rather than left at 1; `refine.place` then repairs what remains.

Copies are placed in descending per-copy load (longest-processing-time order, which is what makes the
load term work) and all layers advance together: the loop runs over the E + R positions of that order,
each step a handful of numpy operations on [L, G] arrays, so no Python code runs per expert and layer.
A GPU is eligible if it has a free slot and no copy of the same expert yet; with replicas, a GPU is also
skipped when taking its last slot would leave fewer non-full GPUs than a later expert has copies (so the
greedy cannot paint itself into a corner), unless no other GPU is eligible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from switchyard.shared.placement_terms import GREEK_TO_TERM, greek_to_terms
from switchyard.solver.placement.problem import PlacementError, PlacementProblem, slots_from_hosts
from switchyard.solver.placement.replication import check_replicas, replica_counts
from switchyard.solver.placement.terms import linear_cost, linear_terms
from switchyard.solver.placement.weights import check_term_map


@dataclass(frozen=True, init=False)
class GreedyParams:
    """Multipliers of the greedy score, one per objective term: α on communication, β on load balance, γ on
    migration, and `others` by term name (a term not named has multiplier 1: its exact marginal).

    `GreedyParams(1, 0.0625, 2)` and `GreedyParams.from_map({"comm": 1, "load": 0.0625, "mig": 2})` are
    the same; `as_map()` is what the wire, the database and the API carry.
    """

    scale: tuple[tuple[str, float], ...]

    def __init__(self, alpha: float = 1.0, beta: float = 1.0, gamma: float = 1.0, **others: float) -> None:
        values = {"comm": alpha, "load": beta, "mig": gamma, **others}
        check_term_map(values, "greedy parameter")
        object.__setattr__(self, "scale", tuple((name, float(value)) for name, value in values.items()))

    @classmethod
    def from_map(cls, values: Mapping[str, float]) -> GreedyParams:
        """From term name → multiplier; the old names alpha, beta and gamma are read as comm, load and mig."""
        values = {**greek_to_terms(dict(values)), **{k: v for k, v in values.items() if k not in GREEK_TO_TERM}}
        return cls(values.pop("comm", 1.0), values.pop("load", 1.0), values.pop("mig", 1.0), **values)

    def as_map(self) -> dict[str, float]:
        return dict(self.scale)

    def __getitem__(self, term: str) -> float:
        return dict(self.scale).get(term, 1.0)

    @property
    def alpha(self) -> float:
        return self["comm"]

    @property
    def beta(self) -> float:
        return self["load"]

    @property
    def gamma(self) -> float:
        return self["mig"]


#: The seed's calibrated values (Gimbal, in its own units of load and communication).
SEED_PARAMS = GreedyParams(alpha=1.0, beta=0.0025, gamma=1.0)
#: The default, relative to the problem's `Weights` in canonical units (mean GPU load = 1): fitted by
#: `calibrate` on the SGLang DeepSeek-V3 windows at 48 x 128 x 4 (docs/placement.md has the run). The seed's
#: values do not transfer: its units of load and communication are not these.
DEFAULT_PARAMS = GreedyParams(alpha=1.0, beta=0.0625, gamma=2.0)


def greedy(
    problem: PlacementProblem, params: GreedyParams = DEFAULT_PARAMS, replicas: np.ndarray | None = None
) -> np.ndarray:
    """The greedy placement as a slot map [L, G, slots], aligned with `problem.current` (stayers keep slots).

    `replicas` [L, E] fixes each expert's copy count; by default `problem.redundant_slots` extra copies
    go to the hottest experts (`replica_counts`).
    """
    hosts = greedy_hosts(problem, params, replicas)
    return slots_from_hosts(hosts, problem.slots_per_gpu, problem.current)


def resolve_replicas(problem: PlacementProblem, replicas: np.ndarray | None) -> np.ndarray:
    """Copy counts r[L, E]: given and validated, or chosen by `replica_counts`."""
    num_layers, num_experts, num_gpus = problem.shape
    if replicas is None:
        return replica_counts(problem.load, problem.redundant_slots, num_gpus)
    r = check_replicas(replicas, num_layers, num_experts, num_gpus)
    if r[0].sum() > num_gpus * problem.slots_per_gpu:
        raise PlacementError(f"{r[0].sum()} copies do not fit in {num_gpus} GPUs x {problem.slots_per_gpu} slots")
    return r


def greedy_hosts(
    problem: PlacementProblem, params: GreedyParams = DEFAULT_PARAMS, replicas: np.ndarray | None = None
) -> np.ndarray:
    """The greedy placement as a 0/1 host matrix [L, E, G]."""
    num_layers, num_experts, num_gpus = problem.shape
    copies = resolve_replicas(problem, replicas)
    beta = params.beta * problem.weights.load
    per_copy = problem.load / copies
    terms = linear_terms(problem, copies)
    static = linear_cost(terms, {name: params[name] * problem.weights[name] for name in terms})
    order = _placement_order(per_copy, copies)
    future_copies = _future_max_copies(order, copies) if (copies > 1).any() else None

    rows = np.arange(num_layers)
    mean = problem.load.sum(axis=1, keepdims=True) / num_gpus
    gpu_load = np.zeros((num_layers, num_gpus))
    used = np.zeros((num_layers, num_gpus), dtype=np.int64)
    hosts = np.zeros((num_layers, num_experts, num_gpus), dtype=bool)
    for step in range(order.shape[1]):
        expert = order[:, step]
        b = per_copy[rows, expert][:, None]
        score = static[rows, expert] + beta * b * (2.0 * (gpu_load - mean) + b)
        eligible = (used < problem.slots_per_gpu) & ~hosts[rows, expert]
        if future_copies is not None:
            eligible = _keep_room(eligible, used, problem.slots_per_gpu, future_copies[:, step])
        if not eligible.any(axis=1).all():
            raise PlacementError(f"no GPU can take expert {expert[~eligible.any(axis=1)][0]}: capacity exhausted")
        gpu = np.where(eligible, score, np.inf).argmin(axis=1)
        hosts[rows, expert, gpu] = True
        gpu_load[rows, gpu] += b[:, 0]
        used[rows, gpu] += 1
    return hosts


def _placement_order(per_copy: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """[L, E + R] expert id of each copy, heaviest per-copy load first; copies of an expert adjacent."""
    num_layers, num_experts = per_copy.shape
    items = np.repeat(np.tile(np.arange(num_experts), num_layers), copies.ravel()).reshape(num_layers, -1)
    rank = np.argsort(-np.take_along_axis(per_copy, items, axis=1), axis=1, kind="stable")
    return np.take_along_axis(items, rank, axis=1)


def _future_max_copies(order: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """[L, n]: the most copies any expert not yet started after step k needs."""
    first = np.ones(order.shape, dtype=bool)
    first[:, 1:] = order[:, 1:] != order[:, :-1]
    starting = np.where(first, np.take_along_axis(copies, order, axis=1), 0)
    later = np.zeros(order.shape, dtype=np.int64)
    later[:, :-1] = np.maximum.accumulate(starting[:, :0:-1], axis=1)[:, ::-1]
    return later


def _keep_room(eligible: np.ndarray, used: np.ndarray, slots: int, needed: np.ndarray) -> np.ndarray:
    """Drop GPUs whose last slot would leave fewer non-full GPUs than `needed`, where an alternative exists."""
    non_full = (used < slots).sum(axis=1, keepdims=True)
    after = non_full - (used + 1 >= slots)
    roomy = eligible & (after >= needed[:, None])
    return np.where(roomy.any(axis=1, keepdims=True), roomy, eligible)
