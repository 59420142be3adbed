"""Flood the expert-load stream from one engine's credentials and report what the store holds (issue 29).

A private nats-server runs with the generated per-role users; placement sets the streams up with the settings
(the environment's `SWITCHYARD_STREAM_*`, or the flags here); engine `e1` publishes one honest window, then
engine `e0` publishes near-limit incompressible payloads on its own expert-load subject, as fast as the server
acks them, for `--seconds`. Printed: bytes sent, the stream's bytes and messages, the JetStream store on disk
before and after, and whether `e1`'s window survived.

    python bench/stream_flood.py --seconds 20 --windows-per-engine 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.embedded import EmbeddedNats
from switchyard.shared.nats_auth import Credentials, engine_user, render_authorization
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.subjects import Subjects


def _du(path: Path) -> int:
    """Bytes on disk under `path` (what the server really stored, not what it reports)."""
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


async def flood(server: EmbeddedNats, subjects: Subjects, creds_path: Path, args: argparse.Namespace) -> None:
    extra = {"stream_expert_load_windows_per_engine": args.windows_per_engine} if args.windows_per_engine else {}
    settings = SwitchyardSettings(
        nats_servers=[server.url], subject_prefix=subjects.prefix, nats_credentials=creds_path, **extra
    )
    placement = await Bus.connect(settings, name="placement", role="placement")
    honest = await Bus.connect(settings, name="e1", role=engine_user("e1"))
    attacker = await Bus.connect(settings, name="e0", role=engine_user("e0"))
    store = server.store_dir / "jetstream"
    try:
        await placement.ensure_streams()
        counts = np.arange(58 * 256, dtype=np.uint32).reshape(58, 256)  # a DeepSeek-V3 window
        window = s.ExpertLoad(engine_id="e1", ep_group="g0", seq=1, window_start=0, window_end=1, expert_counts=counts)
        await honest.js_publish(subjects.expert_load("e1"), window)
        before = _du(store)
        size = getattr(settings, "stream_expert_load_window_bytes", 8 * 1024 * 1024) - 4096
        payload, js, sent, refused = os.urandom(size), attacker.nc.jetstream(), 0, 0
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            results = await asyncio.gather(
                *(js.publish(subjects.expert_load("e0"), payload) for _ in range(16)), return_exceptions=True
            )
            refused += sum(isinstance(r, Exception) for r in results)
            sent += size * sum(not isinstance(r, Exception) for r in results)
        info = await placement.js.stream_info(subjects.expert_load_stream)
        try:
            kept = (await placement.js.get_last_msg(subjects.expert_load_stream, subjects.expert_load("e1"))).seq
        except Exception:
            kept = None
        print(f"flood: {args.seconds:.0f} s, {sent / 2**20:.0f} MiB acked ({size} B each), {refused} refused")
        print(
            f"stream: {info.state.bytes / 2**20:.1f} MiB in {info.state.messages} messages, max_bytes "
            f"{info.config.max_bytes}, per subject {info.config.max_msgs_per_subject}"
        )
        print(f"store on disk: {before / 2**20:.1f} MiB before, {_du(store) / 2**20:.1f} MiB after")
        print(f"e1's window: {f'kept (seq {kept})' if kept else 'GONE'}")
    finally:
        await attacker.close()
        await honest.close()
        await placement.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--windows-per-engine", type=int, default=0, help="0: the settings' default")
    args = parser.parse_args()
    subjects = Subjects("flood" + uuid.uuid4().hex[:6])
    with tempfile.TemporaryDirectory() as tmp:
        credentials = Credentials.generate(["placement", engine_user("e0"), engine_user("e1")])
        creds_path = Path(tmp) / "credentials.json"
        credentials.save(creds_path)
        server = EmbeddedNats(Path(tmp) / "nats", extra_config=render_authorization(subjects, credentials))
        server.start()
        try:
            asyncio.run(flood(server, subjects, creds_path, args))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
