"""Every gRPC call's one path through a worker's server, around its handler.

The worker's server is grpc.aio's: its calls live on one event loop thread, and a prediction
awaits its rows without holding a thread (app/core/batching/engine.py, `awaited`). `CallPath` is the
server's only interceptor. For each call, in order:

1. Health checks skip to step 4, without a record or a place in the call limit, with a receive
   timeout of at most HEALTH_RECEIVE_TIMEOUT_S: predictions filling every place cannot make the
   probe fail.
2. The exchange opens (app/grpc/exchange.py: access line, request metrics, the request id echoed
   in the initial metadata), before anything can refuse the call, so every refusal is recorded.
3. The call limit: at most THREADS calls at once per worker; the rest are refused at once with
   RESOURCE_EXHAUSTED rather than wait where nothing sees them.
4. The request message, within GRPC_RECEIVE_TIMEOUT_MS of the call's headers (grpc-core has no
   such limit: every unary method is served as a client-streaming one that reads its one
   message under a timer), else CANCELLED; a message that does not parse is INVALID_ARGUMENT
   (grpc's own path answers INTERNAL and logs a traceback per call).
5. Triton's restricted categories (GRPC_RESTRICTED_PROTOCOL, RESTRICTED_MODEL_CONTROL): a method
   of a restricted category called without its key is UNAVAILABLE, in Triton's words (the
   probes' too).
6. The trace (TRACING): a SERVER span, continuing the trace in the call's metadata, ended with
   the exchange, with the status its client got.
7. The handler: `handler(request, exchange)`, awaited on the loop where it is a coroutine
   function (a prediction's, which awaits its rows), else run on one of THREADS threads
   (metadata, status, reloads: calls that block). Its ServingError becomes its status code
   (`STATUS_CODES`), anything else INTERNAL.
8. The answer, serialized here: an answer that cannot be is INTERNAL.

A bidirectional stream whose servicer method is `Streamed` (ModelStreamInfer) is checked against
its category once, as it opens (Triton's check); then each request it carries is read as it
comes and served as a unary call is, on a task of its own: its own exchange, a place in the call
limit (held until its answer is written), its trace, its deadline (the stream's, and its own
`timeout`, REQUEST_TIMEOUT_MS from its arrival), its priority, and cancellation with the stream.
So a stream's requests are decoded and queued while earlier ones wait, and batch with each other
and with unary calls; their answers are written in the order the requests came, as Triton writes
a non-decoupled model's. A request that fails is answered in the stream (`Streamed.failed`) and the
stream goes on; with the metadata `triton_grpc_error: true` the first failure ends the stream
with its status instead, as in Triton. A stream ends once the client half-closed and every
answer was written.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from app.core import errors
from app.core.errors import SignatureNotFound
from app.core.exchange import Exchanges
from app.grpc.exchange import GrpcExchange, ended_code

if TYPE_CHECKING:
    from app.ops.tracing import Tracing

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEALTH_RECEIVE_TIMEOUT_S = 1.0
CONCURRENCY_EXCEEDED = "Concurrent RPC limit exceeded!"

# The one map from the server's errors to gRPC status codes; the most specific class wins.
# TensorFlow Serving's own choices: model_servers/get_model_metadata_impl.cc and
# predict_util.cc (INVALID_ARGUMENT, FAILED_PRECONDITION), core/server_core.cc (NOT_FOUND),
# and the batching library's "Task size ... is larger than maximum input batch size"
# (INVALID_ARGUMENT) for a request over the row limit.
STATUS_CODES: dict[type[errors.ServingError], grpc.StatusCode] = {
    errors.ServingError: grpc.StatusCode.INTERNAL,
    errors.BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SignatureNotFound: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    errors.MethodNotAllowed: grpc.StatusCode.UNIMPLEMENTED,
    errors.PayloadTooLarge: grpc.StatusCode.INVALID_ARGUMENT,
    errors.PredictFailed: grpc.StatusCode.INTERNAL,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ClientGone: grpc.StatusCode.CANCELLED,
}


def status_code(exc: errors.ServingError) -> grpc.StatusCode:
    return next(STATUS_CODES[cls] for cls in type(exc).__mro__ if cls in STATUS_CODES)


def details(exc: errors.ServingError) -> str:
    if isinstance(exc, SignatureNotFound):
        # TF Serving's gRPC words (model_servers/predict_util.cc); REST's are the error's own.
        return errors.bounded(f'Serving signature key "{exc.key}" not found.')
    return exc.message


class Handler(NamedTuple):
    """A servicer's method as the call path serves it: `run(request, exchange)`, awaited on the
    loop where it is a coroutine function (`on_loop`), else run on a thread."""

    run: Callable[[Any, GrpcExchange], Any]
    on_loop: bool


def handler(run: Callable[[Any, GrpcExchange], Any]) -> Handler:
    """A servicer's method, to be served through the call path."""
    return Handler(run, inspect.iscoroutinefunction(run))


class Streamed(NamedTuple):
    """A servicer's bidirectional-streaming method whose every request is served as a unary call:
    `run(request, exchange)` (a coroutine function) answers one; `answered(response)` and
    `failed(request, message)` make the stream's message of an answer and of a failure."""

    run: Callable[[Any, GrpcExchange], Awaitable[Any]]
    answered: Callable[[Any], Any]
    failed: Callable[[Any, str], Any]


# Triton's metadata key: a stream's first failure ends it with its status.
STREAM_ERROR_KEY = "triton_grpc_error"


class _Refused(Exception):
    """Ends a call with a status of the path's own (not a handler's error)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CallPath(grpc.aio.ServerInterceptor):
    """The server's one interceptor: the module docstring's steps, for every unary method."""

    def __init__(self, exchanges: Exchanges, *, max_calls: int, receive_timeout_s: float,
                 timeout_s: float | None = None,
                 threads: futures.ThreadPoolExecutor, tracing: Tracing | None = None,
                 restricted: Callable[[str, Any], None] | None = None) -> None:
        self._exchanges = exchanges
        # REQUEST_TIMEOUT_MS: every call's deadline is its client's or this, whichever comes first.
        self._timeout_s = timeout_s
        self._max_calls = max_calls
        self._receive_timeout_s = receive_timeout_s
        self._threads = threads
        self._tracing = tracing
        # Raises errors.Forbidden for a method of a restricted category called without its key
        # (app/wire/restricted.py).
        self._restricted = restricted
        self._methods: dict[str, Any] = {}
        # Calls holding a place: on the loop, or on a thread until their handler returned.
        self.active = 0

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details_: Any) -> Any:
        # The handlers never change once the server started: each method is wrapped once.
        method = details_.method
        wrapped = self._methods.get(method)
        if wrapped is None:
            handler = await continuation(details_)
            if handler is not None and isinstance(handler.stream_stream, Streamed):
                wrapped = self._methods[method] = self._wrap_stream(method, handler)
                return wrapped
            if handler is None or handler.unary_unary is None:
                return handler
            wrapped = self._methods[method] = self._wrap(method, handler)
        return wrapped

    def _wrap(self, method: str, handler: Any) -> Any:
        behavior, parse, serialize = handler.unary_unary, handler.request_deserializer, handler.response_serializer

        if method.startswith(HEALTH_PREFIX):
            timeout_s = min(self._receive_timeout_s, HEALTH_RECEIVE_TIMEOUT_S)

            async def probe(_messages: Any, context: grpc.aio.ServicerContext) -> bytes:
                try:
                    self._check_restriction(method, context)
                    request = await _receive(context, timeout_s, parse)
                    response = behavior(request, context)
                    return serialize(response) if serialize is not None else response
                except errors.ServingError as exc:
                    await context.abort(status_code(exc), details(exc))
                except _Refused as refused:
                    await context.abort(refused.code, refused.message)
                raise AssertionError("unreachable: abort raises")

            return grpc.stream_unary_rpc_method_handler(probe)

        async def serve(_messages: Any, context: grpc.aio.ServicerContext) -> bytes:
            exchange = self.open_exchange(method, context)
            try:
                await exchange.echo_id()
                return await self._serve(method, behavior, parse, serialize, exchange, context)
            except _Refused as refused:
                await context.abort(refused.code, refused.message)
            except grpc.aio.AbortError:
                raise
            except BaseException:
                # Cancelled by grpc (its client left, its deadline passed), or ended under the
                # handler by grpc-core itself (a call it refused before handing it over).
                exchange.cancelled()
                raise
            raise AssertionError("unreachable: abort raises")

        return grpc.stream_unary_rpc_method_handler(serve)

    async def _serve(self, method: str, behavior: Any, parse: Any, serialize: Any, exchange: GrpcExchange,
                     context: grpc.aio.ServicerContext) -> bytes:
        self.admit()
        released = False
        try:
            request = await _receive(context, self._receive_timeout_s, parse)
            self._check_restriction(method, context)
            self._trace(method, exchange)
            try:
                if isinstance(behavior, Handler) and not behavior.on_loop:
                    # The place is held until the thread is done, even if the call ends first.
                    loop = asyncio.get_running_loop()
                    running = self._threads.submit(behavior.run, request, exchange)
                    running.add_done_callback(lambda _running: self._release_from_thread(loop))
                    released = True
                    response = await asyncio.wrap_future(running)
                elif isinstance(behavior, Handler):
                    response = await behavior.run(request, exchange)
                else:
                    # A probe or a servicer base class's UNIMPLEMENTED: quick, on the loop.
                    response = behavior(request, context)
            except Exception as exc:  # noqa: BLE001 - each becomes its status
                raise _refusal(method, exc, context) from None
            return _serialized(method, serialize, response)
        finally:
            if not released:
                self._release()

    def open_exchange(self, method: str, context: grpc.aio.ServicerContext, *, streamed: bool = False,
                      ) -> GrpcExchange:
        """A call's exchange, opened: a unary call's, or one streamed request's."""
        return self._exchanges.open(GrpcExchange(self._exchanges, method, context, timeout_s=self._timeout_s,
                                                 streamed=streamed))

    def _check_restriction(self, method: str, context: grpc.aio.ServicerContext) -> None:
        if self._restricted is not None:
            try:
                self._restricted(method, context.invocation_metadata())
            except errors.Forbidden as exc:
                raise _Refused(grpc.StatusCode.UNAVAILABLE, exc.message) from None

    def _trace(self, method: str, exchange: GrpcExchange) -> None:
        if self._tracing is not None:
            exchange.trace = self._tracing.grpc_span(method, exchange.metadata)

    def _wrap_stream(self, method: str, handler: Any) -> Any:
        streamed, parse, serialize = handler.stream_stream, handler.request_deserializer, handler.response_serializer

        async def serve(_messages: Any, context: grpc.aio.ServicerContext) -> None:
            try:
                self._check_restriction(method, context)
            except _Refused as refused:
                # Recorded as any refused call: an exchange closed with the status sent.
                self.open_exchange(method, context)
                await context.abort(refused.code, refused.message)
            ending = await _Stream(self, method, streamed, parse, serialize, context).serve()
            if ending is not None:
                await context.abort(ending.code, ending.message)

        return grpc.stream_stream_rpc_method_handler(serve)

    def admit(self) -> None:
        """A place in the call limit, or RESOURCE_EXHAUSTED at once."""
        if self.active >= self._max_calls:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, CONCURRENCY_EXCEEDED)
        self.active += 1

    def _release(self) -> None:
        self.active -= 1

    def _release_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._release)
        except RuntimeError:
            pass  # the server stopped and its loop closed: nothing counts places any more


def _refusal(method: str, exc: Exception, context: grpc.aio.ServicerContext) -> _Refused:
    """A handler's exception as the status its call ends with."""
    if isinstance(exc, _Refused):
        return exc
    if isinstance(exc, errors.ServingError):
        return _Refused(status_code(exc), details(exc))
    code = context.code()
    if code is not None:  # set by a base class's UNIMPLEMENTED
        return _Refused(code, context.details() or "")
    log.error("unhandled error in %s", method, exc_info=exc)
    return _Refused(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def _serialized(method: str, serialize: Callable[[Any], bytes] | None, response: Any) -> bytes:
    try:
        return serialize(response) if serialize is not None else response
    except Exception as exc:
        log.exception("the answer of %s cannot be serialized", method)
        raise _Refused(grpc.StatusCode.INTERNAL, f"the answer cannot be serialized: {type(exc).__name__}") \
            from None


class _Stream:
    """One stream of a `Streamed` method (the module docstring): requests read as they come, each
    served on a task of its own, answers written in the order the requests came."""

    def __init__(self, path: CallPath, method: str, streamed: Streamed, parse: Any, serialize: Any,
                 context: grpc.aio.ServicerContext) -> None:
        self.path, self.method, self.streamed, self.context = path, method, streamed, context
        self.parse, self.serialize = parse, serialize
        # Each request's task, in the order they came; None once the client half-closed.
        self.order: asyncio.Queue[asyncio.Task[_Answered] | None] = asyncio.Queue()
        self.tasks: set[asyncio.Task[_Answered]] = set()
        metadata = dict(context.invocation_metadata() or ())
        self.error_ends = str(metadata.get(STREAM_ERROR_KEY, "")).lower() == "true"

    async def serve(self) -> _Refused | None:
        """Until every answer was written; the failure that ends the stream (triton_grpc_error), if one did."""
        reader = asyncio.create_task(self._read())
        try:
            return await self._write()
        except asyncio.CancelledError:
            # grpc cancelled the stream (its client cancelled or left, its deadline passed): its code
            # says so to each request's client-gone check, whose rows are then dropped unrun.
            self.context.set_code(ended_code(self.context))
            raise
        finally:
            reader.cancel()
            for task in self.tasks:
                if not task.done():
                    task.cancel()  # its request ends CANCELLED (or DEADLINE_EXCEEDED), its place given back
                elif not task.cancelled() and task.exception() is None:
                    task.result().done(self.path, grpc.StatusCode.CANCELLED)  # answered, never written

    async def _read(self) -> None:
        try:
            while (raw := await self.context.read()) is not grpc.aio.EOF:
                task = asyncio.create_task(self._one(raw))
                self.tasks.add(task)
                self.order.put_nowait(task)
        except Exception as exc:  # noqa: BLE001 - the call broke: its end cancels the stream
            log.debug("stream %s: read failed: %r", self.method, exc)
        finally:
            self.order.put_nowait(None)

    async def _write(self) -> _Refused | None:
        while (task := await self.order.get()) is not None:
            answered = await task
            self.tasks.discard(task)
            try:
                if answered.refused is not None and self.error_ends:
                    return answered.refused
                await self.context.write(answered.message)
            finally:
                answered.done(self.path)
        return None

    async def _one(self, raw: bytes) -> _Answered:
        """One request served as a unary call: its exchange, a place, its trace, its handler."""
        path = self.path
        exchange = path.open_exchange(self.method, self.context, streamed=True)
        request, placed = None, False
        try:
            request = _parsed(self.parse, raw)
            path.admit()
            placed = True
            path._trace(self.method, exchange)
            message = self.streamed.answered(await self.streamed.run(request, exchange))
            return _Answered(_serialized(self.method, self.serialize, message), exchange, placed)
        except asyncio.CancelledError:
            # The stream ended (its client cancelled or left, its deadline passed) while this ran.
            if placed:
                path._release()
            exchange.finish(ended_code(self.context))
            raise
        except Exception as exc:  # noqa: BLE001 - answered in the stream, which goes on
            refused = _refusal(self.method, exc, self.context)
            failed = self.streamed.failed(request, refused.message)
            return _Answered(_serialized(self.method, self.serialize, failed), exchange, placed, refused)


class _Answered(NamedTuple):
    """A streamed request's message to write, and what writing it ends."""

    message: bytes
    exchange: GrpcExchange
    placed: bool
    refused: _Refused | None = None

    def done(self, path: CallPath, code: grpc.StatusCode | None = None) -> None:
        """Written (or, with `code`, dropped): its place given back, its exchange closed."""
        if self.placed:
            path._release()
        if code is None:
            code = grpc.StatusCode.OK if self.refused is None else self.refused.code
        self.exchange.finish(code)


def _parsed(parse: Callable[[bytes], Any] | None, raw: bytes) -> Any:
    try:
        return parse(raw) if parse is not None else raw
    except Exception:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the request message does not parse") from None


async def _receive(context: grpc.aio.ServicerContext, timeout_s: float, parse: Callable[[bytes], Any] | None) -> Any:
    """The call's one request message, parsed; _Refused if it is late, missing or unparseable."""
    task = asyncio.current_task()
    assert task is not None
    late: list[bool] = []

    def too_late() -> None:
        late.append(True)
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, too_late)
    try:
        raw = await context.read()
    except asyncio.CancelledError:
        if not late:
            raise  # the call itself was cancelled
        task.uncancel()
        raise _Refused(grpc.StatusCode.CANCELLED,
                       f"the request message did not arrive within {timeout_s * 1000:.0f} ms") from None
    finally:
        timer.cancel()
    if raw is grpc.aio.EOF:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
    return _parsed(parse, raw)
