"""Per-request expert counts for routing samples: which rows of a step's batch belong to which request.

vLLM flattens a step's tokens request by request (in `input_batch.req_ids` order, `num_scheduled_tokens`
rows each). A row at position `num_computed_tokens + j` is a prompt token while that position is below
`num_prompt_tokens`, and a decode token after. For a stable, hash-chosen `fraction` of requests this module
picks their rows out of the step, takes their top-k expert ids (gathered on the device by the caller), and
accumulates the request's prefill counts `c[L, E]` and decode counts `p[L, E]`. When vLLM reports the
request finished, these become one `RoutingSample` (`engine_agents.core.routing_samples`). Pure numpy, so
it is tested without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchyard.engine_agents.core.routing_samples import sampled


@dataclass
class TrackedRequest:
    prefill: np.ndarray  # [L, E] uint32
    decode: np.ndarray
    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass
class _Step:
    rows: np.ndarray  # batch rows of tracked requests
    request_ids: list[str]  # the tracked requests of this step
    owner: np.ndarray  # per row: its request's index in `request_ids`
    is_prefill: np.ndarray  # per row


@dataclass
class RequestTracker:
    num_layers: int
    num_experts: int
    fraction: float
    requests: dict[str, TrackedRequest] = field(default_factory=dict)
    _step: _Step | None = None

    def sampled(self, request_id: str) -> bool:
        """The same answer in every process and run: a hash of the id, not a random draw."""
        return sampled(request_id, self.fraction)

    def plan_step(
        self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray, num_prompt: np.ndarray
    ) -> np.ndarray:
        """The rows of this step that belong to tracked requests (the caller gathers their expert ids)."""
        tracked = [i for i, rid in enumerate(req_ids) if rid is not None and self.sampled(rid)]
        if not tracked:
            self._step = None
            return np.zeros(0, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
        counts = np.asarray(num_scheduled)[tracked].astype(np.int64)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # 0.. within each
        owner = np.repeat(np.arange(len(tracked)), counts)
        index = np.asarray(tracked)[owner]
        rows = (starts[index] + offsets).astype(np.int64)
        is_prefill = np.asarray(num_computed)[index] + offsets < np.asarray(num_prompt)[index]
        self._step = _Step(rows, [req_ids[i] for i in tracked], owner, is_prefill)
        return rows

    @property
    def pending_rows(self) -> np.ndarray:
        """The rows `plan_step` picked for the step in flight (empty: nothing to gather)."""
        return self._step.rows if self._step is not None else np.zeros(0, dtype=np.int64)

    def absorb(self, experts: np.ndarray) -> None:
        """Add the planned rows' expert ids, `experts [L, rows, k]` (in `plan_step`'s row order)."""
        step, self._step = self._step, None
        if step is None or experts.shape[1] != step.rows.size:
            return
        for k, request_id in enumerate(step.request_ids):
            mine = step.owner == k
            state = self.requests.setdefault(
                request_id,
                TrackedRequest(
                    np.zeros((self.num_layers, self.num_experts), np.uint32),
                    np.zeros((self.num_layers, self.num_experts), np.uint32),
                ),
            )
            for phase, target in ((mine & step.is_prefill, state.prefill), (mine & ~step.is_prefill, state.decode)):
                if phase.any():
                    target += _counts(experts[:, phase, :], self.num_experts)
            state.prefill_tokens += int((mine & step.is_prefill).sum())
            state.decode_tokens += int((mine & ~step.is_prefill).sum())

    def finish(self, request_ids: set[str] | list[str]) -> list[tuple[str, TrackedRequest]]:
        """The tracked requests among `request_ids`, removed from tracking."""
        return [(rid, self.requests.pop(rid)) for rid in request_ids if rid in self.requests]


def _counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, rows, k] expert ids -> [L, E] selection counts (ids outside 0..E-1 are padding and ignored)."""
    layers = experts.shape[0]
    ids = experts.reshape(layers, -1).astype(np.int64)
    valid = (ids >= 0) & (ids < num_experts)
    flat = (np.arange(layers)[:, None] * num_experts + ids)[valid]
    return np.bincount(flat, minlength=layers * num_experts).reshape(layers, num_experts).astype(np.uint32)
