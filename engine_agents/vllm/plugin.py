"""The vLLM general plugin (entry point `vllm.general_plugins: switchyard`): puts a vLLM engine on the bus.

vLLM loads general plugins in every process it starts. `register` does nothing unless
`SWITCHYARD_AGENT_ENABLED=1`; otherwise it wraps two methods, each only in the process that calls it:

- `Scheduler.__init__` / `Scheduler.schedule` (engine core): the engine's hello from its config and KV blocks,
  and telemetry read from the scheduler after each `schedule()` — running and waiting requests, KV usage,
  prompt tokens not yet prefilled (waiting and running), and the step time. Published by `EngineCoreAgent`.
- `load_model` of the model runner (workers): a capture function on every MoE router (`set_capture_fn`,
  logical expert ids, before any EPLB remapping) adds each step's top-k selections to an `[L, E]` counter on
  the device, through a custom op (`switchyard::count_experts`) so torch.compile keeps it in the graph; TP
  rank 0 publishes it as `ExpertLoad` windows. It is attached right after the weights load, before vLLM
  compiles and warms up.

Every failure to attach is logged and leaves vLLM running as if the plugin were absent.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np

from engine_agents.vllm.config import (
    AgentSettings,
    build_hello,
    engine_identity,
    model_shape,
    moe_layers,
    queue_tokens,
)
from engine_agents.vllm.runtime import AgentThread, EngineCoreAgent, ExpertLoadPublisher

log = logging.getLogger(__name__)
_PATCHED = "_switchyard_patched"


def register() -> None:
    settings = AgentSettings()
    if not settings.enabled:
        return
    _patch_scheduler(settings)
    _patch_model_runners(settings)


# ----- engine core: hello and telemetry -----


class SchedulerProbe:
    """The latest telemetry reading, refreshed by the engine thread after each `schedule()`.

    Token sums walk the queues, so they are recomputed at most once per telemetry interval; the reading is
    one dict replaced whole, which the agent thread can read at any time.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.reading: dict[str, float | int | bool] = {
            "kv_usage": 0.0,
            "num_running": 0,
            "num_waiting": 0,
            "waiting_prefill_tokens": 0,
            "remaining_prefill_tokens": 0,
            "step_time_ema": 0.0,
        }
        self._tokens = (0, 0)
        self._next_tokens = 0.0
        self._last_step: float | None = None
        self._step_ema = 0.0

    def observe(self, scheduler: Any) -> None:
        now = time.monotonic()
        if self._last_step is not None and now - self._last_step < 1.0:  # back-to-back steps: one step's time
            step = now - self._last_step
            self._step_ema = step if self._step_ema == 0.0 else 0.9 * self._step_ema + 0.1 * step
        self._last_step = now
        waiting = [*scheduler.waiting, *scheduler.kv_holding_waiting]
        if now >= self._next_tokens:
            self._tokens = (queue_tokens(waiting), queue_tokens(scheduler.running))
            self._next_tokens = now + self.interval_s
        self.reading = {
            "kv_usage": min(max(float(scheduler.kv_cache_manager.usage), 0.0), 1.0),
            "num_running": len(scheduler.running),
            "num_waiting": len(waiting),
            "waiting_prefill_tokens": self._tokens[0],
            "remaining_prefill_tokens": self._tokens[1],
            "step_time_ema": self._step_ema,
        }

    def read(self) -> dict[str, float | int | bool]:
        return self.reading


def _patch_scheduler(settings: AgentSettings) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, _PATCHED, False):
        return
    original_init, original_schedule = Scheduler.__init__, Scheduler.schedule

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            _attach_engine_core(self, settings)
        except Exception:
            log.exception("switchyard agent: not attached to this engine")

    @functools.wraps(original_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original_schedule(self, *args, **kwargs)
        probe = getattr(self, "_switchyard_probe", None)
        if probe is not None:
            probe.observe(self)
        return output

    Scheduler.__init__, Scheduler.schedule = __init__, schedule  # type: ignore[method-assign]
    setattr(Scheduler, _PATCHED, True)


def _attach_engine_core(scheduler: Any, settings: AgentSettings) -> None:
    import vllm

    hello = build_hello(scheduler.vllm_config, scheduler.cache_config.num_gpu_blocks, settings, vllm.__version__)
    probe = SchedulerProbe(settings.telemetry_interval_s)
    agent = EngineCoreAgent(hello, probe.read, AgentThread(f"core-{hello.engine_id}"))
    if agent.start():
        scheduler._switchyard_probe = probe
        scheduler._switchyard_agent = agent


# ----- workers: expert load -----


class ExpertCounter:
    """Per-MoE-layer expert selection counts on the model's device; `take` moves them to the host."""

    def __init__(self, num_layers: int, num_experts: int, device: Any) -> None:
        import torch

        from engine_agents.vllm.ops import count_experts

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._op = count_experts

    def capture_fn(self, layer: int) -> Any:
        counts, op = self.counts, self._op
        return lambda topk_ids: op(counts, layer, topk_ids)

    def take(self) -> np.ndarray:
        snapshot = self.counts.clone()
        self.counts.sub_(snapshot)  # increments made meanwhile stay for the next window
        return snapshot.cpu().numpy().astype(np.uint32)


def _patch_model_runners(settings: AgentSettings) -> None:
    runners = []
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runners.append(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        runners.append(CPUModelRunner)
    except ImportError:
        pass
    for runner in runners:
        if runner.__dict__.get(_PATCHED):
            continue
        original = runner.load_model

        @functools.wraps(original)
        def load_model(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            result = _original(self, *args, **kwargs)
            try:
                _attach_worker(self, settings)
            except Exception:
                log.exception("switchyard agent: expert capture not attached")
            return result

        runner.load_model = load_model  # type: ignore[method-assign]
        setattr(runner, _PATCHED, True)


def _attach_worker(runner: Any, settings: AgentSettings) -> None:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    if getattr(runner, "_switchyard_counter", None) is not None or get_tensor_model_parallel_rank() != 0:
        return  # every TP rank routes the same tokens: one publisher is enough
    config = runner.vllm_config
    model = runner.get_model()
    moe = [m for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
    expected = len(moe_layers(config.model_config.hf_config))
    if not moe or len(moe) != expected:  # e.g. a pipeline stage holds only some layers
        log.warning("switchyard agent: %d MoE routers found, the config says %d; no expert load", len(moe), expected)
        return
    num_experts = model_shape(config.model_config.hf_config, "moe").num_experts  # logical ids, not EPLB's physical
    counter = ExpertCounter(len(moe), num_experts, next(model.parameters()).device)
    dp_rank = int(getattr(config.parallel_config, "data_parallel_rank", 0) or 0)
    engine_id, group = engine_identity(settings, dp_rank)
    publisher = ExpertLoadPublisher(
        engine_id, group, counter.take, settings.expert_load_interval_s, AgentThread(f"worker-{engine_id}")
    )
    if not publisher.start():
        return  # no bus: count nothing
    for index, module in enumerate(sorted(moe, key=lambda m: m.layer_id)):
        module.router.set_capture_fn(counter.capture_fn(index))
    runner._switchyard_counter = counter
    runner._switchyard_publisher = publisher
