"""The exact placement: the MINLP of DESIGN.md with OR-Tools CP-SAT, one model per layer.

The objective separates by layer, so each layer is its own model, and layers are solved concurrently in
threads (CP-SAT releases the GIL while it searches). Per layer, with y[e, g] ∈ {0, 1} (GPU g hosts a copy
of expert e) and r_e fixed copies:

    Σ_g y[e, g] = r_e,   Σ_e y[e, g] <= slots,   L_g = Σ_e q_e y[e, g],   d_g = G·L_g − Σ_h L_h,   s_g = d_g²
    minimise  w_load·(u/G)²·Σ_g s_g  +  Σ_{e,g} T[e, g]·y[e, g]

with T = Σ_t w_t·T_t the linear terms of `terms.py` (w_comm·comm + w_mig·M·(1 − 2x⁰) + any extra term),

which is the objective of `objective.py` up to a constant (Σ_g (L_g − L̄)² = Σ_g d_g² / G², and
|y − x⁰| is linear in y for binary x⁰). The squares are `add_multiplication_equality` constraints plus
tangent cuts s_g >= 2t·d_g − t² at a few deviations t: without the cuts the LP relaxation prices
imbalance at nothing and the proven bound is useless. Loads enter as integers: q_e is the per-copy load
in units of u = (layer total) / `load_resolution` (u = 1 when the loads already are integers that fit),
so the model is exact on integer inputs and within rounding of one unit per expert otherwise;
`MinlpResult.objective` and `.bound` are the model's, `objective(problem, result.slot_map)` the exact value.

The online placement (`refine.place`: the greedy and the current layout, both refined by swaps) is the
hint; CP-SAT starts from it, so a time-limited solve is never worse than the online placement. When
the mig term cannot tell GPUs apart and their distance columns are equal, those GPUs are interchangeable
and the model orders their loads (L_g >= L_g+1), which removes G!-fold symmetric copies of every solution
from the search.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from switchyard.shared.placement_terms import DEFAULT_PARALLEL_LAYERS, DEFAULT_TIME_LIMIT_S, DEFAULT_WORKERS_PER_LAYER
from switchyard.solver.placement.greedy import DEFAULT_PARAMS, GreedyParams, resolve_replicas
from switchyard.solver.placement.problem import PlacementError, PlacementProblem, hosts_from_slots, slots_from_hosts
from switchyard.solver.placement.refine import place
from switchyard.solver.placement.terms import linear_constants, linear_cost, linear_terms


class MinlpCancelled(PlacementError):
    """`MinlpOptions.cancel` was set: the solve stopped before its remaining layers."""


@dataclass(frozen=True)
class MinlpOptions:
    """How hard and how wide to search. The time limit is per layer; layers run `parallel_layers` at once.

    Setting `cancel` (from any thread) stops a solve before its next layer: a service shutting down waits
    at most one layer's time limit, not the whole calibration.
    """

    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    parallel_layers: int = DEFAULT_PARALLEL_LAYERS
    workers_per_layer: int = DEFAULT_WORKERS_PER_LAYER
    relative_gap: float = 1e-4
    load_resolution: int = 1 << 16
    symmetry_breaking: bool = True
    hint_params: GreedyParams = DEFAULT_PARAMS
    seed: int = 0
    cancel: threading.Event | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0 or self.parallel_layers < 1 or self.workers_per_layer < 1:
            raise PlacementError("time_limit_s must be > 0, parallel_layers and workers_per_layer >= 1")
        if not 0 <= self.relative_gap < 1 or self.load_resolution < 1:
            raise PlacementError("relative_gap must lie in [0, 1) and load_resolution be >= 1")


@dataclass(frozen=True)
class MinlpResult:
    """The solution and, per layer, CP-SAT's objective and proven lower bound (in objective units)."""

    slot_map: np.ndarray
    objective: np.ndarray
    bound: np.ndarray
    status: tuple[str, ...]
    layer_seconds: np.ndarray
    wall_seconds: float

    @property
    def gap(self) -> float:
        """Optimality gap of the whole placement: (objective − bound) / objective, summed over layers."""
        total = float(self.objective.sum())
        return 0.0 if total <= 0 else max(0.0, (total - float(self.bound.sum())) / total)

    @property
    def optimal_layers(self) -> int:
        return sum(s == "OPTIMAL" for s in self.status)


def solve_minlp(
    problem: PlacementProblem,
    options: MinlpOptions | None = None,
    *,
    replicas: np.ndarray | None = None,
    hint: np.ndarray | None = None,
) -> MinlpResult:
    """Solve every layer of `problem` to optimality or to the time limit, starting from the online placement.

    `replicas` [L, E] fixes copy counts (default: `replica_counts`, as for the greedy); `hint` is an
    optional host matrix [L, E, G] to start from instead.
    """
    options = options or MinlpOptions()
    copies = resolve_replicas(problem, replicas)
    if hint is None:
        hint = hosts_from_slots(place(problem, options.hint_params, copies), problem.num_experts)
    start = np.asarray(hint) > 0
    if start.shape != problem.shape:
        raise PlacementError(f"hint shape {list(start.shape)} is not [L, E, G] = {list(problem.shape)}")
    linear = linear_cost(linear_terms(problem, copies), problem.weights)
    interchangeable = problem.interchangeable_gpus() if options.symmetry_breaking else None

    def solve(layer: int) -> _LayerSolution:
        if options.cancel is not None and options.cancel.is_set():
            raise MinlpCancelled(f"cancelled before layer {layer}")
        return _solve_layer(
            load=problem.load[layer] / copies[layer],
            copies=copies[layer],
            linear=np.broadcast_to(linear[layer], problem.shape[1:]),
            constant=sum(problem.weights[t] * c for t, c in linear_constants(problem, layer).items()),
            hint=start[layer],
            problem=problem,
            interchangeable=interchangeable,
            options=options,
        )

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=options.parallel_layers) as pool:
        layers = list(pool.map(solve, range(problem.num_layers)))
    wall = time.perf_counter() - began
    hosts = np.stack([s.hosts for s in layers])
    return MinlpResult(
        slot_map=slots_from_hosts(hosts, problem.slots_per_gpu, problem.current),
        objective=np.array([s.objective for s in layers]),
        bound=np.array([s.bound for s in layers]),
        status=tuple(s.status for s in layers),
        layer_seconds=np.array([s.seconds for s in layers]),
        wall_seconds=wall,
    )


@dataclass(frozen=True)
class _LayerSolution:
    hosts: np.ndarray
    objective: float
    bound: float
    status: str
    seconds: float


def _quantise(load: np.ndarray, copies: np.ndarray, resolution: int) -> tuple[np.ndarray, float]:
    """Integer per-copy loads q and their unit u, exact when the loads are small integers."""
    total = float((load * copies).sum())
    if np.all(load == np.round(load)) and total <= resolution:
        return load.astype(np.int64), 1.0
    unit = total / resolution if total > 0 else 1.0
    return np.round(load / unit).astype(np.int64), unit


def _solve_layer(
    *,
    load: np.ndarray,
    copies: np.ndarray,
    linear: np.ndarray,
    constant: float,
    hint: np.ndarray,
    problem: PlacementProblem,
    interchangeable: list[list[int]] | None,
    options: MinlpOptions,
) -> _LayerSolution:
    num_experts, num_gpus = linear.shape
    weights = problem.weights
    q, unit = _quantise(load, copies, options.load_resolution)
    total_q = int((q * copies).sum())
    # Deviations rather than loads are squared: the bound of Σ d² (>= 0) needs no proof, where Σ L² would
    # first need CP-SAT to prove Σ L² >= (Σ L)² / G.
    square_weight = weights.load * unit * unit / num_gpus**2

    model = cp_model.CpModel()
    y = np.array([[model.new_bool_var(f"y{e}_{g}") for g in range(num_gpus)] for e in range(num_experts)])
    max_load = int(q.sum())
    gpu_load = [model.new_int_var(0, max_load, f"load{g}") for g in range(num_gpus)]
    deviation = [model.new_int_var(-total_q, num_gpus * max_load - total_q, f"dev{g}") for g in range(num_gpus)]
    max_square = max(total_q, num_gpus * max_load - total_q) ** 2
    squares = [model.new_int_var(0, max_square, f"sq{g}") for g in range(num_gpus)]
    for e in range(num_experts):
        model.add(sum(y[e]) == int(copies[e]))
    for g in range(num_gpus):
        model.add(sum(y[:, g]) <= problem.slots_per_gpu)
        model.add(gpu_load[g] == cp_model.LinearExpr.weighted_sum(list(y[:, g]), q.tolist()))
        model.add(deviation[g] == num_gpus * gpu_load[g] - total_q)
        model.add_multiplication_equality(squares[g], [deviation[g], deviation[g]])
        for t in _tangent_points(total_q):  # d² >= 2td − t²: lets the LP relaxation price imbalance
            model.add(squares[g] >= 2 * t * deviation[g] - t * t)

    hint_y = hint.astype(bool)
    if interchangeable:
        hint_y = _sort_classes(hint_y, q, interchangeable)
        for members in interchangeable:
            for a, b in itertools.pairwise(members):
                model.add(gpu_load[a] >= gpu_load[b])
    hint_load = q @ hint_y
    for e in range(num_experts):
        for g in range(num_gpus):
            model.add_hint(y[e, g], bool(hint_y[e, g]))
    for g in range(num_gpus):
        hint_deviation = num_gpus * int(hint_load[g]) - total_q
        model.add_hint(gpu_load[g], int(hint_load[g]))
        model.add_hint(deviation[g], hint_deviation)
        model.add_hint(squares[g], hint_deviation**2)

    cost = cp_model.LinearExpr.weighted_sum(list(y.ravel()), linear.ravel().tolist())
    model.minimize(cost + square_weight * sum(squares) if square_weight > 0 else cost)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = options.time_limit_s
    solver.parameters.num_workers = options.workers_per_layer
    solver.parameters.relative_gap_limit = options.relative_gap
    solver.parameters.random_seed = options.seed
    began = time.perf_counter()
    status = solver.solve(model)
    seconds = time.perf_counter() - began
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        hosts = np.vectorize(solver.boolean_value)(y).astype(bool)
        objective, bound = solver.objective_value + constant, solver.best_objective_bound + constant
    else:  # no solution in time (rare: the hint is feasible): keep the hint, prove nothing
        hosts = hint_y
        squares_hint = ((num_gpus * hint_load - total_q).astype(float) ** 2).sum()
        objective = float(square_weight * squares_hint + (linear * hint_y).sum()) + constant
        bound = -np.inf
    return _LayerSolution(hosts, objective, max(bound, 0.0), solver.status_name(status), seconds)


def _tangent_points(total: int) -> list[int]:
    """Deviations (in model units) to cut the square at: 0 and ±0.1 % ... ±50 % of the layer's load."""
    fractions = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
    points = {round(sign * f * total) for f in fractions for sign in (1, -1)}
    return sorted(points | {0})


def _sort_classes(hosts: np.ndarray, q: np.ndarray, classes: list[list[int]]) -> np.ndarray:
    """Relabel interchangeable GPUs of a hint so their loads descend, as the symmetry constraints demand."""
    hosts = hosts.copy()
    loads = q @ hosts
    for group in classes:
        members = np.asarray(group)
        order = members[np.argsort(-loads[members], kind="stable")]
        hosts[:, members] = hosts[:, order]
    return hosts
