"""vLLM V1's scheduler, the one model of continuous batching every simulated engine runs on.

A step first serves the running requests, oldest admission first: each needs the tokens it has not computed
(one for a decoding request; the rest of its prompt, or of its context after a preemption, otherwise), all
sharing a token budget (`max_num_batched_tokens`), so a long prompt is chunked over several steps. KV blocks
are allocated for the tokens a step computes plus `lookahead` (vLLM's `allocate_slots`); when they do not fit,
the most recently admitted request is preempted: its blocks are freed and it goes to the front of the queue,
keeping the tokens it generated and recomputing its context when readmitted. If no request was preempted,
waiting requests are admitted in the queue-order hook's order — FCFS (vLLM's default) or Gimbal's
shortest-prefill-first with aging (`solver.routing.dispatch.queue_order`) — while a slot (`max_num_seqs`), the
budget and KV blocks for their first chunk last; the first that does not fit stops admission. A step that
computes a request's last missing token samples its next one.

Two ways in: a new request (prefilled here, from token 0), or one whose prompt's KV a prefill engine sent
(`prefilled`): it computes only its last prompt token, as vLLM's KV connectors leave it, and samples.

**Prefix caching** (`prefix_block`, general path only): a request may bring the chained keys of its prompt's
full trace blocks (`prefix_cache.prefix_keys`). At admission its longest cached prefix is a hit: its
`computed` starts there (at most prompt + generated − 1 tokens, as vLLM recomputes the last token), those
blocks are shared rather than allocated, and only the rest is prefilled. Computed prompt blocks are cached as
the prefill goes; freed blocks stay cached until vLLM's LRU free queue hands them out again
(`prefix_cache.PrefixCache`). Every allocation and release then goes through that queue. A request without
keys, or an engine without `prefix_block`, behaves exactly as before. With a CPU tier (`prefix_cpu_tokens`) the
keys after the GPU hit that the tier holds count computed too, their blocks allocated as a miss's; the engine
prices their copy (`loaded_tokens`; `prefix_cache`, `dp_engine`).

**Fast path.** With no token budget (`token_budget=None`: a disaggregated decoder, which recomputes a
readmitted request's context in one step) every running request computes exactly one token per step after
the step that admits it. Its KV then grows by one token a step, so request i needs a new block exactly at
steps s with ``s ≡ s_admit − ctx_admit (mod block)``: a histogram of those phases gives a step's block demand
in O(1), and finishes are known at admission (a request admitted at step s with r tokens to go finishes at
step s + r − 1). The scheduling decisions are the general path's, step for step (`tests/test_sim_core.py`
runs both); only the bookkeeping differs.

The engines (`xpyd_engines.DecodeEngine` and `PrefillEngine`, `dp_engine.MixedEngine`) subclass `Scheduler`
and price the batch it forms with their physics.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from switchyard.simulator.core.experts import ReplayBank
from switchyard.simulator.core.prefix_cache import PrefixCache
from switchyard.solver.routing.dispatch import GimbalParams, queue_order

__all__ = ["ORDERS", "UNBOUNDED", "QueueOrder", "Scheduler", "WaitingQueue", "ceil_div"]

QueueOrder = Literal["fcfs", "sjf-aging"]
ORDERS: tuple[QueueOrder, ...] = ("fcfs", "sjf-aging")

#: The token budget of an engine without one (larger than any step's tokens).
UNBOUNDED = 1 << 62


_sum = np.add.reduce  # ndarray.sum without its Python wrapper (the general path runs on small arrays)


def ceil_div(a: np.ndarray | int, b: int) -> np.ndarray | int:
    return -(-a // b)


class WaitingQueue:
    """An engine's waiting requests as numpy columns; the order hook picks the service order."""

    _INT = ("rid", "replay", "prompt", "output", "gen", "prefilled")

    def __init__(self) -> None:
        cap = 64
        self.size = 0
        self.cols: dict[str, np.ndarray] = {name: np.zeros(cap, np.int64) for name in self._INT}
        self.arrival = np.zeros(cap)
        self.pos = np.zeros(cap)  # FCFS position: arrivals count up, requeued (preempted) requests go in front
        self._back = 0
        self._front = 0
        self.tokens = 0  # Σ tokens to compute before sampling again, over the queue

    def push(
        self,
        rid: int,
        replay: int,
        prompt: int,
        output: int,
        gen: int,
        arrival: float,
        front: bool,
        prefilled: bool = False,
    ) -> None:
        if self.size == len(self.arrival):
            grow = len(self.arrival)
            for name in self._INT:
                self.cols[name] = np.concatenate([self.cols[name], np.zeros(grow, np.int64)])
            self.arrival = np.concatenate([self.arrival, np.zeros(grow)])
            self.pos = np.concatenate([self.pos, np.zeros(grow)])
        i = self.size
        c = self.cols
        c["rid"][i] = rid
        c["replay"][i] = replay
        c["prompt"][i] = prompt
        c["output"][i] = output
        c["gen"][i] = gen
        c["prefilled"][i] = prefilled
        self.arrival[i] = arrival
        if front:
            self._front += 1
            self.pos[i] = -self._front
        else:
            self._back += 1
            self.pos[i] = self._back
        self.size += 1
        self.tokens += 1 if prefilled else prompt + gen

    def work(self) -> np.ndarray:
        """Tokens each waiting request must compute before it samples again (its prefill job size)."""
        n = self.size
        c = self.cols
        return np.where(c["prefilled"][:n] > 0, 1, c["prompt"][:n] + c["gen"][:n])

    def service_order(self, now: float, order: QueueOrder, params: GimbalParams) -> np.ndarray:
        """Storage indices in the order the scheduler considers them (the queue-order hook)."""
        idx = np.argsort(self.pos[: self.size], kind="stable")
        if order == "fcfs":
            return idx
        waited = now - self.arrival[: self.size][idx]
        return idx[queue_order(self.work()[idx], waited, params)]

    def remove(self, indices: list[int]) -> None:
        if len(indices) == self.size:  # the whole queue was admitted (the common case)
            self.size = 0
            self.tokens = 0
            return
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


#: Running-slot columns (int64; `_arrival` is a float column beside them).
_FIELDS = (
    "rid",
    "replay",
    "prompt",
    "output",
    "gen",  # tokens generated
    "computed",  # tokens whose KV is in the cache (general path)
    "blocks",  # KV blocks held (general path)
    "order",  # admission counter: vLLM's running-list order; the newest is preempted first
    "take",  # tokens scheduled this step (general path)
    "dstart",  # the replayed trace request's first decode-token row in the bank
    "dlen",  # and its number of decode tokens
    "phase",  # fast path: the step phase (mod block size) at which it needs a new KV block
    "due",  # fast path: the step at whose end it finishes
)


class Scheduler:
    """Running slots ``0 … n-1`` (swap-removed), a waiting queue, KV blocks; see the module docstring."""

    def __init__(
        self,
        bank: ReplayBank,
        block_size: int,
        kv_blocks: int,
        max_running: int,
        token_budget: int | None,
        lookahead: int = 0,
        order: QueueOrder = "fcfs",
        params: GimbalParams | None = None,
        prefix_block: int | None = None,
        prefix_cpu_tokens: int = 0,
    ) -> None:
        if max_running <= 0 or (token_budget is not None and token_budget <= 0):
            raise ValueError("max_running and token_budget must be positive")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.bank = bank
        self.block_size = block_size
        self.kv_blocks = int(kv_blocks)
        self.max_running = max_running
        self.token_budget = UNBOUNDED if token_budget is None else token_budget
        self.lookahead = lookahead
        self.order: QueueOrder = order
        self.params = params or GimbalParams()
        #: The O(1) bookkeeping of uniform growth (see the module docstring); tests turn it off to compare.
        self.fast = token_budget is None
        # one array per field (numpy is measurably slower on row views of a 2-D array, and the step loop is hot)
        self._columns: tuple[np.ndarray, ...] = (
            *(np.zeros(max_running, np.int64) for _ in _FIELDS),
            np.zeros(max_running),
        )
        for name, col in zip((*_FIELDS, "arrival"), self._columns, strict=True):
            setattr(self, f"_{name}", col)
        self._slot_of: dict[int, int] = {}
        self._n = 0
        self._admit_counter = 0
        self._used = 0
        self.queue = WaitingQueue()
        # fast-path bookkeeping
        self._phase_count = [0] * block_size  # running requests per block phase
        self._finish_at: dict[int, set[int]] = {}  # step -> request ids finishing at its end
        self._step_index = 0
        self._ctx_sum = 0  # Σ prompt + generated over running requests
        self._step_first: list[int] = []
        # counters
        self._emitted = 0  # tokens the last step sampled
        self.preemptions = 0
        self.aged_admissions = 0  # admitted after waiting longer than the aging threshold
        # prefix caching (see the module docstring); None: off
        self.prefix: PrefixCache | None = None
        self.prefix_block = 0
        if prefix_block is not None and not self.fast:
            if prefix_block % block_size:
                raise ValueError(f"the trace block ({prefix_block}) must be a multiple of the KV block ({block_size})")
            self.prefix_block = prefix_block
            self.prefix = PrefixCache(self.kv_blocks, prefix_block // block_size, prefix_cpu_tokens // prefix_block)
        self._keys: dict[int, tuple[int, ...]] = {}  # rid -> its prompt's chained keys
        self._held_keys: dict[int, list[int]] = {}  # running rid -> keys it references
        self._registered: dict[int, int] = {}  # running rid -> keys considered for registration so far
        self.prefix_hits: dict[int, int] = {}  # rid -> tokens hit at its first admission
        self.prefix_query_tokens = 0  # Σ prompt tokens looked up at admissions (vLLM's queries)
        self.prefix_hit_tokens = 0  # Σ of those found cached (vLLM's hits; the CPU tier's included)
        self.prefix_cpu_hit_tokens = 0  # Σ of those loaded back from the CPU tier
        self.loaded_tokens: int = 0  # CPU-tier tokens admitted since the engine last priced their copy (it resets)

    # -- state ---------------------------------------------------------------------------------------------

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

    def waiting_ids(self) -> list[int]:
        return self.queue.ids()

    def has_work(self) -> bool:
        return self._n > 0 or self.queue.size > 0

    def generated(self, rid: int) -> int | None:
        """Tokens a running request has generated so far; None if it is not running."""
        slot = self._slot_of.get(rid)
        return None if slot is None else int(self._gen[slot])

    def _held(self, busy: bool) -> int:
        """Recount of KV blocks the running requests hold (tests compare it with `used_blocks`)."""
        n = self._n
        if self.fast:  # between steps the KV of prompt + generated − 1 tokens, plus the lookahead
            ctx = self._prompt[:n] + self._gen[:n] + self.lookahead - (0 if busy else 1)
        else:
            ctx = self._computed[:n] + self._take[:n] + self.lookahead
        return int(ceil_div(ctx, self.block_size).sum())

    # -- requests in ---------------------------------------------------------------------------------------

    def _enqueue(
        self,
        rid: int,
        replay: int,
        prompt: int,
        output: int,
        arrival: float,
        prefilled: bool,
        keys: tuple[int, ...] | None = None,
    ) -> None:
        if output < 1 or prompt < 1:
            raise ValueError("a request has at least one prompt token and generates at least one token")
        if ceil_div(prompt + output, self.block_size) > self.kv_blocks:
            raise ValueError(
                f"request {rid} needs {prompt + output} KV tokens; the engine holds {self.kv_blocks * self.block_size}"
            )
        self.queue.push(rid, replay, prompt, output, 0, arrival, front=False, prefilled=prefilled)
        if keys and self.prefix is not None and not prefilled:
            self._keys[rid] = keys

    def _drop(self, rid: int) -> bool:
        """Remove a request (waiting or running) and free its KV; only between steps."""
        q = self.queue
        hit = np.flatnonzero(q.cols["rid"][: q.size] == rid)
        if len(hit):
            q.remove([int(hit[0])])
            self._keys.pop(rid, None)
            return True
        slot = self._slot_of.get(rid)
        if slot is None:
            return False
        if self.fast:
            self._release_fast(slot)
        else:
            self._release(slot)
        self._keys.pop(rid, None)
        self.prefix_hits.pop(rid, None)
        self._free_slot(slot)
        return True

    def _release(self, slot: int) -> None:
        """A running request's KV blocks go back (general path); with prefix caching, to the LRU free queue."""
        blocks = int(self._blocks[slot])
        if self.prefix is None:
            self._used -= blocks
            return
        rid = int(self._rid[slot])
        held = self._held_keys.pop(rid, [])
        self._registered.pop(rid, None)
        self._used -= self.prefix.release(blocks - self.prefix.span * len(held), held)

    def _allocate(self, blocks: int) -> None:
        """`blocks` new KV blocks for running requests (general path)."""
        self._used += blocks
        if self.prefix is not None and blocks:
            self.prefix.allocate(blocks)

    # -- one step: form the batch --------------------------------------------------------------------------

    def _schedule(self, now: float) -> tuple[list[int], list[int], int]:
        """(preempted, admitted, recomputed tokens of the admitted): the batch is slots ``0 … n-1``."""
        if not self.fast:
            preempted = self._schedule_running()
        elif self._n and self._phase_count[self._step_index % self.block_size] <= self.kv_blocks - self._used:
            self._used += self._phase_count[self._step_index % self.block_size]  # room for every next token
            preempted = []
        else:
            preempted = self._grow_fast()
        if preempted or not self.queue.size or self._n >= self.max_running:  # nothing to admit (most steps)
            return preempted, [], 0
        budget = self.token_budget if self.fast else self.token_budget - int(_sum(self._take[: self._n]))
        return [], *self._admit(now, budget)

    def _requeue(self, slot: int) -> int:
        """Preempt the request in `slot`: back to the front of the queue, keeping its generated tokens."""
        rid = int(self._rid[slot])
        self.queue.push(
            rid,
            int(self._replay[slot]),
            int(self._prompt[slot]),
            int(self._output[slot]),
            int(self._gen[slot]),
            float(self._arrival[slot]),
            front=True,
        )
        self.preemptions += 1
        self._free_slot(slot)
        return rid

    def _schedule_running(self) -> list[int]:
        """Tokens per running request under the budget, in admission order; preempt the newest while KV is short."""
        preempted: list[int] = []
        bs, la = self.block_size, self.lookahead
        while self._n:
            n = self._n
            by_age = np.argsort(self._order[:n], kind="stable")
            need = (self._prompt[:n] + self._gen[:n] - self._computed[:n])[by_age]
            before = np.cumsum(need) - need
            take = np.empty(n, np.int64)
            take[by_age] = np.clip(self.token_budget - before, 0, need)
            grow = ceil_div(self._computed[:n] + take + la, bs) - self._blocks[:n]
            more = int(_sum(grow))
            if more <= self.kv_blocks - self._used:
                self._take[:n] = take
                self._blocks[:n] += grow
                self._allocate(more)
                return preempted
            victim = int(by_age[-1])
            self._release(victim)
            preempted.append(self._requeue(victim))
        return preempted

    def _grow_fast(self) -> list[int]:
        """The fast path's `_schedule_running`: KV room for one more token each, preempting the newest while short."""
        preempted: list[int] = []
        while self._n:
            need = self._phase_count[self._step_index % self.block_size]
            if need <= self.kv_blocks - self._used:
                self._used += need
                break
            victim = int(np.argmax(self._order[: self._n]))
            self._release_fast(victim)
            preempted.append(self._requeue(victim))
        return preempted

    def _release_fast(self, slot: int) -> None:
        """Fast-path bookkeeping of a running request leaving between steps (preempted or aborted)."""
        ctx = int(self._prompt[slot] + self._gen[slot])
        self._used -= -(-(ctx + self.lookahead - 1) // self.block_size)
        self._ctx_sum -= ctx
        self._phase_count[int(self._phase[slot])] -= 1
        self._finish_at[int(self._due[slot])].discard(int(self._rid[slot]))

    def _admit(self, now: float, budget: int) -> tuple[list[int], int]:
        """Admit in queue-order while slots, budget and KV blocks for a first chunk last; (ids, recomputed tokens)."""
        q = self.queue
        if not q.size or self._n >= self.max_running or budget <= 0:
            return [], 0
        bs, la, fast = self.block_size, self.lookahead, self.fast
        cache = self.prefix
        admitted: list[int] = []
        taken: list[int] = []
        recompute = 0
        cols = q.cols
        for qi in [0] if q.size == 1 else q.service_order(now, self.order, self.params).tolist():
            if self._n >= self.max_running or budget <= 0:
                break
            prompt, gen = int(cols["prompt"][qi]), int(cols["gen"][qi])
            prefilled = bool(cols["prefilled"][qi])
            computed = prompt - 1 if prefilled else 0
            rid = int(cols["rid"][qi])
            keys = self._keys.get(rid) if cache is not None else None
            hits = free_hits = cpu = 0
            if keys and cache is not None:
                limit = (prompt + gen - 1) // self.prefix_block
                hits, free_hits = cache.lookup(keys, limit)
                cpu = cache.lookup_cpu(keys, hits, limit)  # loaded back from the CPU tier, allocated like a miss
                computed = (hits + cpu) * self.prefix_block
            take = min(prompt + gen - computed, budget)
            blocks = int(ceil_div(computed + take + la, bs))
            span = cache.span if cache is not None else 0
            shared = hits * span  # hit blocks: shared, not allocated; those on the free queue leave it
            if blocks - shared + free_hits * span > self.kv_blocks - self._used:
                break
            if cache is not None:
                self._admit_prefix(rid, prompt, keys, hits, free_hits, cpu)
                self._allocate(blocks - shared)
            else:
                self._used += blocks
            i = self._n
            replay = int(cols["replay"][qi])
            self._rid[i] = rid
            self._replay[i] = replay
            self._prompt[i] = prompt
            self._output[i] = cols["output"][qi]
            self._gen[i] = gen
            self._computed[i] = computed
            self._blocks[i] = blocks
            self._take[i] = take
            self._order[i] = self._admit_counter
            self._dstart[i] = self.bank.decode_start[replay]
            self._dlen[i] = self.bank.decode_len[replay]
            self._arrival[i] = q.arrival[qi]
            self._slot_of[rid] = i
            if fast:
                ctx = prompt + gen
                step = self._step_index
                self._phase[i] = phase = (step - ctx - la + 1) % bs
                self._phase_count[phase] += 1
                self._due[i] = due = step + int(cols["output"][qi]) - gen - 1
                self._finish_at.setdefault(due, set()).add(rid)
                self._ctx_sum += ctx
                if gen == 0:
                    self._step_first.append(rid)
            self._admit_counter += 1
            self._n += 1
            budget -= take
            if not prefilled:
                recompute += take
            if now - q.arrival[qi] > self.params.age_threshold_s:
                self.aged_admissions += 1
            admitted.append(rid)
            taken.append(qi)
        if taken:
            q.remove(taken)
        return admitted, recompute

    def _admit_prefix(
        self, rid: int, prompt: int, keys: tuple[int, ...] | None, hits: int, free_hits: int, cpu: int = 0
    ) -> None:
        """Prefix-cache bookkeeping of an admission: take the hit keys, count the query and the hit (GPU and
        CPU tier; the CPU tier's tokens are also `loaded_tokens`, for the engine to price their copy)."""
        cache = self.prefix
        assert cache is not None
        if keys:
            cache.acquire(keys[:hits])
            cache.loaded(keys[hits : hits + cpu])
            self._used += free_hits * cache.span  # hit blocks that were free are held again
            self._held_keys[rid] = list(keys[:hits])
            self._registered[rid] = hits
        self.prefix_query_tokens += prompt
        self.prefix_hit_tokens += (hits + cpu) * self.prefix_block
        self.prefix_cpu_hit_tokens += cpu * self.prefix_block
        self.loaded_tokens += cpu * self.prefix_block
        self.prefix_hits.setdefault(rid, (hits + cpu) * self.prefix_block)

    def _register_computed(self, n: int) -> None:
        """Cache the prompt blocks the step just computed (before `take` is cleared)."""
        cache = self.prefix
        assert cache is not None
        tb = self.prefix_block
        computed, take = self._computed[:n], self._take[:n]
        prefilling = (take > 0) & (computed - take < self._prompt[:n])  # the step computed prompt tokens
        for slot in np.flatnonzero(prefilling).tolist():
            rid = int(self._rid[slot])
            keys = self._keys.get(rid)
            if not keys:
                continue
            start = self._registered[rid]
            full = min(int(self._computed[slot]), int(self._prompt[slot])) // tb
            if full <= start:
                continue
            held = self._held_keys[rid]
            for key in keys[start:full]:
                if cache.register(key):
                    held.append(key)
            self._registered[rid] = max(start, min(full, len(keys)))

    # -- one step: its tokens ------------------------------------------------------------------------------

    def _complete(self) -> tuple[list[int], list[int], list[int]]:
        """Computed tokens enter the KV cache; requests that caught up sample; finished ones leave.

        Returns (first, finished, finished_tokens): requests whose first token this was, requests done (they
        left), and the tokens each of those generated.
        """
        if self.fast:
            return self._complete_fast()
        n = self._n
        computed, take, gen = self._computed[:n], self._take[:n], self._gen[:n]
        computed += take
        if self.prefix is not None and self._keys:
            self._register_computed(n)
        emit = (take > 0) & (computed == self._prompt[:n] + gen)
        take[:] = 0
        gen += emit
        self._emitted = np.count_nonzero(emit)
        first = self._rid[:n][emit & (gen == 1)].tolist()
        done_slots = np.flatnonzero(emit & (gen >= self._output[:n]))
        if len(done_slots) > 1:  # report them in admission order (a prefill engine hands off in FCFS order)
            done_slots = done_slots[np.argsort(self._order[done_slots], kind="stable")]
        finished = self._rid[done_slots].tolist()
        tokens = self._gen[done_slots].tolist()
        for slot in sorted(done_slots.tolist(), reverse=True):  # high slots first: moves never touch a done one
            self._release(slot)
            if self._keys:
                self._keys.pop(int(self._rid[slot]), None)
            self._free_slot(slot)
        return first, finished, tokens

    def _complete_fast(self) -> tuple[list[int], list[int], list[int]]:
        n = self._n
        self._gen[:n] += 1
        self._ctx_sum += n
        self._emitted = n
        first, self._step_first = self._step_first, []
        done = self._finish_at.pop(self._step_index, None)
        self._step_index += 1
        finished: list[int] = []
        tokens: list[int] = []
        if done:
            bs, extra = self.block_size, self.lookahead - 1
            for rid in done:
                slot = self._slot_of[rid]
                gen = int(self._gen[slot])
                ctx = int(self._prompt[slot]) + gen
                self._used -= -(-(ctx + extra) // bs)
                self._ctx_sum -= ctx
                self._phase_count[int(self._phase[slot])] -= 1
                self._free_slot(slot)
                finished.append(rid)
                tokens.append(gen)
        return first, finished, tokens

    def _free_slot(self, slot: int) -> None:
        """Move the last running request into `slot` (order does not matter to the batch)."""
        last = self._n - 1
        del self._slot_of[int(self._rid[slot])]
        if slot != last:
            for col in self._columns:
                col[slot] = col[last]
            self._slot_of[int(self._rid[slot])] = slot
        self._n = last
