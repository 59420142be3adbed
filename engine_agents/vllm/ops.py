"""The torch custom ops that see expert selections inside vLLM's forward pass: counts, and rows for calibration.

A custom op declares the buffer it mutates, so torch.compile keeps it in the graph (a plain Python capture
function would be traced once, its side effects lost) and it runs on the device where the graph runs.
This module imports torch and is imported only inside vLLM worker processes. It has no
`from __future__ import annotations`: torch reads the op's schema from real annotation objects.
"""

import torch


@torch.library.custom_op("switchyard::count_experts", mutates_args=("counts",))
def count_experts(counts: torch.Tensor, layer: int, topk_ids: torch.Tensor) -> None:
    """Add one MoE layer's top-k selections (`topk_ids [tokens, k]`, logical ids) to `counts[layer]`."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = ids[(ids >= 0) & (ids < counts.shape[1])]  # padding rows may carry -1
    counts[layer].add_(torch.bincount(ids, minlength=counts.shape[1]))


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
