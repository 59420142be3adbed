"""Expert-load windows, as every engine kind reports them, and Gimbal's expert pressure read from them.

Shapes: L = MoE layers, E = experts per layer, S = source DP ranks, G = EP ranks (GPUs) of the group.

- `expert_load_counts` / `ExpertLoadWindow` turn a batch's token→expert selections (with the source DP rank
  of each token), or counts already summed, into the `A[L, S, E]` / `B[L, E]` windows of an `ExpertLoad`;
- `WindowPublisher` publishes what a counter elsewhere accumulated (vLLM's device counter) every interval;
- `expert_pressure` is the busiest EP rank's load over the mean rank's, averaged over layers with load (1 =
  balanced), for any expert-to-rank map: `rank_of_expert` reads one off a slot layout, `contiguous_ranks` is
  vLLM's linear map.

Windows go to JetStream (`SY_EXPERT_LOAD`) with a message id, so a retried publish is stored once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from switchyard.engine_agents.core.stored import RESEND_FOR_S, publish_until_stored
from switchyard.shared.schemas import ExpertLoad

__all__ = [
    "ExpertLoadWindow",
    "WindowPublisher",
    "contiguous_ranks",
    "expert_load_counts",
    "expert_pressure",
    "publish_expert_load",
    "rank_of_expert",
]

if TYPE_CHECKING:  # the bus is only passed in: importing this module does not pull in NATS
    from switchyard.shared.bus import Bus

log = logging.getLogger(__name__)


def expert_load_counts(
    selections: np.ndarray, sources: np.ndarray, num_experts: int, num_sources: int
) -> tuple[np.ndarray, np.ndarray]:
    """Count a batch's expert selections per source DP rank.

    `selections` is `[T, L, k]` (the top-k expert ids of T tokens at each of L layers) and `sources` is `[T]`
    (the DP rank each token entered from). Returns `A[L, S, E]` (tokens from source s that selected expert
    e at layer l) and `B[L, E] = A.sum(axis=1)`, both uint32.
    """
    selections, sources = np.asarray(selections), np.asarray(sources)
    if selections.ndim != 3 or sources.shape != selections.shape[:1]:
        raise ValueError(f"selections must be [T, L, k] and sources [T]; got {selections.shape} and {sources.shape}")
    if selections.size and not (selections.min() >= 0 and selections.max() < num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    if sources.size and not (sources.min() >= 0 and sources.max() < num_sources):
        raise ValueError(f"source ranks must lie in 0..{num_sources - 1}")
    layers = selections.shape[1]
    layer = np.broadcast_to(np.arange(layers)[None, :, None], selections.shape)
    source = np.broadcast_to(sources[:, None, None], selections.shape)
    flat = (layer.astype(np.int64) * num_sources + source) * num_experts + selections
    counts = np.bincount(flat.reshape(-1), minlength=layers * num_sources * num_experts)
    source_counts = counts.reshape(layers, num_sources, num_experts).astype(np.uint32)
    return source_counts, source_counts.sum(axis=1, dtype=np.uint32)


@dataclass
class ExpertLoadWindow:
    """Accumulates one engine's expert selections and emits an `ExpertLoad` message per window."""

    engine_id: str
    ep_group: str
    num_layers: int
    num_experts: int
    num_sources: int
    clock: Callable[[], float] = time.time
    seq: int = 0

    def __post_init__(self) -> None:
        self._counts = np.zeros((self.num_layers, self.num_sources, self.num_experts), dtype=np.uint32)
        self._start = self.clock()

    def add(self, selections: np.ndarray, sources: np.ndarray) -> None:
        """Fold in one batch: `selections [T, L, k]`, `sources [T]` (see `expert_load_counts`)."""
        counts, _ = expert_load_counts(selections, sources, self.num_experts, self.num_sources)
        self._counts += counts

    def add_counts(self, counts: np.ndarray, source: int = 0) -> None:
        """Fold in counts already summed over tokens: `[L, E]` from one source rank."""
        self._counts[:, source, :] += counts.astype(np.uint32, copy=False)

    @property
    def counts(self) -> np.ndarray:
        """`B[L, E]` so far in this window."""
        return self._counts.sum(axis=1, dtype=np.uint32)

    def flush(self) -> ExpertLoad:
        """The window since the last flush as a message (seq increases by one per window); starts a new one."""
        end = self.clock()
        message = ExpertLoad(
            engine_id=self.engine_id,
            ep_group=self.ep_group,
            seq=self.seq,
            window_start=self._start,
            window_end=max(end, self._start),
            expert_counts=self._counts.sum(axis=1, dtype=np.uint32),
            source_counts=self._counts,
        )
        self.seq += 1
        self._counts = np.zeros_like(self._counts)
        self._start = end
        return message


def rank_of_expert(layout: np.ndarray, num_experts: int) -> np.ndarray:
    """`[L, G, slots]` slot map -> `[L, E]` rank holding each expert (the lowest rank if replicated)."""
    layers = layout.shape[0]
    rank = np.full((layers, num_experts), -1, dtype=np.int64)
    layer_idx, gpu_idx, _ = np.indices(layout.shape).reshape(3, -1)
    expert = layout.reshape(-1)
    used = expert >= 0
    order = np.argsort(-gpu_idx[used], kind="stable")  # lowest gpu written last, so it wins
    rank[layer_idx[used][order], expert[used][order]] = gpu_idx[used][order]
    if (rank < 0).any():
        raise ValueError("the layout leaves some expert without a GPU")
    return rank


def contiguous_ranks(num_experts: int, num_ranks: int) -> np.ndarray:
    """`[E]` rank of each expert under vLLM's linear expert map: the first `E mod G` ranks hold one more."""
    base, extra = divmod(num_experts, num_ranks)
    return np.repeat(np.arange(num_ranks), [base + (r < extra) for r in range(num_ranks)])


def expert_pressure(counts: np.ndarray, ranks: np.ndarray, num_ranks: int) -> float:
    """Gimbal's MoE pressure of one window: the busiest rank's load over the mean rank's, averaged over layers
    with load (1 = balanced, one rank, or no load). `counts [L, E]`; `ranks [L, E]` or `[E]` (every layer
    alike): the rank that serves each expert."""
    layers = counts.shape[0]
    if num_ranks <= 1 or counts.sum() == 0:
        return 1.0
    ranks = np.asarray(ranks)
    index = (np.arange(layers)[:, None], ranks) if ranks.ndim == 2 else (slice(None), ranks)
    per_rank = np.zeros((layers, num_ranks))
    np.add.at(per_rank, index, counts.astype(np.float64))
    mean = per_rank.mean(axis=1)
    busy = mean > 0
    return float((per_rank.max(axis=1)[busy] / mean[busy]).mean()) if busy.any() else 1.0


async def publish_expert_load(bus: Bus, window: ExpertLoad, msg_id: str, resend_for_s: float = RESEND_FOR_S) -> bool:
    """Store one window on JetStream, resent under `msg_id` until acknowledged (`stored.publish_until_stored`: a
    stream electing a new leader loses no window, and a resend is not stored twice); False (logged) if it never
    was. A publisher awaiting it takes its next window late, and that window then covers the longer span (the
    counts accumulate meanwhile), so the windows still tile time in order."""
    what = f"{window.engine_id}: expert-load window {window.seq}"
    subject = bus.subjects.expert_load(window.engine_id)
    return await publish_until_stored(bus, subject, window, msg_id, what, resend_for_s)


class WindowPublisher:
    """Every `interval_s`, takes the counts an engine accumulated elsewhere and publishes them as a window.

    `take_counts` returns `[L, E]` counts since the previous call and resets its counter (vLLM: a device
    tensor copied to the host, so it runs in a worker thread). With `source_counts` (`[L, E]` -> `A[L, S, E]`
    or None, the kind's own rank order) the window also carries per-source counts. `on_tick` runs after each
    window, on the same loop.
    """

    def __init__(
        self,
        engine_id: str,
        ep_group: str,
        take_counts: Callable[[], np.ndarray],
        interval_s: float,
        source_counts: Callable[[np.ndarray], np.ndarray | None] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.ep_group = ep_group
        self.take_counts = take_counts
        self.interval_s = interval_s
        self.source_counts = source_counts
        self.seq = 0
        self.on_tick: Callable[[], None] | None = None

    async def run(self, bus: Bus) -> None:
        """Publish windows until cancelled; consecutive windows tile time (one's end is the next's start)."""
        start = time.time()
        while True:
            await asyncio.sleep(self.interval_s)
            end = time.time()
            counts = await asyncio.to_thread(self.take_counts)
            window = ExpertLoad(
                engine_id=self.engine_id,
                ep_group=self.ep_group,
                seq=self.seq,
                window_start=start,
                window_end=end,
                expert_counts=counts,
                source_counts=None if self.source_counts is None else self.source_counts(counts),
            )
            await publish_expert_load(bus, window, msg_id=f"{self.engine_id}-{int(start * 1e6)}-{self.seq}")
            self.seq += 1
            start = end
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception:
                    log.exception("%s: tick after an expert-load window failed", self.engine_id)
