"""What a layout costs the running fleet: each EP rank's expert work and the all-to-all it causes (pure).

A token at an MoE layer is dispatched to every rank that hosts one of its top-k experts, once per rank (DeepEP
and vLLM's all-to-all kernels send a token to a rank once, whatever number of its experts live there), and
not at all to its own rank. A send to a rank of the source's node goes over NVLink, one to another node over
the network; DeepEP's internode kernels send a token over the network once per remote *node* and forward it
inside that node over NVLink (DeepEP README, "internode" kernels: https://github.com/deepseek-ai/DeepEP), so
both counts are given. With replicas, a token uses the copy on its own rank, else one on its node, else the
lowest-ranked copy (a deterministic stand-in for vLLM's and SGLang's replica choice).

Ranks are EP-group GPU indices; node of rank g = g // ranks_per_node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.solver.placement.problem import hosts_from_slots

__all__ = ["A2A", "a2a_sends", "rank_loads", "remote_share"]


@dataclass(frozen=True)
class A2A:
    """Dispatch sends of one batch of tokens, per layer `[L]`: token-rank sends within the source's node
    (NVLink), to ranks of other nodes (network), and token-node sends to other nodes (DeepEP's RDMA)."""

    tokens: int
    nvlink: np.ndarray
    network: np.ndarray
    network_nodes: np.ndarray

    def per_token_layer(self) -> dict[str, float]:
        """Sends per token per layer (mean over layers)."""
        scale = 1.0 / max(self.tokens * len(self.nvlink), 1)
        return {
            "nvlink": float(self.nvlink.sum() * scale),
            "network": float(self.network.sum() * scale),
            "network_nodes": float(self.network_nodes.sum() * scale),
        }


def rank_loads(counts: np.ndarray, slot_map: np.ndarray) -> np.ndarray:
    """`[L, G]` expert selections each rank computes, from `counts` `[L, E]` (copies split an expert evenly)."""
    counts = np.asarray(counts, dtype=np.float64)
    hosts = hosts_from_slots(np.asarray(slot_map), counts.shape[1]).astype(np.float64)  # [L, E, G]
    copies = np.maximum(hosts.sum(axis=2), 1.0)
    return np.einsum("le,leg->lg", counts / copies, hosts)


def remote_share(source_load: np.ndarray, slot_map: np.ndarray, tp: int = 1) -> float:
    """Share of the selections in `source_load` `[L, S, E]` served off their source engine's GPUs.

    Engine s owns GPUs [s·tp, (s+1)·tp); copies split an expert's selections evenly (the placement objective's
    communication term, before its normalisation)."""
    source_load = np.asarray(source_load, dtype=np.float64)
    num_layers, num_sources, num_experts = source_load.shape
    hosts = hosts_from_slots(np.asarray(slot_map), num_experts).astype(np.float64)  # [L, E, G]
    if hosts.shape[2] != num_sources * tp:
        raise ValueError(
            f"{num_sources} engines of tp {tp} need {num_sources * tp} GPUs; the layout has {hosts.shape[2]}"
        )
    share = hosts / np.maximum(hosts.sum(axis=2, keepdims=True), 1.0)
    local = share.reshape(num_layers, num_experts, num_sources, tp).sum(axis=3)  # [L, E, S]
    total = source_load.sum()
    return float(1.0 - np.einsum("lse,les->", source_load, local) / total) if total > 0 else 0.0


def _destinations(slot_map: np.ndarray, num_experts: int, source_ranks: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """`[R, L, E]` the rank each source rank in `source_ranks` `[R]` dispatches expert e of layer l to."""
    hosts = hosts_from_slots(np.asarray(slot_map), num_experts)  # [L, E, G]
    num_gpus = hosts.shape[2]
    gpus = np.arange(num_gpus)
    same_node = (source_ranks[:, None] // ranks_per_node) == (gpus[None, :] // ranks_per_node)
    preference = np.where(gpus[None, :] == source_ranks[:, None], 0, np.where(same_node, 1, 2)) * num_gpus + gpus
    cost = np.where(hosts[None], preference[:, None, None, :], np.iinfo(np.int64).max)  # [R, L, E, G]
    return cost.argmin(axis=3)


def a2a_sends(experts: np.ndarray, slot_map: np.ndarray, source_rank: np.ndarray, ranks_per_node: int = 8) -> A2A:
    """The dispatch sends of tokens `experts` `[N, L, k]` (expert ids) from ranks `source_rank` `[N]` under
    `slot_map` `[L, G, slots]` (see the module docstring for the counting rule)."""
    experts = np.asarray(experts, dtype=np.int64)
    source_rank = np.asarray(source_rank, dtype=np.int64)
    if experts.ndim != 3 or source_rank.shape != experts.shape[:1]:
        raise ValueError(f"experts must be [N, L, k] and source_rank [N]; got {experts.shape} and {source_rank.shape}")
    num_layers, num_gpus, _ = np.asarray(slot_map).shape
    if experts.shape[1] != num_layers:
        raise ValueError(f"the tokens have {experts.shape[1]} layers, the layout {num_layers}")
    if len(source_rank) and (source_rank.min() < 0 or source_rank.max() >= num_gpus):
        raise ValueError(f"source ranks must lie in [0, {num_gpus})")
    num_experts = max(int(np.asarray(slot_map).max()) + 1, int(experts.max(initial=-1)) + 1)
    ranks, index = np.unique(source_rank, return_inverse=True)
    table = _destinations(slot_map, num_experts, ranks, ranks_per_node)  # [R, L, E]
    layer = np.arange(num_layers)[None, :, None]
    dest = np.sort(table[index[:, None, None], layer, experts], axis=2)  # [N, L, k]
    first = np.ones(dest.shape, dtype=bool)
    first[..., 1:] = dest[..., 1:] != dest[..., :-1]
    src = source_rank[:, None, None]
    same_node = dest // ranks_per_node == src // ranks_per_node
    nvlink = (first & same_node & (dest != src)).sum(axis=(0, 2))
    network = (first & ~same_node).sum(axis=(0, 2))
    node = np.sort(np.where(same_node, -1, dest // ranks_per_node), axis=2)
    new_node = np.ones(node.shape, dtype=bool)
    new_node[..., 1:] = node[..., 1:] != node[..., :-1]
    network_nodes = (new_node & (node >= 0)).sum(axis=(0, 2))
    return A2A(len(experts), nvlink.astype(np.int64), network.astype(np.int64), network_nodes.astype(np.int64))
