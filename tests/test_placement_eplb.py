"""The EPLB-style baseline, checked against its published rules and against the load-only greedy."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.solver.placement import GreedyParams, PlacementError, PlacementProblem, greedy_hosts, hosts_from_slots
from switchyard.solver.placement.eplb_baseline import balanced_packing, eplb_global, eplb_hierarchical
from switchyard.solver.placement.replication import replica_counts


def test_global_policy_gives_every_gpu_the_same_number_of_copies_and_replicates_hot_experts() -> None:
    load = np.random.default_rng(0).gamma(0.5, 1.0, (3, 16))
    layout = eplb_global(load, num_gpus=4, redundant_slots=4)
    assert layout.shape == (3, 4, 5) and (layout >= 0).all()
    hosts = hosts_from_slots(layout, 16)
    assert (hosts.sum(axis=2) == replica_counts(load, 4, 4)).all()
    assert hosts.max() == 1  # copies of one expert never share a GPU


def test_balanced_packing_is_the_load_only_greedy_written_independently() -> None:
    """EPLB's packing and Switchyard's greedy with only its load term make the same choices."""
    load = np.random.default_rng(1).gamma(0.5, 1.0, (5, 32))
    problem = PlacementProblem(load=load, num_gpus=4, slots_per_gpu=8)
    ours = greedy_hosts(problem, GreedyParams(0.0, 1.0, 0.0))
    theirs = hosts_from_slots(eplb_global(load, 4), 32) > 0
    assert (ours == theirs).all()


def test_balanced_packing_respects_capacity_and_puts_the_heaviest_item_alone_first() -> None:
    weight = np.array([[10.0, 1, 1, 1, 1, 1, 1, 1]])
    packs = balanced_packing(weight, 4)
    assert np.bincount(packs[0], minlength=4).tolist() == [2, 2, 2, 2]
    assert (np.bincount(packs[0], weights=weight[0], minlength=4) == [11, 2, 2, 2]).all()
    with pytest.raises(PlacementError, match="evenly"):
        balanced_packing(np.ones((1, 7)), 4)


def test_hierarchical_policy_keeps_each_group_on_one_node() -> None:
    rng = np.random.default_rng(2)
    load = rng.gamma(0.5, 1.0, (2, 32))  # 8 groups of 4 experts, 2 nodes of 4 GPUs
    layout = eplb_hierarchical(load, num_gpus=8, num_nodes=2, num_groups=8, redundant_slots=8)
    hosts = hosts_from_slots(layout, 32)
    node_of_copy = np.argwhere(hosts > 0)
    for layer, expert, gpu in node_of_copy:
        group_mates = np.arange(expert // 4 * 4, expert // 4 * 4 + 4)
        mate_gpus = np.argwhere(hosts[layer, group_mates] > 0)[:, 1]
        assert set(mate_gpus // 4) == {gpu // 4}
    assert (hosts.sum(axis=1) == 5).all()
    with pytest.raises(PlacementError, match="hierarchical"):
        eplb_hierarchical(load, num_gpus=8, num_nodes=3, num_groups=8)
