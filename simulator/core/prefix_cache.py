"""vLLM V1's automatic prefix cache as the simulator's KV block accounting sees it.

Why: on multi-turn chat, agents and shared system prompts a prompt's leading KV blocks are often already in an
engine's cache; vLLM then skips their prefill. The scheduler (`scheduler.Scheduler`) counts blocks as numbers;
this module keeps *which* blocks are cached and in which order they are evicted, as vLLM's `BlockPool` does.

Shapes and semantics:

- A prompt is a chain of **keys**, one per full *trace block* (`trace_block` tokens: 512 for Mooncake). A key
  is the hash of (parent key, the trace's hash id), so equal keys mean equal prefixes up to that block, as vLLM
  chains its block hashes. `prefix_keys` builds the chain; only full blocks of the prompt get a key.
- A key covers `span = trace_block // engine block size` engine KV blocks (32 for 512 over vLLM's 16); hits are
  on whole keys. Every count here is in engine blocks.
- **Held** keys are referenced by running requests (a reference count; a key shared by two requests occupies
  its blocks once). **Free** blocks form vLLM's free queue, least recently freed at the head: anonymous runs
  of uncached blocks and cached keys. Allocation pops from the head, evicting cached keys it reaches (a key is
  evicted whole; what it leaves over goes back to the head as an anonymous run). A request that leaves
  appends its blocks to the tail in *reverse* order, as vLLM frees them: its uncached tail blocks first, then
  its keys deepest first, so a prompt's tail is evicted before its root. A hit on a free key takes it off the
  queue (``touch``); a hit on a held key only adds a reference.
- A request registers its prompt's keys as its prefill computes those blocks (vLLM caches full blocks once
  computed). A key already cached by another request stays that request's; the duplicate stays private.

**CPU tier** (`cpu_keys` > 0; issue 42): a bounded offload tier behind the GPU cache, as vLLM's
`OffloadingConnector` keeps one in host memory. A key the free queue evicts goes to it (newest last; past
`cpu_keys` its oldest is dropped); a prompt's keys past its GPU hit that the tier holds (`lookup_cpu`) are loaded
back instead of recomputed: the scheduler counts them computed at admission, allocates their blocks like a
miss's, and its engine prices the copy (`dp_engine.MixedEngine`). Assumed: only evicted blocks are offloaded
(vLLM's connector also stores blocks as they are computed, which only adds copies of keys the GPU still holds);
a loaded key stays in the tier (touched); the copy is synchronous in the admitting step.

Source: vLLM's design note "Automatic Prefix Caching" (docs.vllm.ai/en/latest/design/prefix_caching/) and
`vllm/v1/core/block_pool.py` (the free queue "in eviction order").

The free queue's total always equals the engine's free blocks (capacity − blocks held by running requests);
`free_blocks` lets tests check it against the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["PrefixCache", "prefix_keys", "prompt_keys"]

#: The root of every key chain (vLLM's NONE_HASH plays the same part).
_ROOT = 0x5EED


def prefix_keys(hash_ids: Sequence[int] | np.ndarray, prompt_tokens: int, trace_block: int) -> tuple[int, ...]:
    """Chained keys of the prompt's full trace blocks: key_i = hash((key_{i-1}, hash_ids[i])).

    Python's hash of a tuple of ints does not depend on PYTHONHASHSEED, so keys are reproducible.
    """
    full = min(len(hash_ids), prompt_tokens // trace_block)
    keys: list[int] = []
    parent = _ROOT
    for hid in list(hash_ids[:full]):
        parent = hash((parent, int(hid)))
        keys.append(parent)
    return tuple(keys)


def prompt_keys(
    hash_ids: Sequence[np.ndarray] | None, prompt: np.ndarray, trace_block: int | None
) -> list[tuple[int, ...]] | None:
    """Each request's chained prefix keys (`prefix_keys`); None without caching (no block) or without hash ids.
    One rule for every fleet harness (`simulator.offline.xpyd`, `simulator.offline.dp`)."""
    if not trace_block or hash_ids is None:
        return None
    return [prefix_keys(h, int(p), trace_block) for h, p in zip(hash_ids, prompt, strict=True)]


def hits_per_request(per_engine: Iterable[Mapping[int, int]], n_requests: int) -> np.ndarray:
    """`[n_requests]` int64: the prompt tokens each request found cached at its first admission, gathered from
    every engine's `prefix_hits` (request id -> tokens); 0 for a request no engine recorded."""
    hit = np.zeros(n_requests, dtype=np.int64)
    for hits in per_engine:
        for rid, tokens in hits.items():
            hit[rid] = tokens
    return hit


class PrefixCache:
    """Cached keys, their references, and vLLM's LRU free queue over `capacity` engine blocks."""

    def __init__(self, capacity: int, span: int, cpu_keys: int = 0) -> None:
        if capacity <= 0 or span <= 0 or cpu_keys < 0:
            raise ValueError("capacity and span must be positive, cpu_keys not negative")
        self.span = span
        self.capacity = capacity
        self._ref: dict[int, int] = {}  # held key -> references
        # free queue: entry id -> (blocks, key or None for an anonymous run), head first
        self._free: OrderedDict[int, tuple[int, int | None]] = OrderedDict()
        self._entry_of: dict[int, int] = {}  # free cached key -> its entry id
        self._next = 0
        self.free_blocks = 0
        self.evicted = 0  # keys evicted (counter)
        self.cpu_keys = cpu_keys  # the CPU tier's size in keys (0: none)
        self._cpu: OrderedDict[int, None] = OrderedDict()  # keys offloaded, least recently used first
        self.cpu_dropped = 0  # keys dropped from the full CPU tier (counter)
        self._append(capacity, None)

    # -- queries ----------------------------------------------------------------------------------------

    def cached(self, key: int) -> bool:
        return key in self._ref or key in self._entry_of

    @property
    def cached_keys(self) -> int:
        return len(self._ref) + len(self._entry_of)

    def lookup(self, keys: Sequence[int], limit: int) -> tuple[int, int]:
        """(hit keys, of which free): the longest cached prefix of `keys[:limit]`; changes nothing."""
        hits = free = 0
        for key in keys[:limit]:
            if key in self._ref:
                hits += 1
            elif key in self._entry_of:
                hits += 1
                free += 1
            else:
                break
        return hits, free

    def lookup_cpu(self, keys: Sequence[int], start: int, limit: int) -> int:
        """Keys of `keys[start:limit]` the CPU tier holds in a row: what a request past its GPU hit loads back."""
        if not self._cpu:
            return 0
        n = 0
        for key in keys[start:limit]:
            if key not in self._cpu:
                break
            n += 1
        return n

    def credit(self, keys: Sequence[int], limit: int, cpu_weight: float) -> float:
        """The router's precise credit, in keys: the GPU hit, plus the CPU tier's run after it at `cpu_weight`
        (`solver.routing.prefix.tiers`; weight 0: the GPU hit alone, as if the tier were not reported)."""
        hits = self.lookup(keys, limit)[0]
        return hits + cpu_weight * self.lookup_cpu(keys, hits, limit) if cpu_weight > 0 else float(hits)

    @property
    def cpu_held(self) -> int:
        return len(self._cpu)

    def free_order(self) -> list[tuple[int, int | None]]:
        """The free queue, head (next evicted) first: (blocks, key), key None for an anonymous run (tests)."""
        return list(self._free.values())

    # -- changes ----------------------------------------------------------------------------------------

    def acquire(self, keys: Sequence[int]) -> None:
        """A request hit `keys` (all cached): free ones leave the queue, every one gains a reference."""
        for key in keys:
            if key in self._ref:
                self._ref[key] += 1
            else:
                del self._free[self._entry_of.pop(key)]
                self.free_blocks -= self.span
                self._ref[key] = 1

    def allocate(self, blocks: int) -> None:
        """Take `blocks` free blocks from the head of the queue, evicting the cached keys it reaches."""
        if blocks > self.free_blocks:
            raise ValueError(f"allocating {blocks} blocks, {self.free_blocks} free")
        self.free_blocks -= blocks
        while blocks > 0:
            entry, (size, key) = next(iter(self._free.items()))
            if key is not None:
                del self._entry_of[key]
                self.evicted += 1
                self._offload(key)
            if size > blocks:
                self._free[entry] = (size - blocks, None)  # same place: the head
                return
            del self._free[entry]
            blocks -= size

    def register(self, key: int) -> bool:
        """A running request computed the block `key` covers: cache it (one reference) unless already cached."""
        if self.cached(key):
            return False
        self._ref[key] = 1
        return True

    def release(self, private: int, keys: Sequence[int]) -> int:
        """A request leaves: its `private` blocks, then its held `keys` deepest first, to the tail; blocks freed."""
        freed = 0
        if private:
            self._append(private, None)
            freed += private
        for key in reversed(keys):
            left = self._ref[key] - 1
            if left:
                self._ref[key] = left
                continue
            del self._ref[key]
            self._entry_of[key] = self._append(self.span, key)
            freed += self.span
        return freed

    def loaded(self, keys: Sequence[int]) -> None:
        """A request loaded these keys back from the CPU tier: they become its most recently used."""
        for key in keys:
            self._cpu.move_to_end(key)

    def _offload(self, key: int) -> None:
        if not self.cpu_keys:
            return
        self._cpu[key] = None
        self._cpu.move_to_end(key)
        if len(self._cpu) > self.cpu_keys:
            self._cpu.popitem(last=False)
            self.cpu_dropped += 1

    def _append(self, blocks: int, key: int | None) -> int:
        entry = self._next
        self._next += 1
        self._free[entry] = (blocks, key)
        self.free_blocks += blocks
        return entry
