"""The cost of block-granular signatures in vLLM (the seed, ELDR: 0.86 ms per request in all; cache < 1 % of KV).

What the vLLM agent adds per step and per request, measured on the ops it runs, at a real model's shape with
random routing (no weights needed), on this machine's CPU or on a GPU (`--device cuda`):

- per step: `switchyard::count_blocks` once per MoE layer (each token's top-k ids added to its KV block's
  `[L, E]` row; layer 0 also clears blocks whose first slot is written). Reported per prefill token.
- per request: at the end of its prefill, the sum of its blocks' rows (`BlockSignatures.gather`: one
  index_select and one index_add for all requests of the step) and the copy of `[L, E]` to the host.
- memory: the table's bytes per KV block (uint8 cells: a block holds at most `block_size` tokens) over the
  KV cache's bytes per block, for GQA models (2 × KV heads × head dim × layers) and MLA (latent + rope).

On a GPU each timed region ends with `torch.cuda.synchronize()`; the ops themselves never synchronise. The
figures exclude the MoE layers they ride along with. Usage:

    .venv-vllm/bin/python bench/vllm_signatures.py [--device cpu|cuda] [--model qwen3-30b-a3b] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from switchyard.engine_agents.vllm.ops import BLOCK_TABLES, count_blocks
from switchyard.engine_agents.vllm.signatures import table_dtype


@dataclass(frozen=True)
class Shape:
    moe_layers: int
    experts: int
    top_k: int
    attn_layers: int
    kv_bytes_per_token_layer: int  # K and V (GQA) or latent + rope (MLA), bf16
    block_size: int


SHAPES = {
    # Qwen3-30B-A3B: 48 layers, 128 experts, top-8, 4 KV heads × 128, bf16.
    "qwen3-30b-a3b": Shape(48, 128, 8, 48, 2 * 4 * 128 * 2, 16),
    # Qwen3-235B-A22B: 94 layers, 128 experts, top-8, 4 KV heads × 128.
    "qwen3-235b-a22b": Shape(94, 128, 8, 94, 2 * 4 * 128 * 2, 16),
    # DeepSeek-V3: 61 layers (58 MoE), 256 routed experts, top-8, MLA latent 512 + rope 64, block 64 (FlashMLA).
    "deepseek-v3": Shape(58, 256, 8, 61, (512 + 64) * 2, 64),
}


def memory_share(shape: Shape) -> dict[str, float]:
    cell = np.dtype(table_dtype(shape.block_size)).itemsize
    table = shape.moe_layers * shape.experts * cell
    kv = shape.attn_layers * shape.kv_bytes_per_token_layer * shape.block_size
    return {"table_bytes_per_block": table, "kv_bytes_per_block": kv, "share_of_kv": table / kv}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(shape: Shape, tokens: int, num_blocks: int, device: torch.device, repeats: int) -> list[float]:
    """Seconds per forward's worth of `count_blocks` calls (every MoE layer) for `tokens` prefill tokens."""
    dtype = getattr(torch, table_dtype(shape.block_size))
    blocks = torch.zeros(num_blocks + 1, shape.moe_layers, shape.experts, dtype=dtype, device=device)
    slots = torch.arange(tokens, dtype=torch.int64, device=device)  # fresh blocks, contiguous
    ones = torch.ones(tokens * shape.top_k, dtype=dtype, device=device)
    anchor = torch.zeros(1, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = [
        torch.randint(0, shape.experts, (tokens, shape.top_k), generator=gen, device=device, dtype=torch.int32)
        for _ in range(shape.moe_layers)
    ]
    BLOCK_TABLES[0] = (blocks, slots, shape.block_size, ones, torch.zeros(tokens, dtype=torch.int64, device=device))
    times = []
    try:
        for _ in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            for layer in range(shape.moe_layers):
                count_blocks(anchor, layer, ids[layer], 0)
            _sync(device)
            times.append(time.perf_counter() - start)
    finally:
        del BLOCK_TABLES[0]
    return times[1:]  # the first is warm-up


def time_gather(shape: Shape, prompt: int, requests: int, device: torch.device, repeats: int) -> list[float]:
    """Seconds to sum `requests` requests' blocks (`prompt` tokens each) and copy the `[R, L, E]` to the host."""
    dtype = getattr(torch, table_dtype(shape.block_size))
    per = -(-prompt // shape.block_size)
    blocks = torch.randint(0, 3, (per * requests + 1, shape.moe_layers, shape.experts), dtype=dtype, device=device)
    ids = torch.arange(per * requests, device=device)
    owner = torch.arange(requests, device=device).repeat_interleave(per)
    pinned = device.type == "cuda"
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        rows = blocks.index_select(0, ids).to(torch.int32)
        sums = torch.zeros((requests, shape.moe_layers, shape.experts), dtype=torch.int32, device=device)
        sums.index_add_(0, owner, rows)
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=pinned)
        host.copy_(sums, non_blocking=pinned)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=sorted(SHAPES), action="append")
    parser.add_argument("--tokens", type=int, default=2048, help="prefill tokens per step")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request (gather)")
    parser.add_argument("--requests", type=int, default=4, help="requests finishing their prefill in one step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (vLLM pins its own)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = []
    for name in args.model or sorted(SHAPES):
        shape = SHAPES[name]
        num_blocks = -(-args.tokens // shape.block_size) + 16
        step = statistics.median(time_step(shape, args.tokens, num_blocks, device, args.repeats))
        gather = statistics.median(time_gather(shape, args.prompt, args.requests, device, args.repeats))
        per_request = gather / args.requests + step * args.prompt / args.tokens
        result = {
            "model": name,
            "device": str(device),
            "shape": asdict(shape),
            "step_ms_per_forward": round(step * 1e3, 4),
            "us_per_prefill_token": round(step / args.tokens * 1e6, 4),
            "gather_ms_per_request": round(gather / args.requests * 1e3, 4),
            "ms_per_request_in_all": round(per_request * 1e3, 4),
            **{k: round(v, 5) if isinstance(v, float) else v for k, v in memory_share(shape).items()},
        }
        results.append(result)
        print(json.dumps(result), flush=True)
    in_all = f"ms/req ({args.prompt} tok)"
    print(f"\n{'model':18} {'µs/prefill token':>17} {'gather ms/req':>14} {in_all:>20} {'table/KV':>9}")
    for r in results:
        print(
            f"{r['model']:18} {r['us_per_prefill_token']:17.3f} {r['gather_ms_per_request']:14.3f} "
            f"{r['ms_per_request_in_all']:20.3f} {100 * r['share_of_kv']:8.2f}%"
        )


if __name__ == "__main__":
    main()
