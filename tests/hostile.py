"""Hostile payloads for every subject: what a broken or malicious peer can put on the bus.

`hostile(valid, rng, max_payload)` takes one valid message and yields `(kind, payload, refused)` triples:
random bytes, truncations, non-map tops, wrong schema versions, wrong field types, huge / negative / ragged
array dimensions, NaN and infinity, out-of-range integers, oversized strings, deeply nested maps and
payloads at the size limit. `refused` says whether the codec must reject it (checked here with `decode`, so
a generator that accidentally builds a valid message cannot make a test pass); a schema-valid hostile
message (a sequence number of 2^63, say) is yielded with `refused=False`: services must survive it, not
count it. `over_limit(max_payload)` is one byte more than the server takes: the client refuses to send it.

Used by tests/test_hostile_input.py (CI-sized) and bench/hostile_input.py (>= 100,000 messages).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from switchyard.shared.codec import WireModel, decode, encode
from switchyard.shared.errors import WireError

_WRONG_TYPES: tuple[Any, ...] = ("x", 1.5, -7, [1, 2], {"a": 1}, True, None, b"\x00\x01")
_BAD_SHAPES: tuple[Any, ...] = (
    [2**31, 2**31],
    [-1, 4],
    [4, -1],
    [],
    [1, 1, 1, 1, 1],
    ["a", 2],
    [2**63, 1],
    [1.5, 2],
)
_BAD_DTYPES: tuple[Any, ...] = ("<c8", "O", "<U4", "|V8", "<M8", "", "x" * 40, 7, None)
_BAD_INTS: tuple[int, ...] = (-1, -(2**63), 2**63, 2**64 - 1)
_BAD_FLOATS: tuple[float, ...] = (math.nan, math.inf, -math.inf, -1.0, 1e308)


def _is_array(value: Any) -> bool:
    return isinstance(value, dict) and {"dtype", "shape", "data"} <= set(value)


def _refused(payload: bytes, schema: type[WireModel], max_payload: int) -> bool:
    """True if the codec rejects it with a WireError; any other exception is a codec bug and propagates."""
    try:
        decode(payload, schema, max_payload)
    except WireError:
        return True
    return False


def deep_map(depth: int) -> bytes:
    """`{"v": 1, "a": {"a": {... depth levels ...}}}` built byte by byte (msgpack's packer would recurse)."""
    return b"\x82\xa1v\x01\xa1a" + b"\x81\xa1a" * depth + b"\xc0"


def over_limit(max_payload: int) -> bytes:
    return b"\x80" * (max_payload + 1)


def _variants(obj: dict[str, Any], rng: np.random.Generator) -> Iterator[tuple[str, dict[str, Any]]]:
    """Field-level corruptions of a valid message's map."""
    for version in (0, 2, -1, 2**64 - 1, "1", True, None, 1.0):
        yield "wrong_version", {**obj, "v": version}
    yield "no_version", {k: v for k, v in obj.items() if k != "v"}
    for name, value in obj.items():
        if name == "v":
            continue
        yield "missing_field", {k: v for k, v in obj.items() if k != name}
        for wrong in _WRONG_TYPES:
            if type(wrong) is not type(value):
                yield "wrong_type", {**obj, name: wrong}
        if isinstance(value, str):
            yield "huge_string", {**obj, name: "x" * 100_000}
            yield "nul_string", {**obj, name: "a\x00b"}
        if isinstance(value, int) and not isinstance(value, bool):
            for bad in _BAD_INTS:
                yield "int_range", {**obj, name: bad}
        if isinstance(value, float):
            for bad in _BAD_FLOATS:
                yield "nan_inf", {**obj, name: bad}
        if isinstance(value, list):
            yield "huge_list", {**obj, name: ["x"] * 5000}
        if _is_array(value):
            for shape in _BAD_SHAPES:
                yield "bad_dims", {**obj, name: {**value, "shape": shape}}
            for dtype in _BAD_DTYPES:
                yield "bad_dtype", {**obj, name: {**value, "dtype": dtype}}
            yield "ragged_data", {**obj, name: {**value, "data": value["data"][:-1] or b"\x00"}}
            yield "no_data", {**obj, name: {"dtype": value["dtype"], "shape": value["shape"]}}
            shape = [int(s) for s in value["shape"]]
            size = int(np.prod(shape))
            floats = np.full(size, np.nan, dtype="<f4")
            floats[: size // 2] = np.inf
            yield "nan_array", {**obj, name: {"dtype": "<f4", "shape": shape, "data": floats.tobytes()}}
            negative = np.full(size, -5, dtype="<i4")
            yield "negative_array", {**obj, name: {"dtype": "<i4", "shape": shape, "data": negative.tobytes()}}
            zero = [shape[0], 0, *shape[2:]] if len(shape) > 1 else [0]
            yield "zero_dims", {**obj, name: {"dtype": value["dtype"], "shape": zero, "data": b""}}
            big = [min(s * 64, 4096) for s in shape]
            data = np.zeros(int(np.prod(big)), dtype=np.dtype(value["dtype"])).tobytes()
            yield "huge_dims", {**obj, name: {"dtype": value["dtype"], "shape": big, "data": data}}


def hostile(
    valid: WireModel, rng: np.random.Generator, max_payload: int, *, at_limit: bool = True
) -> Iterator[tuple[str, bytes, bool]]:
    """Every hostile variant of `valid`, then random ones (with `rng`); see the module docstring."""
    schema = type(valid)
    good = encode(valid)
    obj = msgpack.unpackb(good, raw=False)

    def judged(kind: str, payload: bytes) -> tuple[str, bytes, bool]:
        return kind, payload, _refused(payload, schema, max_payload)

    for top in ([1, 2, 3], "hello", 42, None, 1.5, b"\xff" * 16, True):
        yield judged("not_a_map", msgpack.packb(top))
    yield judged("empty", b"")
    for cut in sorted({1, len(good) // 3, len(good) // 2, len(good) - 1}):
        yield judged("truncated", good[:cut])
    yield judged("trailing_bytes", good + b"\x00")
    for depth in (100, 10_000, 200_000):
        yield judged("deep_nesting", deep_map(depth))
    yield judged("wide_map", msgpack.packb({"v": 1, **{f"k{i}": i for i in range(70_000)}}))
    for kind, variant in _variants(obj, rng):
        try:
            payload = msgpack.packb(variant, use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            continue  # msgpack cannot even express it (an int beyond 64 bits)
        if len(payload) <= max_payload:
            yield judged(kind, payload)
    if at_limit:
        yield judged("at_limit", bytes(rng.integers(0, 256, max_payload, dtype=np.uint8)))
    while True:  # then forever: random bytes and random single-byte corruptions of the valid message
        if rng.random() < 0.5:
            yield judged("random_bytes", bytes(rng.integers(0, 256, int(rng.integers(0, 512)), dtype=np.uint8)))
        else:
            flipped = bytearray(good)
            for _ in range(int(rng.integers(1, 4))):
                flipped[int(rng.integers(0, len(flipped)))] = int(rng.integers(0, 256))
            yield judged("flipped_bytes", bytes(flipped))


def take(
    valid: WireModel, rng: np.random.Generator, max_payload: int, n: int, **kw: Any
) -> list[tuple[str, bytes, bool]]:
    """The first `n` hostile variants (every systematic one first, if `n` is large enough)."""
    out = []
    for item in hostile(valid, rng, max_payload, **kw):
        out.append(item)
        if len(out) >= n:
            break
    return out
