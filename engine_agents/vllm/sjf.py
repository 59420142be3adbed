"""Gimbal's queue order inside vLLM (Algorithm 2): shortest remaining prefill first, with aging.

vLLM admits waiting requests first come, first served, so one long prompt at the head of the queue holds
every short prompt behind it (head-of-line blocking of TTFT). Before each `schedule()` this scheduler
reorders the waiting queue: requests that have waited longer than θ_age (default 5 s) first, longest wait
first, then the rest by prompt tokens still to prefill, fewest first; ties keep arrival order. The order is
recomputed every step, so a long prompt's wait is bounded by θ_age plus the time to serve what aged before
it. Everything else (budgets, preemption, KV allocation, prefix caching) is vLLM's own `Scheduler`.

Enable it with vLLM's scheduler-class option:

    vllm serve MODEL --scheduler-cls switchyard.engine_agents.vllm.sjf.SJFAgingScheduler
    # θ_age: SWITCHYARD_AGENT_SJF_AGE_THRESHOLD_S (seconds, default 5)

With async scheduling on, use `SJFAgingAsyncScheduler` instead. Only the FCFS policy is reordered: with
`--scheduling-policy priority` the client's priorities are the order, and this class changes nothing.
This module imports vLLM: vLLM resolves it by name in its engine-core process.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler

from switchyard.engine_agents.vllm.config import AgentSettings, sjf_order
from switchyard.solver.routing.dispatch import GimbalParams


class _SJFAging:
    """The mixin: reorder `waiting` before the parent's `schedule()` runs."""

    waiting: Any
    _sjf_params: GimbalParams

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sjf_params = GimbalParams(age_threshold_s=AgentSettings().sjf_age_threshold_s)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.waiting, FCFSRequestQueue):
            sjf_order(self.waiting, self._sjf_params, time.time())  # vLLM stamps arrival_time with time.time()
        return super().schedule(*args, **kwargs)  # type: ignore[misc]


class SJFAgingScheduler(_SJFAging, Scheduler):
    """vLLM's `Scheduler` with Gimbal's waiting-queue order (`--scheduler-cls`)."""


class SJFAgingAsyncScheduler(_SJFAging, AsyncScheduler):
    """vLLM's `AsyncScheduler` with Gimbal's waiting-queue order, for engines with async scheduling on."""
