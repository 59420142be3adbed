"""The contract's streams are bounded (issue 29): a flood from one engine's credentials, on a real nats-server
with the generated per-role permissions, neither grows the store past its bound nor evicts another engine's
data; streams and buckets created before they had limits get them on the next start.

Small limits (a few MB) through the settings keep it fast; the defaults are sized in `shared/settings.py`.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import APIError
from pydantic import ValidationError

from switchyard.shared import schemas as s
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode
from switchyard.shared.embedded import EmbeddedNats, find_nats_server
from switchyard.shared.errors import ConfigError
from switchyard.shared.nats_auth import Credentials, engine_user, render_authorization, render_server_config
from switchyard.shared.settings import SwitchyardSettings
from switchyard.shared.stream_limits import file_store_bytes, store_bound
from switchyard.shared.subjects import Subjects
from tests.test_nats_permissions import SecuredNats

KIB, MIB = 1024, 1024 * 1024
#: One engine keeps at most 8 windows of at most 64 KiB (512 KiB); the stream holds 2 MiB.
LIMITS = {
    "stream_expert_load_window_bytes": 64 * KIB,
    "stream_expert_load_windows_per_engine": 8,
    "stream_expert_load_max_bytes": 2 * MIB,
    "kv_router_max_bytes": 4 * MIB,
}


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[SecuredNats]:
    """A nats-server with the generated per-role users (engines e0 and e1), its own per test."""
    subjects = Subjects("b" + uuid.uuid4().hex[:8])
    roles = ["admin", "placement", "migration", "fit", engine_user("e0"), engine_user("e1")]
    credentials = Credentials.generate(roles)
    path = tmp_path / "credentials.json"
    credentials.save(path)
    server = EmbeddedNats(tmp_path / "nats", extra_config=render_authorization(subjects, credentials))
    server.start()
    yield SecuredNats(server, subjects, credentials, path)
    server.stop()


def _window(engine_id: str, seq: int) -> s.ExpertLoad:
    counts = np.arange(seq, seq + 32, dtype=np.uint32).reshape(4, 8)
    return s.ExpertLoad(
        engine_id=engine_id, ep_group="g0", seq=seq, window_start=0.0, window_end=1.0, expert_counts=counts
    )


async def test_a_flood_from_one_engine_stays_in_its_share(secured: SecuredNats) -> None:
    settings = secured.settings(**LIMITS)
    subjects = secured.subjects
    placement = await Bus.connect(settings, name="placement", role="placement")
    honest = await Bus.connect(settings, name="e1", role=engine_user("e1"))
    attacker = await secured.raw(engine_user("e0"))
    try:
        await placement.ensure_streams()
        await honest.js_publish(subjects.expert_load("e1"), _window("e1", 7), msg_id="e1-7")
        js, sent = attacker.jetstream(), 0
        for _ in range(80):  # 80 x 60 KiB = 4.7 MiB of incompressible bytes, 2.3 x the stream's bound
            await js.publish(subjects.expert_load("e0"), os.urandom(60 * KIB))
            sent += 60 * KIB

        stream = subjects.expert_load_stream
        info = await placement.js.stream_info(stream, subjects_filter=subjects.all_expert_load)
        assert sent > 2 * LIMITS["stream_expert_load_max_bytes"]
        assert info.state.bytes <= LIMITS["stream_expert_load_max_bytes"]
        stored = await placement.js.get_last_msg(stream, subjects.expert_load("e1"))
        window = decode(stored.data, s.ExpertLoad)  # the honest engine's window is still there, intact
        assert window.seq == 7 and window.engine_id == "e1"
        np.testing.assert_array_equal(window.expert_counts, _window("e1", 7).expert_counts)
        assert info.state.subjects[subjects.expert_load("e0")] == 8  # the flood rolled out only its own windows
        with pytest.raises(APIError):  # above the largest window: refused, not stored
            await js.publish(subjects.expert_load("e0"), os.urandom(65 * KIB))
    finally:
        await attacker.close()
        await honest.close()
        await placement.close()


async def test_streams_and_buckets_made_without_limits_get_them_on_the_next_start(secured: SecuredNats) -> None:
    subjects = secured.subjects
    old = await Bus.connect(secured.settings(), name="old", role="admin")
    week = 7 * 86400.0
    try:  # what the previous release created: age and count limits only
        for name, subs, limits in [
            (subjects.expert_load_stream, [subjects.all_expert_load], {"max_age": week, "max_msgs": 1_000_000}),
            (subjects.placement_stream, [subjects.placement_plan, subjects.calibration_request], {"max_msgs": 100_000}),
        ]:
            config = StreamConfig(name=name, subjects=subs, storage=StorageType.FILE, max_msg_size=8 * MIB, **limits)
            await old.js.add_stream(config)
        await old.js.create_key_value(bucket=subjects.router_bucket, history=16, max_value_size=8 * MIB)
        for seq in range(12):
            await old.js_publish(subjects.expert_load("e0"), _window("e0", seq))
        await old.js_publish(subjects.expert_load("e1"), _window("e1", 0))
    finally:
        await old.close()

    settings = secured.settings(**LIMITS)
    placement = await Bus.connect(settings, name="placement", role="placement")
    migration = await Bus.connect(settings, name="migration", role="migration")
    fit = await Bus.connect(settings, name="fit", role="fit")
    try:
        # Two replicas start at once with the same settings: both succeed and agree.
        first, second = await asyncio.gather(placement.ensure_streams(), migration.ensure_streams())
        info = await placement.js.stream_info(subjects.expert_load_stream, subjects_filter=subjects.all_expert_load)
        assert info.config.max_bytes == 2 * MIB and info.config.max_msgs_per_subject == 8
        assert info.config.max_msg_size == 64 * KIB and info.config.max_age == 3600.0
        assert info.state.subjects == {subjects.expert_load("e0"): 8, subjects.expert_load("e1"): 1}
        plans = (await placement.js.stream_info(subjects.placement_stream)).config
        assert plans.max_bytes == settings.stream_placement_max_bytes and plans.max_age == 0
        assert "updated" in (first[subjects.expert_load_stream], second[subjects.expert_load_stream])
        # The next start changes nothing.
        assert set((await migration.ensure_streams()).values()) == {"unchanged"}

        await fit.ensure_kv(subjects.router_bucket)
        bucket = (await fit.js.stream_info(f"KV_{subjects.router_bucket}")).config
        assert bucket.max_bytes == 4 * MIB and bucket.max_msgs_per_subject == 16  # history kept
    finally:
        await fit.close()
        await migration.close()
        await placement.close()


async def test_a_server_that_cannot_reserve_the_bounds_is_a_clear_error(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats", max_file_store=MIB)
    server.start()
    try:
        settings = SwitchyardSettings(nats_servers=[server.url], nats_initial_connect_s=3.0)
        bus = await Bus.connect(settings, name="small")
        try:
            with pytest.raises(ConfigError, match="max_file_store"):
                await bus.ensure_streams()
        finally:
            await bus.close()
    finally:
        server.stop()


def test_the_generated_config_holds_the_contract_bounds(tmp_path: Path) -> None:
    settings = SwitchyardSettings(_env_file=None)  # type: ignore[call-arg]
    credentials = Credentials.generate(["admin"])
    config = render_server_config(
        Subjects("sy"), credentials, store_dir=str(tmp_path / "js"), max_file_store=file_store_bytes(settings)
    )
    assert f"max_file_store: {file_store_bytes(settings)}" in config
    assert store_bound(settings) < file_store_bytes(settings) < 2 * store_bound(settings)
    path = tmp_path / "nats-server.conf"
    path.write_text(config)
    checked = subprocess.run([str(find_nats_server()), "-c", str(path), "-t"], capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_the_shipped_config_holds_the_default_bounds() -> None:
    """infra/nats/nats-server.conf's `max_file_store` is what `switchyard nats-config` writes for the defaults."""
    shipped = (Path(__file__).parents[1] / "infra" / "nats" / "nats-server.conf").read_text()
    found = re.search(r"^\s*max_file_store:\s*(\d+)\s*$", shipped, re.MULTILINE)
    assert found is not None, "no max_file_store in bytes in the shipped config"
    assert int(found.group(1)) == file_store_bytes(SwitchyardSettings(_env_file=None))  # type: ignore[call-arg]


def test_an_engine_share_above_half_the_stream_is_refused() -> None:
    """One engine at its cap must leave room for the others' windows: a share above half the stream is an error."""
    with pytest.raises(ValidationError, match="WINDOWS_PER_ENGINE"):
        SwitchyardSettings(
            _env_file=None,  # type: ignore[call-arg]
            stream_expert_load_window_bytes=MIB,
            stream_expert_load_windows_per_engine=600,
            stream_expert_load_max_bytes=1024 * MIB,
        )
