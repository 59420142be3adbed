"""The msgpack codec: every schema round-trips, and malformed input is refused with a named field."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from switchyard.shared import schemas as s
from switchyard.shared.codec import (
    MAX_ARRAY_ELEMENTS,
    ErrorBody,
    ErrorReply,
    WireModel,
    _is_flat,
    array_to_wire,
    decode,
    decode_reply,
    encode,
    encode_unchecked,
    reply_fields,
)
from switchyard.shared.errors import (
    ArrayMismatch,
    NotMsgpack,
    PayloadTooLarge,
    RemoteError,
    SchemaMismatch,
    UnknownSchemaVersion,
    WireError,
)
from tests.strategies import ALL_MESSAGES


def assert_same(a: Any, b: Any) -> None:
    """Deep equality where arrays compare by dtype, shape and values."""
    if isinstance(a, BaseModel):
        assert type(a) is type(b)
        for name in type(a).model_fields:
            assert_same(getattr(a, name), getattr(b, name))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("schema", list(ALL_MESSAGES), ids=lambda c: c.__name__)
def test_every_schema_round_trips(schema: type) -> None:
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ALL_MESSAGES[schema])
    def check(message: Any) -> None:
        data = encode(message)
        assert isinstance(data, bytes)
        assert_same(message, decode(data, schema))

    check()


@pytest.mark.parametrize("schema", [*ALL_MESSAGES, ErrorReply], ids=lambda c: c.__name__)
def test_encoding_is_the_packed_model_dump(schema: type) -> None:
    """`encode` packs flat messages straight from their fields: the bytes must be model_dump's, exactly."""
    errors = st.builds(ErrorReply, error=st.builds(ErrorBody, code=st.text(), field=st.text(), message=st.text()))
    strategy = ALL_MESSAGES.get(schema, errors)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy)
    def check(message: Any) -> None:
        assert encode(message) == msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)

    check()


@pytest.mark.parametrize("schema", [c for c in ALL_MESSAGES if _is_flat(c)], ids=lambda c: c.__name__)
def test_unchecked_encoding_of_flat_messages_is_encode(schema: type) -> None:
    @settings(max_examples=40, deadline=None)
    @given(ALL_MESSAGES[schema])
    def check(message: Any) -> None:
        fields = {k: v for k, v in message.__dict__.items() if k != "v"}
        assert encode_unchecked(schema, fields) == encode(message)
        defaults_left_out = {k: v for k, v in fields.items() if schema.model_fields[k].is_required()}
        assert decode(encode_unchecked(schema, defaults_left_out), schema).model_dump().keys() == fields.keys() | {"v"}

    check()
    with pytest.raises(KeyError):
        encode_unchecked(schema, {})
    with pytest.raises(TypeError):  # nested models are not packed unchecked
        encode_unchecked(s.Hello, {"engine_id": "e"})


def test_unchecked_encoding_takes_an_optional_array_in_wire_form() -> None:
    keys = np.array([1, 2**64 - 1, 7], dtype=np.uint64)
    wire = encode_unchecked(
        s.RouteDpRequest, {"request_id": "r", "prompt_tokens": 48, "block_keys": array_to_wire(keys)}
    )
    assert wire == encode(s.RouteDpRequest(request_id="r", prompt_tokens=48, block_keys=keys))
    assert decode(wire, s.RouteDpRequest).block_keys.tolist() == keys.tolist()
    assert (
        decode(encode_unchecked(s.RouteDpRequest, {"request_id": "r", "prompt_tokens": 1}), s.RouteDpRequest).block_keys
        is None
    )


def test_flat_messages_take_the_fast_path() -> None:
    assert _is_flat(s.RouteDecodeReply) and _is_flat(s.RouteDecisions) and _is_flat(s.Telemetry)
    assert not _is_flat(s.RouteDecodeRequest) and not _is_flat(s.Hello) and not _is_flat(ErrorReply)


def test_arrays_travel_as_dtype_shape_bytes_not_lists() -> None:
    sig = np.arange(12, dtype=np.uint16).reshape(3, 4)
    data = encode(s.RouteDecodeRequest(request_id="r", prompt_tokens=5, signature=sig))
    raw = msgpack.unpackb(data)
    assert raw["v"] == 1
    assert raw["signature"] == {"dtype": "<u2", "shape": [3, 4], "data": sig.tobytes()}
    decoded = decode(data, s.RouteDecodeRequest).signature
    assert decoded is not None and not decoded.flags.writeable  # zero-copy views are read-only


def test_big_endian_arrays_are_sent_little_endian() -> None:
    big = np.arange(6, dtype=">u4").reshape(2, 3)
    wire = array_to_wire(big)
    assert wire["dtype"] == "<u4"
    out = decode(encode(s.RouteDecodeRequest(request_id="r", prompt_tokens=1, signature=big)), s.RouteDecodeRequest)
    np.testing.assert_array_equal(out.signature, big)


def test_a_message_carries_its_version_and_refuses_another() -> None:
    """`v` is a Literal field defaulting to the class's VERSION (no Python validator); a class that bumps VERSION
    without declaring the matching field fails on import, not on the wire."""
    assert s.RouteDpRequest(request_id="r", prompt_tokens=1).v == 1
    assert s.RouteDecisions(replica_id="r", kinds=[], request_ids=[], engine_ids=[], prompt_tokens=[]).v == 2
    with pytest.raises(ValidationError):
        s.RouteDpRequest(request_id="r", prompt_tokens=1, v=2)
    with pytest.raises(TypeError, match=r"declare `v: Literal\[3\] = 3`"):

        class Bumped(WireModel):
            VERSION: ClassVar[int] = 3


def test_error_reply_becomes_remote_error() -> None:
    reply = encode(ErrorReply.from_exception(SchemaMismatch("prompt_tokens", "must be >= 0")))
    with pytest.raises(RemoteError) as info:
        decode_reply(reply, s.RouteDecodeReply)
    assert info.value.code == "schema" and info.value.field == "prompt_tokens"


def test_reply_fields_checks_errors_and_version_but_not_values() -> None:
    reply = encode(s.RouteDpReply(request_id="r", engine_id="e1", priority=3, decision_us=1.0))
    assert reply_fields(reply, s.RouteDpReply)["engine_id"] == "e1"
    error = encode(ErrorReply.from_exception(SchemaMismatch("model", "too long")))
    with pytest.raises(RemoteError) as info:
        reply_fields(error, s.RouteDpReply)
    assert info.value.field == "model"
    newer = msgpack.packb({**msgpack.unpackb(reply), "v": s.RouteDpReply.VERSION + 1})
    with pytest.raises(UnknownSchemaVersion):
        reply_fields(newer, s.RouteDpReply)
    with pytest.raises(NotMsgpack):
        reply_fields(b"\xc1", s.RouteDpReply)
    # values are the caller's to check: a wrong type passes through
    odd = msgpack.packb({**msgpack.unpackb(reply), "engine_id": 7})
    assert reply_fields(odd, s.RouteDpReply)["engine_id"] == 7


def _valid_route() -> dict[str, Any]:
    return msgpack.unpackb(
        encode(s.RouteDecodeRequest(request_id="r1", prompt_tokens=10, signature=np.ones((2, 4), dtype=np.uint16)))
    )


def _with(path: str, value: Any, base: dict[str, Any] | None = None) -> bytes:
    obj = base if base is not None else _valid_route()
    node = obj
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return msgpack.packb(obj, use_bin_type=True)


_DELETE = object()
_HELLO = msgpack.unpackb(
    encode(
        s.Hello(
            engine_id="d0",
            role="decode",
            model=s.ModelShape(name="m", num_layers=2, num_experts=4, top_k=2),
            ep_group="g",
            gpus=["0"],
            capacity=s.Capacity(max_running=8, kv_blocks=10, block_size=16),
            ts=1.0,
            agent="sim",
        )
    )
)
_LOAD = msgpack.unpackb(
    encode(
        s.ExpertLoad(
            engine_id="e",
            ep_group="g",
            seq=0,
            window_start=0.0,
            window_end=1.0,
            expert_counts=np.zeros((2, 4), np.uint32),
            source_counts=np.zeros((2, 3, 4), np.uint32),
        )
    )
)

_ARTIFACT = msgpack.unpackb(
    encode(
        s.RoutingArtifact(
            version=1,
            content_hash="0123456789abcdef",
            created_at=1.0,
            model=s.ModelShape(name="m", num_layers=2, num_experts=4, top_k=2),
            representation="count_idf",
            layer_mask=[0],
            idf=np.ones((1, 4), np.float32),
            centroids=np.ones((2, 4), np.float32),
            tau=0.1,
            rho=0.5,
        )
    )
)
_LAYOUT = msgpack.unpackb(encode(s.LayoutReply(engine_group="g", layout=np.zeros((1, 2, 2), np.int32), version=0)))


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True))


MALFORMED: list[tuple[str, bytes, type[WireError], str, type]] = [
    ("not msgpack", b"\xc1\xc1\xc1", NotMsgpack, "", s.RouteDecodeRequest),
    ("truncated", encode(s.RouteDpRequest(request_id="x", prompt_tokens=1))[:-2], NotMsgpack, "", s.RouteDpRequest),
    (
        "trailing bytes",
        encode(s.RouteDpRequest(request_id="x", prompt_tokens=1)) + b"\x00",
        NotMsgpack,
        "",
        s.RouteDpRequest,
    ),
    ("top level list", msgpack.packb([1, 2, 3]), NotMsgpack, "", s.RouteDpRequest),
    ("top level int", msgpack.packb(7), NotMsgpack, "", s.RouteDpRequest),
    ("integer map keys", msgpack.packb({1: 2}), NotMsgpack, "", s.RouteDpRequest),
    ("invalid utf-8 string", b"\x81\xa1v\xa2\xff\xfe", NotMsgpack, "", s.RouteDpRequest),
    ("ext type", msgpack.packb({"v": msgpack.ExtType(5, b"x")}), NotMsgpack, "", s.RouteDpRequest),
    (
        "missing version",
        msgpack.packb({"request_id": "a", "prompt_tokens": 1}),
        UnknownSchemaVersion,
        "v",
        s.RouteDpRequest,
    ),
    ("future version", _with("v", 2), UnknownSchemaVersion, "v", s.RouteDecodeRequest),
    ("version as string", _with("v", "1"), UnknownSchemaVersion, "v", s.RouteDecodeRequest),
    ("missing field", _with("request_id", _DELETE), SchemaMismatch, "request_id", s.RouteDecodeRequest),
    ("negative count", _with("prompt_tokens", -1), SchemaMismatch, "prompt_tokens", s.RouteDecodeRequest),
    ("string for int", _with("prompt_tokens", "10"), SchemaMismatch, "prompt_tokens", s.RouteDecodeRequest),
    ("float for int", _with("prompt_tokens", 1.5), SchemaMismatch, "prompt_tokens", s.RouteDecodeRequest),
    ("empty request id", _with("request_id", ""), SchemaMismatch, "request_id", s.RouteDecodeRequest),
    ("array as list of ints", _with("signature", [[1, 2], [3, 4]]), ArrayMismatch, "signature", s.RouteDecodeRequest),
    ("array without data", _with("signature.data", _DELETE), ArrayMismatch, "signature", s.RouteDecodeRequest),
    ("unknown dtype", _with("signature.dtype", "<q9"), ArrayMismatch, "signature", s.RouteDecodeRequest),
    ("object dtype", _with("signature.dtype", "|O"), ArrayMismatch, "signature", s.RouteDecodeRequest),
    (
        "float where counts expected",
        _with("signature", array_to_wire(np.ones((2, 4), np.float32))),
        ArrayMismatch,
        "signature",
        s.RouteDecodeRequest,
    ),
    (
        "wrong rank",
        _with("signature", array_to_wire(np.ones(8, np.uint16))),
        ArrayMismatch,
        "signature",
        s.RouteDecodeRequest,
    ),
    ("byte size mismatch", _with("signature.shape", [2, 5]), ArrayMismatch, "signature", s.RouteDecodeRequest),
    ("negative dimension", _with("signature.shape", [-2, -4]), ArrayMismatch, "signature", s.RouteDecodeRequest),
    (
        "allocation bomb shape",
        _with("signature.shape", [MAX_ARRAY_ELEMENTS, 2]),
        ArrayMismatch,
        "signature",
        s.RouteDecodeRequest,
    ),
    ("data as string", _with("signature.data", "abcd"), ArrayMismatch, "signature", s.RouteDecodeRequest),
    ("layers disagree with signature", _with("layers", [0, 1, 2]), SchemaMismatch, "", s.RouteDecodeRequest),
    ("engine id with a dot", _with("engine_id", "a.b", _copy(_HELLO)), SchemaMismatch, "engine_id", s.Hello),
    ("engine id with wildcard", _with("engine_id", "*", _copy(_HELLO)), SchemaMismatch, "engine_id", s.Hello),
    ("unknown role", _with("role", "encoder", _copy(_HELLO)), SchemaMismatch, "role", s.Hello),
    ("agent kind with a dot", _with("agent", "vllm.0", _copy(_HELLO)), SchemaMismatch, "agent", s.Hello),
    ("agent kind in capitals", _with("agent", "SGLang", _copy(_HELLO)), SchemaMismatch, "agent", s.Hello),
    ("agent kind too long", _with("agent", "a" * 17, _copy(_HELLO)), SchemaMismatch, "agent", s.Hello),
    ("empty agent kind", _with("agent", "", _copy(_HELLO)), SchemaMismatch, "agent", s.Hello),
    ("agent kind not a string", _with("agent", 7, _copy(_HELLO)), SchemaMismatch, "agent", s.Hello),
    ("top_k above experts", _with("model.top_k", 9, _copy(_HELLO)), SchemaMismatch, "model", s.Hello),
    ("zero capacity", _with("capacity.kv_blocks", 0, _copy(_HELLO)), SchemaMismatch, "capacity.kv_blocks", s.Hello),
    ("nan timestamp", _with("ts", float("nan"), _copy(_HELLO)), SchemaMismatch, "ts", s.Hello),
    (
        "kv usage above one",
        msgpack.packb(
            {
                **msgpack.unpackb(
                    encode(
                        s.Telemetry(
                            engine_id="e",
                            seq=1,
                            ts=1.0,
                            kv_usage=0.5,
                            num_running=1,
                            num_waiting=0,
                            waiting_prefill_tokens=0,
                            remaining_prefill_tokens=0,
                            step_time_ema=0.01,
                        )
                    )
                ),
                "kv_usage": 1.5,
            }
        ),
        SchemaMismatch,
        "kv_usage",
        s.Telemetry,
    ),
    (
        "source counts shape mismatch",
        _with("source_counts", array_to_wire(np.zeros((3, 3, 4), np.uint32)), _copy(_LOAD)),
        SchemaMismatch,
        "",
        s.ExpertLoad,
    ),
    (
        "window ends before start",
        _with("window_end", -0.0 + 0.0, {**_copy(_LOAD), "window_start": 5.0}),
        SchemaMismatch,
        "",
        s.ExpertLoad,
    ),
    (
        "negative expert counts",
        _with("expert_counts", array_to_wire(np.full((2, 4), -3, np.int32)), _copy(_LOAD)),
        SchemaMismatch,
        "",
        s.ExpertLoad,
    ),
    (
        "nan in artifact centroids",
        _with("centroids", array_to_wire(np.full((2, 4), np.nan, np.float32)), _copy(_ARTIFACT)),
        SchemaMismatch,
        "",
        s.RoutingArtifact,
    ),
    (
        "infinite idf weight",
        _with("idf", array_to_wire(np.full((1, 4), np.inf, np.float32)), _copy(_ARTIFACT)),
        SchemaMismatch,
        "",
        s.RoutingArtifact,
    ),
    (
        "layout slot below -1",
        _with("layout", array_to_wire(np.full((1, 2, 2), -7, np.int32)), _copy(_LAYOUT)),
        SchemaMismatch,
        "",
        s.LayoutReply,
    ),
    (
        "negative signature counts",
        _with("signature", array_to_wire(np.full((2, 4), -1, np.int16))),
        SchemaMismatch,
        "",
        s.RouteDecodeRequest,
    ),
]


@pytest.mark.parametrize(("name", "data", "error", "field", "schema"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_is_rejected_with_a_named_field(
    name: str, data: bytes, error: type[WireError], field: str, schema: type
) -> None:
    with pytest.raises(error) as info:
        decode(data, schema)
    assert info.value.field == field
    assert info.value.reason  # a human-readable explanation
    assert info.value.code in str(info.value)


def test_at_least_twenty_distinct_malformed_inputs() -> None:
    assert len({m[1] for m in MALFORMED}) >= 20


def test_oversized_payload_is_refused_before_unpacking() -> None:
    data = encode(s.RouteDecodeRequest(request_id="r", prompt_tokens=1, signature=np.zeros((64, 1024), np.uint16)))
    with pytest.raises(PayloadTooLarge):
        decode(data, s.RouteDecodeRequest, max_bytes=len(data) - 1)
    assert decode(data, s.RouteDecodeRequest, max_bytes=len(data)).signature.shape == (64, 1024)


def test_deeply_nested_payload_is_refused() -> None:
    flat = msgpack.packb({"v": 1, "request_id": "a", "prompt_tokens": 1, "x": 0})
    data = flat[:-1] + b"\x91" * 5000 + b"\x00"  # "x": [[[[...0...]]]], 5000 levels deep
    with pytest.raises(WireError):
        decode(data, s.RouteDpRequest)


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_raise_anything_but_wire_errors(data: bytes) -> None:
    for schema in (s.RouteDecodeRequest, s.Telemetry, s.PlacementPlan):
        with contextlib.suppress(WireError):
            decode(data, schema)


@pytest.mark.parametrize("kind", ["sim", "vllm", "sglang", "toy", "trt-llm", "a" * 16])
def test_an_engine_kind_is_an_open_name(kind: str) -> None:
    """A new engine kind needs no schema change; the kinds of older messages still decode."""
    hello = decode(_with("agent", kind, _copy(_HELLO)), s.Hello)
    assert hello.agent == kind
    assert decode(encode(hello), s.Hello) == hello


def test_unknown_extra_keys_are_ignored_for_forward_compatibility() -> None:
    obj = msgpack.unpackb(encode(s.RouteDpRequest(request_id="x", prompt_tokens=3)))
    obj["added_in_a_later_release"] = {"anything": [1, 2]}
    assert decode(msgpack.packb(obj), s.RouteDpRequest).prompt_tokens == 3


def test_artifact_shapes_are_cross_checked() -> None:
    shape = s.ModelShape(name="m", num_layers=4, num_experts=8, top_k=2)
    good = dict(
        version=1,
        content_hash="0" * 16,
        created_at=0.0,
        model=shape,
        representation="count_idf",
        layer_mask=[0, 2],
        idf=np.ones((2, 8), np.float32),
        centroids=np.ones((3, 16), np.float32),
        rho=0.5,
    )
    s.RoutingArtifact(**good)
    for bad in (
        {"layer_mask": [0, 4]},
        {"idf": np.ones((3, 8), np.float32)},
        {"centroids": np.ones((3, 15), np.float32)},
        {"decoder_ids": ["a", "b"]},
    ):
        with pytest.raises(ValueError):
            s.RoutingArtifact(**{**good, **bad})


def test_shared_decisions_are_columns_of_one_length_and_version_2() -> None:
    columns: dict[str, list[Any]] = {
        "kinds": ["decode", "dp"],
        "request_ids": ["a", "b"],
        "engine_ids": ["d0", "d1"],
        "prompt_tokens": [1, 2],
    }
    batch = s.RouteDecisions(replica_id="r", **columns)
    assert decode(encode(batch), s.RouteDecisions) == batch and msgpack.unpackb(encode(batch))["v"] == 2
    ragged = msgpack.packb({"v": 2, "replica_id": "r", **columns, "prompt_tokens": [1]})
    with pytest.raises(SchemaMismatch, match="columns differ in length"):
        decode(ragged, s.RouteDecisions)
    one_decision = msgpack.packb(  # what version 1 sent: one decision per message
        {"v": 1, "replica_id": "r", "kind": "decode", "request_id": "a", "engine_id": "d0", "prompt_tokens": 1}
    )
    with pytest.raises(UnknownSchemaVersion):
        decode(one_decision, s.RouteDecisions)


def _plan_fields() -> dict[str, Any]:
    plan = s.PlacementPlan(
        plan_id="p1",
        version=1,
        engine_group="g",
        created_at=1.0,
        source="greedy",
        gpus=["a", "b"],
        placement=np.array([[[0], [1]]], np.int32),
        moves=np.zeros((0, 6), np.int32),
        objective=s.ObjectiveTerms(terms={"load": 1.0, "comm": 2.0, "mig": 0.5, "hot": 0.25}, total=3.75),
        params=s.PlacementParams(weights={"comm": 1.0, "load": 0.0625, "mig": 2.0, "hot": 1.0}),
    )
    return msgpack.unpackb(encode(plan))


def test_plans_carry_objective_terms_and_greedy_weights_as_maps() -> None:
    obj = _plan_fields()
    assert obj["objective"] == {"terms": {"load": 1.0, "comm": 2.0, "mig": 0.5, "hot": 0.25}, "total": 3.75}
    assert obj["params"] == {"weights": {"comm": 1.0, "load": 0.0625, "mig": 2.0, "hot": 1.0}}
    assert decode(msgpack.packb(obj), s.PlacementPlan).objective.terms["hot"] == 0.25


def test_plans_with_the_old_fixed_fields_still_decode() -> None:
    obj = _plan_fields()  # what a sender from before term maps wrote: three fixed fields each
    obj["objective"] = {"load": 1.0, "comm": 2.0, "mig": 0.5, "total": 3.5}
    obj["params"] = {"alpha": 1.0, "beta": 0.0025, "gamma": 1.0}
    plan = decode(msgpack.packb(obj), s.PlacementPlan)
    assert plan.objective == s.ObjectiveTerms(terms={"load": 1.0, "comm": 2.0, "mig": 0.5}, total=3.5)
    assert plan.params.weights == {"comm": 1.0, "load": 0.0025, "mig": 1.0}  # alpha, beta, gamma by term


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("objective.terms", {f"t{i}": 1.0 for i in range(33)}, "objective.terms"),  # at most MAX_TERMS
        ("objective.terms", {"Not A Name": 1.0}, "objective.terms"),
        ("objective.terms", {"total": 1.0}, "objective"),  # the weighted sum is no term
        ("objective.terms", {"load": -1.0}, "objective.terms.load"),
        ("objective.terms", {"load": float("nan")}, "objective.terms.load"),
        ("params.weights", {"comm": float("inf")}, "params.weights.comm"),
        ("params.weights", {f"t{i}": 1.0 for i in range(33)}, "params.weights"),
        ("params.weights", {"x" * 33: 1.0}, "params.weights"),
        ("params.weights", [1.0, 2.0], "params.weights"),
    ],
)
def test_term_maps_are_bounded(path: str, value: Any, field: str) -> None:
    with pytest.raises(SchemaMismatch) as info:
        decode(_with(path, value, _plan_fields()), s.PlacementPlan)
    assert info.value.field is not None and info.value.field.startswith(field), info.value.field
