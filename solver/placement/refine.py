"""Swap refinement: improve a placement by exchanging expert copies between GPUs, on the true objective.

The greedy decides each copy once, before it knows where later copies will go; a swap of two copies (or
of a copy and an empty slot, which is a relocation) between two GPUs can repair such decisions. For
copy i on GPU h and copy j on GPU g, with per-copy loads b, deviations u = L − L̄ and static costs
T(copy, gpu) = Σ_t w_t·T_t (`terms.py`: w_comm·comm + w_mig·M·(1 − 2x⁰) + …), the swap changes the objective by exactly

    Δ = T(i, g) − T(i, h) + T(j, h) − T(j, g) + 2·w_load·[(b_j − b_i)(u_h − u_g) + (b_j − b_i)²]

Each round evaluates Δ for every pair of copies on every pair of GPUs, all layers at once, as one
[L, G, G, slots, slots] array built by broadcasting (no gathers), and then applies in each layer the best
improving swap of several disjoint GPU pairs: swaps on disjoint GPU pairs change disjoint loads and
costs, so their gains add up exactly. Rounds stop when no swap improves or `max_rounds` is reached. The
objective never increases, so the result is at least as good as the input; at convergence no single swap
or relocation improves it (a 2-swap local optimum).
"""

from __future__ import annotations

import numpy as np

from switchyard.solver.placement.greedy import DEFAULT_PARAMS, GreedyParams, greedy_hosts, resolve_replicas
from switchyard.solver.placement.objective import objective
from switchyard.solver.placement.problem import PlacementProblem, check_slot_map, hosts_from_slots, slots_from_hosts
from switchyard.solver.placement.terms import linear_cost, linear_terms

#: Gains smaller than this (relative to a layer's mean GPU load squared) are noise, not improvements.
_EPSILON = 1e-12


def refine_swaps(problem: PlacementProblem, slot_map: np.ndarray, max_rounds: int = 64) -> tuple[np.ndarray, int]:
    """A slot map at least as good as `slot_map` on the objective, and the rounds it took."""
    layout = check_slot_map(slot_map, problem.num_layers, problem.num_experts, problem.num_gpus).copy()
    num_layers, num_gpus, num_slots = layout.shape
    weights = problem.weights
    hosts = hosts_from_slots(layout, problem.num_experts) > 0
    copies = hosts.sum(axis=2)
    static = linear_cost(linear_terms(problem, copies), weights)
    per_copy = problem.load / copies
    mean = problem.load.sum(axis=1) / num_gpus
    beta = weights.load

    rows = np.arange(num_layers)[:, None, None]
    occupied = layout >= 0
    expert = np.maximum(layout, 0)
    b = np.where(occupied, per_copy[rows, expert], 0.0)  # [L, G, S]
    cost = np.where(occupied[..., None], static[rows, expert], 0.0)  # [L, G, S, G]: copy at (h, s) on GPU g
    first, second = np.triu_indices(num_gpus, k=1)  # the GPU pairs h < g
    replicated = bool((copies > 1).any())  # only then can a swap put two copies of an expert on one GPU

    for round_ in range(max_rounds):
        u = b.sum(axis=2) - mean[:, None]  # [L, G]
        own = np.take_along_axis(cost, np.arange(num_gpus)[None, :, None, None], axis=3)[..., 0]
        # a[l, h, s, g]: change of the objective if the copy at (h, s) alone went to GPU g (its share of Δ)
        shift = u[:, :, None, None] - u[:, None, None, :]
        a = cost - own[..., None] + 2 * beta * b[..., None] * (b[..., None] - shift)
        out_h = a[:, first, :, second].transpose(1, 0, 2)  # [L, P, S]: copy (h, s) moving to g
        out_g = a[:, second, :, first].transpose(1, 0, 2)  # copy (g, t) moving to h
        delta = out_h[..., :, None] + out_g[..., None, :] - 4 * beta * b[:, first, :, None] * b[:, second, None, :]
        if replicated:
            on = hosts[rows[..., None], expert[..., None], np.arange(num_gpus)] & occupied[..., None]
            clash = (
                on[:, first, :, second].transpose(1, 0, 2)[..., :, None]
                | on[:, second, :, first].transpose(1, 0, 2)[..., None, :]
            )
            delta = np.where(clash, np.inf, delta)
        flat = delta.reshape(num_layers, len(first), -1)
        pick = flat.argmin(axis=2)
        gain = np.take_along_axis(flat, pick[..., None], axis=2)[..., 0]  # [L, P]
        threshold = -_EPSILON * np.maximum(mean, 1e-300)[:, None] ** 2
        chosen = _disjoint_pairs(gain < threshold, gain, first, second)  # [L, P] bool
        if not chosen.any():
            return layout, round_
        layer, pair = np.nonzero(chosen)
        h, g = first[pair], second[pair]
        s, t = np.divmod(pick[layer, pair], num_slots)
        i, j = layout[layer, h, s], layout[layer, g, t]
        for e, src, dst in ((i, h, g), (j, g, h)):
            moved = e >= 0
            hosts[layer[moved], e[moved], src[moved]] = False
            hosts[layer[moved], e[moved], dst[moved]] = True
        for array in (layout, b, cost, occupied, expert):
            array[layer, h, s], array[layer, g, t] = array[layer, g, t].copy(), array[layer, h, s].copy()
    return layout, max_rounds


def _disjoint_pairs(improving: np.ndarray, gain: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Per layer, the best improving GPU pair, then the best disjoint from it, and so on (greedy matching)."""
    num_layers, num_pairs = gain.shape
    gain = np.where(improving, gain, np.inf)
    chosen = np.zeros((num_layers, num_pairs), dtype=bool)
    rows = np.arange(num_layers)
    while np.isfinite(gain).any():
        best = gain.argmin(axis=1)
        take = np.isfinite(gain[rows, best])
        chosen[rows[take], best[take]] = True
        used_h, used_g = first[best][:, None], second[best][:, None]
        touches = (first == used_h) | (second == used_h) | (first == used_g) | (second == used_g)
        gain = np.where(touches & take[:, None], np.inf, gain)
    return chosen


def place(
    problem: PlacementProblem,
    params: GreedyParams = DEFAULT_PARAMS,
    replicas: np.ndarray | None = None,
    max_rounds: int = 64,
) -> np.ndarray:
    """The online placement: the greedy refined by swaps and, where the engines' current layout holds the
    same copies, that layout refined by swaps; per layer the cheaper of the two.

    Refining the current layout finds placements that are good *and* close to it (few moves); the greedy
    start covers layers whose current layout is far from any good placement, or holds other copies.
    """
    copies = resolve_replicas(problem, replicas)
    start = slots_from_hosts(greedy_hosts(problem, params, copies), problem.slots_per_gpu, problem.current)
    candidates = [refine_swaps(problem, start, max_rounds)[0]]
    costs = [objective(problem, candidates[0]).per_layer]
    if problem.current is not None:
        current = hosts_from_slots(problem.current, problem.num_experts)
        same_copies = (current.sum(axis=2) == copies).all(axis=1)
        if same_copies.any():
            candidates.append(refine_swaps(problem, problem.current, max_rounds)[0])
            costs.append(np.where(same_copies, objective(problem, candidates[1]).per_layer, np.inf))
    best = np.argmin(np.stack(costs), axis=0)
    return np.stack(candidates)[best, np.arange(problem.num_layers)]
