"""One engine as the engine book knows it, and what the book tells its projections."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from switchyard.shared.liveness import DEFAULT_HELLO_INTERVAL_S, DEFAULT_TELEMETRY_INTERVAL_S
from switchyard.shared.schemas import Hello, Telemetry
from switchyard.shared.sequence import Seq

__all__ = ["BookEntry", "BookListener", "BookListenerBase", "HelloChange"]


@dataclass
class BookEntry:
    """What the book holds of one engine: its last accepted hello (None while only its telemetry came), when
    each signal last came, the liveness rule's answer, and its telemetry's sequence check."""

    engine_id: str
    hello: Hello | None = None
    #: When its last accepted hello and telemetry arrived (None: never), on the book owner's clock.
    hello_at: float | None = None
    telemetry_at: float | None = None
    #: Its last accepted telemetry and that message's sequence number (None: none yet).
    telemetry: Telemetry | None = None
    last_seq: int | None = None
    #: Messages its telemetry sequence says were lost, and restarts it showed.
    telemetry_gaps: int = 0
    restarts: int = 0
    #: The liveness rule's answer for its last hello and telemetry (`shared/liveness.py`).
    live_until: float = -math.inf
    #: When its current stretch of liveness began (its first word after being unknown or dead).
    live_since: float = 0.0
    #: When it took its current (ep_group, dp_rank): a group's coordinator is settled only once it held it a while.
    joined_at: float = 0.0
    #: What its stored hello weighs (`hello_weight`; 0 without one).
    weight: int = 0
    #: The hello's HTTP base URL without a trailing slash (None: it serves no HTTP).
    base_url: str | None = None
    #: Held out of rotation by the book's owner (the in-process gateway: ejected, on trial, or serving no HTTP).
    held: bool = False

    @property
    def said_hello(self) -> bool:
        return self.hello is not None

    @property
    def role(self) -> str | None:
        return self.hello.role if self.hello is not None else None

    @property
    def model(self) -> str:
        return self.hello.model.name if self.hello is not None else ""

    @property
    def hello_interval_s(self) -> float:
        return self.hello.hello_interval_s if self.hello is not None else DEFAULT_HELLO_INTERVAL_S

    @property
    def telemetry_interval_s(self) -> float:
        return self.hello.telemetry_interval_s if self.hello is not None else DEFAULT_TELEMETRY_INTERVAL_S

    @property
    def block_size(self) -> int:
        return self.hello.capacity.block_size if self.hello is not None else 0

    @property
    def kv_blocks(self) -> int:
        return self.hello.capacity.kv_blocks if self.hello is not None else 2**31

    @property
    def slot(self) -> tuple[str, int] | None:
        return (self.hello.ep_group, self.hello.dp_rank) if self.hello is not None else None

    @property
    def last_seen(self) -> float:
        """When it was last heard from (an entry is made by its first message: always heard from once)."""
        return max(self.hello_at or 0.0, self.telemetry_at or 0.0)

    def is_live(self, now: float) -> bool:
        return now <= self.live_until


class HelloChange:
    """What an accepted hello changed: `JOIN` (the engine's first hello, or its first since it was dead),
    `CHANGE` (role, model, base URL, place or capacity), `REFRESH` (nothing but its liveness)."""

    JOIN = "join"
    CHANGE = "change"
    REFRESH = "refresh"


class BookListener(Protocol):
    """A projection of the book (the router's columns, the gateway's URLs, the fleet view's groups): told of every
    change, in the order the book made it. Each method may be left to `BookListenerBase`'s no-op."""

    def entry_added(self, entry: BookEntry) -> None:
        """The book holds a new engine (by its hello or, before one, its telemetry)."""

    def hello_accepted(self, entry: BookEntry, change: str, previous: Hello | None) -> None:
        """A hello was accepted (`HelloChange`); `previous` is the hello it replaced."""

    def telemetry_accepted(self, entry: BookEntry, telemetry: Telemetry, event: Seq, revived: bool) -> None:
        """Telemetry was accepted (not late); `revived`: the engine was dead before it."""

    def held_changed(self, entry: BookEntry) -> None:
        """The book's owner took the engine out of rotation (`entry.held`) or put it back."""

    def entries_left(self, engine_ids: list[str]) -> None:
        """The book forgot these engines (silent too long, or evicted dead to make room)."""

    def refusal(self, reason: str, engine_id: str) -> None:
        """A hello or telemetry was refused: a manifest field, `slot_taken`, `rebind_while_live`, `max_engines`,
        `max_hello_bytes`."""


class BookListenerBase:
    """No-op `BookListener` methods, for projections that need only some."""

    def entry_added(self, entry: BookEntry) -> None:
        pass

    def hello_accepted(self, entry: BookEntry, change: str, previous: Hello | None) -> None:
        pass

    def telemetry_accepted(self, entry: BookEntry, telemetry: Telemetry, event: Seq, revived: bool) -> None:
        pass

    def held_changed(self, entry: BookEntry) -> None:
        pass

    def entries_left(self, engine_ids: list[str]) -> None:
        pass

    def refusal(self, reason: str, engine_id: str) -> None:
        pass
