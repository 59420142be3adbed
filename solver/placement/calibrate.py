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

Agreement alone is close to trivial: most copies stay where they are, so keeping the current layout agrees
with most of the MINLP's decisions at a far worse objective. Each method (greedy, `place`, keep-layout,
EPLB) is therefore reported by its objective gap first, then agreement on all copies, agreement on the
copies the reference *moves*, and the communication gap; against a reference MINLP that did not start from
that method (`calibrate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from switchyard.shared.placement_terms import DEFAULT_OBJECTIVE_TOLERANCE
from switchyard.solver.placement.eplb_baseline import eplb_global
from switchyard.solver.placement.greedy import SEED_PARAMS, GreedyParams, greedy_hosts, resolve_replicas
from switchyard.solver.placement.minlp import MinlpOptions, MinlpResult, solve_minlp
from switchyard.solver.placement.objective import objective_of_hosts
from switchyard.solver.placement.problem import PlacementError, PlacementProblem, contiguous_slots, hosts_from_slots
from switchyard.solver.placement.refine import place

COARSE_GRID = 2.0 ** np.arange(-6, 7)
#: MINLP solves per window: the reference started from keep-layout and the one started from EPLB.
REFERENCE_SOLVES = 2
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
    #: per method (greedy, place, keep_layout, eplb): objective_gap, agreement, agreement_moved, comm_gap
    #: against a reference MINLP not warm-started from that method (`reference` says which)
    methods: dict = field(default_factory=dict)
    #: the two references (from keep-layout, from EPLB) judged against each other: the noise floor
    reference_agreement: dict = field(default_factory=dict)

    def details(self) -> dict:
        """JSON-ready summary (the `details` column of a `calibrations` row)."""
        return {
            "objective_gap": self.objective_gap,
            "greedy": self.greedy,
            "methods": self.methods,
            "reference_agreement": self.reference_agreement,
            "minlp_gap": self.minlp_gap,
            "fit_seconds": self.fit_seconds,
            "windows": list(self.windows),
        }


def agreement(problem: PlacementProblem, placement: np.ndarray, reference: np.ndarray) -> float:
    """Share of expert copies that two host matrices [L, E, G] put on the same GPU."""
    return _matches(problem, np.asarray(placement) > 0, np.asarray(reference) > 0) / float(np.sum(reference > 0))


def _matches(problem: PlacementProblem, placement: np.ndarray, reference: np.ndarray) -> int:
    return int((_aligned(problem, placement, reference) & reference).sum())


def _aligned(problem: PlacementProblem, placement: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """`placement` with each layer's interchangeable GPUs relabelled to overlap `reference` most."""
    classes = problem.interchangeable_gpus()
    if not classes:
        return placement
    same_class = np.eye(problem.num_gpus, dtype=bool)
    for members in classes:
        same_class[np.ix_(members, members)] = True
    out = np.zeros_like(placement)
    for layer in range(problem.num_layers):  # one small assignment problem per layer
        overlap = reference[layer].T.astype(np.int64) @ placement[layer]
        rows, cols = linear_sum_assignment(np.where(same_class, overlap, -1), maximize=True)
        out[layer][:, rows] = placement[layer][:, cols]
    return out


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
    fit_gamma = any(p.current is not None and p.mig.any() for p in problems)

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
    objective_tolerance: float = DEFAULT_OBJECTIVE_TOLERANCE,
    on_solve: Callable[[int, int], None] | None = None,
) -> CalibrationResult:
    """Solve each window's MINLP, fit the greedy's weights to it, and measure every method against it.

    `on_solve(done, total)` is called after each MINLP solve (two per window; each may take its time limit), so a
    caller can show progress.

    No method is judged against a MINLP that started from it: the main reference is warm-started from the
    current layout (keep-layout), which the greedy, `place` and EPLB are judged against and the weights are
    fitted to; keep-layout itself is judged against a second MINLP warm-started from EPLB's layout. The two
    references' agreement with each other is the floor below which agreement says nothing.
    """
    options = options or MinlpOptions()
    copies = [resolve_replicas(p, None) for p in problems]
    keep = [keep_layout_hosts(p) for p in problems]
    eplb = [_eplb_hosts(p) for p in problems]
    unit = [greedy_hosts(p, GreedyParams(), c) for p, c in zip(problems, copies, strict=True)]
    # main start: keep-layout where it holds the copies the MINLP must place; else the unit-weight greedy
    main_start = [
        ("keep_layout", k) if (k.sum(axis=2) == c).all() else ("greedy_unit", u)
        for k, c, u in zip(keep, copies, unit, strict=True)
    ]
    # second start: EPLB where it applies; else the unit-weight greedy
    second_start = [("eplb", e) if e is not None else ("greedy_unit", u) for e, u in zip(eplb, unit, strict=True)]
    began = time.perf_counter()
    total = 2 * len(problems)

    def solved(start: Sequence[tuple[str, np.ndarray]], before: int) -> list[MinlpResult]:
        out = []
        for p, c, (_, h) in zip(problems, copies, start, strict=True):
            out.append(solve_minlp(p, options, replicas=c, hint=h))
            if on_solve is not None:
                on_solve(before + len(out), total)
        return out

    solutions = solved(main_start, 0)
    others = solved(second_start, len(problems))
    minlp_seconds = time.perf_counter() - began
    references = [hosts_from_slots(s.slot_map, p.num_experts) for p, s in zip(problems, solutions, strict=True)]
    second = [hosts_from_slots(s.slot_map, p.num_experts) for p, s in zip(problems, others, strict=True)]

    began = time.perf_counter()
    params, _ = fit_params(problems, references, alpha=alpha, objective_tolerance=objective_tolerance)
    fit_seconds = time.perf_counter() - began

    windows = []
    for i, (p, solution, reference) in enumerate(zip(problems, solutions, references, strict=True)):
        c = copies[i]
        window = {
            "shape": list(p.shape),
            "minlp_gap": solution.gap,
            "minlp_optimal_layers": solution.optimal_layers,
            "minlp_seconds": solution.wall_seconds,
            "minlp": objective_of_hosts(p, reference).totals(),
            "minlp_from_eplb": objective_of_hosts(p, second[i]).totals(),
            "online": _versus(p, hosts_from_slots(place(p, params, c), p.num_experts), reference),
            "keep_layout": _versus(p, keep[i], second[i]),
            "reference_vs_reference": _versus(p, second[i], reference),
        }
        eplb_hosts = eplb[i]
        if eplb_hosts is not None:
            window["eplb"] = _versus(p, eplb_hosts, reference)
        # beside the fitted greedy: the uncalibrated one (exact marginals, α = β = γ = 1) and the seed's weights
        for name, candidate in (("greedy", params), ("greedy_unit", GreedyParams()), ("greedy_seed", SEED_PARAMS)):
            window[name] = _versus(p, greedy_hosts(p, candidate, c), reference)
        windows.append(window)
    online, greedy = _overall(windows, "online"), _overall(windows, "greedy")
    methods = {"greedy": greedy, "place": online, "keep_layout": _overall(windows, "keep_layout", "minlp_from_eplb")}
    if all("eplb" in w for w in windows):
        methods["eplb"] = _overall(windows, "eplb")
    main_name, second_name = _start_name(main_start), _start_name(second_start)
    for name in ("greedy", "place", "eplb"):
        if name in methods:
            methods[name]["reference"] = f"MINLP warm-started from {main_name}"
    methods["keep_layout"]["reference"] = f"MINLP warm-started from {second_name}"
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
        methods=methods,
        reference_agreement=_overall(windows, "reference_vs_reference"),
    )


def keep_layout_hosts(problem: PlacementProblem) -> np.ndarray:
    """The do-nothing placement: the engines' current layout (the contiguous default when there is none)."""
    current = problem.current
    if current is None:
        current = contiguous_slots(problem.num_layers, problem.num_experts, problem.num_gpus, problem.slots_per_gpu)
    return hosts_from_slots(current, problem.num_experts)


def _eplb_hosts(problem: PlacementProblem) -> np.ndarray | None:
    """EPLB's global layout of the window's load, or None where EPLB does not apply (G ∤ E + R, slots differ)."""
    try:
        slots = eplb_global(problem.load, problem.num_gpus, problem.redundant_slots)
    except PlacementError:
        return None
    if slots.shape[2] > problem.slots_per_gpu:
        return None
    return hosts_from_slots(slots, problem.num_experts)


def _start_name(starts: list[tuple[str, np.ndarray]]) -> str:
    names = sorted({name for name, _ in starts})
    return names[0] if len(names) == 1 else " / ".join(names) + " (per window)"


def _versus(problem: PlacementProblem, hosts: np.ndarray, reference: np.ndarray) -> dict:
    """A placement's objective terms, its agreement with the reference, and its agreement on the copies the
    reference moves away from the current layout (`moved`: reference copies the current layout lacks)."""
    aligned = _aligned(problem, hosts > 0, reference > 0)
    moved = reference > 0
    current = problem.current_hosts()
    if current is not None:
        moved = moved & ~(current > 0)
    return {
        **objective_of_hosts(problem, hosts).totals(),
        "matched": int((aligned & (reference > 0)).sum()),
        "copies": int((reference > 0).sum()),
        "matched_moved": int((aligned & moved).sum()) if current is not None else 0,
        "moved": int(moved.sum()) if current is not None else 0,
    }


def _overall(windows: list[dict], name: str, reference: str = "minlp") -> dict:
    """Objective gap, agreement (all copies, moved copies) and communication gap of one method over all windows."""
    keys = ("matched", "copies", "matched_moved", "moved", "comm", "total")
    total = {key: sum(w[name][key] for w in windows) for key in keys}
    ref = {key: sum(w[reference][key] for w in windows) for key in ("comm", "total")}
    return {
        "objective_gap": _relative(total["total"], ref["total"]),
        "agreement": total["matched"] / total["copies"],
        "agreement_moved": total["matched_moved"] / total["moved"] if total["moved"] else None,
        "comm_gap": _relative(total["comm"], ref["comm"]),
    }


def _relative(value: float, reference: float) -> float:
    return float((value - reference) / reference) if reference > 0 else 0.0
