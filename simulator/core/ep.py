"""Expert parallelism of a lock-step DP+EP fleet: where a step's expert work lands and what its all-to-all moves.

A DP+EP fleet (vLLM's data-parallel attention with expert-parallel MoE) spreads the routed experts over all
its GPUs, the EP ranks. Each MoE layer of a step waits for the slowest rank, so the placement in force (a slot
map ``[L, G, slots]``) decides two costs the even-spread model (`dp_engine.DPCost.moe_time`) leaves out:

- **expert work**: per layer, the busiest rank's distinct experts loaded (each costs a weight read) and
  (token, expert) pairs computed. An expert with r copies splits its tokens evenly over them, as EPLB's
  dispatch does (vLLM and SGLang pick a replica per token);
- **the all-to-all**: every token sits on a source rank of its own DP engine and, at every MoE layer, is sent
  once to each OTHER rank that hosts one of its top-k experts (DeepEP sends a token to a rank once however
  many of its experts live there), dispatched (FP8) and combined back (BF16); over NVLink when both ranks
  share a node, over the network otherwise. A phase lasts as long as the busiest rank's bytes (the larger of
  what it sends and receives) take on the slower of its two links, plus a latency.

Source ranks: a DP engine's tokens are split evenly over its `tp` ranks (each TP rank dispatches its share
of the batch, as vLLM's sequence-parallel MoE input does with DeepEP); a token's traffic is counted 1/tp from
each of them, so a token is "local" to the experts on the rank it sits on.

Decode tokens use their real routing-trace selections (`ReplayBank.decode_bits` rows). A prefill chunk has
only its request's per-expert prefill counts (`prefill_counts[R, L, E]`), scaled to the chunk: its pairs per
expert are exact in expectation, and its dedup per rank assumes each of its tokens draws its k experts
independently from the chunk's expert mix (no per-token co-selection in the counts). The replica a token
reaches is likewise drawn uniformly, independently per expert (exact when no expert is replicated).

Everything is vectorised numpy over tokens, layers and ranks; no clock and no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from switchyard.simulator.core.physics import CostModel
from switchyard.solver.placement.problem import hosts_from_slots
from switchyard.solver.placement.step_time import StepCost, a2a_seconds, expert_seconds, rank_tokens

__all__ = [
    "EpTopology",
    "Placed",
    "StepTraffic",
    "busiest",
    "placed",
    "rank_work",
    "selections",
    "step_cost",
    "step_traffic",
]

#: Stand-in for log(0) in the replica-miss product: exp(-1e4) is 0 in float64, and 0 × it stays 0.
_LOG_ZERO = -1e4


@dataclass(frozen=True)
class EpTopology:
    """The EP group's ranks, nodes and links (defaults: H100 HGX nodes of 8 GPUs, DeepEP's measured kernels).

    Bandwidths are the all-to-all kernels' *achieved* per-rank bottleneck figures, not link peaks: DeepEP's
    normal kernels (https://github.com/deepseek-ai/DeepEP, docs/legacy.md "Normal kernels with NVLink and RDMA
    forwarding", H800, 4096 tokens, hidden 7168, top-8, FP8 dispatch / BF16 combine) reach 153 GB/s (dispatch)
    and 158 GB/s (combine) over NVLink at EP8, and 43 GB/s over RDMA at EP16 (CX7 400 Gb/s, ~50 GB/s max).
    H100's NVLink 4 peaks at 900 GB/s bidirectional, 450 GB/s a direction (NVIDIA H100 datasheet); H800's
    NVLink is cut to 400 GB/s, so 153 GB/s understates an H100 node by up to ~3×: we keep the measured kernel
    figure (a kernel at a link's peak is unpublished for H100) and say so. The low-latency kernels the
    simulator's flat a2a term reproduces (`physics.CostModel.a2a`: 77 µs + 114 µs at EP8, ~120 GB/s RDMA)
    are a decode-only path; the normal kernels cover prefill chunks as well.

    Latency: 5 µs per dispatch or combine phase on either link, the simulator's existing assumption
    (`CostModel.a2a_latency_s`: a launch and one round trip); no published per-phase figure isolates it.
    """

    ranks: int
    hidden: int
    tp: int = 1  # GPUs per DP engine; engine i's tokens sit on ranks i·tp … i·tp + tp − 1
    ranks_per_node: int = 8  # H100 HGX: 8 GPUs per NVLink domain
    nvlink_bytes_per_s: float = 153e9
    network_bytes_per_s: float = 43e9
    nvlink_latency_s: float = 5e-6
    network_latency_s: float = 5e-6
    dispatch_bytes: float = 1.0  # FP8 per hidden element (DeepEP's dispatch)
    combine_bytes: float = 2.0  # BF16 per hidden element (DeepEP's combine)

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.tp < 1 or self.ranks % self.tp:
            raise ValueError(f"EP ranks ({self.ranks}) must be a positive multiple of tp ({self.tp})")
        if self.ranks_per_node < 1 or self.hidden < 1:
            raise ValueError("ranks_per_node and hidden must be >= 1")
        if min(self.nvlink_bytes_per_s, self.network_bytes_per_s) <= 0:
            raise ValueError("link bandwidths must be > 0")
        if min(self.nvlink_latency_s, self.network_latency_s, self.dispatch_bytes, self.combine_bytes) < 0:
            raise ValueError("latencies and bytes per element must be >= 0")

    @property
    def engines(self) -> int:
        return self.ranks // self.tp

    @cached_property
    def same_node(self) -> np.ndarray:
        """`[G, G]` bool: ranks g and h share a node (an NVLink domain)."""
        node = np.arange(self.ranks) // self.ranks_per_node
        return node[:, None] == node[None, :]

    @cached_property
    def source_engine(self) -> np.ndarray:
        """`[G]` the DP engine whose tokens rank g dispatches."""
        return np.arange(self.ranks) // self.tp

    @cached_property
    def origin(self) -> np.ndarray:
        """`[S, G]`: engine s dispatches 1/tp of its tokens from each of its own ranks."""
        return (np.arange(self.engines)[:, None] == self.source_engine[None, :]) / self.tp


def step_cost(cost: CostModel, topo: EpTopology) -> StepCost:
    """The layout-dependent step-time constants (`solver.placement.step_time`) of this engine on this group:
    what the simulator prices every step with and the placement loop predicts with."""
    return StepCost(
        expert_read_s=cost.b,
        pair_s=cost.expert_pair_flops_s,
        token_bytes=topo.hidden * (topo.dispatch_bytes + topo.combine_bytes),
        top_k=cost.model.top_k,
        ranks_per_node=topo.ranks_per_node,
        nvlink_bytes_per_s=topo.nvlink_bytes_per_s,
        network_bytes_per_s=topo.network_bytes_per_s,
    )


@dataclass(frozen=True)
class Placed:
    """A slot map in the forms the step model reads.

    - `layout[L, G, slots]`: expert id per slot (-1 empty);
    - `hosts[L, E, G]`: copies of expert e on rank g; `copies[L, E]` = Σ_g hosts ≥ 1;
    - `share[L, E, G]` = hosts / copies: the fraction of e's tokens rank g computes (EPLB's even split);
    - `log_miss[L, E, G]` = log(1 − share): a token selecting e misses rank g with probability exp of it.
    """

    layout: np.ndarray
    hosts: np.ndarray
    copies: np.ndarray
    share: np.ndarray
    log_miss: np.ndarray


def placed(layout: np.ndarray, num_experts: int) -> Placed:
    """The step model's view of slot map `layout[L, G, slots]`; every expert needs a copy on some rank."""
    layout = np.asarray(layout)
    if layout.ndim != 3:
        raise ValueError(f"a slot map is [L, G, slots], got shape {layout.shape}")
    if layout.size and int(layout.max()) >= num_experts:
        raise ValueError(f"slot map holds expert {int(layout.max())}, the model has {num_experts}")
    hosts = hosts_from_slots(layout, num_experts)
    copies = hosts.sum(axis=2)
    if (copies == 0).any():
        layer, expert = np.argwhere(copies == 0)[0]
        raise ValueError(f"layer {layer}: expert {expert} has no copy on any rank")
    share = hosts / copies[..., None]
    with np.errstate(divide="ignore"):
        log_miss = np.maximum(np.log1p(-np.minimum(share, 1.0)), _LOG_ZERO)
    return Placed(layout, hosts, copies, share, log_miss)


def rank_work(counts: np.ndarray, pl: Placed) -> tuple[np.ndarray, np.ndarray]:
    """A step's expert work per rank: `counts[L, E]` (token, expert) pairs → (`distinct[L, G]`, `pairs[L, G]`).

    `distinct`: copies of selected experts on rank g (each is one weight read); `pairs`: the pairs rank g
    computes, an expert's pairs split evenly over its copies.
    """
    counts = np.asarray(counts, dtype=np.float64)
    distinct = np.einsum("le,leg->lg", (counts > 0).astype(np.float64), pl.hosts)
    pairs = np.einsum("le,leg->lg", counts, pl.share)
    return distinct, pairs


def busiest(cost: CostModel, distinct: np.ndarray, pairs: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """MoE seconds of a step and, per layer, the busiest rank's (distinct experts, pairs): `[L]`, `[L]`.

    ``Σ_ℓ a + max_g (b·U_ℓg + pairs_ℓg · expert FLOPs)`` — `DPCost.moe_time` with the even spread replaced; the
    max is `solver.placement.step_time.expert_seconds`, the formula the placement loop predicts with.
    """
    per = cost.b * distinct + pairs * cost.expert_pair_flops_s  # [L, G]
    g = per.argmax(axis=1)
    rows = np.arange(per.shape[0])
    terms = StepCost(cost.b, cost.expert_pair_flops_s, 0.0, cost.model.top_k)
    seconds = per.shape[0] * cost.moe_overhead_s + float(expert_seconds(terms, distinct, pairs).sum())
    return seconds, distinct[rows, g], pairs[rows, g]


def selections(bits: np.ndarray, num_experts: int) -> np.ndarray:
    """`[B, L, W]` token bitsets → `[B, L, E]` float32 one-hot selections."""
    as_bytes = np.ascontiguousarray(bits).astype("<u8", copy=False).view(np.uint8)
    onehot = np.unpackbits(as_bytes, axis=-1, bitorder="little")[..., :num_experts]
    return onehot.astype(np.float32)


@dataclass(frozen=True)
class StepTraffic:
    """One step's expert selections and all-to-all under a placement.

    - `load[L, S, E]`: (token, expert) pairs by source DP engine (what `PlacementControl.observe` reads);
    - `nvlink_bytes`, `network_bytes`: dispatch + combine bytes over all layers, each link class;
    - `a2a_s`: Σ over layers of both phases' busiest-rank time plus latencies.
    """

    load: np.ndarray
    nvlink_bytes: float
    network_bytes: float
    a2a_s: float


def step_traffic(
    topo: EpTopology,
    pl: Placed,
    decode_sel: np.ndarray,
    decode_src: np.ndarray,
    chunk_counts: np.ndarray,
    chunk_tokens: np.ndarray,
    chunk_src: np.ndarray,
    top_k: int,
) -> StepTraffic:
    """The all-to-all and expert selections of one lock-step step (see the module docstring).

    decode_sel `[B, L, E]` one-hot selections of the step's decode tokens, decode_src `[B]` their DP engine;
    chunk_counts `[C, L, E]` expected pairs of each prefill chunk, chunk_tokens `[C]` its tokens, chunk_src
    `[C]` its engine.
    """
    num_layers, num_experts, num_ranks = pl.share.shape
    if num_ranks != topo.ranks:
        raise ValueError(f"the placement has {num_ranks} ranks, the topology {topo.ranks}")
    engines = topo.engines
    load = np.zeros((num_layers, engines, num_experts))
    dest = np.zeros((engines, num_layers, num_ranks))  # tokens each engine sends to each rank (expected)
    if len(decode_src):
        src = np.asarray(decode_src, dtype=np.int64)
        np.add.at(load.transpose(1, 0, 2), src, decode_sel)
        miss = np.einsum("ble,leg->blg", decode_sel, pl.log_miss.astype(np.float32), optimize=True)
        np.add.at(dest, src, 1.0 - np.exp(miss.astype(np.float64)))
    if len(chunk_src):
        src = np.asarray(chunk_src, dtype=np.int64)
        counts = np.asarray(chunk_counts, dtype=np.float64)
        np.add.at(load.transpose(1, 0, 2), src, counts)
        tokens = np.asarray(chunk_tokens, dtype=np.float64)[:, None, None]
        mass = np.einsum("cle,leg->clg", counts, pl.share) / np.maximum(tokens * top_k, 1e-12)
        hit = 1.0 - (1.0 - np.clip(mass, 0.0, 1.0)) ** top_k  # P(a chunk token reaches rank g)
        np.add.at(dest, src, tokens * hit)
    nv, net, seconds = _a2a(topo, dest)
    return StepTraffic(load, nv, net, seconds)


def _a2a(topo: EpTopology, dest: np.ndarray) -> tuple[float, float, float]:
    """`dest[S, L, G]` tokens from each engine to each rank → (NVLink bytes, network bytes, seconds).

    The busy time is `solver.placement.step_time.a2a_seconds`, the formula the placement loop predicts with."""
    terms = StepCost(
        0.0,
        0.0,
        topo.hidden * (topo.dispatch_bytes + topo.combine_bytes),
        1,
        topo.ranks_per_node,
        topo.nvlink_bytes_per_s,
        topo.network_bytes_per_s,
    )
    tokens = rank_tokens(dest, topo.origin)
    busy, nv_bytes, net_bytes = a2a_seconds(terms, tokens)
    near = topo.same_node
    layers_net = np.where(near, 0.0, tokens).sum(axis=(1, 2)) > 0
    layers_nv = ~layers_net & (np.where(near, tokens, 0.0).sum(axis=(1, 2)) > 0)
    latency = 2 * (layers_net.sum() * topo.network_latency_s + layers_nv.sum() * topo.nvlink_latency_s)
    return nv_bytes, net_bytes, float(busy.sum() + latency)
