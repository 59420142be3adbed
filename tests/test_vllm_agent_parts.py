"""The vLLM agent's parts that need no vLLM: config reading, the scheduler probe, and its bus side on real NATS.

`test_vllm_agent.py` runs the whole agent inside a real vLLM engine when vLLM is installed; these run always.
The vLLM objects are stood in for by namespaces with the attributes the agent reads (named in the docstrings
of `engine_agents/vllm/config.py` and `plugin.py`), so a change in what it reads shows here.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from nats.aio.msg import Msg

from switchyard.engine_agents.vllm.config import (
    AgentSettings,
    build_hello,
    expert_parallelism,
    expert_pressure,
    kv_events_endpoint,
    model_shape,
    moe_layers,
    queue_tokens,
    role_of,
    sjf_order,
    source_counts,
)
from switchyard.engine_agents.vllm.kv_relay import local_endpoint
from switchyard.engine_agents.vllm.plugin import SchedulerProbe
from switchyard.engine_agents.vllm.runtime import AgentThread, EngineCoreAgent, ExpertLoadPublisher
from switchyard.engine_agents.vllm.signatures import prefill_ends
from switchyard.engine_agents.vllm.tracker import RequestTracker
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.schemas import (
    ExpertLoad,
    Hello,
    LayoutReply,
    LayoutRequest,
    MigrateReply,
    MigrateRequest,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings
from switchyard.solver.routing.dispatch import GimbalParams
from tests.helpers import eventually

QWEN3_30B = SimpleNamespace(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1)
DEEPSEEK_V2_LITE = SimpleNamespace(
    num_hidden_layers=27, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1
)
MIXTRAL = SimpleNamespace(num_hidden_layers=32, num_local_experts=8, num_experts_per_tok=2)


def test_moe_shapes_of_the_families_we_serve() -> None:
    assert model_shape(QWEN3_30B, "qwen").model_dump() == {
        "name": "qwen",
        "num_layers": 48,
        "num_experts": 128,
        "top_k": 8,
    }
    assert moe_layers(DEEPSEEK_V2_LITE) == list(range(1, 27))  # the first layer is dense: 26 MoE layers
    assert model_shape(MIXTRAL, "mixtral").num_experts == 8
    sparse = SimpleNamespace(num_hidden_layers=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)
    assert moe_layers(sparse) == [1, 3, 5, 7]
    dense_some = SimpleNamespace(**vars(QWEN3_30B), mlp_only_layers=[0, 47])
    assert len(moe_layers(dense_some)) == 46
    with pytest.raises(ValueError, match="no routed expert count"):
        model_shape(SimpleNamespace(num_hidden_layers=32, num_experts_per_tok=2), "llama")


def test_role_and_queue_tokens() -> None:
    assert role_of(SimpleNamespace(kv_role="kv_producer")) == "prefill"
    assert role_of(SimpleNamespace(kv_role="kv_consumer")) == "decode"
    assert role_of(SimpleNamespace(kv_role="kv_both")) == role_of(None) == "dp"
    requests = [
        SimpleNamespace(num_prompt_tokens=100, num_computed_tokens=30),
        SimpleNamespace(num_prompt_tokens=5, num_computed_tokens=9),
    ]
    assert queue_tokens(requests) == 70


def _vllm_config(dp_rank: int = 1, tp: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_rank=dp_rank, tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(hf_config=QWEN3_30B, served_model_name="qwen3-30b-a3b", model="/models/q"),
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"),
        scheduler_config=SimpleNamespace(max_num_seqs=256),
        cache_config=SimpleNamespace(block_size=16),
    )


def test_hello_from_the_engine_config() -> None:
    hello = build_hello(_vllm_config(), 40_000, AgentSettings(engine_id="d7", ep_group="ep-a"), "0.32.0")
    assert (hello.engine_id, hello.ep_group, hello.role, hello.dp_rank) == ("d7", "ep-a", "decode", 1)
    assert hello.gpus == ["d7-gpu0", "d7-gpu1"] and hello.agent == "vllm" and hello.agent_version == "0.32.0"
    assert hello.migrates is False  # the placement service leaves its group alone
    assert (hello.capacity.max_running, hello.capacity.kv_blocks, hello.capacity.block_size) == (256, 40_000, 16)
    assert hello.base_url is None  # serves no HTTP the gateway knows of
    served = build_hello(_vllm_config(), 10, AgentSettings(engine_id="d7", base_url="http://10.0.0.5:8000"), "x")
    assert served.base_url == "http://10.0.0.5:8000"
    default = build_hello(_vllm_config(dp_rank=3), 10, AgentSettings(), "x")
    assert default.engine_id.endswith("-dp3") and default.ep_group == default.engine_id and "." not in default.engine_id


def test_the_routing_sample_share_is_read_under_its_old_name_too(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        AgentSettings().routing_sample_fraction == 0.0
        and AgentSettings(routing_sample_fraction=0.5).routing_sample_fraction == 0.5
    )
    monkeypatch.setenv("SWITCHYARD_AGENT_CALIBRATION_FRACTION", "0.25")  # a deployment of before the rename
    assert AgentSettings().routing_sample_fraction == 0.25
    monkeypatch.setenv("SWITCHYARD_AGENT_ROUTING_SAMPLE_FRACTION", "0.5")  # the new name wins
    assert AgentSettings().routing_sample_fraction == 0.5


def test_the_probe_reads_the_scheduler() -> None:
    waiting = deque([SimpleNamespace(num_prompt_tokens=50, num_computed_tokens=0)])
    running = [
        SimpleNamespace(num_prompt_tokens=80, num_computed_tokens=60),
        SimpleNamespace(num_prompt_tokens=9, num_computed_tokens=9),
    ]
    scheduler = SimpleNamespace(
        waiting=waiting, kv_holding_waiting=deque(), running=running, kv_cache_manager=SimpleNamespace(usage=0.25)
    )
    probe = SchedulerProbe(interval_s=0.0)
    probe.observe(scheduler)
    probe.observe(scheduler)  # back to back: the second call measures a step
    reading = probe.read()
    assert (reading["num_running"], reading["num_waiting"], reading["kv_usage"]) == (2, 1, 0.25)
    assert (reading["waiting_prefill_tokens"], reading["remaining_prefill_tokens"]) == (50, 20)
    assert reading["step_time_ema"] > 0.0
    Telemetry(engine_id="e", seq=0, ts=1.0, **reading)  # a valid telemetry body


def test_telemetry_keeps_a_request_that_came_and_went_between_two_messages() -> None:
    """The race that made the real-vLLM test flaky: a request admitted and finished within one 100 ms interval."""
    busy = SimpleNamespace(
        waiting=deque([SimpleNamespace(num_prompt_tokens=30, num_computed_tokens=0)]),
        kv_holding_waiting=deque(),
        running=[SimpleNamespace(num_prompt_tokens=40, num_computed_tokens=0)],
        kv_cache_manager=SimpleNamespace(usage=0.5),
    )
    idle = SimpleNamespace(
        waiting=deque(), kv_holding_waiting=deque(), running=[], kv_cache_manager=SimpleNamespace(usage=0.0)
    )
    probe = SchedulerProbe(interval_s=0.0)
    probe.observe(busy)
    probe.observe(idle, step=False)  # update_from_output: the requests finished before any message went out
    reading = probe.read()
    assert (reading["num_running"], reading["num_waiting"]) == (1, 1)  # the peak since the last message
    assert (reading["waiting_prefill_tokens"], reading["remaining_prefill_tokens"]) == (30, 40)
    assert reading["kv_usage"] == 0.0  # a level, not a peak: the latest value
    quiet = probe.read()  # no step since: the state after the last one
    assert (quiet["num_running"], quiet["num_waiting"], quiet["remaining_prefill_tokens"]) == (0, 0, 0)


def test_sjf_with_aging_reorders_the_waiting_queue() -> None:
    """Gimbal's Algorithm 2 on vLLM's deque: aged first (longest wait first), then fewest tokens to prefill."""

    def req(name: str, prompt: int, computed: int, arrived: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, num_prompt_tokens=prompt, num_computed_tokens=computed, arrival_time=arrived)

    queue = deque([req("long", 900, 0, 99.0), req("old-long", 800, 0, 90.0), req("short", 20, 0, 99.5)])
    queue.append(req("chunked", 900, 880, 99.8))  # 20 left, arrived later than "short": the tie keeps queue order
    queue.append(req("older-long", 700, 0, 80.0))
    assert sjf_order(queue, GimbalParams(age_threshold_s=5.0), now=100.0)
    assert [r.name for r in queue] == ["older-long", "old-long", "short", "chunked", "long"]
    assert not sjf_order(queue, GimbalParams(age_threshold_s=5.0), now=100.0)  # already in order: untouched


def test_expert_pressure_and_source_ranks_follow_vllms_expert_parallel_layout() -> None:
    """Gimbal's MoE pressure from real counts (vLLM's linear expert map), and DP+EP source attribution."""
    config = SimpleNamespace(data_parallel_size=2, data_parallel_rank=1, tensor_parallel_size=2)
    assert expert_parallelism(config) == (1, 1, 2)  # no EP: every expert is local
    assert expert_parallelism(SimpleNamespace(**vars(config), enable_expert_parallel=True)) == (4, 1, 2)
    counts = np.array([[4, 4, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    assert expert_pressure(counts, 1) == 1.0
    assert expert_pressure(counts, 4) == pytest.approx((8 / 3 + 1.0) / 2)  # rank loads [8, 2, 2, 0] and even
    assert expert_pressure(np.ones((2, 10)), 4) == pytest.approx(1.2)  # 10 experts on 4 ranks: [3, 3, 2, 2]
    assert expert_pressure(np.zeros((2, 8)), 4) == 1.0
    sources = source_counts(counts, dp_rank=1, dp_size=2, tp_size=2)
    assert sources is not None and sources.shape == (2, 4, 8)
    np.testing.assert_array_equal(sources[:, 2], counts)  # DP rank 1 starts at EP rank 2
    assert sources.sum() == counts.sum() and source_counts(counts, 0, 1, 2) is None
    ExpertLoad(
        engine_id="e", ep_group="g", seq=0, window_start=0, window_end=1, expert_counts=counts, source_counts=sources
    )  # a valid window


def test_a_request_whose_prefill_ends_in_a_step_names_its_blocks() -> None:
    """Which requests finish their prefill in a step, with the KV blocks of their whole prompt (cached ones too)."""
    table = np.array([[7, 3, 9, 0], [4, 5, 0, 0], [2, 6, 8, 1]])
    cached = {"hit": 32, "gone": 16}
    finished = prefill_ends(
        ["hit", "decoding", "chunked", None],
        num_scheduled=np.array([8, 1, 16, 5]),
        num_computed=np.array([32, 20, 0, 0]),
        num_prompt=np.array([40, 18, 48, 5]),
        block_table=table,
        block_size=16,
        cached=cached,
    )
    assert [(f.request_id, f.prompt_tokens, f.cached_tokens, f.blocks.tolist()) for f in finished] == [
        ("hit", 40, 32, [7, 3, 9])  # its prefill ends: 3 blocks hold 40 tokens, 2 of them from the cache
    ]
    assert cached == {"gone": 16}  # consumed once
    later = prefill_ends(["chunked"], np.array([32]), np.array([16]), np.array([48]), table[2:], 16, cached)
    assert [(f.request_id, f.cached_tokens, f.blocks.tolist()) for f in later] == [("chunked", 0, [2, 6, 8])]


async def test_the_engine_core_agent_speaks_the_contract(bus: Bus, settings: SwitchyardSettings) -> None:
    hello = build_hello(_vllm_config(tp=4), 100, AgentSettings(engine_id="v0", telemetry_interval_s=0.05), "t")
    hellos: list[Hello] = []
    telemetry: list[Telemetry] = []
    await bus.subscribe(bus.subjects.hello("v0"), Hello, lambda m, _: hellos.append(m))
    await bus.subscribe(bus.subjects.telemetry("v0"), Telemetry, lambda m, _: telemetry.append(m))
    reading = {
        "kv_usage": 0.5,
        "num_running": 3,
        "num_waiting": 1,
        "waiting_prefill_tokens": 10,
        "remaining_prefill_tokens": 2,
        "step_time_ema": 0.02,
    }
    agent = EngineCoreAgent(hello, lambda: reading, AgentThread("v0", settings), ep_size=2)
    assert await asyncio.to_thread(agent.start)
    try:
        await eventually(lambda: _at_least(telemetry, 3))
        assert hellos[0].engine_id == "v0" and hellos[0].ts > 0
        assert [t.seq for t in telemetry[:3]] == [0, 1, 2] and telemetry[0].num_running == 3
        assert telemetry[0].expert_pressure == 1.0  # no window yet
        # The worker's window (another process) comes back over NATS: rank 0's experts take 3/4 of the load.
        counts = np.zeros((48, 128), np.uint32)
        counts[:, :64], counts[:, 64:] = 3, 1
        window = ExpertLoad(
            engine_id="v0", ep_group="v0", seq=0, window_start=1.0, window_end=2.0, expert_counts=counts
        )
        await bus.publish(bus.subjects.expert_load("v0"), window)
        await eventually(lambda: _pressure_is(telemetry, 1.5))
        layout = await bus.request(bus.subjects.layout("v0"), LayoutRequest(engine_group="v0"), LayoutReply)
        assert layout.layout.shape == (48, 4, 32) and layout.version == 0
        np.testing.assert_array_equal(layout.layout[5, 1], np.arange(32, 64))  # vLLM's contiguous ranges
        step = MigrateRequest(plan_id="p", version=1, engine_group="v0", step=0, moves=np.zeros((0, 6), np.int32))
        refused = await bus.request(bus.subjects.migrate("v0"), step, MigrateReply)
        assert refused.applied == 0 and "does not move experts" in (refused.failure or "")
    finally:
        await asyncio.to_thread(agent.thread.stop)


async def test_expert_load_windows_reach_the_stream(bus: Bus, settings: SwitchyardSettings) -> None:
    await bus.ensure_streams()
    windows: list[ExpertLoad] = []

    async def on_window(msg: Msg) -> None:
        windows.append(decode(msg.data, ExpertLoad))

    await bus.js.subscribe(bus.subjects.expert_load("v1"), stream=bus.subjects.expert_load_stream, cb=on_window)
    taken = iter(np.full((2, 2, 4), 3, dtype=np.uint32))
    publisher = ExpertLoadPublisher("v1", "g1", lambda: next(taken), 0.05, AgentThread("v1", settings))
    assert await asyncio.to_thread(publisher.start)
    try:
        await eventually(lambda: _at_least(windows, 2))
    finally:
        await asyncio.to_thread(publisher.thread.stop)
    assert [w.seq for w in windows[:2]] == [0, 1] and windows[0].ep_group == "g1"
    assert windows[0].window_end == windows[1].window_start  # windows tile time
    assert int(windows[0].expert_counts.sum()) == 24


async def test_an_unreachable_nats_leaves_the_engine_alone(settings: SwitchyardSettings) -> None:
    unreachable = settings.model_copy(update={"nats_servers": ["nats://127.0.0.1:1"], "nats_initial_connect_s": 0.5})
    agent = EngineCoreAgent(
        build_hello(_vllm_config(), 1, AgentSettings(engine_id="v2"), "t"), dict, AgentThread("v2", unreachable)
    )
    assert await asyncio.to_thread(agent.start) is False


async def _at_least(items: list, count: int) -> bool:
    return len(items) >= count


async def _pressure_is(telemetry: list[Telemetry], value: float) -> bool:
    return telemetry[-1].expert_pressure == value


def test_the_tracker_attributes_rows_to_requests_and_phases() -> None:
    tracker = RequestTracker(num_layers=2, num_experts=4, fraction=1.0)
    # Step 1: "a" prefills 3 of its 5 prompt tokens, "b" decodes one token (its prompt of 2 is done).
    rows = tracker.plan_step(["a", "b"], np.array([3, 1]), np.array([0, 4]), np.array([5, 2]))
    assert rows.tolist() == [0, 1, 2, 3]
    step1 = np.array([[[0, 1], [0, 1], [2, 3], [1, 2]], [[3, 2], [3, 2], [3, 0], [0, 1]]])  # [L, rows, k]
    tracker.absorb(step1)
    # Step 2: "a" finishes its prompt (2 tokens) and decodes one more, in the same chunk.
    tracker.plan_step(["a"], np.array([3]), np.array([3]), np.array([5]))
    tracker.absorb(np.array([[[0, 3], [0, 3], [1, 1]], [[2, 2], [2, 2], [1, -1]]]))  # -1: a padding slot
    done = dict(tracker.finish({"a", "b", "never-seen"}))
    a, b = done["a"], done["b"]
    assert (a.prefill_tokens, a.decode_tokens, b.prefill_tokens, b.decode_tokens) == (5, 1, 0, 1)
    assert a.prefill[0].tolist() == [4, 2, 1, 3] and a.prefill[1].tolist() == [1, 0, 6, 3]
    assert a.decode[0].tolist() == [0, 2, 0, 0] and a.decode[1].tolist() == [0, 1, 0, 0]
    assert b.decode[0].tolist() == [0, 1, 1, 0] and b.prefill.sum() == 0
    assert tracker.requests == {}


def test_the_tracker_samples_a_stable_fraction() -> None:
    tracker = RequestTracker(num_layers=1, num_experts=2, fraction=0.1)
    chosen = [tracker.sampled(f"req-{i}") for i in range(5_000)]
    assert 0.08 < sum(chosen) / len(chosen) < 0.12
    assert chosen == [RequestTracker(1, 2, 0.1).sampled(f"req-{i}") for i in range(5_000)]  # any process agrees
    assert tracker.plan_step(["x"], np.array([4]), np.array([0]), np.array([4])).size in (0, 4)


def test_the_endpoint_the_kv_event_relay_connects_to() -> None:
    """Where vLLM's KV-event publisher is reachable from the engine's own process (`kv_relay.local_endpoint`)."""
    assert local_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://*:5557", "tcp://*:5559") == "tcp://127.0.0.1:5559"  # DP rank 2's offset
    assert local_endpoint("tcp://*:0", "tcp://10.1.2.3:41000") == "tcp://10.1.2.3:41000"
    assert local_endpoint("tcp://[::]:5557") == "tcp://[::1]:5557"
    assert local_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv"
    assert local_endpoint("tcp://collector:5557") is None  # vLLM connects out: nothing to subscribe to here

    class Config:
        enable_kv_cache_events, publisher, endpoint, topic = True, "zmq", "tcp://*:6000", "t"

    assert kv_events_endpoint(Config(), "tcp://*:6001") == ("tcp://127.0.0.1:6001", "t")
    Config.publisher = "null"
    assert "null" in kv_events_endpoint(Config(), None)  # type: ignore[operator]
    assert "no --kv-events-config" in kv_events_endpoint(None, None)  # type: ignore[operator]
