"""Simulated MoE engines with continuous batching, stepped by whoever owns the clock.

Each engine runs a step in two phases so the same object serves the discrete-event simulator and a live
simulated fleet running in (scaled) real time:

    plan = engine.begin_step()        # schedule the batch, return its duration (s); None when idle
    ...  wait plan.duration (simulated or real) ...
    out = engine.end_step()           # emit the step's tokens, finish and free requests

Requests added between the two calls wait for the next step, as in vLLM, whose scheduler forms a batch at
the start of a step.

`DecodeEngine` is the core scheduler (`scheduler.Scheduler`, vLLM V1's model: slots, KV blocks, preemption of
the newest, FCFS admission) with no token budget and one lookahead KV slot, which puts it on the scheduler's
O(1) decode-only fast path. The step's cost comes from `physics.CostModel` with the distinct experts the
batch's current decode tokens select, taken from a `ReplayBank` (real routing traces).

`PrefillEngine` serves prompts first-come first-served with chunked prefill: each step processes up to
`token_budget` prompt tokens (vLLM's `max_num_batched_tokens`), continuing a partly done prompt first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchyard.simulator.core.defaults import DECODE_MAX_RUNNING, TOKEN_BUDGET
from switchyard.simulator.core.experts import ReplayBank, distinct_per_layer, distinct_per_rank
from switchyard.simulator.core.physics import CostModel
from switchyard.simulator.core.scheduler import UNBOUNDED, Scheduler

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


class DecodeEngine(Scheduler):
    """A decode engine: the core scheduler (`scheduler.Scheduler`) with no token budget, priced by the physics.

    With no budget a readmitted request recomputes its whole context in the step that admits it, so every
    running request computes one token a step after that: the scheduler's O(1) fast path. KV is reserved for
    the token a step samples (lookahead 1). The step's cost comes from `physics.CostModel` with the distinct
    experts the batch's current decode tokens select, taken from a `ReplayBank` (real routing traces).
    """

    def __init__(
        self,
        cost: CostModel,
        bank: ReplayBank,
        max_running: int = DECODE_MAX_RUNNING,
        kv_blocks: int | None = None,
        rank_masks: np.ndarray | None = None,
    ) -> None:
        if max_running <= 0:
            raise ValueError("max_running must be positive")
        super().__init__(
            bank,
            cost.block_size,
            kv_blocks if kv_blocks is not None else cost.kv_capacity_blocks,
            max_running,
            token_budget=None,
            lookahead=1,
        )
        self.cost = cost
        self.rank_masks = rank_masks
        self._bits = bank.decode_bits[:, :, 0] if bank.decode_bits.shape[2] == 1 else bank.decode_bits
        self._sliding = cost.model.sliding_layers > 0
        self._busy = False
        self._step_n = 0
        # counters
        self.steps = 0
        self.tokens_out = 0
        self.busy_time = 0.0

    # -- state visible to routers and tests ------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._busy

    def running_ids(self) -> np.ndarray:
        return self._rid[: self._n].copy()

    def blocks_held(self) -> int:
        """Recount of KV blocks the running requests hold (tests compare it with `used_blocks`)."""
        return self._held(self._busy)

    # -- requests in -----------------------------------------------------------------------------------

    def add(self, rid: int, replay: int, prompt_tokens: int, output_tokens: int, recompute: bool = False) -> None:
        """Queue a request whose prompt KV has arrived; it generates `output_tokens` (≥ 1) tokens.

        With `recompute` the prompt's KV did not arrive: the engine prefills it in the step that admits it
        (as a preempted request's), which is what a decode engine does with a request no prefill engine saw.
        """
        self._enqueue(rid, replay, prompt_tokens, output_tokens, 0.0, prefilled=not recompute)

    def abort(self, rid: int) -> bool:
        """Drop a request (its client went away), freeing its slot and KV; only between steps."""
        if self._busy:
            raise RuntimeError("abort during a step")
        return self._drop(rid)

    # -- one step ----------------------------------------------------------------------------------------

    def begin_step(self) -> DecodeStep | None:
        """Form the batch and return the step's duration; None when there is nothing to run."""
        if self._busy:
            raise RuntimeError("begin_step called twice without end_step")
        preempted, admitted, recompute = self._schedule(0.0)
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
        ctx_sum = self._ctx_sum if self.fast else int((self._prompt[:n] + self._gen[:n]).sum())
        if self._sliding:
            context: np.ndarray | int = self._prompt[:n] + self._gen[:n]
        else:
            context = ctx_sum
        duration = self.cost.decode_time_total(distinct_sum, n, context, prefill_tokens=recompute)
        self._busy = True
        self._step_n = n
        self.busy_time += duration
        return DecodeStep(duration, n, distinct, distinct_sum, ctx_sum, admitted, preempted, recompute, rows)

    def end_step(self) -> StepOutput:
        """Every request of the step gets one token; finished requests leave and free their KV."""
        if not self._busy:
            raise RuntimeError("end_step without begin_step")
        self._busy = False
        n = self._step_n
        first, finished, tokens = self._complete_fast() if self.fast else self._complete()
        self.steps += 1
        self.tokens_out += n
        return StepOutput(n, first, finished, tokens)


@dataclass(frozen=True)
class PrefillStep:
    duration: float
    tokens: int
    distinct: np.ndarray


class PrefillEngine(Scheduler):
    """A prefill engine: the core scheduler with FCFS chunked prefill, `token_budget` prompt tokens per step.

    Each request leaves with the token its last chunk samples (a vLLM prefill instance in P/D serves one
    token), in arrival order. A step's distinct experts per layer are the union of its requests'
    prefill-token selections from the replay bank (each request's whole prefill, whichever chunk runs: long
    prompts load nearly every expert in any case). Its KV is held until the transfer to the decoder;
    prefill-side KV capacity is not modelled (no KV limit, so no preemption). At most one request is partly
    prefilled at a time, so `token_budget` slots never bind.

    With `prefix_block` (a trace with prefix hashes) the engine keeps vLLM's prefix cache, and then its KV is
    what the weights leave (`cost.kv_capacity_blocks`): the cache holds what the prefills left behind until
    that capacity evicts it (`prefix_cache`).
    """

    def __init__(
        self,
        cost: CostModel,
        bank: ReplayBank,
        token_budget: int = TOKEN_BUDGET,
        rank_masks: np.ndarray | None = None,
        prefix_block: int | None = None,
    ) -> None:
        kv_blocks = UNBOUNDED if prefix_block is None else cost.kv_capacity_blocks
        super().__init__(
            bank,
            cost.block_size,
            kv_blocks,
            max_running=token_budget,
            token_budget=token_budget,
            prefix_block=prefix_block,
        )
        self.cost = cost
        self.rank_masks = rank_masks
        self._busy = False
        self.steps = 0
        self.busy_time = 0.0

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet prefilled, running (partly prefilled) and waiting requests together."""
        n = self._n
        return int((self._prompt[:n] - self._computed[:n]).sum()) + self.queue.tokens

    @property
    def pending(self) -> int:
        """Prompts not yet fully prefilled."""
        return self._n + self.queue.size

    def add(self, rid: int, replay: int, prompt_tokens: int, keys: tuple[int, ...] | None = None) -> None:
        """Queue a prompt; `keys`: its prefix-cache keys (`prefix_cache.prefix_keys`), used when caching."""
        if prompt_tokens < 1:
            raise ValueError("a prompt has at least one token")
        self._enqueue(rid, replay, prompt_tokens, 1, 0.0, prefilled=False, keys=keys)

    def begin_step(self) -> PrefillStep | None:
        if self._busy:
            raise RuntimeError("begin_step called twice without end_step")
        self._schedule(0.0)
        n = self._n
        take = self._take[:n]
        sched = take > 0
        if not np.count_nonzero(sched):
            return None
        chunk = take[sched]
        done = self._computed[:n][sched]
        # causal attention of `take` new queries over `done` cached + the new tokens themselves
        pairs = float(int(np.add.reduce(chunk * done)) + np.add.reduce(chunk * (chunk + 1) / 2))
        tokens = int(np.add.reduce(chunk))
        bits = self.bank.prefill_bits[self._replay[:n][sched]]
        if self.rank_masks is None:
            distinct = distinct_per_layer(bits)
        else:
            distinct = distinct_per_rank(bits, self.rank_masks).max(axis=0)
        duration = self.cost.prefill_time(distinct, tokens, pairs)
        self._busy = True
        self.busy_time += duration
        return PrefillStep(duration=duration, tokens=tokens, distinct=distinct)

    def end_step(self) -> np.ndarray:
        """Advance the step's prompts; returns the ids whose prefill completed, in arrival order."""
        if not self._busy:
            raise RuntimeError("end_step without begin_step")
        self._busy = False
        self.steps += 1
        _, finished, _ = self._complete()
        return np.asarray(finished, dtype=np.int64) if finished else _EMPTY
