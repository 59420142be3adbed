"""Simulated MoE engines with continuous batching, stepped by whoever owns the clock.

Each engine runs a step in two phases so the same object serves the discrete-event simulator and a live
simulated fleet running in (scaled) real time:

    plan = engine.begin_step()        # schedule the batch, return its duration (s); None when idle
    ...  wait plan.duration (simulated or real) ...
    out = engine.end_step()           # emit the step's tokens, finish and free requests

Requests added between the two calls wait for the next step, as in vLLM, whose scheduler forms a batch at
the start of a step.

`DecodeEngine` follows vLLM V1's scheduler: running requests are served first, each needing KV slots for
one more token; when the free KV blocks do not cover them, the most recently admitted request is
preempted (its blocks freed; it goes back to the head of the waiting queue and recomputes its context when
readmitted, keeping the tokens it has generated); waiting requests are admitted first-come first-served
while there are free slots (`max_running`) and KV blocks for their context, and not in a step that
preempted. The step's cost comes from `physics.CostModel` with the distinct experts the batch's current
decode tokens select, taken from a `ReplayBank` (real routing traces).

`PrefillEngine` serves prompts first-come first-served with chunked prefill: each step processes up to
`token_budget` prompt tokens (vLLM's `max_num_batched_tokens`), continuing a partly done prompt first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from switchyard.engine_agents.sim.core.experts import ReplayBank, distinct_per_layer, distinct_per_rank
from switchyard.engine_agents.sim.core.physics import CostModel

__all__ = ["DecodeEngine", "DecodeStep", "PrefillEngine", "PrefillStep", "StepOutput"]

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class DecodeStep:
    """What `DecodeEngine.begin_step` scheduled."""

    duration: float
    batch: int
    distinct: np.ndarray  # [L] distinct experts loaded per MoE layer (per-rank maximum with EP)
    distinct_sum: int  # Σ over layers of `distinct`
    kv_tokens: int  # context tokens whose KV the step reads
    admitted: list[int]  # request ids admitted at this step
    preempted: list[int]  # request ids preempted at this step
    recompute_tokens: int
    rows: np.ndarray  # bank rows of the batch's decode tokens (`experts.token_counts` turns them into B[L, E])


@dataclass(slots=True)
class StepOutput:
    """What `end_step` emitted: every request of the step produced one output token."""

    batch: int
    first: list[int]  # requests whose first output token this was
    finished: list[int]  # requests that are done and left the engine
    finished_tokens: list[int]  # tokens each finished request generated in all


@dataclass(slots=True)
class _Req:
    rid: int
    replay: int
    prompt: int
    output: int
    generated: int = 0
    recompute: bool = False
    slot: int = -1
    admitted_step: int = 0
    admitted_ctx: int = 0
    order: int = 0  # admission counter: the newest running request is preempted first


class DecodeEngine:
    """A decode engine: continuous batching over a paged KV cache, step cost from the expert physics.

    Running requests occupy slots ``0 … n-1`` of a few arrays (bank row start and length, tokens generated),
    so a step is a handful of numpy calls over the batch, never a Python loop over requests, tokens or
    experts. KV blocks are counted without per-request arrays: every running request gains one token per
    step, so request i needs a new block exactly at steps s with ``s ≡ s_admit − ctx_admit (mod block)``;
    a histogram of those phases gives the step's block demand in O(1). Finishes are scheduled the same way
    (a request admitted at step s with r tokens to go finishes at step s + r − 1).
    """

    def __init__(
        self,
        cost: CostModel,
        bank: ReplayBank,
        max_running: int = 256,
        kv_blocks: int | None = None,
        rank_masks: np.ndarray | None = None,
    ) -> None:
        if max_running <= 0:
            raise ValueError("max_running must be positive")
        self.cost = cost
        self.bank = bank
        self.block_size = cost.block_size
        self.kv_blocks = int(kv_blocks if kv_blocks is not None else cost.kv_capacity_blocks)
        self.max_running = max_running
        self.rank_masks = rank_masks
        self._bits = bank.decode_bits[:, :, 0] if bank.decode_bits.shape[2] == 1 else bank.decode_bits
        self._sliding = cost.model.sliding_layers > 0
        m = max_running
        self._rid = np.full(m, -1, dtype=np.int64)
        self._dstart = np.zeros(m, dtype=np.int64)
        self._dlen = np.ones(m, dtype=np.int64)
        self._gen = np.zeros(m, dtype=np.int64)
        self._prompt = np.zeros(m, dtype=np.int64)
        self._n = 0
        self._reqs: dict[int, _Req] = {}  # running requests by id
        self._phase = [0] * self.block_size  # running requests per block phase
        self._finish_at: dict[int, set[int]] = {}  # step -> request ids finishing at that step
        self._step_index = 0
        self._admit_counter = 0
        self._ctx_sum = 0
        self._used_blocks = 0
        self.waiting: deque[_Req] = deque()
        self._busy = False
        self._step_n = 0
        self._step_first: list[int] = []
        # counters
        self.steps = 0
        self.tokens_out = 0
        self.preemptions = 0
        self.busy_time = 0.0

    # -- state visible to routers and tests ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self._n

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def used_blocks(self) -> int:
        return self._used_blocks

    @property
    def kv_usage(self) -> float:
        return self._used_blocks / self.kv_blocks

    @property
    def busy(self) -> bool:
        return self._busy

    def running_ids(self) -> np.ndarray:
        return self._rid[: self._n].copy()

    def waiting_ids(self) -> list[int]:
        return [w.rid for w in self.waiting]

    def has_work(self) -> bool:
        return self._n > 0 or bool(self.waiting)

    def blocks_held(self) -> int:
        """Recount of KV blocks the running requests hold (tests compare it with `used_blocks`)."""
        ctx = self._prompt[: self._n] + self._gen[: self._n]
        extra = 1 if self._busy else 0  # during a step each request holds room for the token being made
        return int((-(-(ctx + extra) // self.block_size)).sum())

    # -- requests in -----------------------------------------------------------------------------------

    def add(self, rid: int, replay: int, prompt_tokens: int, output_tokens: int, recompute: bool = False) -> None:
        """Queue a request whose prompt KV has arrived; it generates `output_tokens` (≥ 1) tokens.

        With `recompute` the prompt's KV did not arrive: the engine prefills it in the step that admits it
        (as a preempted request's), which is what a decode engine does with a request no prefill engine saw.
        """
        if output_tokens < 1 or prompt_tokens < 1:
            raise ValueError("a request has at least one prompt token and generates at least one token")
        if -(-(prompt_tokens + output_tokens) // self.block_size) > self.kv_blocks:
            raise ValueError(
                f"request {rid} needs {prompt_tokens + output_tokens} KV tokens; the engine holds "
                f"{self.kv_blocks * self.block_size}"
            )
        self.waiting.append(_Req(rid, replay, prompt_tokens, output_tokens, recompute=recompute))

    def generated(self, rid: int) -> int | None:
        """Tokens a running request has generated so far; None if it is not running."""
        req = self._reqs.get(rid)
        return None if req is None else int(self._gen[req.slot])

    def abort(self, rid: int) -> bool:
        """Drop a request (its client went away), freeing its slot and KV; only between steps."""
        if self._busy:
            raise RuntimeError("abort during a step")
        for w in self.waiting:
            if w.rid == rid:
                self.waiting.remove(w)
                return True
        req = self._reqs.pop(rid, None)
        if req is None:
            return False
        ctx = req.prompt + int(self._gen[req.slot])
        self._used_blocks -= -(-ctx // self.block_size)
        self._ctx_sum -= ctx
        self._phase[(req.admitted_step - req.admitted_ctx) % self.block_size] -= 1
        self._finish_at[req.admitted_step + req.output - req.generated - 1].discard(rid)
        self._free_slot(req.slot)
        return True

    # -- one step ----------------------------------------------------------------------------------------

    def begin_step(self) -> DecodeStep | None:
        """Form the batch and return the step's duration; None when there is nothing to run."""
        if self._busy:
            raise RuntimeError("begin_step called twice without end_step")
        preempted = self._grow_or_preempt()
        admitted, recompute = ([], 0) if preempted else self._admit()
        n = self._n
        if n == 0:
            return None
        rows = self._dstart[:n] + self._gen[:n] % self._dlen[:n]
        if self.rank_masks is None:
            union = np.bitwise_or.reduce(self._bits.take(rows, axis=0), axis=0)
            counts = np.bitwise_count(union)
            distinct = counts if counts.ndim == 1 else counts.sum(axis=-1)
        else:
            distinct = distinct_per_rank(self.bank.decode_bits[rows], self.rank_masks).max(axis=0)
        distinct_sum = int(distinct.sum(dtype=np.int64))
        if self._sliding:
            context: np.ndarray | int = self._prompt[:n] + self._gen[:n]
        else:
            context = self._ctx_sum
        duration = self.cost.decode_time_total(distinct_sum, n, context, prefill_tokens=recompute)
        self._busy = True
        self._step_n = n
        self.busy_time += duration
        return DecodeStep(duration, n, distinct, distinct_sum, self._ctx_sum, admitted, preempted, recompute, rows)

    def end_step(self) -> StepOutput:
        """Every request of the step gets one token; finished requests leave and free their KV."""
        if not self._busy:
            raise RuntimeError("end_step without begin_step")
        self._busy = False
        n = self._step_n
        self._gen[:n] += 1
        self._ctx_sum += n
        first, self._step_first = self._step_first, []
        done = self._finish_at.pop(self._step_index, None)
        self._step_index += 1
        self.steps += 1
        self.tokens_out += n
        finished: list[int] = []
        tokens: list[int] = []
        if done:
            for rid in done:
                req = self._reqs.pop(rid)
                gen = int(self._gen[req.slot])
                ctx = req.prompt + gen
                self._used_blocks -= -(-ctx // self.block_size)
                self._ctx_sum -= ctx
                self._phase[(req.admitted_step - req.admitted_ctx) % self.block_size] -= 1
                self._free_slot(req.slot)
                finished.append(rid)
                tokens.append(gen)
        return StepOutput(n, first, finished, tokens)

    # -- internals ---------------------------------------------------------------------------------------

    _COLUMNS = ("_rid", "_dstart", "_dlen", "_gen", "_prompt")

    def _free_slot(self, slot: int) -> None:
        """Move the last running request into `slot` (order does not matter to the batch)."""
        last = self._n - 1
        if slot != last:
            for name in self._COLUMNS:
                col = getattr(self, name)
                col[slot] = col[last]
            self._reqs[int(self._rid[slot])].slot = slot
        self._rid[last] = -1
        self._n = last

    def _grow_or_preempt(self) -> list[int]:
        """Give each running request KV room for one more token, preempting the newest while short."""
        preempted: list[int] = []
        bs = self.block_size
        while self._n:
            need = self._phase[self._step_index % bs]
            if need <= self.kv_blocks - self._used_blocks:
                self._used_blocks += need
                break
            victim = max(self._reqs.values(), key=lambda r: r.order)
            gen = int(self._gen[victim.slot])
            ctx = victim.prompt + gen
            self._used_blocks -= -(-ctx // bs)
            self._ctx_sum -= ctx
            self._phase[(victim.admitted_step - victim.admitted_ctx) % bs] -= 1
            self._finish_at[victim.admitted_step + victim.output - victim.generated - 1].discard(victim.rid)
            self._free_slot(victim.slot)
            del self._reqs[victim.rid]
            victim.generated = gen
            victim.recompute = True
            victim.slot = -1
            self.waiting.appendleft(victim)
            self.preemptions += 1
            preempted.append(victim.rid)
        return preempted

    def _admit(self) -> tuple[list[int], int]:
        """Admit waiting requests FCFS while slots and KV blocks last; returns ids and recomputed tokens."""
        admitted: list[int] = []
        recompute = 0
        bs = self.block_size
        while self.waiting and self._n < self.max_running:
            w = self.waiting[0]
            ctx = w.prompt + w.generated
            blocks = -(-(ctx + 1) // bs)
            if blocks > self.kv_blocks - self._used_blocks:
                break
            self.waiting.popleft()
            i = self._n
            self._rid[i] = w.rid
            self._dstart[i] = self.bank.decode_start[w.replay]
            self._dlen[i] = self.bank.decode_len[w.replay]
            self._gen[i] = w.generated
            self._prompt[i] = w.prompt
            w.slot = i
            w.admitted_step = self._step_index
            w.admitted_ctx = ctx
            w.order = self._admit_counter
            self._admit_counter += 1
            self._reqs[w.rid] = w
            self._phase[(self._step_index - ctx) % bs] += 1
            self._finish_at.setdefault(self._step_index + w.output - w.generated - 1, set()).add(w.rid)
            self._used_blocks += blocks
            self._ctx_sum += ctx
            self._n += 1
            admitted.append(w.rid)
            if w.generated == 0:
                self._step_first.append(w.rid)
            if w.recompute:
                recompute += ctx
        return admitted, recompute


@dataclass(frozen=True)
class PrefillStep:
    duration: float
    tokens: int
    distinct: np.ndarray


@dataclass
class _Prompt:
    rid: int
    replay: int
    tokens: int
    done: int = 0


@dataclass
class PrefillEngine:
    """A prefill engine: FCFS chunked prefill, `token_budget` prompt tokens per step.

    A step's distinct experts per layer are the union of its requests' prefill-token selections from the
    replay bank (each request's whole prefill, whichever chunk runs: long prompts load nearly every expert
    in any case). Its KV is held until the transfer to the decoder; prefill-side KV capacity is not modelled.
    """

    cost: CostModel
    bank: ReplayBank
    token_budget: int = 8192
    rank_masks: np.ndarray | None = None
    queue: deque[_Prompt] = field(default_factory=deque)
    _step: list[tuple[_Prompt, int]] = field(default_factory=list)
    _busy: bool = False
    steps: int = 0
    busy_time: float = 0.0

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def queued_tokens(self) -> int:
        return sum(p.tokens - p.done for p in self.queue)

    def has_work(self) -> bool:
        return bool(self.queue)

    def add(self, rid: int, replay: int, prompt_tokens: int) -> None:
        if prompt_tokens < 1:
            raise ValueError("a prompt has at least one token")
        self.queue.append(_Prompt(rid, replay, prompt_tokens))

    def begin_step(self) -> PrefillStep | None:
        if self._busy:
            raise RuntimeError("begin_step called twice without end_step")
        budget = self.token_budget
        chunk: list[tuple[_Prompt, int]] = []
        pairs = 0.0
        for p in self.queue:
            if budget <= 0:
                break
            take = min(budget, p.tokens - p.done)
            chunk.append((p, take))
            # causal attention of `take` new queries over `done` cached + the new tokens themselves
            pairs += take * p.done + take * (take + 1) / 2
            budget -= take
        if not chunk:
            return None
        tokens = self.token_budget - budget
        replays = np.fromiter((p.replay for p, _ in chunk), dtype=np.int64, count=len(chunk))
        bits = self.bank.prefill_bits[replays]
        if self.rank_masks is None:
            distinct = distinct_per_layer(bits)
        else:
            distinct = distinct_per_rank(bits, self.rank_masks).max(axis=0)
        duration = self.cost.prefill_time(distinct, tokens, pairs)
        self._step = chunk
        self._busy = True
        self.busy_time += duration
        return PrefillStep(duration=duration, tokens=tokens, distinct=distinct)

    def end_step(self) -> np.ndarray:
        """Advance the step's prompts; returns the ids whose prefill completed."""
        if not self._busy:
            raise RuntimeError("end_step without begin_step")
        self._busy = False
        self.steps += 1
        done: list[int] = []
        for p, take in self._step:
            p.done += take
        while self.queue and self.queue[0].done >= self.queue[0].tokens:
            done.append(self.queue.popleft().rid)
        self._step = []
        return np.asarray(done, dtype=np.int64) if done else _EMPTY
