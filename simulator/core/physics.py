"""Step-time physics of a simulated MoE engine: what one forward step costs on a GPU.

Decode is memory-bandwidth bound. A decode step of a batch reads, from HBM:

- per MoE layer, the weights of every *distinct* expert the batch's tokens select (U experts), plus a fixed
  per-layer cost (router, top-k, permutation, kernel launches): ``a + b·U`` with ``b = expert bytes / BW``;
- the dense weights (attention projections, routers, shared experts, dense FFN layers, LM head), once;
- the KV cache of every running request (context tokens × KV bytes per token).

Compute is added as FLOPs over the peak dense throughput (``tokens × top_k × expert FLOPs / peak`` per MoE
layer, the dense FLOPs, and attention over the context). It is small in decode, which is why the seed's
microbenchmark is nearly flat in batch size at a fixed expert count; in prefill it dominates.

``a`` is the only fitted constant. It is solved once from the ELDR seed's microbenchmark (Fig. 2: on one
MI300X, Qwen3-30B-A3B, growing the active experts of a MoE layer from 16 to 128 at batch 64 multiplies its
latency by 4.7×): ``(a + c64 + 128·b) / (a + c64 + 16·b) = 4.7``. The same ``a`` (in seconds) is then used
for every GPU and model: it stands for per-layer fixed work that does not scale with expert bytes. Every
other constant is a datasheet or model-config number; `docs/simulator.md` lists them with sources.

Everything here is pure and vectorised: the engine model (`simulator.core.xpyd_engines`), the discrete-event
simulator and the live simulated fleet call these functions with numpy arrays of per-layer distinct-expert
counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

__all__ = [
    "GPUS",
    "MODELS",
    "MOE_LAYER_OVERHEAD_S",
    "SEED_FIG2",
    "CostModel",
    "GpuSpec",
    "ModelSpec",
    "calibrate_moe_overhead",
    "cost_model",
    "get_gpu",
    "get_model",
]


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator, from its vendor datasheet (dense, no-sparsity numbers)."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: float  # BF16 dense tensor throughput
    hbm_bytes: float
    source: str


#: Datasheet numbers. HBM capacities are the marketed GB (10^9 bytes); the usable amount is a little lower,
#: which `gpu_memory_utilization` (vLLM's default 0.9) covers.
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            "H100",
            hbm_bytes_per_s=3.35e12,
            peak_flops=989.4e12,
            hbm_bytes=80e9,
            source="NVIDIA H100 Tensor Core GPU datasheet, SXM5: HBM3 3.35 TB/s, BF16 989.4 TFLOPS dense, 80 GB",
        ),
        GpuSpec(
            "H200",
            hbm_bytes_per_s=4.8e12,
            peak_flops=989.4e12,
            hbm_bytes=141e9,
            source="NVIDIA H200 Tensor Core GPU datasheet, SXM: HBM3e 4.8 TB/s, BF16 989 TFLOPS dense, 141 GB",
        ),
        GpuSpec(
            "MI300X",
            hbm_bytes_per_s=5.3e12,
            peak_flops=1307.4e12,
            hbm_bytes=192e9,
            source="AMD Instinct MI300X datasheet: HBM3 5.3 TB/s, BF16 1307.4 TFLOPS dense, 192 GB",
        ),
    )
}


@dataclass(frozen=True)
class ModelSpec:
    """A MoE model's shape, from its Hugging Face `config.json`; sizes derived in properties.

    Attention is GQA (`q_heads`, `kv_heads`, `head_dim`) unless `kv_lora_rank` is set, in which case it is
    DeepSeek's MLA (the KV cache holds the compressed latent plus the decoupled RoPE key).
    """

    name: str
    num_layers: int  # transformer blocks
    moe_layers: int  # blocks whose FFN is routed (the routing trace's L)
    num_experts: int
    top_k: int
    hidden: int
    expert_ffn: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dense_ffn: int = 0  # FFN width of the non-MoE blocks
    shared_ffn: int = 0  # total shared-expert FFN width per MoE block
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    tie_embeddings: bool = False
    expert_weight_bytes: float = 2.0  # bytes per expert parameter (bf16 2, fp8 1, mxfp4 4.25/8)
    dense_weight_bytes: float = 2.0
    kv_bytes: int = 2  # KV cache element size
    sliding_layers: int = 0  # blocks with sliding-window attention
    sliding_window: int = 0
    default_gpus: int = 1  # GPUs per engine needed to hold the weights (expert + tensor parallel)
    source: str = ""

    # -- derived sizes (parameters, bytes, FLOPs) ---------------------------------------------------------

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def expert_params(self) -> int:
        """One routed expert: SwiGLU gate, up and down projections."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.expert_weight_bytes

    @property
    def expert_flops_per_token(self) -> float:
        return 2.0 * self.expert_params

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden
        if self.kv_lora_rank:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = h * self.q_heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
            kv_b = self.kv_lora_rank * self.q_heads * (self.qk_nope_dim + self.v_head_dim)
            o = self.q_heads * self.v_head_dim * h
            return q + kv_a + kv_b + o
        q = h * self.q_heads * self.head_dim
        kv = 2 * h * self.kv_heads * self.head_dim
        return q + kv + self.q_heads * self.head_dim * h

    @property
    def dense_params(self) -> int:
        """Weights every decode step reads whatever the batch: all but routed experts and the embedding."""
        attn = self.num_layers * self.attention_params_per_layer
        router = self.moe_layers * self.hidden * self.num_experts
        shared = self.moe_layers * 3 * self.hidden * self.shared_ffn
        ffn = self.dense_layers * 3 * self.hidden * self.dense_ffn
        lm_head = self.vocab * self.hidden
        return attn + router + shared + ffn + lm_head

    @property
    def dense_bytes(self) -> float:
        return self.dense_params * self.dense_weight_bytes

    @property
    def weight_bytes(self) -> float:
        """Resident weights (for the KV-cache budget): dense + every routed expert + input embedding."""
        experts = self.moe_layers * self.num_experts * self.expert_bytes
        embed = 0 if self.tie_embeddings else self.vocab * self.hidden * self.dense_weight_bytes
        return self.dense_bytes + experts + embed

    @property
    def kv_bytes_per_token_layer(self) -> int:
        if self.kv_lora_rank:
            return (self.kv_lora_rank + self.qk_rope_dim) * self.kv_bytes
        return 2 * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies (all layers; sliding layers hold it too, up to their window)."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def attn_flops_per_context(self) -> float:
        """Attention FLOPs of one query token against one context token, all layers (QK^T and AV)."""
        if self.kv_lora_rank:
            per_layer = 2 * self.q_heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)
        else:
            per_layer = 4 * self.q_heads * self.head_dim
        return float(per_layer * self.num_layers)

    def with_(self, **changes: object) -> ModelSpec:
        return replace(self, **changes)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "qwen3-30b-a3b",
            num_layers=48,
            moe_layers=48,
            num_experts=128,
            top_k=8,
            hidden=2048,
            expert_ffn=768,
            vocab=151936,
            q_heads=32,
            kv_heads=4,
            head_dim=128,
            source="huggingface.co/Qwen/Qwen3-30B-A3B config.json: 48 layers, 128 experts, top-8, hidden 2048, "
            "moe_intermediate_size 768, 32 q / 4 kv heads x 128, vocab 151936, untied, bf16 (96 KiB KV/token)",
        ),
        ModelSpec(
            "deepseek-v2-lite",
            num_layers=27,
            moe_layers=26,
            num_experts=64,
            top_k=6,
            hidden=2048,
            expert_ffn=1408,
            vocab=102400,
            q_heads=16,
            kv_heads=16,
            head_dim=128,
            dense_ffn=10944,
            shared_ffn=2 * 1408,
            kv_lora_rank=512,
            qk_rope_dim=64,
            qk_nope_dim=128,
            v_head_dim=128,
            source="huggingface.co/deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers (first_k_dense_replace 1, "
            "intermediate 10944), 64 routed + 2 shared experts of 1408, top-6, hidden 2048, MLA 16 heads, "
            "kv_lora_rank 512, qk_rope 64 / nope 128, v 128, q_lora none, vocab 102400, bf16",
        ),
        ModelSpec(
            "llama4-maverick",
            num_layers=48,
            moe_layers=24,
            num_experts=128,
            top_k=1,
            hidden=5120,
            expert_ffn=8192,
            vocab=202048,
            q_heads=40,
            kv_heads=8,
            head_dim=128,
            dense_ffn=16384,
            shared_ffn=8192,
            expert_weight_bytes=1.0,
            dense_weight_bytes=1.0,
            default_gpus=8,
            source="huggingface.co/meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8 config: 48 layers with MoE "
            "every 2nd (interleave_moe_layer_step 2 -> 24 x 128 experts, top-1, one shared expert of 8192), "
            "dense FFN 16384, hidden 5120, 40 q / 8 kv heads x 128, vocab 202048; FP8 weights; 8 GPUs (EP)",
        ),
        ModelSpec(
            "gpt-oss-120b",
            num_layers=36,
            moe_layers=36,
            num_experts=128,
            top_k=4,
            hidden=2880,
            expert_ffn=2880,
            vocab=201088,
            q_heads=64,
            kv_heads=8,
            head_dim=64,
            expert_weight_bytes=4.25 / 8,
            sliding_layers=18,
            sliding_window=128,
            source="huggingface.co/openai/gpt-oss-120b config.json: 36 layers, 128 experts, top-4, hidden 2880, "
            "intermediate 2880, 64 q / 8 kv heads x 64, alternating sliding window 128, vocab 201088; experts "
            "MXFP4 (4 bits + an 8-bit scale per 32 = 4.25 bits), attention/router/head bf16",
        ),
    )
}

#: The seed's microbenchmark (ELDR Fig. 2) the constant `a` is solved from.
SEED_FIG2 = {
    "gpu": "MI300X",
    "model": "qwen3-30b-a3b",
    "batch": 64,
    "experts_lo": 16,
    "experts_hi": 128,
    "ratio": 4.7,
    "source": "ELDR seed 000_310e4ae5e312ee1e, Fig. 2 / Q1: 16->128 active experts at batch 64 = 4.7x "
    "MoE-layer latency on one MI300X, Qwen3-30B-A3B; batch size at fixed experts nearly flat",
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name] if name in GPUS else GPUS[name.upper()]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}") from None


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(MODELS)}") from None


def calibrate_moe_overhead(
    model: ModelSpec | None = None,
    gpu: GpuSpec | None = None,
    ratio: float = SEED_FIG2["ratio"],
    experts_lo: int = SEED_FIG2["experts_lo"],
    experts_hi: int = SEED_FIG2["experts_hi"],
    batch: int = SEED_FIG2["batch"],
) -> float:
    """The per-MoE-layer fixed time `a` (s) that makes ``t(U=hi)/t(U=lo) = ratio`` at `batch` tokens.

    With ``t(U) = a + c + b·U`` (c: the expert compute of `batch` tokens, independent of U),
    ``a = ((hi − ratio·lo)·b − (ratio − 1)·c) / (ratio − 1)``. Defaults: the seed's MI300X / Qwen3 setup.
    """
    model = model or MODELS[SEED_FIG2["model"]]
    gpu = gpu or GPUS[SEED_FIG2["gpu"]]
    if ratio <= 1 or experts_hi <= experts_lo:
        raise ValueError("need ratio > 1 and experts_hi > experts_lo")
    b = model.expert_bytes / gpu.hbm_bytes_per_s
    c = batch * model.top_k * model.expert_flops_per_token / gpu.peak_flops
    a = ((experts_hi - ratio * experts_lo) * b - (ratio - 1) * c) / (ratio - 1)
    if a < 0:
        raise ValueError(f"ratio {ratio} is unreachable with a non-negative fixed cost (a = {a:.3g} s)")
    return a


#: `a`, solved once on the seed's setup; shared by every GPU and model preset.
MOE_LAYER_OVERHEAD_S: float = calibrate_moe_overhead()


@dataclass(frozen=True)
class CostModel:
    """Step-time functions for one engine: a model on `gpus` GPUs of one kind.

    With `gpus` > 1 the engine is tensor-parallel for dense weights and KV (split evenly) and
    expert-parallel for routed experts; each MoE layer waits for its slowest rank, so its time uses the
    largest per-rank distinct-expert count (pass per-rank counts to `moe_time`).

    Three cost terms bracket what the weight-read physics leaves out; all default to *off* (the figures of
    docs/results are the upper bound they give) and `switchyard report` sweeps them (docs/simulator.md):

    - `step_overhead_s`: fixed CPU time per forward step (scheduling, input preparation, sampling, launch)
      that does not overlap the GPU;
    - `a2a`: expert-parallel all-to-all per MoE layer, a dispatch (FP8, 1 byte per hidden element) and a
      combine (BF16, 2 bytes) of every (token, expert) pair at `a2a_bytes_per_s`, plus `a2a_latency_s` per
      transfer; DeepEP's published low-latency kernels (EP8, H800, RDMA) move 128 tokens × top-8 × 7168
      in 77 µs (dispatch) + 114 µs (combine), 22 MB in 191 µs, which 120 GB/s + 2 × 5 µs reproduces;
    - `hbm_efficiency`: the fraction of datasheet HBM bandwidth the kernels achieve (every HBM read).
    """

    model: ModelSpec
    gpu: GpuSpec
    gpus: int = 1
    moe_overhead_s: float = MOE_LAYER_OVERHEAD_S
    link_bytes_per_s: float = 400e9 / 8  # seed: 400 Gb/s NDR InfiniBand per GPU (ConnectX-7)
    gpu_memory_utilization: float = 0.9  # vLLM default
    block_size: int = 16  # vLLM default KV block size (tokens)
    step_overhead_s: float = 0.0
    a2a: bool = False
    a2a_bytes_per_s: float = 120e9  # DeepEP low-latency kernels, EP8 over RDMA (see above)
    a2a_latency_s: float = 5e-6  # per dispatch or combine: an assumption (launch + one RDMA round trip)
    hbm_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.step_overhead_s < 0 or self.a2a_bytes_per_s <= 0 or self.a2a_latency_s < 0:
            raise ValueError("step overhead and a2a latency must be >= 0, a2a bandwidth > 0")
        if not 0 < self.hbm_efficiency <= 1:
            raise ValueError(f"hbm_efficiency must lie in (0, 1], got {self.hbm_efficiency}")

    # -- constants of the linear model ---------------------------------------------------------------------

    @cached_property
    def b(self) -> float:
        """Seconds to stream one expert's weights from HBM."""
        return self.model.expert_bytes / (self.gpu.hbm_bytes_per_s * self.hbm_efficiency)

    @cached_property
    def expert_pair_flops_s(self) -> float:
        """Seconds of compute for one (token, expert) pair at peak."""
        return self.model.expert_flops_per_token / self.gpu.peak_flops

    @cached_property
    def dense_read_s(self) -> float:
        return self.model.dense_bytes / (self.gpus * self.gpu.hbm_bytes_per_s * self.hbm_efficiency)

    @cached_property
    def dense_flops_s_per_token(self) -> float:
        return 2.0 * self.model.dense_params / (self.gpus * self.gpu.peak_flops)

    @cached_property
    def kv_read_s_per_token(self) -> float:
        return self.model.kv_bytes_per_token_layer / (self.gpus * self.gpu.hbm_bytes_per_s * self.hbm_efficiency)

    @cached_property
    def a2a_fixed_s(self) -> float:
        """All-to-all seconds per step that do not scale with tokens: a dispatch and a combine per MoE layer."""
        return self.model.moe_layers * 2 * self.a2a_latency_s if self.a2a else 0.0

    @cached_property
    def a2a_s_per_token(self) -> float:
        """All-to-all seconds per token per step: top-k copies of the hidden state out (FP8) and back (BF16)."""
        if not self.a2a:
            return 0.0
        m = self.model
        return m.moe_layers * m.top_k * m.hidden * 3.0 / self.a2a_bytes_per_s

    def extra_time(self, tokens: int | float) -> float:
        """The bracketing terms of a step of `tokens` tokens: CPU overhead and all-to-all (0 when off)."""
        return self.step_overhead_s + self.a2a_fixed_s + tokens * self.a2a_s_per_token

    @cached_property
    def attn_flops_s_per_context(self) -> float:
        return self.model.attn_flops_per_context / (self.gpus * self.gpu.peak_flops)

    @cached_property
    def kv_capacity_blocks(self) -> int:
        """KV blocks that fit beside the weights, as vLLM sizes its cache (no activation reserve)."""
        free = self.gpus * self.gpu.hbm_bytes * self.gpu_memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB) does not fit on "
                f"{self.gpus} x {self.gpu.name}; raise gpus"
            )
        return int(free // (self.block_size * self.model.kv_bytes_per_token))

    # -- step times ----------------------------------------------------------------------------------------

    def moe_time(self, distinct: np.ndarray, tokens: int | np.ndarray) -> np.ndarray:
        """Per-MoE-layer time (s) of a step: ``a + b·U + tokens·top_k·expert FLOPs / peak``.

        `distinct` is `[..., L]` (distinct experts per layer, or the largest per-rank count with EP); the
        compute term splits evenly over the EP ranks.
        """
        u = np.asarray(distinct, dtype=np.float64)
        pairs = np.asarray(tokens, dtype=np.float64)[..., None] * self.model.top_k / self.gpus
        return self.moe_overhead_s + self.b * u + pairs * self.expert_pair_flops_s

    def kv_read_time(self, context_tokens: int | np.ndarray) -> np.ndarray | float:
        """HBM time to read the KV of `context_tokens` (summed over the batch's requests), all layers.

        Sliding-window layers read at most their window per request; pass `context_tokens` as the batch's
        per-request contexts to get that right (an array), or a sum to ignore it.
        """
        m = self.model
        ctx = np.asarray(context_tokens, dtype=np.float64)
        full = m.num_layers - m.sliding_layers
        tokens_layers = full * ctx.sum() + m.sliding_layers * np.minimum(ctx, m.sliding_window or 0).sum()
        return tokens_layers * self.kv_read_s_per_token

    def decode_time(
        self,
        distinct: np.ndarray,
        batch: int,
        context: np.ndarray | int,
        prefill_tokens: int = 0,
    ) -> float:
        """Seconds for one decode step of `batch` requests.

        `distinct`: `[L]` distinct experts per MoE layer (per-rank maximum with EP); `context`: the
        requests' context lengths (KV tokens read). `prefill_tokens` adds the compute of tokens recomputed
        in the same step (a request readmitted after preemption).
        """
        tokens = batch + prefill_tokens
        moe = float(self.moe_time(distinct, tokens).sum())
        dense = self.dense_read_s + tokens * self.dense_flops_s_per_token
        ctx = np.asarray(context)
        attn = float(self.kv_read_time(ctx)) + float(ctx.sum()) * self.attn_flops_s_per_context
        if prefill_tokens:
            attn += 0.5 * prefill_tokens * prefill_tokens * self.attn_flops_s_per_context
        return moe + dense + attn + self.extra_time(tokens)

    @cached_property
    def _decode_consts(self) -> tuple[float, float, float, float]:
        """(fixed s, s per distinct expert-layer, s per batch token, s per context token) of a decode step."""
        m = self.model
        fixed = m.moe_layers * self.moe_overhead_s + self.dense_read_s + self.step_overhead_s + self.a2a_fixed_s
        per_token = (
            m.moe_layers * m.top_k / self.gpus * self.expert_pair_flops_s
            + self.dense_flops_s_per_token
            + self.a2a_s_per_token
        )
        per_ctx = m.num_layers * self.kv_read_s_per_token + self.attn_flops_s_per_context
        return fixed, self.b, per_token, per_ctx

    def decode_time_total(
        self, distinct_sum: int, batch: int, context: int | np.ndarray, prefill_tokens: int = 0
    ) -> float:
        """`decode_time` from ``Σ_layers U`` (the linear model needs only the sum): the step loop's fast path.

        `context`: total context tokens, or the per-request contexts when the model has sliding-window
        layers (their KV read is capped at the window).
        """
        fixed, b, per_token, per_ctx = self._decode_consts
        tokens = batch + prefill_tokens
        if isinstance(context, np.ndarray):
            t_ctx = float(self.kv_read_time(context)) + float(context.sum()) * self.attn_flops_s_per_context
        else:
            t_ctx = context * per_ctx
        t = fixed + b * distinct_sum + tokens * per_token + t_ctx
        if prefill_tokens:
            t += 0.5 * prefill_tokens * prefill_tokens * self.attn_flops_s_per_context
        return t

    def prefill_time(self, distinct: np.ndarray, tokens: int, attn_pairs: float) -> float:
        """Seconds for one prefill step processing `tokens` prompt tokens.

        `distinct`: `[L]` distinct experts the step's tokens select; `attn_pairs`: the number of
        (query, key) token pairs the step's attention computes (a fresh prompt of n tokens: n(n+1)/2).
        Weight reads and compute are summed, not overlapped (an upper bound; decode is memory bound either way).
        """
        moe = float(self.moe_time(distinct, tokens).sum())
        dense = self.dense_read_s + tokens * self.dense_flops_s_per_token
        return moe + dense + attn_pairs * self.attn_flops_s_per_context + self.extra_time(tokens)

    def kv_transfer_time(self, prompt_tokens: int | np.ndarray) -> np.ndarray | float:
        """Seconds to move a prompt's KV cache from the prefill to the decode engine over the link.

        The engine's GPUs each send their shard over their own NIC, so bandwidth scales with `gpus`.
        """
        return np.asarray(prompt_tokens) * self.model.kv_bytes_per_token / (self.gpus * self.link_bytes_per_s)


def cost_model(
    model: str | ModelSpec = "qwen3-30b-a3b", gpu: str | GpuSpec = "H100", gpus: int | None = None, **kw: object
) -> CostModel:
    """A `CostModel` from preset names; `gpus` defaults to the model's `default_gpus`."""
    m = get_model(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    return CostModel(model=m, gpu=g, gpus=gpus or m.default_gpus, **kw)  # type: ignore[arg-type]
