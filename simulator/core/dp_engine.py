"""A data-parallel (DP) MoE engine that prefills and decodes on the same GPUs, as vLLM V1 schedules it.

The scheduling is the core's (`scheduler.Scheduler`): running requests first, in admission order, sharing the
token budget (`max_num_batched_tokens`), so a long prompt is chunked over several steps; KV blocks allocated per
chunk, the newest request preempted when they run short; waiting requests admitted in the queue-order hook's
order — FCFS (vLLM's default) or Gimbal's shortest-prefill-first with aging — while a slot, the budget and KV
blocks for their first chunk last. This module prices the batch that forms.

Costs come from `physics.CostModel` through `DPCost`: the dense part and attention run on the engine's own
`tp` GPUs; routed experts are spread over `ep_ranks` GPUs, which are the engine's own (an independent engine)
or the whole fleet's (vLLM's DP+EP, where every DP engine's MoE layers run in lock-step and the fleet
combines their tokens; see `offline.dp`). A step's MoE time uses the distinct experts its tokens select on the
busiest EP rank: decode tokens replay real routing-trace tokens, a prefill chunk loads the union of its
trace request's prefill experts, as the xPyD simulator does.

The engine also keeps what Gimbal's dispatcher reads from its telemetry: KV usage, prefill tokens still to
compute for running requests, prefill tokens of waiting requests, and expert pressure — the busiest EP
rank's share of the tokens' expert selections over the mean rank's, averaged over MoE layers, over the
window since the last report (1 = balanced; the live simulated engine's definition).

A CPU prefix tier (`prefix_cpu_tokens`, `prefix_cache.PrefixCache`): a prompt's blocks loaded back from host
memory are not recomputed; their copy costs their KV bytes over each GPU's host link (`offload_bytes_per_s`,
default `OFFLOAD_BYTES_PER_S`: PCIe Gen5 x16's 64 GB/s at ~80 %), added to the dense part of the step that
admits them (synchronous: pessimistic for vLLM's connector, whose loads delay only their own request).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from switchyard.simulator.core.defaults import DP_MAX_RUNNING, TOKEN_BUDGET
from switchyard.simulator.core.experts import ReplayBank, rank_masks
from switchyard.simulator.core.physics import CostModel
from switchyard.simulator.core.scheduler import ORDERS, QueueOrder, Scheduler
from switchyard.solver.routing.dispatch import GimbalParams

#: Host-to-GPU copy rate of one GPU's link for CPU-tier KV loads (bytes/s): PCIe Gen5 x16, ~80 % of 64 GB/s.
OFFLOAD_BYTES_PER_S = 50e9

__all__ = [
    "OFFLOAD_BYTES_PER_S",
    "ORDERS",
    "DPCost",
    "ExpertLoadTables",
    "MixedEngine",
    "MixedStep",
    "MixedStepOutput",
    "QueueOrder",
]


@dataclass(frozen=True)
class DPCost:
    """Step costs of one DP engine: dense and attention on its `tp` GPUs, experts spread over `ep_ranks` GPUs.

    `cost` is the model on one engine's GPUs (`cost.gpus` = tp). With MLA (DeepSeek) the latent KV cache
    cannot be split by heads, so every TP rank holds and reads all of it (vLLM replicates it); GQA KV is
    split over the TP ranks. Expert weights are split evenly over the EP ranks; the KV cache gets what the
    weights leave of `gpu_memory_utilization` on each GPU, as vLLM sizes it.
    """

    cost: CostModel
    ep_ranks: int

    def __post_init__(self) -> None:
        if self.ep_ranks < 1 or self.ep_ranks % self.cost.gpus:
            raise ValueError(f"ep_ranks ({self.ep_ranks}) must be a positive multiple of tp ({self.cost.gpus})")

    @property
    def tp(self) -> int:
        return self.cost.gpus

    @property
    def model_layers(self) -> int:
        return self.cost.model.moe_layers

    @cached_property
    def kv_shards(self) -> int:
        """TP ranks the KV cache is split over (1 with MLA: replicated)."""
        return 1 if self.cost.model.kv_lora_rank else self.tp

    @cached_property
    def kv_capacity_blocks(self) -> int:
        m, g = self.cost.model, self.cost.gpu
        experts = m.moe_layers * m.num_experts * m.expert_bytes
        per_gpu_weights = (m.weight_bytes - experts) / self.tp + experts / self.ep_ranks
        free = g.hbm_bytes * self.cost.gpu_memory_utilization - per_gpu_weights
        per_token = m.kv_bytes_per_token / self.kv_shards
        if free <= 0:
            raise ValueError(f"{m.name} does not fit: {per_gpu_weights / 1e9:.1f} GB of weights per {g.name}")
        return int(free // (self.cost.block_size * per_token))

    @cached_property
    def rank_masks(self) -> np.ndarray:
        """[G, L, W] experts on each EP rank: vLLM's default contiguous layout (no EPLB)."""
        m = self.cost.model
        return rank_masks(m.moe_layers, m.num_experts, self.ep_ranks)

    def nonmoe_time(self, tokens: int, kv_context: np.ndarray, attn_pairs: float) -> float:
        """Dense weights and FLOPs of `tokens`, KV reads of `kv_context` (per request), attention FLOPs (s)."""
        c, m = self.cost, self.cost.model
        ctx = np.asarray(kv_context, dtype=np.float64)
        full = m.num_layers - m.sliding_layers
        token_layers = full * ctx.sum()
        if m.sliding_layers:
            token_layers += m.sliding_layers * np.minimum(ctx, m.sliding_window).sum()
        kv_read = token_layers * m.kv_bytes_per_token_layer / (self.kv_shards * c.gpu.hbm_bytes_per_s)
        return c.dense_read_s + tokens * c.dense_flops_s_per_token + kv_read + attn_pairs * c.attn_flops_s_per_context

    def distinct_max(self, union: np.ndarray) -> np.ndarray:
        """[L, W] union of a step's expert bitsets → [L] distinct experts on the busiest EP rank."""
        per_rank = np.bitwise_count(union[None] & self.rank_masks).sum(axis=-1, dtype=np.int64)
        return per_rank.max(axis=0)

    def moe_time(self, union: np.ndarray, tokens: int) -> float:
        """MoE layers of a step: ``Σ_ℓ a + b·U_ℓ + tokens·k/G·expert FLOPs`` (U: busiest rank's distinct experts)."""
        c, m = self.cost, self.cost.model
        u = float(self.distinct_max(union).sum())
        pair_s = tokens * m.top_k / self.ep_ranks * c.expert_pair_flops_s
        return m.moe_layers * (c.moe_overhead_s + pair_s) + c.b * u


@dataclass(frozen=True)
class ExpertLoadTables:
    """Per-token expert load on each EP rank, for the engines' expert-pressure figure.

    - `decode[T, L, G]`: how many of decode token t's top-k experts live on rank g at layer ℓ.
    - `prefill[R, L, G]`: the same per prefill token of bank request r, averaged over its prefill tokens
      (from the trace's prefill expert counts when given, else spread evenly over its prefill union).
    """

    decode: np.ndarray
    prefill: np.ndarray

    @classmethod
    def build(cls, bank: ReplayBank, masks: np.ndarray, prefill_counts: np.ndarray | None = None) -> ExpertLoadTables:
        decode = np.bitwise_count(bank.decode_bits[:, None] & masks[None]).sum(axis=-1, dtype=np.int64)
        decode = decode.transpose(0, 2, 1).astype(np.float32)  # [T, L, G]
        if prefill_counts is not None:
            ranks = masks.shape[0]
            num_experts = prefill_counts.shape[2]
            owner = (np.arange(num_experts) * ranks) // num_experts  # contiguous layout, as `DPCost.rank_masks`
            per_rank = np.zeros((*prefill_counts.shape[:2], ranks), dtype=np.float64)
            for g in range(ranks):
                per_rank[..., g] = prefill_counts[..., owner == g].sum(axis=-1)
            tokens = np.maximum(bank.prefill_len, 1).astype(np.float64)[:, None, None]
            prefill = (per_rank / tokens).astype(np.float32)
        else:
            union = np.bitwise_count(bank.prefill_bits[:, None] & masks[None]).sum(axis=-1).transpose(0, 2, 1)
            total = np.maximum(union.sum(axis=-1, keepdims=True), 1)
            prefill = (union / total * (decode.sum(axis=-1).mean() if len(decode) else 1.0)).astype(np.float32)
        return cls(decode=decode, prefill=prefill)


@dataclass(slots=True)
class MixedStep:
    """What `MixedEngine.begin_step` scheduled."""

    duration: float  # on its own (experts over the engine's own EP ranks); a lock-step fleet recomputes it
    nonmoe_s: float  # dense + attention part (the part a lock-step fleet takes the maximum of)
    tokens: int  # tokens computed: decode tokens + prefill chunk tokens
    decode: int  # requests decoding one token
    prefill_tokens: int  # prompt (or recomputed) tokens computed
    union: np.ndarray  # [L, W] expert bitsets the step's tokens select
    admitted: list[int]
    preempted: list[int]
    decode_rows: np.ndarray  # [B] bank decode rows of the decoding requests' tokens (their real selections)
    prefill_rows: np.ndarray  # [C] bank rows of the requests computing a prompt chunk
    prefill_chunk: np.ndarray  # [C] each chunk's tokens


@dataclass(slots=True)
class MixedStepOutput:
    first: list[int]  # requests whose first output token this step sampled
    finished: list[int]  # requests done (they left the engine)
    finished_tokens: list[int]  # tokens each finished request generated
    prefill_tokens: int


class MixedEngine(Scheduler):
    """One DP engine: continuous batching with chunked prefill over a paged KV cache (see the module docstring).

    Two-phase like `xpyd_engines.DecodeEngine`: ``plan = begin_step(now)`` schedules a step (None when idle), the
    owner waits ``plan.duration`` (or the lock-step duration), then ``end_step(duration)`` emits its tokens.
    Requests added in between wait for the next step.
    """

    def __init__(
        self,
        cost: DPCost,
        bank: ReplayBank,
        *,
        max_running: int = DP_MAX_RUNNING,
        token_budget: int = TOKEN_BUDGET,
        kv_blocks: int | None = None,
        order: QueueOrder = "fcfs",
        params: GimbalParams | None = None,
        load_tables: ExpertLoadTables | None = None,
        prefix_block: int | None = None,
        prefix_cpu_tokens: int = 0,
        offload_bytes_per_s: float = OFFLOAD_BYTES_PER_S,
    ) -> None:
        super().__init__(
            bank,
            cost.cost.block_size,
            kv_blocks if kv_blocks is not None else cost.kv_capacity_blocks,
            max_running,
            token_budget,
            lookahead=0,
            order=order,
            params=params,
            prefix_block=prefix_block,
            prefix_cpu_tokens=prefix_cpu_tokens,
        )
        self.cost = cost
        #: Seconds to copy one token's KV back from the CPU tier (every KV shard over its own GPU's link).
        self.load_s_per_token = cost.cost.model.kv_bytes_per_token / (cost.kv_shards * offload_bytes_per_s)
        self.load_tables = load_tables
        self._bits = bank.decode_bits
        self._busy = False
        self._step_prefill = 0
        self._pending_duration = 0.0
        self._load = np.zeros((cost.cost.model.moe_layers, cost.ep_ranks))
        self.own_ranks: slice | None = None  # the EP ranks on this engine's GPUs (`take_expert_pressure`)
        # counters
        self.steps = 0
        self.tokens_out = 0
        self.prompt_tokens = 0  # prefill (and recompute) tokens computed
        self.busy_time = 0.0
        self.max_used_blocks = 0

    # -- state visible to dispatchers and tests ----------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def waiting_prefill_tokens(self) -> int:
        return self.queue.tokens

    @property
    def remaining_prefill_tokens(self) -> int:
        """Tokens running requests must still compute before they decode (prompt chunks, recomputation)."""
        n = self._n
        need = self._prompt[:n] + self._gen[:n] - self._computed[:n]
        prefilling = (need > 1) | (self._gen[:n] == 0)
        return int(need[prefilling].sum())

    def running_ids(self) -> list[int]:
        return self._rid[: self._n].tolist()

    def blocks_held(self) -> int:
        """Recount of blocks from the running requests' KV tokens (tests compare it with `used_blocks`)."""
        return self._held(self._busy)

    def take_expert_pressure(self) -> float:
        """Busiest EP rank's expert load over the mean rank's, mean over layers, since the last call (1 if idle).

        With `own_ranks` set (a fleet that places experts, `offline.dp_ep`), the busiest of the engine's *own*
        GPUs: the window then holds the whole fleet's load per rank, and the engine reports how hot the experts
        its GPUs host are, the backend pressure Gimbal's dispatcher reads to keep work off hot GPUs."""
        load, self._load = self._load, np.zeros_like(self._load)
        mean = load.mean(axis=1)
        busy = mean > 0
        top = load.max(axis=1) if self.own_ranks is None else load[:, self.own_ranks].max(axis=1)
        return float((top[busy] / mean[busy]).mean()) if busy.any() else 1.0

    def add_expert_load(self, load: np.ndarray) -> None:
        """Add one step's `[L, G]` expert load per EP rank to the pressure window (a fleet that places experts
        itself, `offline.dp_ep`, computes it under the layout in force instead of `load_tables`)."""
        self._load += load

    # -- requests in -------------------------------------------------------------------------------------

    def add(
        self,
        rid: int,
        replay: int,
        prompt_tokens: int,
        output_tokens: int,
        arrival: float,
        keys: tuple[int, ...] | None = None,
    ) -> None:
        """Queue a new request (its prompt must be prefilled here); it generates `output_tokens` (≥ 1) tokens.

        `keys`: its prompt's prefix-cache keys (`prefix_cache.prefix_keys`), used when the engine caches prefixes.
        """
        self._enqueue(rid, replay, prompt_tokens, output_tokens, arrival, prefilled=False, keys=keys)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache over prompt tokens looked up (0 without caching)."""
        q = self.prefix_query_tokens
        return self.prefix_hit_tokens / q if q else 0.0

    # -- one step ----------------------------------------------------------------------------------------

    def begin_step(self, now: float) -> MixedStep | None:
        """Schedule running requests, then admit waiting ones; None when there is nothing to run."""
        if self._busy:
            raise RuntimeError("begin_step called twice without end_step")
        preempted, admitted, _ = self._schedule(now)
        n = self._n
        take = self._take[:n]
        sched = take > 0
        if not sched.any():
            return None
        need = self._prompt[:n] + self._gen[:n] - self._computed[:n]
        decoding = sched & (need == 1) & (self._gen[:n] >= 1)
        prefilling = sched & ~decoding
        dec_replay = self._replay[:n][decoding]
        rows = self.bank.decode_start[dec_replay] + self._gen[:n][decoding] % self.bank.decode_len[dec_replay]
        pre_rows = self._replay[:n][prefilling]
        union = np.zeros(self._bits.shape[1:], dtype=np.uint64)
        if len(rows):
            union |= np.bitwise_or.reduce(self._bits[rows], axis=0)
        if len(pre_rows):
            union |= np.bitwise_or.reduce(self.bank.prefill_bits[pre_rows], axis=0)
        chunk = take[prefilling].astype(np.float64)
        done = self._computed[:n][prefilling].astype(np.float64)
        ctx = self._computed[:n][sched]
        pairs = float(self._computed[:n][decoding].sum()) + float((chunk * done + chunk * (chunk + 1) / 2).sum())
        tokens = int(take.sum())
        nonmoe = self.cost.nonmoe_time(tokens, ctx, pairs)
        if self.loaded_tokens:  # CPU-tier blocks admitted this step: their copy back (see the module docstring)
            nonmoe += self.loaded_tokens * self.load_s_per_token
            self.loaded_tokens = 0
        duration = nonmoe + self.cost.moe_time(union, tokens)
        if self.load_tables is not None:
            if len(rows):
                self._load += self.load_tables.decode[rows].sum(axis=0)
            if len(pre_rows):
                self._load += np.einsum("r,rlg->lg", chunk, self.load_tables.prefill[pre_rows])
        self._step_prefill = int(chunk.sum())
        self._pending_duration = duration
        self._busy = True
        self.max_used_blocks = max(self.max_used_blocks, self._used)
        return MixedStep(
            duration=duration,
            nonmoe_s=nonmoe,
            tokens=tokens,
            decode=int(decoding.sum()),
            prefill_tokens=self._step_prefill,
            union=union,
            admitted=admitted,
            preempted=preempted,
            decode_rows=rows,
            prefill_rows=pre_rows,
            prefill_chunk=chunk,
        )

    def end_step(self, duration: float | None = None) -> MixedStepOutput:
        """Computed tokens enter the KV cache; requests that caught up sample a token; finished ones leave."""
        if not self._busy:
            raise RuntimeError("end_step without begin_step")
        self._busy = False
        self.busy_time += self._pending_duration if duration is None else duration
        self.steps += 1
        first, finished, tokens = self._complete()
        self.tokens_out += self._emitted
        self.prompt_tokens += self._step_prefill
        return MixedStepOutput(first, finished, tokens, self._step_prefill)
