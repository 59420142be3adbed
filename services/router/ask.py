"""What a DP decision reads of its request, so an in-process gateway need not build a pydantic model for it.

A `RouteDpRequest` from the bus has these fields, validated on decode. An in-process gateway's own requests are
`LocalDpAsk`s: the same fields, all of them the gateway's own (its request id, a positive count, the uint64 keys it
computed), in a plain slotted object. Building the pydantic model unvalidated (`model_construct`) cost ~75 µs of a
cold request's TTFT here (`bench/bench_gateway.py`), this ~2 µs.
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np

__all__ = ["LOCAL_REPORTER", "DpAsk", "LocalDpAsk"]

#: The reporter of an in-process gateway's own asks: its progress settles the core directly
#: (`CoreFeed.settle`). No bus subject token is empty, so no report from the bus can name it.
LOCAL_REPORTER = ""


class DpAsk(Protocol):
    """The fields of `RouteDpRequest` that `RouterCore.route_dp` and the prefix index read."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def model(self) -> str | None: ...
    @property
    def block_keys(self) -> np.ndarray | None: ...
    @property
    def key_kind(self) -> Literal["tokens", "text"]: ...
    @property
    def progress(self) -> bool: ...
    @property
    def reporter(self) -> str | None: ...


class LocalDpAsk:
    """A `DpAsk` made in-process (see the module docstring: no validation, so only for values the caller made)."""

    __slots__ = ("block_keys", "key_kind", "model", "progress", "prompt_tokens", "request_id")
    reporter = LOCAL_REPORTER  # its progress comes from this process, never the bus

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        model: str | None,
        block_keys: np.ndarray | None,
        key_kind: Literal["tokens", "text"],
        progress: bool,
    ) -> None:
        self.request_id, self.prompt_tokens, self.model = request_id, prompt_tokens, model
        self.block_keys, self.key_kind, self.progress = block_keys, key_kind, progress
