"""msgpack codec for the bus contract.

Payloads are msgpack maps carrying a schema version `v`. Numeric arrays travel as
``{"dtype": "<u2", "shape": [L, E], "data": <bytes>}`` (never pickle, never lists of ints), so a 48x128
signature costs 12 KiB on the wire and decodes with one `np.frombuffer`, zero-copy and read-only.

`decode` is the single entry point for untrusted bytes: it bounds the payload size, refuses anything that
is not a msgpack map of the right version, and validates every field against the schema, raising a
`shared.errors.WireError` subclass that names the offending field.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticCustomError, core_schema

from switchyard.shared.errors import (
    ArrayMismatch,
    NotMsgpack,
    PayloadTooLarge,
    RemoteError,
    SchemaMismatch,
    UnknownSchemaVersion,
    WireError,
)

#: Largest payload `decode` accepts unless told otherwise. The embedded NATS server is configured with the
#: same `max_payload`, so anything the bus delivers can be decoded.
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
#: Largest array accepted, in elements (a guard against `shape: [1e9, 1e9]` allocation bombs).
MAX_ARRAY_ELEMENTS = 1 << 24
_ALLOWED_KINDS = frozenset("biuf")
_MAX_NDIM = 4


def array_to_wire(array: np.ndarray) -> dict[str, Any]:
    """The wire form of a numeric array: dtype string, shape, raw little-endian bytes."""
    a = np.asarray(array)
    if a.dtype.kind not in _ALLOWED_KINDS:
        raise TypeError(f"dtype {a.dtype} cannot travel on the bus (only bool/int/uint/float)")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": np.ascontiguousarray(a).tobytes()}


def _array_error(reason: str) -> PydanticCustomError:
    return PydanticCustomError("array", reason)


_dtypes: dict[str, np.dtype] = {}  # dtype strings seen on the wire (at most a few dozen: short, numeric)


def _wire_dtype(dtype_str: Any) -> np.dtype:
    dtype = _dtypes.get(dtype_str) if isinstance(dtype_str, str) else None
    if dtype is not None:
        return dtype
    if not isinstance(dtype_str, str) or len(dtype_str) > 4:
        raise _array_error(f"dtype must be a short numpy type string like '<u2', got {dtype_str!r}")
    try:
        dtype = np.dtype(dtype_str)
    except Exception:  # numpy parses some strings as Python (',2': SyntaxError), not only TypeError
        raise _array_error(f"unknown dtype {dtype_str!r}") from None
    if dtype.kind not in _ALLOWED_KINDS:
        raise _array_error(f"dtype {dtype_str!r} is not numeric (allowed kinds: bool, int, uint, float)")
    _dtypes[dtype_str] = dtype
    return dtype


def array_from_wire(obj: Any, kinds: str = "biuf", ndim: int | None = None) -> np.ndarray:
    """Decode and check one wire array; raises `PydanticCustomError('array', ...)` on any mismatch."""
    if isinstance(obj, np.ndarray):  # constructing a model in-process
        array = obj
    else:
        if not isinstance(obj, dict):
            raise _array_error(f"expected an array map {{dtype, shape, data}}, got {type(obj).__name__}")
        try:
            dtype_str, shape, data = obj["dtype"], obj["shape"], obj["data"]
        except KeyError:
            raise _array_error(f"array map lacks {sorted({'dtype', 'shape', 'data'} - obj.keys())}") from None
        dtype = _wire_dtype(dtype_str)
        if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
            raise _array_error(f"shape must be a list of at most {_MAX_NDIM} sizes, got {shape!r}")
        count = 1
        for n in shape:
            if type(n) is not int or n < 0:  # bool is not int here
                raise _array_error(f"shape entries must be non-negative integers, got {shape!r}")
            count *= n
        if count > MAX_ARRAY_ELEMENTS:
            raise _array_error(f"{count} elements exceed the limit of {MAX_ARRAY_ELEMENTS}")
        if not isinstance(data, bytes):
            raise _array_error(f"data must be bytes, got {type(data).__name__}")
        if len(data) != count * dtype.itemsize:
            raise _array_error(
                f"data holds {len(data)} bytes but dtype {dtype_str} x shape {shape} needs {count * dtype.itemsize}"
            )
        array = np.ndarray(shape, dtype, buffer=data)  # zero-copy, read-only (bytes are immutable)
    if array.dtype.kind not in kinds:
        raise _array_error(f"dtype {array.dtype.str} not allowed here (allowed kinds: {kinds!r})")
    if ndim is not None and array.ndim != ndim:
        raise _array_error(f"expected {ndim} dimensions, got shape {list(array.shape)}")
    return array


@dataclass(frozen=True)
class Array:
    """Annotation marker: ``Annotated[np.ndarray, Array("iu", ndim=2)]`` is an integer matrix field."""

    kinds: str = "biuf"
    ndim: int | None = None

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        def validate(value: Any) -> np.ndarray:
            return array_from_wire(value, self.kinds, self.ndim)

        def serialize(value: np.ndarray, info: core_schema.SerializationInfo) -> Any:
            if info.mode == "json":
                return np.asarray(value).tolist()
            return array_to_wire(value)

        return core_schema.no_info_plain_validator_function(
            validate,
            serialization=core_schema.plain_serializer_function_ser_schema(serialize, info_arg=True),
        )

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        if isinstance(getattr(handler, "generate_json_schema", None), WireJsonSchema):
            return self.wire_json_schema()
        return {"type": "array", "description": f"numeric array, dtype kinds {self.kinds!r}, ndim {self.ndim}"}

    def wire_json_schema(self) -> dict[str, Any]:
        """The map `array_to_wire` writes, as a JSON Schema of the decoded msgpack (`data` is a msgpack bin)."""
        dtypes = []
        if "b" in self.kinds:
            dtypes.append(r"\|b1")
        ints = "".join(k for k in "iu" if k in self.kinds)
        if ints:
            dtypes += [rf"\|[{ints}]1", rf"<[{ints}][248]"]
        if "f" in self.kinds:
            dtypes.append(r"<f[248]")
        example = next({"u": "<u2", "i": "<i8", "f": "<f4", "b": "|b1"}[k] for k in "uifb" if k in self.kinds)
        rank = {"minItems": self.ndim, "maxItems": self.ndim} if self.ndim is not None else {"maxItems": _MAX_NDIM}
        return {
            "type": "object",
            "description": f"numeric array, dtype kinds {self.kinds!r}, ndim {self.ndim}: raw little-endian C-order "
            "bytes with their numpy dtype string and shape (`shared.codec.array_to_wire`)",
            "required": ["dtype", "shape", "data"],
            "properties": {
                "dtype": {"type": "string", "pattern": f"^(?:{'|'.join(dtypes)})$", "examples": [example]},
                "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, **rank},
                "data": {
                    "type": "string",
                    "format": "binary",
                    "description": "msgpack bin: product(shape) x itemsize bytes",
                },
            },
        }


class WireJsonSchema(GenerateJsonSchema):
    """JSON Schema of messages as they travel (`shared.asyncapi`): `Array` fields as their wire maps, where the
    default schema (the HTTP API's JSON) shows them as nested lists."""


class WireModel(BaseModel):
    """Base of every bus message: strict types, immutable, tolerant of unknown extra keys.

    Unknown keys are ignored (a newer peer may add optional fields without bumping `v`); a change in the
    meaning of an existing field bumps `VERSION`, and old decoders then refuse it loudly.
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore", arbitrary_types_allowed=True)

    #: The schema version; a subclass that bumps it declares `v: Literal[N] = N` beside it (checked on import).
    VERSION: ClassVar[int] = 1
    #: Largest encoding accepted for this message class on the bus (None: the bus-wide max payload). Small
    #: messages on wildcard subscriptions get a limit far below the server's: a flood of 8 MiB "telemetry"
    #: is then refused by size before it is unpacked (issue 15, finding 3).
    MAX_WIRE_BYTES: ClassVar[int | None] = None
    #: A Literal with a default rather than Python validators: validation stays in pydantic-core, which a
    #: cold request (one per route decision) pays ~40% less for.
    v: Literal[1] = 1

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        version = cls.model_fields["v"]
        if version.default != cls.VERSION or version.annotation != Literal[cls.VERSION]:
            raise TypeError(f"{cls.__name__}: declare `v: Literal[{cls.VERSION}] = {cls.VERSION}` beside its VERSION")


class ErrorBody(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)
    code: str
    field: str = ""
    message: str


class ErrorReply(WireModel):
    """What a request/reply server answers instead of its reply schema when it cannot serve a request."""

    error: ErrorBody

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorReply:
        if isinstance(exc, WireError):
            return cls(error=ErrorBody(**exc.to_dict()))
        return cls(error=ErrorBody(code="internal", message=f"{type(exc).__name__}: {exc}"))


M = TypeVar("M", bound=WireModel)

_PACKER_OPTS: dict[str, Any] = {"use_bin_type": True}
_SCALARS = (str, int, float, bool, type(None))
_flat: dict[type[BaseModel], bool] = {}
_local = threading.local()


def _flat_annotation(annotation: Any) -> bool:
    """Scalars, Literals of scalars, and Optional/Union/list of those (pydantic keeps Annotated metadata apart)."""
    if annotation in _SCALARS:
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return all(isinstance(a, _SCALARS) for a in get_args(annotation))
    if origin in (list, Union, UnionType, Annotated):
        return all(_flat_annotation(a) for a in get_args(annotation)[: 1 if origin is Annotated else None])
    return False


def _optional_array(field: Any) -> bool:
    """An `Array` field defaulting to None: `encode_unchecked` takes it in wire form."""
    return (field.default is None and any(isinstance(m, Array) for m in field.metadata)) or any(
        isinstance(m, Array) for a in get_args(field.annotation) for m in getattr(a, "__metadata__", ())
    )


def _is_flat(cls: type[BaseModel]) -> bool:
    """True when `model_dump(mode="python")` is exactly the instance's `__dict__`: every field a scalar or a list
    of scalars, no aliases, no custom serializers, no computed fields (decided once per class)."""
    flat = _flat.get(cls)
    if flat is None:
        decorators = cls.__pydantic_decorators__
        flat = _flat[cls] = (
            not decorators.field_serializers
            and not decorators.model_serializers
            and not cls.model_computed_fields
            and all(
                f.alias is None and f.serialization_alias is None and _flat_annotation(f.annotation)
                for f in cls.model_fields.values()
            )
        )
    return flat


def _packer() -> msgpack.Packer:
    packer = getattr(_local, "packer", None)
    if packer is None:  # one per thread: a Packer is not thread-safe, and making one per call costs
        packer = _local.packer = msgpack.Packer(**_PACKER_OPTS)
    return packer


def encode(message: WireModel) -> bytes:
    """Serialise a message for the bus.

    A flat message (see `_is_flat`: replies, telemetry, decisions) is packed straight from its field values,
    which is what `model_dump` would return for it, at a quarter of the cost.
    """
    if _is_flat(type(message)):
        return _packer().pack(message.__dict__)
    return _packer().pack(message.model_dump(mode="python"))


def encode_unchecked(schema: type[WireModel], fields: dict[str, Any]) -> bytes:
    """`encode(schema(**fields))` without validating: for flat messages built from values that were validated
    where they came in (ids of known engines, ids and counts of decoded requests). Fields in declaration order,
    unset ones at their defaults, so the bytes are exactly `encode`'s. An array field (`Array`) is passed in its
    wire form (`array_to_wire(a)`), or left at its default None."""
    message: dict[str, Any] = {"v": schema.VERSION}
    for name, required, default, factory in _unchecked_fields(schema):
        if name in fields:
            message[name] = fields[name]
        elif required:
            raise KeyError(f"{schema.__name__}.{name} is required")
        else:
            message[name] = factory() if factory is not None else default
    return _packer().pack(message)


_field_plans: dict[type[WireModel], tuple[tuple[str, bool, Any, Any], ...]] = {}


def _unchecked_fields(schema: type[WireModel]) -> tuple[tuple[str, bool, Any, Any], ...]:
    """(name, required, default, default factory) of a flat schema's fields but `v`, in declaration order;
    worked out once per class (asking pydantic per call cost a cold request ~50 µs)."""
    plan = _field_plans.get(schema)
    if plan is None:
        if (
            not all(_flat_annotation(f.annotation) or _optional_array(f) for f in schema.model_fields.values())
            or schema.__pydantic_decorators__.model_serializers
        ):
            raise TypeError(f"{schema.__name__} is not flat: build it and use encode()")
        plan = _field_plans[schema] = tuple(
            (name, f.is_required(), f.default, f.default_factory)
            for name, f in schema.model_fields.items()
            if name != "v"
        )
    return plan


def _unpack(data: bytes, max_bytes: int) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise NotMsgpack("", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise PayloadTooLarge("", f"{len(data)} bytes exceed the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=1 << 20,
            max_array_len=1 << 20,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types (ExtraData, FormatError, ValueError...)
        raise NotMsgpack("", f"cannot unpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise NotMsgpack("", f"top level must be a map, got {type(obj).__name__}")
    return obj


def _check_version(obj: dict[str, Any], schema: type[WireModel]) -> None:
    version = obj.get("v")
    if version is None:
        raise UnknownSchemaVersion("v", f"missing schema version for {schema.__name__}")
    if not isinstance(version, int) or isinstance(version, bool):
        raise UnknownSchemaVersion("v", f"schema version must be an integer, got {version!r}")
    if version != schema.VERSION:
        raise UnknownSchemaVersion("v", f"{schema.__name__} v{version} unknown (this build speaks v{schema.VERSION})")


def _validate(obj: dict[str, Any], schema: type[M]) -> M:
    try:
        return schema.__pydantic_validator__.validate_python(obj)  # model_validate's work, one call less
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"])
        cls = ArrayMismatch if first["type"] == "array" else SchemaMismatch
        raise cls(field, first["msg"]) from None


def decode(data: bytes, schema: type[M], max_bytes: int = DEFAULT_MAX_PAYLOAD) -> M:
    """Decode untrusted bytes into `schema`, or raise a `WireError` naming the field at fault."""
    obj = _unpack(data, max_bytes)
    _check_version(obj, schema)
    return _validate(obj, schema)


def reply_fields(data: bytes, schema: type[WireModel], max_bytes: int = DEFAULT_MAX_PAYLOAD) -> dict[str, Any]:
    """A request/reply answer's raw fields, its version checked but its values not validated; raises
    `RemoteError` for an ErrorReply, as `decode_reply` does.

    For a hot path that checks the few values it uses itself (the gateway looks the chosen engine id up among
    its candidates): validating the whole reply cost ~60 µs of a cold request's latency.
    """
    obj = _unpack(data, max_bytes)
    if "error" in obj and "error" not in schema.model_fields:
        _check_version(obj, ErrorReply)
        err = _validate(obj, ErrorReply).error
        raise RemoteError(err.code, err.field, err.message)
    _check_version(obj, schema)
    return obj


def decode_reply(data: bytes, schema: type[M], max_bytes: int = DEFAULT_MAX_PAYLOAD) -> M:
    """Decode a request/reply answer: `schema`, or raise `RemoteError` if the server sent an ErrorReply."""
    return _validate(reply_fields(data, schema, max_bytes), schema)
