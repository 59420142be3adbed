"""A data-parallel (DP) MoE engine that prefills and decodes on the same GPUs, as vLLM V1 schedules it.

Each step serves the running requests first, in admission order: a decoding request needs one token, a
request still prefilling needs the rest of its prompt, and all of them share a token budget
(`max_num_batched_tokens`), so a long prompt is chunked over several steps. If the budget is left and no
request was preempted, waiting requests are admitted in the order of the engine's queue policy — FCFS (vLLM's
default) or Gimbal's shortest-prefill-first with aging (`solver.routing.dispatch.queue_order`) — while a slot
(`max_num_seqs`) and KV blocks for their first chunk are free. KV blocks are allocated per chunk (vLLM's
`allocate_slots`); when the running requests' next tokens do not fit, the most recently admitted request is
preempted: its blocks are freed, it goes to the front of the queue and recomputes prompt and generated tokens
when readmitted. The step that computes a request's last missing token samples its next one (its first
token, at the end of its prefill).

Costs come from `physics.CostModel` through `DPCost`: the dense part and attention run on the engine's own
`tp` GPUs; routed experts are spread over `ep_ranks` GPUs, which are the engine's own (an independent engine)
or the whole fleet's (vLLM's DP+EP, where every DP engine's MoE layers run in lock-step and the fleet
combines their tokens; see `dp_fleet`). A step's MoE time uses the distinct experts its tokens select on the
busiest EP rank: decode tokens replay real routing-trace tokens, a prefill chunk loads the union of its
trace request's prefill experts, as the xPyD simulator does.

The engine also keeps what Gimbal's dispatcher reads from its telemetry: KV usage, prefill tokens still to
compute for running requests, prefill tokens of waiting requests, and expert pressure — the busiest EP
rank's share of the tokens' expert selections over the mean rank's, averaged over MoE layers, over the
window since the last report (1 = balanced; the live simulated engine's definition).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

from switchyard.engine_agents.sim.core.experts import ReplayBank, rank_masks
from switchyard.engine_agents.sim.core.physics import CostModel
from switchyard.solver.routing.dispatch import GimbalParams, queue_order

__all__ = ["ORDERS", "DPCost", "ExpertLoadTables", "MixedEngine", "MixedStep", "MixedStepOutput", "QueueOrder"]

QueueOrder = Literal["fcfs", "sjf-aging"]
ORDERS: tuple[QueueOrder, ...] = ("fcfs", "sjf-aging")


def _ceil_div(a: np.ndarray | int, b: int) -> np.ndarray | int:
    return -(-a // b)


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


@dataclass(slots=True)
class MixedStepOutput:
    first: list[int]  # requests whose first output token this step sampled
    finished: list[int]  # requests done (they left the engine)
    finished_tokens: list[int]  # tokens each finished request generated
    prefill_tokens: int


class _Queue:
    """An engine's waiting requests as numpy columns; service order by FCFS position or Gimbal's SJF-aging."""

    _INT = ("rid", "replay", "prompt", "output", "gen")

    def __init__(self) -> None:
        cap = 64
        self.size = 0
        self.cols: dict[str, np.ndarray] = {name: np.zeros(cap, np.int64) for name in self._INT}
        self.arrival = np.zeros(cap)
        self.pos = np.zeros(cap)  # FCFS position: arrivals count up, requeued (preempted) requests go in front
        self._back = 0
        self._front = 0
        self.tokens = 0  # Σ tokens to compute (prompt + generated) over the queue

    def push(self, rid: int, replay: int, prompt: int, output: int, gen: int, arrival: float, front: bool) -> None:
        if self.size == len(self.arrival):
            grow = len(self.arrival)
            for name in self._INT:
                self.cols[name] = np.concatenate([self.cols[name], np.zeros(grow, np.int64)])
            self.arrival = np.concatenate([self.arrival, np.zeros(grow)])
            self.pos = np.concatenate([self.pos, np.zeros(grow)])
        i = self.size
        for name, value in zip(self._INT, (rid, replay, prompt, output, gen), strict=True):
            self.cols[name][i] = value
        self.arrival[i] = arrival
        if front:
            self._front += 1
            self.pos[i] = -self._front
        else:
            self._back += 1
            self.pos[i] = self._back
        self.size += 1
        self.tokens += prompt + gen

    def work(self) -> np.ndarray:
        """Tokens each waiting request must compute before it samples again (its prefill job size)."""
        return self.cols["prompt"][: self.size] + self.cols["gen"][: self.size]

    def service_order(self, now: float, order: QueueOrder, params: GimbalParams) -> np.ndarray:
        """Storage indices in the order the scheduler considers them."""
        idx = np.argsort(self.pos[: self.size], kind="stable")
        if order == "fcfs":
            return idx
        waited = now - self.arrival[: self.size][idx]
        return idx[queue_order(self.work()[idx], waited, params)]

    def remove(self, indices: list[int]) -> None:
        keep = np.ones(self.size, dtype=bool)
        keep[indices] = False
        self.tokens -= int(self.work()[~keep].sum())
        n = int(keep.sum())
        for name in self._INT:
            self.cols[name][:n] = self.cols[name][: self.size][keep]
        self.arrival[:n] = self.arrival[: self.size][keep]
        self.pos[:n] = self.pos[: self.size][keep]
        self.size = n

    def ids(self) -> list[int]:
        return self.cols["rid"][: self.size].tolist()


@dataclass
class _Slots:
    """Running requests as columns (slot i ↔ index i; the last slot moves into a freed one)."""

    cap: int
    rid: np.ndarray = field(init=False)
    replay: np.ndarray = field(init=False)
    prompt: np.ndarray = field(init=False)
    output: np.ndarray = field(init=False)
    gen: np.ndarray = field(init=False)  # tokens generated
    computed: np.ndarray = field(init=False)  # tokens whose KV is in the cache
    blocks: np.ndarray = field(init=False)  # KV blocks held
    order: np.ndarray = field(init=False)  # admission counter: vLLM's running-list order
    take: np.ndarray = field(init=False)  # tokens scheduled this step
    arrival: np.ndarray = field(init=False)

    NAMES = ("rid", "replay", "prompt", "output", "gen", "computed", "blocks", "order", "take")

    def __post_init__(self) -> None:
        for name in self.NAMES:
            setattr(self, name, np.zeros(self.cap, np.int64))
        self.arrival = np.zeros(self.cap)


class MixedEngine:
    """One DP engine: continuous batching with chunked prefill over a paged KV cache (see the module docstring).

    Two-phase like `engine.DecodeEngine`: ``plan = begin_step(now)`` schedules a step (None when idle), the
    owner waits ``plan.duration`` (or the lock-step duration), then ``end_step(duration)`` emits its tokens.
    Requests added in between wait for the next step.
    """

    def __init__(
        self,
        cost: DPCost,
        bank: ReplayBank,
        *,
        max_running: int = 1024,
        token_budget: int = 8192,
        kv_blocks: int | None = None,
        order: QueueOrder = "fcfs",
        params: GimbalParams | None = None,
        load_tables: ExpertLoadTables | None = None,
    ) -> None:
        if max_running <= 0 or token_budget <= 0:
            raise ValueError("max_running and token_budget must be positive")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.cost = cost
        self.bank = bank
        self.block_size = cost.cost.block_size
        self.kv_blocks = int(kv_blocks if kv_blocks is not None else cost.kv_capacity_blocks)
        self.max_running = max_running
        self.token_budget = token_budget
        self.order: QueueOrder = order
        self.params = params or GimbalParams()
        self.load_tables = load_tables
        self._bits = bank.decode_bits
        self._s = _Slots(max_running)
        self._n = 0
        self._admit_counter = 0
        self._used = 0
        self.queue = _Queue()
        self._busy = False
        self._step_prefill = 0
        self._pending_duration = 0.0
        self._load = np.zeros((cost.cost.model.moe_layers, cost.ep_ranks))
        # counters
        self.steps = 0
        self.tokens_out = 0
        self.prompt_tokens = 0  # prefill (and recompute) tokens computed
        self.preemptions = 0
        self.busy_time = 0.0
        self.max_used_blocks = 0
        self.aged_admissions = 0  # admitted after waiting longer than the aging threshold

    # -- state visible to dispatchers and tests ----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self._n

    @property
    def num_waiting(self) -> int:
        return self.queue.size

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def kv_usage(self) -> float:
        return self._used / self.kv_blocks

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def waiting_prefill_tokens(self) -> int:
        return self.queue.tokens

    @property
    def remaining_prefill_tokens(self) -> int:
        """Tokens running requests must still compute before they decode (prompt chunks, recomputation)."""
        s, n = self._s, self._n
        need = s.prompt[:n] + s.gen[:n] - s.computed[:n]
        prefilling = (need > 1) | (s.gen[:n] == 0)
        return int(need[prefilling].sum())

    def running_ids(self) -> list[int]:
        return self._s.rid[: self._n].tolist()

    def waiting_ids(self) -> list[int]:
        return self.queue.ids()

    def has_work(self) -> bool:
        return self._n > 0 or self.queue.size > 0

    def blocks_held(self) -> int:
        """Recount of blocks from the running requests' KV tokens (tests compare it with `used_blocks`)."""
        s, n = self._s, self._n
        return int(_ceil_div(s.computed[:n] + s.take[:n], self.block_size).sum())

    def take_expert_pressure(self) -> float:
        """Busiest EP rank's expert load over the mean rank's, mean over layers, since the last call (1 if idle)."""
        load, self._load = self._load, np.zeros_like(self._load)
        mean = load.mean(axis=1)
        busy = mean > 0
        return float((load.max(axis=1)[busy] / mean[busy]).mean()) if busy.any() else 1.0

    # -- requests in -------------------------------------------------------------------------------------

    def add(self, rid: int, replay: int, prompt_tokens: int, output_tokens: int, arrival: float) -> None:
        """Queue a new request (its prompt must be prefilled here); it generates `output_tokens` (≥ 1) tokens."""
        if output_tokens < 1 or prompt_tokens < 1:
            raise ValueError("a request has at least one prompt token and generates at least one token")
        if _ceil_div(prompt_tokens + output_tokens, self.block_size) > self.kv_blocks:
            raise ValueError(
                f"request {rid} needs {prompt_tokens + output_tokens} KV tokens; the engine holds "
                f"{self.kv_blocks * self.block_size}"
            )
        self.queue.push(rid, replay, prompt_tokens, output_tokens, 0, arrival, front=False)

    # -- one step ----------------------------------------------------------------------------------------

    def begin_step(self, now: float) -> MixedStep | None:
        """Schedule running requests, then admit waiting ones; None when there is nothing to run."""
        if self._busy:
            raise RuntimeError("begin_step called twice without end_step")
        preempted = self._schedule_running()
        budget = self.token_budget - int(self._s.take[: self._n].sum())
        admitted = [] if preempted else self._admit(now, budget)
        s, n = self._s, self._n
        take = s.take[:n]
        sched = take > 0
        if not sched.any():
            return None
        need = s.prompt[:n] + s.gen[:n] - s.computed[:n]
        decoding = sched & (need == 1) & (s.gen[:n] >= 1)
        prefilling = sched & ~decoding
        dec_replay = s.replay[:n][decoding]
        rows = self.bank.decode_start[dec_replay] + s.gen[:n][decoding] % self.bank.decode_len[dec_replay]
        pre_rows = s.replay[:n][prefilling]
        union = np.zeros(self._bits.shape[1:], dtype=np.uint64)
        if len(rows):
            union |= np.bitwise_or.reduce(self._bits[rows], axis=0)
        if len(pre_rows):
            union |= np.bitwise_or.reduce(self.bank.prefill_bits[pre_rows], axis=0)
        chunk = take[prefilling].astype(np.float64)
        done = s.computed[:n][prefilling].astype(np.float64)
        ctx = s.computed[:n][sched]
        pairs = float(s.computed[:n][decoding].sum()) + float((chunk * done + chunk * (chunk + 1) / 2).sum())
        tokens = int(take.sum())
        nonmoe = self.cost.nonmoe_time(tokens, ctx, pairs)
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
        )

    def end_step(self, duration: float | None = None) -> MixedStepOutput:
        """Computed tokens enter the KV cache; requests that caught up sample a token; finished ones leave."""
        if not self._busy:
            raise RuntimeError("end_step without begin_step")
        self._busy = False
        self.busy_time += self._pending_duration if duration is None else duration
        self.steps += 1
        s, n = self._s, self._n
        s.computed[:n] += s.take[:n]
        emit = (s.take[:n] > 0) & (s.computed[:n] == s.prompt[:n] + s.gen[:n])
        s.take[:n] = 0
        s.gen[:n] += emit
        self.tokens_out += int(emit.sum())
        self.prompt_tokens += self._step_prefill
        first = s.rid[:n][emit & (s.gen[:n] == 1)].tolist()
        done_slots = np.flatnonzero(emit & (s.gen[:n] >= s.output[:n]))
        finished = s.rid[done_slots].tolist()
        tokens = s.gen[done_slots].tolist()
        for slot in sorted(done_slots.tolist(), reverse=True):  # high slots first: moves never touch a done one
            self._used -= int(s.blocks[slot])
            self._free_slot(slot)
        return MixedStepOutput(first, finished, tokens, self._step_prefill)

    # -- internals ---------------------------------------------------------------------------------------

    def _free_slot(self, slot: int) -> None:
        last = self._n - 1
        s = self._s
        if slot != last:
            for name in _Slots.NAMES:
                col = getattr(s, name)
                col[slot] = col[last]
            s.arrival[slot] = s.arrival[last]
        self._n = last

    def _schedule_running(self) -> list[int]:
        """Tokens per running request under the budget, in admission order; preempt the newest while KV is short."""
        preempted: list[int] = []
        s, bs = self._s, self.block_size
        while self._n:
            n = self._n
            by_age = np.argsort(s.order[:n], kind="stable")
            need = (s.prompt[:n] + s.gen[:n] - s.computed[:n])[by_age]
            before = np.cumsum(need) - need
            take = np.empty(n, np.int64)
            take[by_age] = np.clip(self.token_budget - before, 0, need)
            grow = _ceil_div(s.computed[:n] + take, bs) - s.blocks[:n]
            if int(grow.sum()) <= self.kv_blocks - self._used:
                s.take[:n] = take
                s.blocks[:n] += grow
                self._used += int(grow.sum())
                return preempted
            victim = int(by_age[-1])
            self._used -= int(s.blocks[victim])
            self.queue.push(
                int(s.rid[victim]),
                int(s.replay[victim]),
                int(s.prompt[victim]),
                int(s.output[victim]),
                int(s.gen[victim]),
                float(s.arrival[victim]),
                front=True,
            )
            preempted.append(int(s.rid[victim]))
            self.preemptions += 1
            self._free_slot(victim)
        return preempted

    def _admit(self, now: float, budget: int) -> list[int]:
        """Admit waiting requests in queue-policy order while slots, budget and KV blocks for a first chunk last."""
        q = self.queue
        if not q.size or self._n >= self.max_running or budget <= 0:
            return []
        s, bs = self._s, self.block_size
        admitted: list[int] = []
        taken: list[int] = []
        cols = q.cols
        for qi in q.service_order(now, self.order, self.params).tolist():
            if self._n >= self.max_running or budget <= 0:
                break
            work = int(cols["prompt"][qi] + cols["gen"][qi])
            take = min(work, budget)
            blocks = int(_ceil_div(take, bs))
            if blocks > self.kv_blocks - self._used:
                break
            i = self._n
            for name in ("rid", "replay", "prompt", "output", "gen"):
                getattr(s, name)[i] = cols[name][qi]
            s.computed[i] = 0
            s.blocks[i] = blocks
            s.take[i] = take
            s.order[i] = self._admit_counter
            s.arrival[i] = q.arrival[qi]
            self._admit_counter += 1
            self._used += blocks
            self._n += 1
            budget -= take
            if now - q.arrival[qi] > self.params.age_threshold_s:
                self.aged_admissions += 1
            admitted.append(int(cols["rid"][qi]))
            taken.append(qi)
        if taken:
            q.remove(taken)
        return admitted
