"""Every request's prefill signature from per-KV-block expert counts (ELDR's signature cache, inside vLLM).

The capture op (`switchyard::count_blocks`) adds each token's top-k selections, per MoE layer, to the
`[L, E]` row of the KV block its KV lands in: a preallocated `[B + 1, L, E]` table indexed by vLLM's block
ids, written on the device with no host synchronisation. When a request's prefill completes, its signature
is the sum of the rows of the blocks that hold its prompt, including blocks it got from the prefix cache,
which it never computed: their rows are still those of the request that did. A block is cleared when its
first slot is written again (new content after eviction).

This module decides, per step, which requests finish their prefill and which blocks they hold (`plan`,
pure numpy, tested without vLLM), and gathers their sums after the step (`BlockSignatures`, in the worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Finished:
    """A request whose prefill completes in this step, and the KV blocks its prompt occupies."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    blocks: np.ndarray  # block ids, in order


def prefill_ends(
    req_ids: list[str | None],
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    num_prompt: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    cached: dict[str, int],
) -> list[Finished]:
    """The requests of a step whose last prompt token is computed in it (`num_computed` before the step).

    `block_table[i]` is batch row i's block ids; `cached[rid]` the tokens its first step found computed
    (prefix cache hits), popped here.
    """
    computed = np.asarray(num_computed[: len(req_ids)], np.int64)
    prompt = np.asarray(num_prompt[: len(req_ids)], np.int64)
    end = computed + np.asarray(num_scheduled[: len(req_ids)], np.int64)
    rows = np.flatnonzero((computed < prompt) & (end >= prompt))
    finished = []
    for row in rows.tolist():
        rid = req_ids[row]
        if rid is None:
            continue
        tokens = int(prompt[row])
        nblocks = -(-tokens // block_size)
        blocks = np.asarray(block_table[row, :nblocks], np.int64).copy()
        finished.append(Finished(rid, tokens, min(cached.pop(rid, 0), tokens), blocks))
    return finished


def table_dtype(block_size: int) -> str:
    """A cell counts one block's tokens that chose an expert at one layer: at most `block_size`."""
    return "uint8" if block_size <= 255 else "int16" if block_size <= 32767 else "int32"


class BlockSignatures:
    """The worker's per-block count table and the gather of finished requests' sums (imports torch)."""

    def __init__(self, runner: Any, num_layers: int, num_experts: int, top_k: int, table_key: int) -> None:
        import torch

        from switchyard.engine_agents.vllm.ops import BLOCK_TABLES

        block_table = runner.input_batch.block_table[0]
        self.block_size = int(block_table.block_size)  # the kernel's block size: the slot mapping's unit
        ratio = max(int(runner.cache_config.block_size) // self.block_size, 1)
        self.num_blocks = int(runner.kv_cache_config.num_blocks) * ratio
        device = block_table.slot_mapping.gpu.device
        dtype = getattr(torch, table_dtype(self.block_size))
        self.blocks = torch.zeros(self.num_blocks + 1, num_layers, num_experts, dtype=dtype, device=device)
        slots = block_table.slot_mapping.gpu
        ones = torch.ones(slots.shape[0] * top_k, dtype=dtype, device=device)
        base = torch.zeros(slots.shape[0], dtype=torch.int64, device=device)
        self.block_table = block_table
        self.key = table_key
        self.cached: dict[str, int] = {}
        self.pending: list[Finished] = []
        BLOCK_TABLES[table_key] = (self.blocks, slots, self.block_size, ones, base)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def plan(self, runner: Any, scheduler_output: Any, num_scheduled: np.ndarray) -> None:
        """Before the step: note first-step cache hits, and which requests finish their prefill in it."""
        for new in scheduler_output.scheduled_new_reqs:
            self.cached.setdefault(new.req_id, int(new.num_computed_tokens))
        batch, n = runner.input_batch, runner.input_batch.num_reqs
        self.pending = prefill_ends(
            list(batch.req_ids[:n]),
            np.asarray(num_scheduled),
            batch.num_computed_tokens_cpu[:n],
            batch.num_prompt_tokens[:n],
            self.block_table.block_table.np,
            self.block_size,
            self.cached,
        )

    def gather(self) -> tuple[list[Finished], Any] | None:
        """After the step: the finished requests and their `[R, L, E]` sums, still on the device (no sync)."""
        import torch

        if not self.pending:
            return None
        finished, self.pending = self.pending, []
        ids = torch.from_numpy(np.concatenate([f.blocks for f in finished])).to(self.blocks.device)
        owner = torch.from_numpy(np.repeat(np.arange(len(finished)), [f.blocks.size for f in finished]))
        rows = self.blocks.index_select(0, ids).to(torch.int32)
        sums = torch.zeros((len(finished), *self.blocks.shape[1:]), dtype=torch.int32, device=self.blocks.device)
        sums.index_add_(0, owner.to(self.blocks.device), rows)
        return finished, sums

    def forget(self, request_ids: Any) -> None:
        """Requests that finished or were aborted before their prefill ended."""
        for rid in request_ids:
            self.cached.pop(rid, None)
