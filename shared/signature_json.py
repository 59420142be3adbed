"""A prefill expert signature as it travels in JSON: inside the prefill response's `kv_transfer_params`.

At the prefill->decode handoff the gateway (like vLLM's disaggregated-serving proxy) receives the prefill
engine's completion response; the engine adds the request's signature there, so the gateway can ask
`sy.route.decode` without a second round trip. The signature is the `[L, E]` matrix of top-k selection counts
of the prompt's tokens per MoE layer (summed over the request's KV blocks, so exact under prefix caching),
with the same `{dtype, shape, data}` layout as arrays on the bus, `data` base64-encoded.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from switchyard.shared.errors import ArrayMismatch, SchemaMismatch

#: Keys the prefill engine adds to `kv_transfer_params`; the gateway strips them before the decode hop.
SIGNATURE_KEY = "switchyard_signature"
ENGINE_KEY = "switchyard_engine_id"

#: Unsigned counts only (they are never negative); uint8 fits block-granular cells, wider ones whole requests.
SIGNATURE_DTYPES = ("|u1", "<u2", "<u4")
#: Bound on L * E, far above real models (DeepSeek-V3: 58 x 256), so a hostile body cannot allocate much.
MAX_SIGNATURE_CELLS = 1 << 20


def signature_to_json(counts: np.ndarray) -> dict[str, Any]:
    """`counts [L, E]` (unsigned ints) -> a JSON-safe dict."""
    if counts.ndim != 2 or counts.dtype.kind != "u":
        raise ValueError(f"a signature is a 2-D unsigned array, got {counts.dtype} {counts.shape}")
    little = counts.astype(counts.dtype.newbyteorder("<"), copy=False)
    return {
        "dtype": little.dtype.str,
        "shape": [int(n) for n in little.shape],
        "data": base64.b64encode(np.ascontiguousarray(little).tobytes()).decode("ascii"),
    }


def signature_from_json(obj: Any, field: str = SIGNATURE_KEY) -> np.ndarray:
    """The inverse of `signature_to_json`; raises a `WireError` naming what is wrong."""
    if not isinstance(obj, dict):
        raise SchemaMismatch(field, f"expected an object with dtype, shape and data, got {type(obj).__name__}")
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if dtype not in SIGNATURE_DTYPES:
        raise ArrayMismatch(f"{field}.dtype", f"expected one of {SIGNATURE_DTYPES}, got {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise ArrayMismatch(f"{field}.shape", f"expected [layers, experts] of positive ints, got {shape!r}")
    if shape[0] * shape[1] > MAX_SIGNATURE_CELLS:
        raise ArrayMismatch(f"{field}.shape", f"{shape[0]} x {shape[1]} cells exceed {MAX_SIGNATURE_CELLS}")
    if not isinstance(data, str):
        raise SchemaMismatch(f"{field}.data", "expected a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SchemaMismatch(f"{field}.data", f"not base64: {exc}") from None
    expected = shape[0] * shape[1] * np.dtype(dtype).itemsize
    if len(raw) != expected:
        raise ArrayMismatch(f"{field}.data", f"{len(raw)} bytes for {dtype} {shape} (expected {expected})")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)
