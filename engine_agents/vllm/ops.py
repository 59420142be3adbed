"""The torch custom ops that see expert selections inside vLLM's forward pass: counts, and rows for calibration.

A custom op declares the buffer it mutates, so torch.compile keeps it in the graph (a plain Python capture
function would be traced once, its side effects lost) and it runs on the device where the graph runs.
This module imports torch and is imported only inside vLLM worker processes. It has no
`from __future__ import annotations`: torch reads the op's schema from real annotation objects.
"""

import torch


@torch.library.custom_op("switchyard::count_experts", mutates_args=("counts",))
def count_experts(counts: torch.Tensor, layer: int, topk_ids: torch.Tensor) -> None:
    """Add one MoE layer's top-k selections (`topk_ids [tokens, k]`, logical ids) to `counts[layer]`.

    `counts` is `[L, E + 1]`: ids outside 0..E-1 (padding rows may carry -1) land in the last column, which
    nobody reads. No boolean indexing and no bincount: both size their output from the data, a host sync.
    """
    experts = counts.shape[1] - 1
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < experts), ids, experts)
    counts[layer].index_add_(0, ids, torch.ones_like(ids))


@count_experts.register_fake
def _(counts: torch.Tensor, layer: int, topk_ids: torch.Tensor) -> None:
    return None


@torch.library.custom_op("switchyard::record_experts", mutates_args=("buffer",))
def record_experts(buffer: torch.Tensor, layer: int, topk_ids: torch.Tensor) -> None:
    """Keep this step's top-k ids of one layer in `buffer[layer, rows, k]`, for per-request calibration counts."""
    rows, k = min(topk_ids.shape[0], buffer.shape[1]), min(topk_ids.shape[1], buffer.shape[2])
    buffer[layer, :rows, :k].copy_(topk_ids[:rows, :k])


@record_experts.register_fake
def _(buffer: torch.Tensor, layer: int, topk_ids: torch.Tensor) -> None:
    return None


#: Per-KV-block count tables, by the key the capture op carries: `(blocks [B + 1, L, E], slot_mapping, block_size,
#: ones, base)`; `base` (int64, one per batch row) holds each row's flat offset `block * L * E`, computed once per
#: step at layer 0. Registered after vLLM allocates its KV cache, which is after torch.compile traced the
#: model: the op is in the graph from load time and finds its table here when it runs (on a GPU: when CUDA
#: graphs are captured, after which the replays write into the same tensors).
BLOCK_TABLES: dict[int, tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]] = {}


@torch.library.custom_op("switchyard::count_blocks", mutates_args=("anchor",))
def count_blocks(anchor: torch.Tensor, layer: int, topk_ids: torch.Tensor, table: int) -> None:
    """Add one MoE layer's top-k selections to the `[L, E]` row of the KV block each token's KV lands in.

    A token's block is its slot (vLLM's slot mapping, `-1` for padding) // block size; padding rows go to the
    last, scratch row. At layer 0 (the first MoE layer of the step) the rows' offsets are computed once, and a
    block whose first slot is written in this step is new content (fresh, or reused after eviction): its row
    is cleared first. Everything stays on the device: no host sync. `anchor` is a declared mutation so that
    the compiler keeps the call.
    """
    entry = BLOCK_TABLES.get(table)
    if entry is None:
        return
    blocks, slot_mapping, block_size, ones, base = entry
    rows = min(topk_ids.shape[0], slot_mapping.shape[0])
    layers, experts = blocks.shape[1], blocks.shape[2]
    if layer == 0:
        scratch = blocks.shape[0] - 1
        slots = slot_mapping[:rows]
        block = torch.where(slots >= 0, torch.div(slots, block_size, rounding_mode="floor"), scratch)
        blocks.index_fill_(0, torch.where(slots % block_size == 0, block, scratch), 0)
        torch.mul(block, layers * experts, out=base[:rows])
    ids = topk_ids[:rows].clamp(0, experts - 1)  # router ids are in range; padding rows' land in the scratch row
    flat = base[:rows, None] + (layer * experts) + ids
    blocks.view(-1).index_add_(0, flat.reshape(-1), ones[: flat.numel()])


@count_blocks.register_fake
def _(anchor: torch.Tensor, layer: int, topk_ids: torch.Tensor, table: int) -> None:
    return None
