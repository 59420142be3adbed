"""Calibrating the greedy's (α, β, γ) against MINLP solutions of recorded windows.

The greedy is myopic, so its best weights are not the objective's: `fit_params` searches the weights
whose greedy placements make the same expert→GPU decisions as reference placements (the MINLP's, in
`calibrate`). The greedy's choice depends only on the ratios of its weights, so α is fixed at 1 and β, γ
are searched on a log grid (factor 2), then refined around the best point (factor 2^¼). Agreement is a
step function of the weights; among equally good points the search takes the one nearest the centre of
the tied region, which is the estimate least sensitive to the grid.

Agreement is the fraction of expert copies placed on the same GPU by both placements (with one copy per
expert: the fraction of identical expert→GPU decisions). Where the objective cannot tell GPUs apart
(`PlacementProblem.interchangeable_gpus`), GPU labels are arbitrary, so each layer's labels are first
matched (Hungarian algorithm on the overlap) within those classes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from switchyard.solver.placement.greedy import SEED_PARAMS, GreedyParams, greedy_hosts
from switchyard.solver.placement.minlp import MinlpOptions, solve_minlp
from switchyard.solver.placement.objective import objective_of_hosts
from switchyard.solver.placement.problem import PlacementError, PlacementProblem, hosts_from_slots
from switchyard.solver.placement.refine import place

COARSE_GRID = 2.0 ** np.arange(-6, 7)
FINE_STEPS = 2.0 ** (np.arange(-4, 5) / 4)


@dataclass(frozen=True)
class CalibrationResult:
    """Fitted weights and how closely the online placement (`place`) then follows the MINLP, over all windows.

    `agreement`, `comm_gap` and `objective_gap` are those of `place` with the fitted weights (what the
    placement service runs); `greedy` holds the same three for the greedy construction alone (what the
    weights were fitted on).
    """

    params: GreedyParams
    agreement: float
    comm_gap: float
    objective_gap: float
    greedy: dict
    minlp_gap: float
    minlp_seconds: float
    fit_seconds: float
    num_windows: int
    windows: tuple[dict, ...] = field(default=())
    references: tuple[np.ndarray, ...] = field(default=(), repr=False)  # the MINLP slot maps, per window

    def details(self) -> dict:
        """JSON-ready summary (the `details` column of a `calibrations` row)."""
        return {
            "objective_gap": self.objective_gap,
            "greedy": self.greedy,
            "minlp_gap": self.minlp_gap,
            "fit_seconds": self.fit_seconds,
            "windows": list(self.windows),
        }


def agreement(problem: PlacementProblem, placement: np.ndarray, reference: np.ndarray) -> float:
    """Share of expert copies that two host matrices [L, E, G] put on the same GPU."""
    return _matches(problem, np.asarray(placement) > 0, np.asarray(reference) > 0) / float(np.sum(reference > 0))


def _matches(problem: PlacementProblem, placement: np.ndarray, reference: np.ndarray) -> int:
    classes = problem.interchangeable_gpus()
    if not classes:
        return int((placement & reference).sum())
    same_class = np.eye(problem.num_gpus, dtype=bool)
    for members in classes:
        same_class[np.ix_(members, members)] = True
    total = 0
    for layer in range(problem.num_layers):  # one small assignment problem per layer
        overlap = reference[layer].T.astype(np.int64) @ placement[layer]
        rows, cols = linear_sum_assignment(np.where(same_class, overlap, -1), maximize=True)
        total += int(overlap[rows, cols].sum())
    return total


def fit_params(
    problems: Sequence[PlacementProblem],
    references: Sequence[np.ndarray],
    *,
    alpha: float = 1.0,
    objective_tolerance: float | None = None,
) -> tuple[GreedyParams, float]:
    """Weights (α fixed) whose greedy placements agree most with the reference host matrices, and that agreement.

    With `objective_tolerance`, only weights whose greedy placements cost at most (1 + tolerance) times
    the cheapest greedy on the grid compete on agreement. Agreement alone can be gamed: when the
    reference keeps most experts where they are, a greedy that moves nothing agrees with most decisions
    while leaving the load as unbalanced as it was.
    """
    if not problems or len(problems) != len(references):
        raise PlacementError("give one reference placement per problem, and at least one")
    references = [np.asarray(r) > 0 for r in references]
    for problem, reference in zip(problems, references, strict=True):
        if reference.shape != problem.shape:
            raise PlacementError(f"reference shape {list(reference.shape)} is not {list(problem.shape)}")
    copies = [r.sum(axis=2) for r in references]  # the greedy must place the same copies as the reference
    total = sum(float(r.sum()) for r in references)
    fit_gamma = any(p.current is not None and p.migration_cost.any() for p in problems)

    def evaluate(beta: float, gamma: float) -> tuple[float, float]:
        params = GreedyParams(alpha, beta, gamma)
        matched, cost = 0, 0.0
        for p, c, r in zip(problems, copies, references, strict=True):
            hosts = greedy_hosts(p, params, c)
            matched += _matches(p, hosts, r)
            cost += objective_of_hosts(p, hosts).total if objective_tolerance is not None else 0.0
        return matched / total, cost

    gammas = COARSE_GRID if fit_gamma else np.array([1.0])
    coarse = _grid(evaluate, COARSE_GRID, gammas)
    beta, gamma, _ = _best(coarse, objective_tolerance, cheapest=coarse.cost.min())
    fine = _grid(evaluate, beta * FINE_STEPS, gamma * FINE_STEPS if fit_gamma else gammas)
    cheapest = min(coarse.cost.min(), fine.cost.min())
    beta, gamma, agreed = _best(fine, objective_tolerance, cheapest=cheapest)
    return GreedyParams(alpha, beta, gamma), agreed


@dataclass(frozen=True)
class _Grid:
    betas: np.ndarray
    gammas: np.ndarray
    agreement: np.ndarray  # [betas, gammas]
    cost: np.ndarray


def _grid(evaluate, betas: np.ndarray, gammas: np.ndarray) -> _Grid:
    values = np.array([[evaluate(b, g) for g in gammas] for b in betas])
    return _Grid(betas, gammas, values[..., 0], values[..., 1])


def _best(grid: _Grid, tolerance: float | None, cheapest: float) -> tuple[float, float, float]:
    """(β, γ, agreement) of the most agreeing admissible point nearest the centre of its ties (in log space)."""
    admissible = np.ones(grid.agreement.shape, dtype=bool)
    if tolerance is not None:
        admissible = grid.cost <= (1 + tolerance) * cheapest
        if not admissible.any():  # the cheapest point lies outside this grid: take this grid's cheapest
            admissible = grid.cost <= grid.cost.min()
    agreement = np.where(admissible, grid.agreement, -1.0)
    tied = np.argwhere(agreement >= agreement.max() - 1e-12)
    centre = tied.mean(axis=0)
    i, j = tied[np.argmin(((tied - centre) ** 2).sum(axis=1))]
    return float(grid.betas[i]), float(grid.gammas[j]), float(grid.agreement[i, j])


def calibrate(
    problems: Sequence[PlacementProblem],
    options: MinlpOptions | None = None,
    *,
    alpha: float = 1.0,
    objective_tolerance: float = 0.01,
) -> CalibrationResult:
    """Solve each window's MINLP, fit the greedy's weights to it, and measure what the online placement loses."""
    options = options or MinlpOptions()
    began = time.perf_counter()
    solutions = [solve_minlp(p, options) for p in problems]
    minlp_seconds = time.perf_counter() - began
    references = [hosts_from_slots(s.slot_map, p.num_experts) for p, s in zip(problems, solutions, strict=True)]

    began = time.perf_counter()
    params, _ = fit_params(problems, references, alpha=alpha, objective_tolerance=objective_tolerance)
    fit_seconds = time.perf_counter() - began

    windows = []
    for p, solution, reference in zip(problems, solutions, references, strict=True):
        copies = reference.sum(axis=2)
        window = {
            "shape": list(p.shape),
            "minlp_gap": solution.gap,
            "minlp_optimal_layers": solution.optimal_layers,
            "minlp_seconds": solution.wall_seconds,
            "minlp": objective_of_hosts(p, reference).totals(),
            "online": _versus(p, hosts_from_slots(place(p, params, copies), p.num_experts), reference),
        }
        # beside the fitted greedy: the uncalibrated one (exact marginals, α = β = γ = 1) and the seed's weights
        for name, candidate in (("greedy", params), ("greedy_unit", GreedyParams()), ("greedy_seed", SEED_PARAMS)):
            window[name] = _versus(p, greedy_hosts(p, candidate, copies), reference)
        windows.append(window)
    online, greedy = _overall(windows, "online"), _overall(windows, "greedy")
    bound_total = sum(float(s.bound.sum()) for s in solutions)
    model_total = sum(float(s.objective.sum()) for s in solutions)
    return CalibrationResult(
        params=params,
        agreement=online["agreement"],
        comm_gap=online["comm_gap"],
        objective_gap=online["objective_gap"],
        greedy=greedy,
        minlp_gap=max(0.0, 1.0 - bound_total / model_total) if model_total > 0 else 0.0,
        minlp_seconds=minlp_seconds,
        fit_seconds=fit_seconds,
        num_windows=len(problems),
        windows=tuple(windows),
        references=tuple(s.slot_map for s in solutions),
    )


def _versus(problem: PlacementProblem, hosts: np.ndarray, reference: np.ndarray) -> dict:
    """A placement's objective terms and its agreement with the reference."""
    matched = _matches(problem, hosts > 0, reference)
    return {**objective_of_hosts(problem, hosts).totals(), "matched": matched, "copies": int(reference.sum())}


def _overall(windows: list[dict], name: str) -> dict:
    """Agreement, communication gap and objective gap of one placement method over all windows."""
    total = {key: sum(w[name][key] for w in windows) for key in ("matched", "copies", "comm", "total")}
    minlp = {key: sum(w["minlp"][key] for w in windows) for key in ("comm", "total")}
    return {
        "agreement": total["matched"] / total["copies"],
        "comm_gap": _relative(total["comm"], minlp["comm"]),
        "objective_gap": _relative(total["total"], minlp["total"]),
    }


def _relative(value: float, reference: float) -> float:
    return float((value - reference) / reference) if reference > 0 else 0.0
