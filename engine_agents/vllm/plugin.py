"""The vLLM general plugin (entry point `vllm.general_plugins: switchyard`): puts a vLLM engine on the bus.

vLLM loads general plugins in every process it starts. `register` does nothing unless
`SWITCHYARD_AGENT_ENABLED=1`; otherwise it wraps two methods, each only in the process that calls it:

- `Scheduler.__init__` / `Scheduler.schedule` (engine core): the engine's hello from its config and KV blocks,
  and telemetry read from the scheduler after each `schedule()` — running and waiting requests, KV usage,
  prompt tokens not yet prefilled (waiting and running), and the step time. Published by `EngineCoreAgent`.
  With `--kv-events-config` (publisher zmq), the engine core also relays vLLM's KV-cache events as
  `KvEvents` on `sy.engine.<id>.kv` (`kv_relay.py`); `reset_prefix_cache` then publishes its clear at once
  instead of with the next step.
- `load_model` of the model runner (workers): a capture function on every MoE router (`set_capture_fn`,
  logical expert ids, before any EPLB remapping) adds each step's top-k selections to an `[L, E]` counter on
  the device, through a custom op (`switchyard::count_experts`) so torch.compile keeps it in the graph; TP
  rank 0 publishes it as `ExpertLoad` windows (through the engine-agent core, `engine_agents.core`). It is
  attached right after the weights load, before vLLM compiles and warms up.

Every failure to attach is logged and leaves vLLM running as if the plugin were absent.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from switchyard.engine_agents.vllm.config import (
    AgentSettings,
    build_hello,
    engine_identity,
    expert_parallelism,
    kv_events_endpoint,
    model_shape,
    moe_layers,
    queue_tokens,
)
from switchyard.shared.nats_auth import engine_user

if TYPE_CHECKING:  # the bus side is imported only by a process that attaches (vLLM loads plugins everywhere)
    from switchyard.engine_agents.vllm.runtime import ExpertLoadPublisher
    from switchyard.engine_agents.vllm.tracker import RequestTracker

log = logging.getLogger(__name__)
_PATCHED = "_switchyard_patched"
#: No step for this long means every request the worker saw has finished (see `_wrap_steps`).
IDLE_FLUSH_S = 1.0
#: Keys of the per-block count tables (`ops.BLOCK_TABLES`), one per worker in attach order. The key is a
#: constant of the compiled graph, and vLLM's compile cache hands that graph to any later process with the same
#: engine configuration (a restart, another engine): a key that depended on the process (an object's `id`)
#: would name no table there, and the signatures would silently stay empty.
_TABLE_KEYS = itertools.count()


def register() -> None:
    settings = AgentSettings()
    if not settings.enabled:
        return
    _patch_scheduler(settings)
    _patch_model_runners(settings)


# ----- engine core: hello and telemetry -----


class SchedulerProbe:
    """The telemetry reading, refreshed by the engine thread after each `schedule()` and `update_from_output()`.

    Queue lengths are the **peak since the previous telemetry message**, not the value at the moment of
    sampling: a request that arrives and finishes between two 100 ms samples still shows up in one of them
    (it is in `running` after the `schedule()` that admitted it), so a router never sees an engine as idle
    while it served requests in the interval. With no step since the last message (the engine is idle) the
    reading is the state after the last step, so a drained engine reports 0. Token sums walk the queues, so
    they are recomputed at most once per telemetry interval.
    """

    _PEAKS = ("num_running", "num_waiting", "waiting_prefill_tokens", "remaining_prefill_tokens")

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
        self._peak: dict[str, float | int | bool] | None = None
        self._lock = threading.Lock()  # engine thread writes, agent thread reads; uncontended almost always
        self._tokens = (0, 0)
        self._next_tokens = 0.0
        self._last_step: float | None = None
        self._step_ema = 0.0

    def observe(self, scheduler: Any, step: bool = True) -> None:
        """Read the scheduler; `step` is False after `update_from_output` (the same step, its requests done)."""
        now = time.monotonic()
        if step:
            if self._last_step is not None and now - self._last_step < 1.0:  # back-to-back steps: one step's time
                gap = now - self._last_step
                self._step_ema = gap if self._step_ema == 0.0 else 0.9 * self._step_ema + 0.1 * gap
            self._last_step = now
        if now >= self._next_tokens or not step:  # walking the queues is O(requests): once per interval
            waiting = queue_tokens(scheduler.waiting) + queue_tokens(scheduler.kv_holding_waiting)
            self._tokens = (waiting, queue_tokens(scheduler.running))
            self._next_tokens = now + self.interval_s
        reading = {
            "kv_usage": min(max(float(scheduler.kv_cache_manager.usage), 0.0), 1.0),
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting) + len(scheduler.kv_holding_waiting),
            "waiting_prefill_tokens": self._tokens[0],
            "remaining_prefill_tokens": self._tokens[1],
            "step_time_ema": self._step_ema,
        }
        with self._lock:
            self.reading = reading
            if self._peak is None:
                self._peak = dict(reading)
            else:
                for key in self._PEAKS:
                    self._peak[key] = max(self._peak[key], reading[key])

    def read(self) -> dict[str, float | int | bool]:
        """The reading for one telemetry message: peaks since the previous call, else the latest state."""
        with self._lock:
            peak, self._peak = self._peak, None
            if peak is None:
                return self.reading
            return {**self.reading, **{key: peak[key] for key in self._PEAKS}}


def _patch_scheduler(settings: AgentSettings) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, _PATCHED, False):
        return
    original_init, original_schedule = Scheduler.__init__, Scheduler.schedule
    original_update = Scheduler.update_from_output

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

    @functools.wraps(original_update)
    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original_update(self, *args, **kwargs)
        probe = getattr(self, "_switchyard_probe", None)
        if probe is not None:  # finished requests have left the queues: an idle engine then reads 0
            probe.observe(self, step=False)
        return outputs

    Scheduler.__init__, Scheduler.schedule = __init__, schedule  # type: ignore[method-assign]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    original_reset = getattr(Scheduler, "reset_prefix_cache", None)
    if original_reset is not None:

        @functools.wraps(original_reset)
        def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original_reset(self, *args, **kwargs)
            if getattr(getattr(self, "_switchyard_agent", None), "kv_relay", None) is not None:
                try:
                    _publish_kv_events_now(self)
                except Exception:
                    log.exception("switchyard agent: the prefix-cache reset's KV events wait for the next step")
            return result

        Scheduler.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]
    setattr(Scheduler, _PATCHED, True)


def _attach_engine_core(scheduler: Any, settings: AgentSettings) -> None:
    import vllm

    from switchyard.engine_agents.vllm.runtime import AgentThread, EngineCoreAgent

    hello = build_hello(scheduler.vllm_config, scheduler.cache_config.num_gpu_blocks, settings, vllm.__version__)
    probe = SchedulerProbe(settings.telemetry_interval_s)
    ep_size, _, _ = expert_parallelism(scheduler.vllm_config.parallel_config)
    thread = AgentThread(f"core-{hello.engine_id}", role=engine_user(hello.engine_id), kind="vllm")
    try:
        relay = _kv_relay(scheduler, hello, settings)
    except Exception:  # the rest of the agent attaches without it
        log.exception("switchyard agent: no KV-event relay")
        relay = None
    agent = EngineCoreAgent(hello, probe.read, thread, ep_size, relay)
    if agent.start():
        scheduler._switchyard_probe = probe
        scheduler._switchyard_agent = agent


def _publish_kv_events_now(scheduler: Any) -> None:
    """Publish the KV events queued since the last step (a reset's `AllBlocksCleared`) instead of at the next
    step's end, so an idle engine that cleared its cache leaves the router's index at once. Order is kept: the
    events go to vLLM's one publisher queue, ahead of whatever the next step adds."""
    from vllm.distributed.kv_events import KVEventBatch

    events = scheduler.kv_cache_manager.take_events()
    if events:
        scheduler.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))


def _kv_relay(scheduler: Any, hello: Any, settings: AgentSettings) -> Any:
    """The KV-event relay for this engine core (`kv_relay.py`), or None when vLLM publishes no events to read."""
    if not settings.kv_events:
        return None
    config = getattr(scheduler.vllm_config, "kv_events_config", None)
    publisher = getattr(scheduler, "kv_event_publisher", None)
    resolved = None
    try:
        resolved = publisher.get_publisher_config().endpoint  # type: ignore[union-attr]
    except Exception:
        resolved = getattr(publisher, "_endpoint", None)
    where = kv_events_endpoint(config, resolved)
    if isinstance(where, str):
        if config is not None and getattr(config, "enable_kv_cache_events", False):
            log.warning("switchyard agent: no KV-event relay: %s", where)
        return None
    if not getattr(scheduler.cache_config, "enable_prefix_caching", False):
        log.warning("switchyard agent: KV events are on but prefix caching is off: vLLM stores no blocks to relay")
    from switchyard.engine_agents.vllm.kv_relay import KvRelay

    endpoint, topic = where
    bound = settings.kv_relay_max_hashes or 2 * hello.capacity.kv_blocks + 4096
    return KvRelay(hello.engine_id, endpoint, hello.capacity.block_size, topic, max_hashes=bound)


# ----- workers: expert load -----


class ExpertCounter:
    """Per-MoE-layer expert selection counts on the model's device; `take` moves them to the host.

    With `rows > 0` it also keeps each step's top-k ids (`[L, rows, k]`), from which the request tracker
    picks its requests' rows. Counting starts at the first real step (`arm`): vLLM's profiling and
    warm-up forward passes select experts too, for tokens nobody sent.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, rows: int, device: Any) -> None:
        import torch

        from switchyard.engine_agents.vllm.ops import count_experts, record_experts

        self.counts = torch.zeros(num_layers, num_experts + 1, dtype=torch.int64, device=device)  # + padding
        self.ids = torch.full((num_layers, rows, top_k), -1, dtype=torch.int32, device=device) if rows else None
        self.anchor = torch.zeros(1, dtype=torch.int32, device=device)  # what `count_blocks` declares it mutates
        self.armed = False
        self._count, self._record = count_experts, record_experts

    def capture_fn(self, layer: int, blocks_key: int | None = None) -> Any:
        """The router's capture function for MoE layer `layer`; with `blocks_key`, also per-KV-block counts."""
        from switchyard.engine_agents.vllm.ops import count_blocks

        counts, ids, count, record, anchor = self.counts, self.ids, self._count, self._record, self.anchor

        def capture(topk_ids: Any) -> None:
            count(counts, layer, topk_ids)
            if ids is not None:
                record(ids, layer, topk_ids)
            if blocks_key is not None:
                count_blocks(anchor, layer, topk_ids, blocks_key)

        return capture

    def arm(self) -> None:
        if not self.armed:
            self.counts.zero_()
            self.armed = True

    def take(self) -> np.ndarray:
        snapshot = self.counts.clone()
        self.counts.sub_(snapshot)  # increments made meanwhile stay for the next window
        if not self.armed:
            snapshot.zero_()
        return snapshot[:, :-1].cpu().numpy().astype(np.uint32)  # without the padding column

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The kept top-k ids of these batch rows, `[L, rows, k]` on the host."""
        import torch

        index = torch.from_numpy(rows).to(self.ids.device)  # type: ignore[union-attr]
        return self.ids.index_select(1, index).cpu().numpy()  # type: ignore[union-attr]


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

    from switchyard.engine_agents.vllm.runtime import AgentThread, ExpertLoadPublisher
    from switchyard.engine_agents.vllm.tracker import RequestTracker

    if getattr(runner, "_switchyard_counter", None) is not None or get_tensor_model_parallel_rank() != 0:
        return  # every TP rank routes the same tokens: one publisher is enough
    config = runner.vllm_config
    model = runner.get_model()
    moe = [m for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
    expected = len(moe_layers(config.model_config.hf_config))
    if not moe or len(moe) != expected:  # e.g. a pipeline stage holds only some layers
        log.warning("switchyard agent: %d MoE routers found, the config says %d; no expert load", len(moe), expected)
        return
    shape = model_shape(config.model_config.hf_config, "moe")  # logical expert ids, not EPLB's physical ones
    rows = int(runner.max_num_tokens) if settings.routing_sample_fraction > 0 else 0
    counter = ExpertCounter(len(moe), shape.num_experts, shape.top_k, rows, next(model.parameters()).device)
    ep_size, dp_rank, dp_size = expert_parallelism(config.parallel_config)
    engine_id, group = engine_identity(settings, dp_rank)
    tp_size = int(getattr(config.parallel_config, "tensor_parallel_size", 1) or 1)
    sources = (dp_rank, dp_size, tp_size) if ep_size > 1 and dp_size > 1 else None
    publisher = ExpertLoadPublisher(
        engine_id,
        group,
        counter.take,
        settings.expert_load_interval_s,
        AgentThread(f"worker-{engine_id}", role=engine_user(engine_id), kind="vllm"),
        sources,
    )
    if not publisher.start():
        return  # no bus: count nothing
    blocks_key = next(_TABLE_KEYS) if settings.signatures else None
    for index, module in enumerate(sorted(moe, key=lambda m: m.layer_id)):
        module.router.set_capture_fn(counter.capture_fn(index, blocks_key))
    if blocks_key is not None:
        _wrap_kv_cache_init(runner, len(moe), shape.num_experts, shape.top_k, blocks_key)
    tracker = RequestTracker(len(moe), shape.num_experts, settings.routing_sample_fraction) if rows else None
    _wrap_steps(runner, counter, tracker, publisher)
    runner._switchyard_counter = counter
    runner._switchyard_publisher = publisher


def _wrap_kv_cache_init(runner: Any, num_layers: int, num_experts: int, top_k: int, key: int) -> None:
    """Once vLLM has allocated its KV cache (block count known), allocate the per-block count table."""
    from switchyard.engine_agents.vllm.signatures import BlockSignatures

    original = runner.initialize_kv_cache

    def initialize_kv_cache(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            runner._switchyard_signatures = BlockSignatures(runner, num_layers, num_experts, top_k, key)
            log.info(
                "switchyard agent: per-block signature table, %d blocks, %.1f MiB",
                runner._switchyard_signatures.num_blocks,
                runner._switchyard_signatures.nbytes / 2**20,
            )
        except Exception:
            log.exception("switchyard agent: no per-block signatures")
        return result

    runner.initialize_kv_cache = initialize_kv_cache


def _wrap_steps(
    runner: Any, counter: ExpertCounter, tracker: RequestTracker | None, publisher: ExpertLoadPublisher
) -> None:
    """Around each real step: arm the counter, feed the tracker (rows before, expert ids after), and gather
    the signatures of the requests whose prefill ends in the step."""
    execute_model, prepare_inputs = runner.execute_model, runner._prepare_inputs

    def prepare(scheduler_output: Any, num_scheduled_tokens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        signatures = getattr(runner, "_switchyard_signatures", None)
        if signatures is not None:
            signatures.plan(runner, scheduler_output, num_scheduled_tokens)
        if tracker is not None:
            batch, n = runner.input_batch, runner.input_batch.num_reqs
            tracker.plan_step(
                list(batch.req_ids[:n]),
                np.asarray(num_scheduled_tokens),
                batch.num_computed_tokens_cpu[:n].copy(),
                batch.num_prompt_tokens[:n].copy(),
            )
        return prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    def execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        counter.arm()
        signatures = getattr(runner, "_switchyard_signatures", None)
        if signatures is not None:
            signatures.forget(scheduler_output.finished_req_ids)
            signatures.pending = []  # planned by this step's `_prepare_inputs`, if it has tokens
        if tracker is None:
            result = execute_model(scheduler_output, *args, **kwargs)
            _publish_signatures(signatures, publisher)
            return result
        with lock:
            last_step[0] = time.monotonic()
            for request_id, state in tracker.finish(scheduler_output.finished_req_ids):
                publisher.publish_sample(request_id, state)
            result = execute_model(scheduler_output, *args, **kwargs)
            if tracker.pending_rows.size:
                tracker.absorb(counter.rows(tracker.pending_rows))
            last_step[0] = time.monotonic()  # a step longer than IDLE_FLUSH_S is not idleness
        _publish_signatures(signatures, publisher)
        return result

    def flush_when_idle() -> None:
        """vLLM names finished requests in the *next* step's output; when no step follows (the engine went
        idle), whatever is tracked has finished: publish it."""
        if tracker is None or time.monotonic() - last_step[0] < IDLE_FLUSH_S:
            return
        with lock:
            for request_id, state in tracker.finish(list(tracker.requests)):
                publisher.publish_sample(request_id, state)

    lock, last_step = threading.Lock(), [time.monotonic()]
    runner._prepare_inputs, runner.execute_model = prepare, execute
    publisher.on_tick = flush_when_idle


def _publish_signatures(signatures: Any, publisher: ExpertLoadPublisher) -> None:
    """Gather the step's finished prefills (device ops queued after the forward) and hand them to the bus."""
    if signatures is None:
        return
    gathered = signatures.gather()
    if gathered is not None:
        publisher.publish_signatures(*gathered)
