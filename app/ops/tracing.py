"""OpenTelemetry tracing of requests and predict calls; imported only when TRACING is on.

Spans (docs/tracing.md is the manual):

    request (SERVER: REST "POST /v1/models/<model_name:name>:predict", gRPC its full method)
      ├─ decode      from the request's start to its tensors decoded: body, parse, lookup, tensors
      ├─ preprocess  a model's handler making the rows it queues (app/core/handlers.py)
      ├─ queue wait  from the queueing to the start of the predict call that runs the first rows
      ├─ postprocess the handler making the answer of the request's rows
      └─ encode      from the answer to the end of the front door: shaping and the response body
    predict         one per predict call (a trace of its own), LINKED to each request it served

With MODEL_PROCESSES the predict calls run in a model process: the request span's context
travels in the call's frame (`RequestTrace.frame_fields`), the model process's BatchTracer
links its predict span to it (`LinkedTrace`) and exports it with its own provider, and the
call's start comes back in the answer to end the queue-wait span. The spans and links are the
default mode's.

A request continues the W3C `traceparent` it came with (the propagators OTEL_PROPAGATORS
names, tracecontext and baggage by default). A predict call serves many requests, so it
cannot be the child of one: its span starts a trace of its own with a link to each.

Nothing here runs unless TRACING is on: the services then hold a `Tracing`, whose spans each
transport's outermost layer opens into the request's exchange (`http_span`, `grpc_span`);
the exchange's call carries the trace, on which the request layer marks `decoded`,
`handled`, `answered` and `waited`, and the exchange's close `finish`es it with the status its client
got. app/core/loading.py wraps each batcher's observer in a `BatchTracer`. Off, no module of
tracing is imported and a request's path holds no call of it. This module knows no request
layer and no model: what it reads of an answer it reads by name.

The batch thread is the server's one serial section, so it does the least: one span per
call, built after the call with its links, and a timestamp on each request's trace; the
queue-wait span is made by the request's own thread once its answer arrives.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, cast

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from app.ops.metrics import Metrics
from app.ops.observer import BatchObserver
from app.ops.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "model-server"

_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


class RequestTrace:
    """One traced request: its span, and the marks its child spans are made from.

    The request layer marks `decoded` (its rows are about to be queued), `answered` (its answer is
    back) and `waited` (its rows ran, or never will); the exchange's close calls `finish`.
    """

    __slots__ = ("span", "context", "predict_started_ns", "encode", "_tracer", "_queued_ns")

    def __init__(self, span: trace.Span, tracer_: trace.Tracer) -> None:
        self.span = span
        self.context = trace.set_span_in_context(span)
        # Set by the batch thread when the first predict call that runs the request's rows starts.
        self.predict_started_ns: int | None = None
        self.encode: trace.Span | None = None
        self._tracer = tracer_
        self._queued_ns: int | None = None

    @property
    def recording(self) -> bool:
        """False when sampled out: then no predict span links to it either."""
        return self.span.is_recording()

    def decoded(self) -> None:
        """The decode span: from the request's start to now, when its rows are queued."""
        self._queued_ns = time.time_ns()
        self._tracer.start_span("decode", context=self.context,
                                start_time=cast(ReadableSpan, self.span).start_time).end(self._queued_ns)

    def handled(self, stage: str, started_ns: int) -> None:
        """A handler's span, `preprocess` or `postprocess`: from `started_ns` to now. The queue wait
        starts once preprocess has made the rows it queues."""
        now = time.time_ns()
        self._tracer.start_span(stage, context=self.context, start_time=started_ns).end(now)
        if stage == "preprocess" and self._queued_ns is not None:
            self._queued_ns = now

    def waited(self) -> None:
        """The queue-wait span, once decoded: it ends where the first predict call serving the
        request began, or now if none did (refused, expired)."""
        if self._queued_ns is not None:
            self._tracer.start_span("queue wait", context=self.context,
                                    start_time=self._queued_ns).end(self.predict_started_ns or time.time_ns())

    def answered(self, answer: Any) -> None:
        """The answer's attributes on the request span, and the encode span (ended by `finish`)."""
        self.span.set_attributes({
            "model_server.model.name": answer.servable.model.name,
            "model_server.model.version": answer.servable.model.version,
            "model_server.model.signature": answer.signature.name,
            "model_server.request.rows": answer.rows,
            "model_server.batch.rows": answer.batch_rows,
            "model_server.batch.requests": answer.batch_requests,
        })
        self.encode = self._tracer.start_span("encode", context=self.context)

    def finish(self, status: int | str, route: str | None) -> None:
        """End the request's spans with the status its client got."""
        self._status(status, route)
        if self.encode is not None:
            self.encode.end()
        self.span.end()

    def _status(self, status: int | str, route: str | None) -> None:
        raise NotImplementedError

    def frame_fields(self) -> list[str | int]:
        """What a model process needs of the trace to link its predict span to it (Call.frame):
        the request span's context (W3C's trace id, span id and flags), as text the frame's JSON holds."""
        context = self.span.get_span_context()
        return [format(context.trace_id, "032x"), format(context.span_id, "016x"), int(context.trace_flags)]


class HttpTrace(RequestTrace):
    __slots__ = ("method",)

    def __init__(self, span: trace.Span, tracer_: trace.Tracer, method: str) -> None:
        super().__init__(span, tracer_)
        self.method = method

    def _status(self, status: int | str, route: str | None) -> None:
        if route:
            self.span.update_name(f"{self.method} {route}")
            self.span.set_attribute("http.route", route)
        self.span.set_attribute("http.response.status_code", int(status))
        if int(status) >= 500:
            self.span.set_status(Status(StatusCode.ERROR))


class GrpcTrace(RequestTrace):
    __slots__ = ()

    def _status(self, status: int | str, route: str | None) -> None:
        self.span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[str(status)].value[0])
        if status != grpc.StatusCode.OK.name:
            self.span.set_status(Status(StatusCode.ERROR, str(status)))


# -- the provider: one per process (a Gunicorn worker makes it after the fork) ------------------


def provider(settings: Settings) -> TracerProvider:
    """This process's TracerProvider, made on first use. The SDK reads the OTEL_* variables:
    the sampler, the batch processor's delays and sizes, the exporter's endpoint and headers.

    The provider shuts down at the process's exit (the SDK's own atexit handler), which exports
    the spans still waiting: a Gunicorn worker gets there after worker_exit drained its batchers,
    so the last requests' spans are in."""
    global _provider, _tracer
    if _provider is None:
        _provider = TracerProvider(resource=_resource())
        # Asked for once: get_tracer builds a new Tracer (and checks its arguments) on every call.
        _tracer = _provider.get_tracer(__name__)
        _provider.add_span_processor(BatchSpanProcessor(_exporter(settings.tracing)))
        log.info("tracing on: %s exporter, service %s, pid %d", settings.tracing,
                 _provider.resource.attributes.get(SERVICE_NAME), os.getpid())
    return _provider


def _resource() -> Resource:
    resource = Resource.create({"process.pid": os.getpid()})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def _exporter(kind: str) -> SpanExporter:
    if kind == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def tracer(settings: Settings) -> trace.Tracer:
    """The tracer of this process's provider (made by whichever part asks first)."""
    provider(settings)
    assert _tracer is not None
    return _tracer


def batch_observer(metrics: Metrics, settings: Settings, model: Any, signature: str) -> BatchObserver:
    """A batcher's observer with tracing on: a tracer of its predict calls around the batch metrics."""
    return BatchTracer(metrics.observer(model.name), tracer(settings), model=model.name, version=model.version,
                       signature=signature)


class Tracing:
    """This process's tracing: the request spans each transport's outermost layer opens."""

    def __init__(self, settings: Settings) -> None:
        self.provider = provider(settings)
        self.tracer = tracer(settings)

    def http_span(self, environ: dict[str, Any]) -> HttpTrace:
        """A SERVER span for an HTTP request, continuing the trace in its headers; named by its
        route once known (its `finish`)."""
        method = environ.get("REQUEST_METHOD", "")
        span = self.tracer.start_span(method, context=propagate.extract(environ, getter=_ENVIRON),
                                      kind=SpanKind.SERVER,
                                      attributes={"http.request.method": method,
                                                  "url.path": environ.get("PATH_INFO", "")})
        return HttpTrace(span, self.tracer, method)

    def grpc_span(self, method: str, metadata: Any) -> GrpcTrace:
        """A SERVER span for a gRPC call, continuing the trace in its metadata."""
        service, _, name = method.lstrip("/").rpartition("/")
        span = self.tracer.start_span(method.lstrip("/"), context=propagate.extract(dict(metadata or ())),
                                      kind=SpanKind.SERVER,
                                      attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        return GrpcTrace(span, self.tracer)


class _EnvironGetter(Getter[dict]):
    """Reads a propagator's headers (traceparent, tracestate, baggage) from a WSGI environ."""

    def get(self, carrier: dict, key: str) -> list[str] | None:
        value = carrier.get("HTTP_" + key.upper().replace("-", "_"))
        return None if value is None else [value]

    def keys(self, carrier: dict) -> list[str]:
        return [key[5:].lower().replace("_", "-") for key in carrier if key.startswith("HTTP_")]


_ENVIRON = _EnvironGetter()


# -- the batch thread: one span per predict call -------------------------------------------


class BatchTracer(BatchObserver):
    """A batcher's observer (metrics) with its predict calls traced, each linked to its requests."""

    traces = True

    def __init__(self, observer: BatchObserver, tracer_: trace.Tracer, *, model: str, version: int,
                 signature: str) -> None:
        self._observer = observer
        self._tracer = tracer_
        self._attributes: dict[str, AttributeValue] = {
            "model_server.model.name": model, "model_server.model.version": version,
            "model_server.model.signature": signature}

    def queue_depth(self, rows: int) -> None:
        self._observer.queue_depth(rows)

    def queue_wait(self, seconds: float) -> None:
        self._observer.queue_wait(seconds)

    def level_depth(self, level: int, rows: int) -> None:
        self._observer.level_depth(level, rows)

    def level_rejected(self, level: int) -> None:
        self._observer.level_rejected(level)

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        self._observer.batch_done(rows=rows, requests=requests, padded_rows=padded_rows, predict_s=predict_s)

    def call_answered(self, *, rows: int, requests: int, input_s: float, infer_s: float, output_s: float,
                      finished_s: list[float]) -> None:
        self._observer.call_answered(rows=rows, requests=requests, input_s=input_s, infer_s=infer_s,
                                     output_s=output_s, finished_s=finished_s)

    def requests_failed(self, waited_s: list[float]) -> None:
        self._observer.requests_failed(waited_s)

    def length_padding(self, *, real_elements: int, padded_elements: int) -> None:
        self._observer.length_padding(real_elements=real_elements, padded_elements=padded_elements)

    def rejected(self, reason: str) -> None:
        self._observer.rejected(reason)

    def predict_call(self, traces: list[Any], *, rows: int, padded_rows: int, predict_s: float,
                     error: BaseException | None) -> None:
        # Called as the call returns: its start is now less its duration, on the spans' clock.
        ended_ns = time.time_ns()
        started_ns = ended_ns - int(predict_s * 1e9)
        links = []
        for request in traces:
            if request is None:
                continue
            if request.predict_started_ns is None:
                request.predict_started_ns = started_ns
            links.append(Link(request.span.get_span_context()))
        if not links:
            return
        span = self._tracer.start_span("predict", context=Context(), kind=SpanKind.INTERNAL, links=links,
                                   start_time=started_ns, attributes={
                                       **self._attributes,
                                       "model_server.batch.rows": rows,
                                       "model_server.batch.padded_rows": padded_rows,
                                       "model_server.batch.requests": len(traces),
                                   })
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end(ended_ns)


# -- MODEL_PROCESSES: the request's trace in the frame, its predict span in the model process ----


class LinkedTrace:
    """A request's trace as a model process's BatchTracer sees it: the request span to link to
    (remote, not recording), and the start of the first predict call that runs its rows, which
    goes back to the worker in the answer and ends the request's queue-wait span there."""

    __slots__ = ("span", "predict_started_ns")

    def __init__(self, fields: list[str | int]) -> None:
        trace_id, span_id, flags = fields
        self.span = trace.NonRecordingSpan(trace.SpanContext(
            int(str(trace_id), 16), int(str(span_id), 16), is_remote=True, trace_flags=trace.TraceFlags(int(flags))))
        self.predict_started_ns: int | None = None
