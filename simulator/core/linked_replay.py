"""Workloads whose expert signatures follow their prefixes (issue 40 item 3; docs/expert-affinity.md).

A request's experts can be predicted before its prefill only if something already known about it, its prefix,
says which experts it will use. Neither shipped trace links the two: the ESFT routing trace has no prompts'
block hashes, and the Mooncake request trace has block hashes but no routing. Two constructions link them, each
stated as an assumption, never as a measurement:

- `task_prefixed` (ESFT, the seed's Poisson + BurstGPT setting): each of the routing trace's tasks (intent,
  law, summary, translation) has its own system prompt of `system_blocks` blocks, which every request of that
  task begins with; the rest of the prompt is the request's own. Requests of one task share a prefix and a task's
  expert mix, as requests of one application share its system prompt.
- `prefix_linked` (Mooncake): every distinct first block (a conversation's or a document's root) belongs to a
  task, drawn uniformly (stream ``linked.task``), and each request replays a trace request of its root's task
  (stream ``linked.row``): requests sharing a root share a task, as turns of one conversation do.

The replayed rows' signatures are the routing trace's, unchanged. Pure functions of their inputs and seed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from switchyard.shared.streams import stream
from switchyard.simulator.core.workload import Workload

__all__ = ["prefix_linked", "task_prefixed"]

#: Hash ids of the synthetic prompts: a task's system prompt ids are task·SPAN + j, a request's own are
#: (request + 1)·SPAN·ROOM + j, so the two never collide.
_SPAN = 1 << 20
_ROOM = 1 << 8


def task_prefixed(workload: Workload, labels: np.ndarray, block: int = 16, system_blocks: int = 4) -> Workload:
    """The workload with synthetic block hash ids: its task's `system_blocks` shared blocks, then the request's
    own (`labels[row]`: each bank row's task, −1 unknown: no shared prefix). `block`: tokens per hash id."""
    if block <= 0 or system_blocks < 0:
        raise ValueError("block must be positive and system_blocks non-negative")
    task = np.asarray(labels)[workload.replay]
    ids = []
    for r, (t, p) in enumerate(zip(task.tolist(), workload.prompt.tolist(), strict=True)):
        n = int(p) // block
        shared = min(system_blocks, n) if t >= 0 else 0
        own = np.arange(n - shared, dtype=np.int64) + (r + 1) * _SPAN * _ROOM
        ids.append(np.concatenate([np.arange(shared, dtype=np.int64) + t * _SPAN, own]))
    desc = f"{workload.description}; task system prompts of {system_blocks}x{block} tokens"
    return replace(workload, hash_ids=tuple(ids), hash_block=block, description=desc)


def prefix_linked(workload: Workload, labels: np.ndarray, seed: int) -> Workload:
    """The workload (with the trace's hash ids) replaying, for every request, a bank row of its root's task
    (`labels[row]`: each bank row's task; rows of unknown task are never drawn)."""
    if workload.hash_ids is None:
        raise ValueError("prefix_linked needs a request trace with block hash ids (Mooncake's JSONL)")
    labels = np.asarray(labels)
    tasks = np.unique(labels[labels >= 0])
    if not len(tasks):
        raise ValueError("no bank row has a task label")
    rows_of = {int(t): np.flatnonzero(labels == t) for t in tasks}
    roots = sorted({int(h[0]) for h in workload.hash_ids if len(h)})
    drawn = stream(seed, "linked.task").integers(len(tasks), size=len(roots))
    task_of = {root: int(tasks[d]) for root, d in zip(roots, drawn.tolist(), strict=True)}
    pick = stream(seed, "linked.row").random(workload.size)
    fallback = stream(seed, "linked.rootless").integers(len(tasks), size=workload.size)
    replay = np.empty(workload.size, dtype=np.int64)
    for r, h in enumerate(workload.hash_ids):
        rows = rows_of[task_of[int(h[0])] if len(h) else int(tasks[fallback[r]])]
        replay[r] = rows[int(pick[r] * len(rows))]
    return replace(workload, replay=replay, description=f"{workload.description}; replay linked to the root's task")
