"""The KV-event relay: vLLM's own KV-cache events, renamed in Switchyard's block keys, onto the engine's subject.

vLLM publishes what its prefix cache does when started with ``--kv-events-config`` (publisher ``zmq``): each
scheduler step's `KVEventBatch` (msgspec msgpack) goes out on a ZMQ PUB socket as three frames, ``(topic,
seq: 8 bytes big-endian, payload)``, `seq` +1 per batch. The relay runs in the engine-core process, on the
agent's bus thread: a ZMQ SUB socket connects to that endpoint (the one vLLM's publisher resolved, so a data-
parallel rank's port offset and ``tcp://*:0`` are followed), and each batch becomes `KvEvents` messages on
``sy.engine.<id>.kv`` (`shared.schemas.KvEvents`), in order, `seq` +1 per message from 0.

**Where keys are computed: here.** For each `BlockStored` the relay calls `shared.prefix_keys.block_keys` over
the block's token ids at the engine's block size, continuing the chain from the parent's key (a block with no
parent starts a chain, salt 0). The gateway names a request's prompt with the same function over the same
tokens, so the router's index matches the two **without reproducing vLLM's own hash**: vLLM's algorithm
(``--prefix-caching-hash-algo``) and seed (random unless ``PYTHONHASHSEED`` is set) need not match anything.
vLLM's hashes are only used as names inside this process: a bounded map vLLM hash -> Switchyard key, so that
a child block can be keyed from its parent and a `BlockRemoved` (which carries hashes only) can be translated.

Per op:

- `BlockStored` -> ``stored`` with the blocks' keys; the map learns each hash. A parent the map does not know
  (evicted from the map, or stored before the relay started) means the chain cannot be named: those blocks
  are skipped and counted (`KvTranslator.counts["unknown_parent"]`), and so are their children.
- `BlockRemoved` -> ``removed`` with the keys of the hashes (unknown hashes are counted and skipped); a hash
  leaves the map once no tier holds it.
- `AllBlocksCleared` -> ``cleared``, and the map is emptied.
- A gap in vLLM's batch sequence (the SUB socket dropped batches) -> ``cleared``: the router then forgets this
  engine's blocks, which re-enter as they are stored again, instead of trusting an index that missed
  removals. The map is kept (a hash names the same tokens whatever was lost), so children still chain. The
  relay also opens with ``cleared``: a restarted engine's previous blocks leave the index.

**Cache tiers.** Each op keeps the event's `medium` as its tier (`KvOp.tier`): vLLM's own KV cache reports
``GPU`` (also on the CPU backend) or none, which is tier ``gpu`` and left off the message; its offloading
connector (`--kv-transfer-config '{"kv_connector": "OffloadingConnector", ...}'`) reports ``CPU``, and a
storage tier ``STORAGE`` (tier ``disk``). A connector's event with ``"self_describing_kv_events": true`` carries
its blocks' tokens and parent, keyed as above; without it vLLM sends a placeholder (no tokens, one hash per
offloaded chunk, block size 0), keyed only when the map knows the hash (from the GPU store of the same block).

**What is lost** (skipped and counted, never guessed): blocks whose vLLM hash mixes in more than tokens —
LoRA adapters (`lora_name`/`lora_id`), multimodal inputs, ``cache_salt`` and prompt embeddings (vLLM's
`extra_keys`) — because the gateway keys a prompt from its token ids alone; blocks on a medium vLLM does not
name (counted as `other_medium`); KV-cache groups other than group 0 (hybrid models); and events whose token
count is not one engine block per hash (partial or masked blocks). When vLLM stores a block
twice under one hash (two requests computing one prefix at once) and evicts one copy, the key is removed
though a copy stays: the index then under-reports, which only costs a routing hint.

vLLM publishes a step's events after the step; so that an `AllBlocksCleared` from ``POST /reset_prefix_cache``
on an idle engine does not wait for its next step, the plugin publishes a reset's events at once
(`plugin._publish_kv_events_now`). The relay costs the engine-core process the decoding and one `block_keys`
call per stored event (~90 µs for 8 blocks here, numpy's per-call overhead) on the agent's thread, never on
vLLM's scheduling thread (they share the GIL).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from switchyard.shared.prefix_keys import block_keys
from switchyard.shared.schemas import MAX_KV_EVENT_KEYS, KvEvents, KvOp

__all__ = ["KvRelay", "KvTranslator", "local_endpoint"]

log = logging.getLogger(__name__)

#: Most ops one published message carries (each op costs a few bytes of framing on top of its keys).
MAX_OPS_PER_MESSAGE = 256
#: vLLM's own medium for its KV cache (`vllm.distributed.kv_events.MEDIUM_GPU`, also on the CPU backend).
ENGINE_MEDIUM = "GPU"
#: vLLM's media (`vllm.distributed.kv_events.MEDIUM_*`) -> Switchyard's cache tiers (`KvOp.tier`).
TIER_OF_MEDIUM = {None: "gpu", "GPU": "gpu", "CPU": "cpu", "STORAGE": "disk", "DISK": "disk"}
_TIER_BIT = {"gpu": 1, "cpu": 2, "disk": 4}
#: Batches drained from the socket into one round of messages at most (then the loop yields).
MAX_BATCHES_PER_ROUND = 64


class KvTranslator:
    """vLLM KV events -> Switchyard `KvOp`s for one engine (pure; no socket, no bus).

    `max_hashes` bounds the vLLM hash -> key map (oldest learned out first); an engine holds at most its KV
    block count of cached blocks at once, so twice that loses nothing but stale entries.
    """

    COUNTERS = (
        "stored",
        "removed",
        "cleared",
        "stored_cpu",
        "stored_disk",
        "unknown_parent",
        "unknown_removed",
        "unsupported",
        "other_medium",
        "other_group",
        "irregular",
    )

    def __init__(self, block_size: int, max_hashes: int = 1 << 20) -> None:
        if block_size <= 0 or max_hashes <= 0:
            raise ValueError("block_size and max_hashes must be positive")
        self.block_size = block_size
        self.max_hashes = max_hashes
        self.keys: dict[Any, int] = {}  # vLLM hash (int, or bytes with int hashes off) -> Switchyard key
        self.tiers: dict[Any, int] = {}  # vLLM hash -> the tiers holding it (bits of `_TIER_BIT`)
        #: Blocks (or events, for `cleared` and `irregular`) seen per outcome since start.
        self.counts = dict.fromkeys(self.COUNTERS, 0)

    def translate(self, events: Iterable[Any]) -> list[KvOp]:
        """One batch's events (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`) as ops, in order."""
        ops: list[tuple[str, str, list[int]]] = []
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                tier = self._tier(event)
                if tier is not None:
                    _extend(ops, "stored", tier, self._stored(event, tier))
            elif kind == "BlockRemoved":
                tier = self._tier(event)
                if tier is not None:
                    _extend(ops, "removed", tier, self._removed(event, tier))
            elif kind == "AllBlocksCleared":
                self.clear()
                ops = [("cleared", "gpu", [])]  # what came before in the batch no longer matters
        return [op for kind, tier, keys in ops for op in _ops(kind, tier, keys)]

    def clear(self) -> None:
        self.keys.clear()
        self.tiers.clear()
        self.counts["cleared"] += 1

    def _tier(self, event: Any) -> str | None:
        """The event's tier, or None (counted) when it is not one the relay can name."""
        medium = getattr(event, "medium", None)
        tier = TIER_OF_MEDIUM.get(medium.upper() if isinstance(medium, str) else medium)
        if tier is None:
            self.counts["other_medium"] += len(event.block_hashes)
            return None
        if getattr(event, "group_idx", None) not in (None, 0):
            self.counts["other_group"] += len(event.block_hashes)
            return None
        return tier

    def _learn(self, vllm_hash: Any, key: int, tier: str) -> None:
        self.keys.pop(vllm_hash, None)  # a re-stored hash becomes the newest
        self.keys[vllm_hash] = key
        self.tiers[vllm_hash] = self.tiers.get(vllm_hash, 0) | _TIER_BIT[tier]

    def _stored(self, event: Any, tier: str) -> list[int]:
        hashes = list(event.block_hashes)
        if not hashes:
            return []
        if not event.token_ids and not event.block_size and tier != "gpu":  # an offload placeholder: hashes only
            return self._placeholder(hashes, tier)
        if getattr(event, "lora_name", None) is not None or getattr(event, "lora_id", None) is not None:
            self.counts["unsupported"] += len(hashes)
            return []
        extra = getattr(event, "extra_keys", None) or []
        plain = next((i for i, e in enumerate(extra) if e), len(hashes))  # blocks before the first extra key
        if plain < len(hashes):
            self.counts["unsupported"] += len(hashes) - plain
        if event.block_size != self.block_size or len(event.token_ids) != len(hashes) * self.block_size:
            self.counts["irregular"] += 1
            return []
        if not plain:
            return []
        parent = event.parent_block_hash
        parent_key = None
        if parent is not None:
            parent_key = self.keys.get(parent)
            if parent_key is None:
                self.counts["unknown_parent"] += len(hashes)
                return []
        keys = block_keys(event.token_ids[: plain * self.block_size], self.block_size, parent=parent_key).tolist()
        for vllm_hash, key in zip(hashes, keys, strict=False):
            self._learn(vllm_hash, key, tier)
        self._bound()
        self._count_stored(tier, len(keys))
        return keys

    def _placeholder(self, hashes: list[Any], tier: str) -> list[int]:
        """An offload connector's store without tokens: keyed by the map (the GPU store of the same hash)."""
        keys = []
        for vllm_hash in hashes:
            key = self.keys.get(vllm_hash)
            if key is None:
                self.counts["unknown_parent"] += 1
            else:
                self._learn(vllm_hash, key, tier)
                keys.append(key)
        self._count_stored(tier, len(keys))
        return keys

    def _count_stored(self, tier: str, n: int) -> None:
        self.counts["stored"] += n
        if tier != "gpu":
            self.counts[f"stored_{tier}"] += n

    def _bound(self) -> None:
        while len(self.keys) > self.max_hashes:
            oldest = next(iter(self.keys))
            del self.keys[oldest]
            self.tiers.pop(oldest, None)

    def _removed(self, event: Any, tier: str) -> list[int]:
        keys = []
        bit = _TIER_BIT[tier]
        for vllm_hash in event.block_hashes:
            key = self.keys.get(vllm_hash)
            if key is None:
                self.counts["unknown_removed"] += 1
                continue
            keys.append(key)
            left = self.tiers.get(vllm_hash, 0) & ~bit
            if left:
                self.tiers[vllm_hash] = left
            else:  # no tier holds it: the name goes
                del self.keys[vllm_hash]
                self.tiers.pop(vllm_hash, None)
        self.counts["removed"] += len(keys)
        return keys


def _extend(ops: list[tuple[str, str, list[int]]], kind: str, tier: str, keys: list[int]) -> None:
    """Append keys, merging with the previous op of the same kind and tier (adjacent ones only: order is kept)."""
    if not keys:
        return
    if ops and ops[-1][0] == kind and ops[-1][1] == tier:
        ops[-1][2].extend(keys)
    else:
        ops.append((kind, tier, keys))


def _ops(kind: str, tier: str, keys: list[int]) -> list[KvOp]:
    if kind == "cleared":
        return [KvOp(kind="cleared", keys=np.zeros(0, dtype=np.uint64))]
    array = np.asarray(keys, dtype=np.uint64)
    named = None if tier == "gpu" else tier  # gpu is the default: left off, as an older relay sends it
    return [
        KvOp(kind=kind, keys=array[i : i + MAX_KV_EVENT_KEYS], tier=named)
        for i in range(0, len(array), MAX_KV_EVENT_KEYS)
    ]


def messages(engine_id: str, block_size: int, ops: list[KvOp], first_seq: int) -> list[KvEvents]:
    """`ops` packed in order into `KvEvents` (≤ MAX_KV_EVENT_KEYS keys and MAX_OPS_PER_MESSAGE ops each)."""
    out: list[KvEvents] = []
    batch: list[KvOp] = []
    keys = 0
    now = time.time()
    for op in ops:
        while op is not None:
            room = MAX_KV_EVENT_KEYS - keys
            if len(batch) == MAX_OPS_PER_MESSAGE or (room == 0 and len(op.keys)):
                out.append(
                    KvEvents(engine_id=engine_id, seq=first_seq + len(out), ts=now, block_size=block_size, ops=batch)
                )
                batch, keys, room = [], 0, MAX_KV_EVENT_KEYS
            if len(op.keys) <= room:
                batch.append(op)
                keys += len(op.keys)
                op = None
            else:  # split the op at the message's remaining room
                batch.append(KvOp(kind=op.kind, keys=op.keys[:room], tier=op.tier))
                keys += room
                op = KvOp(kind=op.kind, keys=op.keys[room:], tier=op.tier)
    if batch:
        out.append(KvEvents(engine_id=engine_id, seq=first_seq + len(out), ts=now, block_size=block_size, ops=batch))
    return out


def local_endpoint(configured: str, resolved: str | None = None) -> str | None:
    """Where a subscriber in the engine's process connects to vLLM's KV-event publisher, or None if it cannot.

    `configured` is ``kv_events_config.endpoint``; `resolved` the endpoint vLLM's publisher reports once bound
    (a data-parallel rank's port offset applied, ``tcp://*:0`` turned into the node's address and port). vLLM
    binds wildcard (``tcp://*:5557``, anything with ``::``), ``ipc://`` and ``inproc://`` endpoints and
    connects to every other one: then it publishes into somebody else's socket, which the relay cannot share.
    """
    if not (configured.startswith(("ipc://", "inproc://")) or "*" in configured or "::" in configured):
        return None
    endpoint = resolved or configured
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("*", "0.0.0.0"):
        return f"tcp://127.0.0.1:{port}"
    if host.strip("[]") == "::":
        return f"tcp://[::1]:{port}"
    return endpoint


class KvRelay:
    """Subscribes to vLLM's KV-event socket and publishes `KvEvents` on the engine's subject (see the module)."""

    def __init__(
        self, engine_id: str, endpoint: str, block_size: int, topic: str = "", max_hashes: int = 1 << 20
    ) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.topic = topic
        self.block_size = block_size
        self.translator = KvTranslator(block_size, max_hashes)
        self.seq = 0  # the next KvEvents message's
        self.batches = 0  # vLLM batches received
        self.events = 0  # vLLM events decoded
        self.gaps = 0  # times vLLM's sequence skipped (batches lost)
        self.bad = 0  # frames that could not be decoded
        self._vllm_seq: int | None = None
        self._warned: set[str] = set()

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("switchyard agent: KV-event relay of %s: " + message, self.engine_id, *args)

    async def run(self, bus: Any, ready: asyncio.Event | None = None) -> None:
        """Relay until cancelled; any failure is logged once and ends only the relay, never the engine."""
        try:
            await self._run(bus, ready)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._warn_once("fatal", "stopped (%r); the router sees this engine without its prefix cache", exc)

    async def _run(self, bus: Any, ready: asyncio.Event | None) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        context = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)  # inproc:// as vLLM's socket
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.LINGER, 0)
        if self.endpoint.startswith("tcp://[") or self.endpoint.count(":") > 2:
            socket.setsockopt(zmq.IPV6, 1)
        subject = bus.subjects.kv_events(self.engine_id)
        try:
            socket.connect(self.endpoint)
            socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            # An engine (re)started with an empty cache: whatever a previous process reported is gone.
            self.translator.clear()
            await self._publish(bus, subject, [KvOp(kind="cleared", keys=np.zeros(0, dtype=np.uint64))])
            log.info("switchyard agent: relaying %s's KV events from %s to %s", self.engine_id, self.endpoint, subject)
            if ready is not None:
                ready.set()
            while True:
                frames = [await socket.recv_multipart()]
                while len(frames) < MAX_BATCHES_PER_ROUND and await socket.poll(0):
                    frames.append(await socket.recv_multipart())
                ops: list[KvOp] = []
                for frame in frames:
                    ops.extend(self._translate(frame, decoder))
                await self._publish(bus, subject, ops)
        finally:
            socket.close(linger=0)

    def _translate(self, frames: list[bytes], decoder: Any) -> list[KvOp]:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad += 1
            self._warn_once("frames", "a message of %d frames is not vLLM's (topic, seq, payload)", len(frames))
            return []
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decoder.decode(frames[2])
        except Exception as exc:
            self.bad += 1
            self._warn_once("decode", "a batch could not be decoded (%s); skipping such batches", exc)
            return []
        ops: list[KvOp] = []
        if self._vllm_seq is not None and seq != self._vllm_seq + 1:
            self.gaps += 1
            self._warn_once(
                "gap", "vLLM's batch %d followed %d: events lost, the engine's blocks cleared", seq, self._vllm_seq
            )
            # The map stays: a vLLM hash names the same content whatever was lost, so children still chain.
            self.translator.counts["cleared"] += 1
            ops.append(KvOp(kind="cleared", keys=np.zeros(0, dtype=np.uint64)))
        self._vllm_seq = seq
        self.batches += 1
        self.events += len(batch.events)
        return ops + self.translator.translate(batch.events)

    async def _publish(self, bus: Any, subject: str, ops: list[KvOp]) -> None:
        if not ops:
            return
        for message in messages(self.engine_id, self.block_size, _merge(ops), self.seq):
            self.seq += 1
            try:
                await bus.publish(subject, message)
            except Exception as exc:  # the router then misses these blocks; later ones still go out
                self._warn_once("publish", "KvEvents not published (%s)", exc)


def _merge(ops: list[KvOp]) -> list[KvOp]:
    """Adjacent ops of one kind merged (batches translated one by one each end in their own ops)."""
    out: list[KvOp] = []
    for op in ops:
        if op.kind == "cleared":
            out = [op]  # nothing before a clear matters
        elif (
            out
            and (out[-1].kind, out[-1].tier) == (op.kind, op.tier)
            and len(out[-1].keys) + len(op.keys) <= MAX_KV_EVENT_KEYS
        ):
            out[-1] = KvOp(kind=op.kind, keys=np.concatenate([out[-1].keys, op.keys]), tier=op.tier)
        else:
            out.append(op)
    return out
