"""Session affinity in the DP simulator (issue 42 item 3): the gateway's "sticky until saturated" rule
(`services.gateway.sessions`) in front of any DP profile, and the sessions of a trace that names none.

The rule, as the gateway applies it: a request of a session goes to the engine of the session's previous request
while that engine has room below saturation (requests outstanding below `limit`, the gateway's
`saturation_concurrency` or the engine's `max_num_seqs`, and KV usage below `kv_limit`, by the telemetry the
dispatcher holds); otherwise the profile chooses as for any request, and the session moves to its choice. A
pinned choice is booked exactly as the profile's would be (ledger, prefix index, outstanding counts): the
dispatcher runs its own `choose`, with the profile answering the pinned engine.

Sessions of the Mooncake trace (`conversation_sessions`): the FAST'25 trace names no sessions, only each
prompt's chained block hashes. A request whose prompt begins with the whole prompt of an earlier request is
taken as that request's next turn (its history, then the answer and the new message), and belongs to its
session; any other request opens a session. "Whole" but for its last block: a prompt's last block is partial
(Mooncake's 512-token blocks), and the next turn's text fills it differently. An assumption, stated as one:
prompts merely sharing a system prompt are not linked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["StickyProfile", "conversation_sessions", "sticky"]


def conversation_sessions(hash_ids: Sequence[np.ndarray]) -> np.ndarray:
    """Each request's session (0, 1, ... in order of first request): the session of the latest earlier request
    whose prompt, but for its last block, this one begins with (see the module docstring), else a new one."""
    sessions = np.empty(len(hash_ids), dtype=np.int64)
    seen: dict[tuple[int, ...], int] = {}  # a prompt's block hashes but its last (a partial block) -> its session
    opened = 0
    for r, ids in enumerate(hash_ids):
        blocks = tuple(int(h) for h in ids)
        session = -1
        for k in range(len(blocks), 0, -1):  # the longest earlier prompt that this one continues
            session = seen.get(blocks[:k], -1)
            if session >= 0:
                break
        if session < 0:
            session, opened = opened, opened + 1
        sessions[r] = session
        seen[blocks[:-1] if len(blocks) > 1 else blocks] = session
    return sessions


class _Pinned(NamedTuple):
    index: int


class StickyProfile:
    """A DP profile that answers `pin` while it is set, else asks the profile it wraps (its attributes too)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pin: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any) -> Any:
        return _Pinned(self.pin) if self.pin is not None else self.inner(*args)


class _Counts:
    sticky = saturated = moved = 0


def sticky(
    disp: Any, sessions: np.ndarray, limit: int, kv_limit: float = 0.95
) -> tuple[Callable[[float, int, Any, int], int], _Counts]:
    """Wrap dispatcher `disp` (`dp_dispatch.Dispatcher`) so each request `rid` of session `sessions[rid]` (−1:
    none) is held on its session's engine while that engine has room; returns the new `choose` (installed on
    `disp`) and the counts (sticky, saturated, moved) it keeps."""
    profile = StickyProfile(disp.profile)
    disp.profile = profile
    choose = disp.choose
    engine_of: dict[int, int] = {}  # session -> its last request's engine
    counts = _Counts()

    def sticky_choose(now: float, prompt_tokens: int, keys: Any = None, rid: int = -1) -> int:
        session = int(sessions[rid]) if rid >= 0 else -1
        held = engine_of.get(session, -1) if session >= 0 else -1
        if held >= 0 and disp.outstanding[held] < limit and disp.kv[held] < kv_limit:
            profile.pin = held
            counts.sticky += 1
        elif held >= 0:
            counts.saturated += 1
        try:
            engine = choose(now, prompt_tokens, keys, rid)
        finally:
            profile.pin = None
        if held >= 0 and engine != held:
            counts.moved += 1
        if session >= 0:
            engine_of[session] = engine
        return engine

    disp.choose = sticky_choose
    return sticky_choose, counts
