"""What the core's two decisions read of their request: one kind of ask for both, in both shapes.

`RouterCore.route_dp` takes a `DpAsk` and `route_decode` a `DecodeAsk`: protocols with the fields of
`RouteDpRequest` and `RouteDecodeRequest`. From the bus (`switchyard router`) those pydantic models are the asks,
validated when decoded: the bus is the boundary. In process (the gateway, the endpoint picker) every field is the
caller's own or was checked where it came in (its request id, a positive count, the uint64 block keys it computed,
a signature parsed at the HTTP or bus boundary, an engine id from its registry), so the asks are plain slotted
objects, `LocalDpAsk` and `LocalDecodeAsk`: building the pydantic model, even unvalidated (`model_construct`),
cost ~75 µs of a cold request's TTFT here (`bench/bench_gateway.py`), these ~2 µs. The remote shape sends the
same objects (`wire()`, packed unchecked: nothing in them is a stranger's).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import numpy as np

from switchyard.shared.codec import array_to_wire

__all__ = ["LOCAL_REPORTER", "DecodeAsk", "DpAsk", "LocalDecodeAsk", "LocalDpAsk"]

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


class DecodeAsk(Protocol):
    """The fields of `RouteDecodeRequest` that `RouterCore.route_decode` reads."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def signature(self) -> np.ndarray | None: ...
    @property
    def layers(self) -> list[int] | None: ...
    @property
    def label(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def prefill_engine_id(self) -> str | None: ...


class LocalDpAsk:
    """A `DpAsk` made in-process (see the module docstring: no validation, so only for values the caller made)."""

    __slots__ = ("block_keys", "key_kind", "model", "progress", "prompt_tokens", "reporter", "request_id")

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        model: str | None,
        block_keys: np.ndarray | None,
        key_kind: Literal["tokens", "text"],
        progress: bool,
        reporter: str | None = LOCAL_REPORTER,
    ) -> None:
        self.request_id, self.prompt_tokens, self.model = request_id, prompt_tokens, model
        self.block_keys, self.key_kind, self.progress = block_keys, key_kind, progress
        #: Who reports its progress: this process (`LOCAL_REPORTER`), or the remote shape's NATS user.
        self.reporter = reporter

    def wire(self) -> dict[str, Any]:
        """`RouteDpRequest`'s fields, for `encode_unchecked` (the remote shape)."""
        fields: dict[str, Any] = {"request_id": self.request_id, "prompt_tokens": self.prompt_tokens}
        fields["model"] = self.model
        if self.progress:
            fields["progress"], fields["reporter"] = True, self.reporter
        if self.block_keys is not None and len(self.block_keys):  # uint64 keys, at most MAX_PROMPT_BLOCKS
            fields["block_keys"], fields["key_kind"] = array_to_wire(self.block_keys), self.key_kind
        return fields


class LocalDecodeAsk:
    """A `DecodeAsk` made in-process (no validation: the signature was checked where it came in)."""

    __slots__ = ("label", "layers", "model", "prefill_engine_id", "prompt_tokens", "request_id", "signature")

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        signature: np.ndarray | None,
        prefill_engine_id: str | None,
        model: str | None,
        layers: list[int] | None = None,
        label: str | None = None,
    ) -> None:
        self.request_id, self.prompt_tokens, self.signature = request_id, prompt_tokens, signature
        self.prefill_engine_id, self.model, self.layers, self.label = prefill_engine_id, model, layers, label

    def wire(self) -> dict[str, Any]:
        """`RouteDecodeRequest`'s fields, for `encode_unchecked` (the remote shape)."""
        fields: dict[str, Any] = {"request_id": self.request_id, "prompt_tokens": self.prompt_tokens}
        fields["model"], fields["prefill_engine_id"] = self.model, self.prefill_engine_id
        if self.signature is not None:
            fields["signature"] = array_to_wire(self.signature)
        if self.layers is not None:
            fields["layers"] = self.layers
        if self.label is not None:
            fields["label"] = self.label
        return fields
