"""The endpoint-picker protocol over Envoy's ext_proc messages, as pure functions (no I/O, no state).

Gateway API Inference Extension, `docs/proposals/004-endpoint-picker-protocol` (v1.0.0):

- the proxy MAY name the endpoints the picker must choose among: metadata namespace `envoy.lb.subset_hint`, key
  `x-gateway-destination-endpoint-subset` (a list of `ip:port`; a comma-separated string is read too);
- the picker answers with the header `x-gateway-destination-endpoint` AND the dynamic metadata `envoy.lb` →
  `x-gateway-destination-endpoint`, the same value: the chosen `ip:port`, then fallbacks, comma-separated;
- or with an `ImmediateResponse`: 503 when no endpoint can serve, 429 when shedding;
- on the response, the proxy reports the endpoint that served in the metadata `envoy.lb` →
  `x-gateway-destination-endpoint-served`. Plain Envoy has no such step: its ext_proc filter can send the
  attribute `upstream.address` instead (`response_attributes`), which this module reads when the metadata is absent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct, Value

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
#: Where Envoy puts the attributes an ext_proc filter asks for (`request_attributes`, `response_attributes`).
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS = "upstream.address"
#: The request id the picker gives each request, sent to the engine (vLLM names its request after it).
REQUEST_ID = "x-request-id"
#: A body sent back in FULL_DUPLEX_STREAMED mode goes in messages of at most this many bytes (Envoy's and gRPC's
#: default message limits are 4 MiB).
BODY_CHUNK = 1024 * 1024

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(message: HttpHeaders) -> dict[str, str]:
    """The headers as a dict (lower-case names; Envoy sends `raw_value` bytes, older ones `value`)."""
    out: dict[str, str] = {}
    for header in message.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


def _field(request: ProcessingRequest, namespace: str, key: str) -> Value | None:
    metadata = request.metadata_context.filter_metadata
    if namespace not in metadata:
        return None
    fields = metadata[namespace].fields
    return fields.get(key)


def subset_of(request: ProcessingRequest) -> list[str] | None:
    """The endpoints the proxy allows (None: no hint, choose from the whole pool; []: none, answer 503)."""
    value = _field(request, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return []


def served_of(request: ProcessingRequest) -> str | None:
    """The endpoint that served the response: the protocol's metadata, else Envoy's `upstream.address` attribute."""
    value = _field(request, LB_NAMESPACE, SERVED)
    if value is not None and value.WhichOneof("kind") == "string_value":
        return value.string_value
    attributes = request.attributes
    if ATTRIBUTES_KEY in attributes:
        fields = attributes[ATTRIBUTES_KEY].fields
        if UPSTREAM_ADDRESS in fields and fields[UPSTREAM_ADDRESS].WhichOneof("kind") == "string_value":
            return fields[UPSTREAM_ADDRESS].string_value or None
    return None


def status_of(headers: Mapping[str, str]) -> int:
    """A response's `:status` (0 when missing or not a number)."""
    status = headers.get(":status", "")
    return int(status) if status.isdigit() else 0


def _mutation(endpoints: Sequence[str], request_id: str) -> CommonResponse:
    value = ",".join(endpoints).encode()
    return CommonResponse(
        header_mutation=HeaderMutation(
            set_headers=[
                HeaderValueOption(header=HeaderValue(key=DESTINATION, raw_value=value), append_action=_OVERWRITE),
                HeaderValueOption(
                    header=HeaderValue(key=REQUEST_ID, raw_value=request_id.encode()), append_action=_OVERWRITE
                ),
            ]
        ),
        # The cluster stays the route's; only the host within it changes: no route re-selection needed.
        clear_route_cache=False,
    )


def _destination_metadata(endpoints: Sequence[str]) -> Struct:
    metadata = Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = ",".join(endpoints)
    return metadata


def destination_at_headers(endpoints: Sequence[str], request_id: str) -> ProcessingResponse:
    """The answer to the request headers: the destination header and metadata (the same value)."""
    return ProcessingResponse(
        request_headers=HeadersResponse(response=_mutation(endpoints, request_id)),
        dynamic_metadata=_destination_metadata(endpoints),
    )


def destination_at_body(endpoints: Sequence[str], request_id: str) -> ProcessingResponse:
    """BUFFERED mode: the answer to the whole body; the headers are still held, so it may set them."""
    return ProcessingResponse(
        request_body=BodyResponse(response=_mutation(endpoints, request_id)),
        dynamic_metadata=_destination_metadata(endpoints),
    )


def body_back(body: bytes, end_of_stream: bool = True) -> Iterator[ProcessingResponse]:
    """FULL_DUPLEX_STREAMED mode: Envoy forwards only the body the processor sends back, so send it all
    (`end_of_stream` False when trailers follow)."""
    if not body:
        yield _streamed(b"", end_of_stream)
        return
    for start in range(0, len(body), BODY_CHUNK):
        chunk = body[start : start + BODY_CHUNK]
        yield _streamed(chunk, end_of_stream and start + BODY_CHUNK >= len(body))


def _streamed(chunk: bytes, last: bool) -> ProcessingResponse:
    streamed = StreamedBodyResponse(body=chunk, end_of_stream=last)
    return ProcessingResponse(
        request_body=BodyResponse(response=CommonResponse(body_mutation=BodyMutation(streamed_response=streamed)))
    )


def continue_request_headers() -> ProcessingResponse:
    return ProcessingResponse(request_headers=HeadersResponse(response=CommonResponse()))


def continue_response_headers() -> ProcessingResponse:
    return ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse()))


def continue_response_body() -> ProcessingResponse:
    return ProcessingResponse(response_body=BodyResponse(response=CommonResponse()))


def continue_trailers(response_side: bool) -> ProcessingResponse:
    if response_side:
        return ProcessingResponse(response_trailers=TrailersResponse())
    return ProcessingResponse(request_trailers=TrailersResponse())


def immediate(
    status: int, error: dict[str, Any], details: str, headers: dict[str, str] | None = None
) -> ProcessingResponse:
    """The picker answers the client itself (no engine): `error` is OpenAI's error object (`body.openai_error`);
    `headers`: more to send (a 429's `Retry-After`)."""
    sent = {"content-type": "application/json", **(headers or {})}
    set_headers = [
        HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)
        for key, value in sent.items()
    ]
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status),  # type: ignore[arg-type]  # an int is a valid enum value
            headers=HeaderMutation(set_headers=set_headers),
            body=json.dumps(error, separators=(",", ":")).encode(),
            details=details,
        )
    )
