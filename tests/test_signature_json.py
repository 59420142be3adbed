"""The signature's JSON carrier (prefill response -> gateway) round-trips and refuses malformed input."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.errors import WireError
from switchyard.shared.signature_json import signature_from_json, signature_to_json


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, ">u2"])
def test_round_trip(dtype: object) -> None:
    counts = np.random.default_rng(0).integers(0, 200, size=(26, 64)).astype(dtype)
    back = signature_from_json(signature_to_json(counts))
    assert back.shape == (26, 64) and np.array_equal(back, counts) and back.dtype.byteorder in "<|="


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ([1, 2], "switchyard_signature"),
        ({"dtype": "<i2", "shape": [1, 1], "data": "AAA="}, "switchyard_signature.dtype"),
        ({"dtype": "<u2", "shape": [1], "data": ""}, "switchyard_signature.shape"),
        ({"dtype": "<u2", "shape": [1, -4], "data": ""}, "switchyard_signature.shape"),
        ({"dtype": "<u2", "shape": [1 << 12, 1 << 12], "data": ""}, "switchyard_signature.shape"),
        ({"dtype": "<u2", "shape": [2, 2], "data": "!!"}, "switchyard_signature.data"),
        ({"dtype": "<u2", "shape": [2, 2], "data": "AAAA"}, "switchyard_signature.data"),
    ],
)
def test_malformed_signatures_name_the_field(payload: object, field: str) -> None:
    with pytest.raises(WireError) as info:
        signature_from_json(payload)
    assert info.value.field == field


def test_only_unsigned_matrices_are_sent() -> None:
    with pytest.raises(ValueError, match="unsigned"):
        signature_to_json(np.zeros((2, 2), dtype=np.int32))
