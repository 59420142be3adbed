"""What an engine stores on JetStream is resent until the stream has it, and stored once
(`engine_agents/core/stored.py`): expert-load windows as routing samples, on a real nats-server.

The stream is missing at first (as one is while a cluster elects its leader, or a server restarts): the
publish keeps failing, then succeeds once the stream exists; a resend under the same msg-id is not stored twice.
"""

from __future__ import annotations

import asyncio

import numpy as np

from switchyard.engine_agents.core import publish_expert_load
from switchyard.shared.bus import Bus
from switchyard.shared.schemas import ExpertLoad


def _window(seq: int) -> ExpertLoad:
    counts = np.arange(8, dtype=np.int64).reshape(2, 4)
    return ExpertLoad(engine_id="e0", ep_group="g0", seq=seq, window_start=0.0, window_end=1.0, expert_counts=counts)


async def _stored(bus: Bus) -> int:
    return (await bus.js.stream_info(bus.subjects.expert_load_stream)).state.messages


async def test_a_window_published_while_its_stream_is_away_is_stored_once_it_is_back(bus: Bus) -> None:
    publishing = asyncio.create_task(publish_expert_load(bus, _window(0), "e0-0", resend_for_s=20))
    await asyncio.sleep(0.6)  # a few failed attempts: no stream answers yet
    assert not publishing.done()
    await bus.ensure_streams()
    assert await asyncio.wait_for(publishing, 10)
    assert await publish_expert_load(bus, _window(0), "e0-0")  # the same window again (a lost ack): dropped
    assert await publish_expert_load(bus, _window(1), "e0-1")
    assert await _stored(bus) == 2


async def test_a_window_never_stored_is_given_up_after_the_resend_time(bus: Bus, caplog) -> None:
    assert not await publish_expert_load(bus, _window(0), "e0-0", resend_for_s=0.6)
    assert any("expert-load window 0 not published" in r.getMessage() for r in caplog.records)
