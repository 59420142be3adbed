"""A placement objective term that sheds load off GPUs marked hot (docs/architecture.md, "How to add a
placement objective term"). tests/test_placement_terms.py runs this file as it stands."""

from dataclasses import replace

import numpy as np

from switchyard.solver.placement import PlacementProblem, Weights, objective, place

#: The term's default weight. The unit is the objective's, so a GPU running δ above the mean costs
#: 2·δ·w_load per unit of load moved off it: the hot GPU sheds load until it runs δ* = w_hot / (2·w_load)
#: below the mean. 10 against the default w_load = 50 aims at about 10 %.
HOT_WEIGHT = 10.0


def hot_gpu_cost(load: np.ndarray, hot: np.ndarray) -> np.ndarray:
    """T[L, E, G] = B[l, e]·hot[g]: the load one copy of expert e puts on GPU g if g is marked hot.

    load: B[L, E] in canonical units (`PlacementProblem.load`); hot: [G] bool. With replicas a copy
    carries B / r: divide by the copy counts first.
    """
    return load[:, :, None] * np.asarray(hot, dtype=np.float64)[None, None, :]


def with_hot_gpus(problem: PlacementProblem, hot: np.ndarray, weight: float = HOT_WEIGHT) -> PlacementProblem:
    """`problem` with the term added: its cost array under a name, and the name's weight."""
    return replace(
        problem,
        extra_terms={**problem.extra_terms, "hot": hot_gpu_cost(problem.load, hot)},
        weights=Weights({**problem.weights, "hot": weight}),
    )


def place_avoiding_hot(counts: np.ndarray, num_gpus: int, slots_per_gpu: int, hot: np.ndarray) -> tuple:
    """The online placement of token counts B[L, E] with the hot-GPU term; and its objective by term.

    Greedy, swap refinement and MINLP read the term through `solver.placement.terms.linear_cost`; the
    totals (now with a "hot" entry) go into a plan as `ObjectiveTerms.from_flat(totals)`, and the wire,
    the database and the API carry the new name without a change.
    """
    problem = with_hot_gpus(PlacementProblem.from_counts(counts, num_gpus, slots_per_gpu), hot)
    slot_map = place(problem)
    return slot_map, objective(problem, slot_map).totals()
