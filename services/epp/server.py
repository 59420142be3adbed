"""The ext_proc gRPC server: one `Process` stream per HTTP request, the picker's health, TLS when configured.

Per stream (`Exchange`), in the order Envoy sends:

- request headers: the path and the proxy's subset hint are noted. With a body to come, the answer waits for it:
  FULL_DUPLEX_STREAMED holds the headers until the processor answers them (so the destination header can still
  be set after the body), BUFFERED lets them pass unchanged and takes the destination in the body's answer. With
  no body (a GET, or body mode NONE) the decision is made at once, by load alone;
- request body: collected up to `max_body_bytes` (413 past it), then the decision; in FULL_DUPLEX_STREAMED the
  body goes back to Envoy (it forwards only what the processor returns);
- response headers: the first token for the core, and which endpoint served (the proxy's report);
- response trailers (`response_trailer_mode: SEND`: Envoy adds empty ones when the engine sends none): the
  request is over for the core. Without them Envoy closes the stream right after the response headers, long
  before a stream ends; a stream closed without them (client gone, Envoy reset) ends the request too.

Response bodies are never asked for: each chunk would be one more round trip on every token. The trailers cost
one round trip after the last chunk, on no token's latency (docs/epp.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer  # `health.aio`: the asyncio servicer

from switchyard.services.epp import metrics, protocol
from switchyard.services.epp.picker import EndpointPicker, Pick, Refused
from switchyard.services.epp.settings import EppSettings
from switchyard.services.gateway.body import openai_error
from switchyard.shared.errors import ConfigError

log = logging.getLogger(__name__)

#: The gRPC health services the protocol names: the process, its readiness, and the ext_proc service itself.
LIVENESS, READINESS = "liveness", "readiness"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
FULL_DUPLEX, BUFFERED, NO_BODY = ProcessingMode.FULL_DUPLEX_STREAMED, ProcessingMode.BUFFERED, ProcessingMode.NONE


class ProtocolError(Exception):
    """A message out of the protocol's order: the stream ends with an error (Envoy applies `failure_mode_allow`)."""


class Exchange:
    """One HTTP request's ext_proc stream (see the module docstring)."""

    def __init__(self, picker: EndpointPicker, max_body_bytes: int) -> None:
        self.picker, self.max_body_bytes = picker, max_body_bytes
        self.path = ""
        self.subset: list[str] | None = None
        self.headers: list[tuple[bytes, bytes]] = []  # the request's, for flow control's band and tenant
        self.mode = NO_BODY
        self.body = bytearray()
        self.pick: Pick | None = None
        self.seen_headers = False

    async def on(self, request: ProcessingRequest) -> list[ProcessingResponse]:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(request)
        if kind == "request_body":
            return await self._request_body(request)
        if kind == "request_trailers":  # a body ended by trailers (rare over HTTP/1): decide now, if not yet
            out = [] if self.pick is not None else await self._decide(bytes(self.body), last=False)
            return [*out, protocol.continue_trailers(False)]
        if kind == "response_headers":
            if self.pick is not None:
                headers = protocol.headers_of(request.response_headers)
                self.picker.answered(self.pick, protocol.status_of(headers), protocol.served_of(request))
            return [protocol.continue_response_headers()]
        if kind == "response_body":  # only if the proxy was configured to send them: pass them on unchanged
            return [protocol.continue_response_body()]
        if kind == "response_trailers":  # the response's end (Envoy adds empty trailers when it has none)
            self.close()
            return [protocol.continue_trailers(True)]
        raise ProtocolError(f"unknown message {kind!r}")

    async def _request_headers(self, request: ProcessingRequest) -> list[ProcessingResponse]:
        if self.seen_headers:
            raise ProtocolError("request headers twice")
        self.seen_headers = True
        headers = protocol.headers_of(request.request_headers)
        self.path = headers.get(":path", "")
        self.headers = [(k.encode("latin-1", "replace"), v.encode("utf-8", "replace")) for k, v in headers.items()]
        self.subset = protocol.subset_of(request)
        self.mode = request.protocol_config.request_body_mode
        if request.request_headers.end_of_stream or self.mode == NO_BODY:
            return await self._decide(None, last=True)
        if self.mode == FULL_DUPLEX:
            return []  # held until the body is in
        return [protocol.continue_request_headers()]  # BUFFERED (and STREAMED): the body's answer carries it

    async def _request_body(self, request: ProcessingRequest) -> list[ProcessingResponse]:
        if not self.seen_headers or self.pick is not None:
            raise ProtocolError("request body out of order")
        body = request.request_body
        self.body += body.body
        if len(self.body) > self.max_body_bytes:
            return [_refusal(Refused(413, f"request body over {self.max_body_bytes} bytes", "", "too_large"))]
        if not body.end_of_stream:
            return [] if self.mode == FULL_DUPLEX else [_refusal(_unsupported(self.mode))]
        return await self._decide(bytes(self.body), last=True)

    async def _decide(self, raw: bytes | None, last: bool) -> list[ProcessingResponse]:
        started = time.perf_counter()
        try:
            self.pick = pick = await self.picker.pick(self.path, raw, self.subset, self.headers)
        except Refused as refused:
            return [_refusal(refused)]
        metrics.REQUESTS.labels("routed").inc()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        if raw is None:  # no body follows: the headers' answer is the whole answer
            return [protocol.destination_at_headers(pick.endpoints, pick.request_id)]
        if self.mode == FULL_DUPLEX:
            back = protocol.body_back(raw, end_of_stream=last)
            return [protocol.destination_at_headers(pick.endpoints, pick.request_id), *back]
        return [protocol.destination_at_body(pick.endpoints, pick.request_id)]

    def close(self) -> None:
        if self.pick is not None:
            self.picker.finish(self.pick)


def _unsupported(mode: int) -> Refused:
    """STREAMED request bodies would need a decision before the body is whole: configure BUFFERED or
    FULL_DUPLEX_STREAMED (infra/envoy/README.md)."""
    metrics.PROTOCOL_ERRORS.labels("mode").inc()
    name = ProcessingMode.BodySendMode.Name(mode) if mode in ProcessingMode.BodySendMode.values() else str(mode)
    return Refused(
        500,
        f"the endpoint picker needs request_body_mode BUFFERED or FULL_DUPLEX_STREAMED, not {name}",
        "InternalServerError",
        "misconfigured",
    )


def _refusal(refused: Refused) -> ProcessingResponse:
    metrics.REQUESTS.labels(refused.outcome).inc()
    kind = refused.kind or {413: "RequestEntityTooLargeError"}.get(refused.status)
    return protocol.immediate(
        refused.status,
        openai_error(refused.status, str(refused), kind, refused.param),
        f"switchyard_epp_{refused.outcome}",
        {"retry-after": refused.retry_after} if refused.retry_after is not None else None,
    )


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker, max_body_bytes: int) -> None:
        self.picker, self.max_body_bytes = picker, max_body_bytes

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        exchange = Exchange(self.picker, self.max_body_bytes)
        metrics.STREAMS.inc()
        try:
            async for request in request_iterator:
                try:
                    responses = await exchange.on(request)
                except ProtocolError as exc:
                    metrics.PROTOCOL_ERRORS.labels("out_of_order").inc()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                for response in responses:
                    yield response
        finally:
            metrics.STREAMS.dec()
            exchange.close()


class GrpcHealth:
    """The three health services; readiness (and the ext_proc service) follows `ready()`."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.servicer = HealthServicer()
        self.ready = ready
        self._state: bool | None = None

    async def start(self) -> None:
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.update()

    async def update(self) -> None:
        ready = self.ready()
        if ready == self._state:
            return
        self._state = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (READINESS, EXT_PROC, ""):
            await self.servicer.set(service, status)
        log.info("endpoint picker %s", "ready" if ready else "not ready")

    async def stopping(self) -> None:
        await self.servicer.enter_graceful_shutdown()


def build_server(
    settings: EppSettings, processor: ExternalProcessor, health: GrpcHealth
) -> tuple[grpc.aio.Server, int]:
    """The gRPC server bound to its port (returned; 0 asks for a free one): a busy port or unreadable TLS files are
    one `ConfigError`."""
    limit = settings.max_body_bytes + protocol.BODY_CHUNK  # one BUFFERED body in one message, and its envelope
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        maximum_concurrent_rpcs=settings.max_streams,
    )
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    address = f"[{settings.host}]:{settings.port}" if ":" in settings.host else f"{settings.host}:{settings.port}"
    try:
        if settings.tls_cert is not None and settings.tls_key is not None:
            credentials = grpc.ssl_server_credentials([(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except OSError as exc:
        raise ConfigError(f"the endpoint picker cannot read its TLS files: {exc}") from None
    except RuntimeError as exc:
        raise ConfigError(f"the endpoint picker cannot listen on {address}: {exc}") from None
    if port == 0:
        raise ConfigError(f"the endpoint picker cannot listen on {address}")
    return server, port
