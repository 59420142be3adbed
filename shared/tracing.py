"""OpenTelemetry tracing, off unless the standard `OTEL_*` settings turn it on.

On when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`) or an OTLP endpoint is set
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`); off when neither is, when
`OTEL_TRACES_EXPORTER=none` or when `OTEL_SDK_DISABLED=true`. (The SDK's own default exporter is otlp; Switchyard's
default is off, so a process without these settings makes no span and sends no `traceparent`.) The rest is the
SDK's: `OTEL_SERVICE_NAME` (default: the service's own, e.g. `switchyard-gateway`), `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_PROPAGATORS` (W3C trace context by default), `OTEL_BSP_*`, and the OTLP
exporter's `OTEL_EXPORTER_OTLP_*` (`http/protobuf` by default: the `tracing` extra; `grpc` needs
`opentelemetry-exporter-otlp-proto-grpc`).

Each service asks `start(name)` once and holds the answer: a `Tracing`, or None when off. The request paths test
for None and skip everything else, so tracing off costs an attribute check per hop. The OpenTelemetry SDK is
imported only when tracing is on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from switchyard.shared.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context as OtelContext
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

__all__ = ["Tracing", "enabled_exporters", "exporting_to", "start"]

#: A test's (or an embedder's) exporter: while set, every service traces into it (`exporting_to`).
_override: SpanExporter | None = None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def enabled_exporters(env: Mapping[str, str] | None = None) -> list[str]:
    """The exporters the `OTEL_*` settings ask for; empty when tracing is off."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    return [n for n in names if n != "none"]


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (Switchyard knows otlp, console, none)")
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    try:
        if protocol.strip() == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc()
        if protocol.strip() != "http/protobuf":
            raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported (http/protobuf, grpc)")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http()
    except ImportError as exc:
        package = "opentelemetry-exporter-otlp-proto-grpc" if protocol.strip() == "grpc" else "switchyard[tracing]"
        raise ConfigError(
            f"tracing asks for the OTLP exporter ({protocol}), which is not installed: pip install {package}"
        ) from exc


def start(service: str) -> Tracing | None:
    """This service's tracing as the `OTEL_*` settings (or `exporting_to`) say; None when off."""
    from_test = _override
    names = [] if from_test is not None else enabled_exporters()
    if from_test is None and not names:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))  # sampler: OTEL_TRACES_SAMPLER
    if from_test is not None:  # exported as each span ends, so a test sees it at once
        provider.add_span_processor(SimpleSpanProcessor(cast("SpanExporter", _Unowned(from_test))))
    else:
        for exporter in names:
            provider.add_span_processor(BatchSpanProcessor(_exporter(exporter)))
        log.info("tracing on: %s exports its spans (%s)", name, ", ".join(names))
    return Tracing(provider)


@contextlib.contextmanager
def exporting_to(exporter: SpanExporter) -> Iterator[None]:
    """Every service started meanwhile traces into `exporter` (a test's `InMemorySpanExporter`), whatever the
    `OTEL_*` settings say; shutting a service's tracing down leaves the exporter open."""
    global _override
    previous, _override = _override, exporter
    try:
        yield
    finally:
        _override = previous


class _Unowned:
    """A shared exporter that one provider's shutdown must not close (several services export into it)."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter

    def export(self, spans: Any) -> Any:
        return self.exporter.export(spans)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class Tracing:
    """One service's tracer, with what its request paths do with it (they import nothing of OpenTelemetry)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.provider = provider
        self.tracer = provider.get_tracer("switchyard")
        self._propagate, self._trace = propagate, trace
        self._kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
        self._error = lambda description: Status(StatusCode.ERROR, description)

    def server(
        self, name: str, carrier: Mapping[str, Any] | None, attributes: dict[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Span]:
        """A server span, current while the `with` runs, the child of the caller's `traceparent` in `carrier`
        (HTTP or NATS headers) when it sent one."""
        parent = self._propagate.extract(carrier) if carrier else None
        return self.tracer.start_as_current_span(name, parent, self._kinds["server"], attributes)

    def enter(self, name: str, carrier: Mapping[str, Any] | None, attributes: dict[str, Any]) -> tuple[Span, object]:
        """`server` without a `with`, for a callback that must not pay for one when tracing is off: the span and
        the token `leave` takes."""
        from opentelemetry import context

        parent = self._propagate.extract(carrier) if carrier else None
        span = self.tracer.start_span(name, parent, self._kinds["server"], attributes)
        return span, context.attach(self._trace.set_span_in_context(span, parent))

    def leave(self, span: Span, token: object, error: str | None = None) -> None:
        from opentelemetry import context

        context.detach(token)  # type: ignore[arg-type]
        self.end(span, error)

    def span(
        self, name: str, kind: str = "internal", attributes: dict[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Span]:
        """A child of the current span, current while the `with` runs."""
        return self.tracer.start_as_current_span(name, kind=self._kinds[kind], attributes=attributes)

    def open(
        self,
        name: str,
        kind: str = "client",
        attributes: dict[str, Any] | None = None,
        carrier: Mapping[str, Any] | None = None,
    ) -> Span:
        """A span not made current, which the caller ends (`end`), e.g. when a stream ends: the child of the
        `traceparent` in `carrier` when given, else of the current span."""
        parent = self._propagate.extract(carrier) if carrier is not None else None
        return self.tracer.start_span(name, parent, self._kinds[kind], attributes)

    def end(self, span: Span, error: str | None = None) -> None:
        if error is not None:
            span.set_status(self._error(error))
        span.end()

    def failed(self, span: Span, error: str) -> None:
        """Mark a span failed without ending it."""
        span.set_status(self._error(error))

    def headers(self, span: Span | None = None) -> dict[str, str]:
        """The propagation headers (`traceparent`, ...) naming `span` (default: the current one) as the parent."""
        carrier: dict[str, str] = {}
        context: OtelContext | None = None if span is None else self._trace.set_span_in_context(span)
        self._propagate.inject(carrier, context)
        return carrier

    def annotate(self, attributes: dict[str, Any]) -> None:
        """Attributes on the current span."""
        self._trace.get_current_span().set_attributes(attributes)

    def close(self) -> None:
        """Export what is buffered and stop."""
        self.provider.shutdown()
