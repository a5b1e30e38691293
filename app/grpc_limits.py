"""The gRPC server's limits, from settings, as the HTTP side's come from theirs: one builder.

`build_server` makes every worker's `grpc.server`. What bounds a client, and why:

- connections: at most GRPC_MAX_CONNECTIONS per worker (default a quarter of the process's
  descriptor limit), so connections held open on the gRPC port cannot take the descriptors
  the HTTP listener needs (app/worker.py backs off if they run out all the same); a
  connection with no call for GRPC_CONNECTION_IDLE_MS, or older than GRPC_CONNECTION_AGE_MS,
  gets a GOAWAY, and its calls still running are cancelled REQUEST_TIMEOUT_MS later;
- streams: at most GRPC_MAX_STREAMS_PER_CONNECTION calls at once on one connection, when set
  (advertised in SETTINGS; grpc-core refuses more, and ends a connection that keeps
  opening and resetting streams beyond it). Unset by default: with grpc 1.85's server, a
  limit of N refuses every stream of a connection after about N + 4 calls, sequential ones
  included (REFUSED_STREAM); the call limit, Health's own threads and the receive timeout
  bound what streams can hold meanwhile;
- metadata: GRPC_MAX_METADATA_BYTES, both the soft limit (what the server advertises in
  SETTINGS_MAX_HEADER_LIST_SIZE) and the hard one, so what is advertised is what is held;
- messages: MAX_REQUEST_BYTES (the limit the app derived for REST bodies);
- calls: at most THREADS at once per worker (Health excluded), the rest refused at once with
  RESOURCE_EXHAUSTED rather than waiting in the thread pool's queue where nothing sees them;
- the wait for a call's message: a call whose request message has not arrived within
  GRPC_RECEIVE_TIMEOUT_MS of its headers is cancelled, so streams that send headers only
  cannot hold threads. grpc-core has no such channel argument: every unary method is served
  here as a client-streaming one that reads its one message under a timer, and cancels the
  call when the timer fires first;
- Health: grpc.health.v1 runs on threads of its own (HEALTH_THREADS), outside the call
  limit, with a receive timeout of at most HEALTH_RECEIVE_TIMEOUT_S: predictions holding
  every thread cannot make the probe fail, and stalled health calls hold a thread for at
  most that long.

GRPC_CHANNEL_ARGUMENTS (TF Serving's --grpc_channel_arguments) may replace any of the
channel arguments above, as TF Serving lets its own be replaced (`channel_options`).

A message that does not parse is answered INVALID_ARGUMENT (grpc-python's own path answers
INTERNAL and logs a traceback per call).
"""

from __future__ import annotations

import heapq
import itertools
import resource
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc

from app.settings import Settings

HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEALTH_THREADS = 4
HEALTH_RECEIVE_TIMEOUT_S = 1.0
# Descriptors per worker the gRPC server may hold as connections, by default: the rest serve
# REST connections, model files, pipes and TensorFlow.
CONNECTION_SHARE_OF_FDS = 4
CONCURRENCY_EXCEEDED = "Concurrent RPC limit exceeded!"


def descriptor_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def max_connections(settings: Settings) -> int:
    return settings.grpc_max_connections or max(1, descriptor_limit() // CONNECTION_SHARE_OF_FDS)


def channel_options(settings: Settings, *, threads: int, max_bytes: int) -> list[tuple[str, int | str]]:
    """The grpc-core channel arguments, each from a setting, then GRPC_CHANNEL_ARGUMENTS.

    An argument GRPC_CHANNEL_ARGUMENTS names replaces this server's own value for it; each key
    is passed once. TF Serving sets only the message size limits itself, so every other
    argument a user gives takes effect there; here the limits are many, each a setting's
    default, and a user's argument takes effect all the same. grpc.so_reuseport cannot be
    turned off (app/settings.py): every worker binds the same port.
    """
    streams = settings.grpc_max_streams_per_connection
    own: list[tuple[str, int | str]] = [
        ("grpc.so_reuseport", 1),
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_allowed_incoming_connections", max_connections(settings)),
        *([("grpc.max_concurrent_streams", streams)] if streams else []),
        ("grpc.max_metadata_size", settings.grpc_max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", settings.grpc_max_metadata_bytes),
        ("grpc.max_connection_idle_ms", int(settings.grpc_connection_idle_ms)),
        ("grpc.max_connection_age_ms", int(settings.grpc_connection_age_ms)),
        ("grpc.max_connection_age_grace_ms", int(settings.request_timeout_ms)),
    ]
    return list({**dict(own), **dict(settings.grpc_channel_arguments)}.items())


def build_server(settings: Settings, *, threads: int, max_bytes: int, records: grpc.ServerInterceptor | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = ()) -> grpc.Server:
    """A worker's grpc.server with every limit above; services are added by the caller. The
    limits' guard comes after `records` (the call records, which see the calls it refuses)
    and before other `interceptors` (tracing), which see only admitted calls."""
    calls = _CountingPool(max_workers=threads, thread_name_prefix="grpc")
    guard = _CallGuard(calls, max_calls=threads, receive_timeout_s=settings.grpc_receive_timeout_ms / 1000.0)
    return grpc.server(calls, interceptors=[*([records] if records else []), guard, *interceptors],
                       options=channel_options(settings, threads=threads, max_bytes=max_bytes))


class _CountingPool(futures.ThreadPoolExecutor):
    """The calls' thread pool, counting the calls it holds, queued or running."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self.held = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
        with self._lock:
            self.held += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return future

    def _release(self, _future: Any) -> None:
        with self._lock:
            self.held -= 1


class _CallGuard(grpc.ServerInterceptor):
    """Call limit, Health's own threads, receive timeout and parse errors, for every method."""

    def __init__(self, calls: _CountingPool, *, max_calls: int, receive_timeout_s: float) -> None:
        self._calls = calls
        self._max_calls = max_calls
        self._receive_timeout_s = receive_timeout_s
        self._health = futures.ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="grpc-health")
        self._refusals = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpc-refusal")

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        if details.method.startswith(HEALTH_PREFIX):
            return self._guarded(handler, min(self._receive_timeout_s, HEALTH_RECEIVE_TIMEOUT_S), self._health)
        # Only the server's poll thread calls this and submits to the pool, so the count
        # cannot grow between this check and the call's submission.
        if self._calls.held >= self._max_calls:
            return self._refusal(handler)
        return self._guarded(handler, self._receive_timeout_s, None)

    def _guarded(self, handler: Any, timeout_s: float, pool: futures.ThreadPoolExecutor | None) -> Any:
        behavior = handler.unary_unary
        parse = handler.request_deserializer

        def receive_then_call(messages: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            raw = _first_message(messages, context, timeout_s)
            try:
                request = parse(raw) if parse is not None else raw
            except Exception:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request message does not parse")
            return behavior(request, context)

        if pool is not None:
            receive_then_call.experimental_thread_pool = pool  # type: ignore[attr-defined]
        # Raw bytes in: a message that does not parse is the caller's error, answered above.
        return grpc.stream_unary_rpc_method_handler(receive_then_call, request_deserializer=None,
                                                    response_serializer=handler.response_serializer)

    def _refusal(self, handler: Any) -> Any:
        def refuse(_messages: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, CONCURRENCY_EXCEEDED)

        refuse.experimental_thread_pool = self._refusals  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)


def _first_message(messages: Iterator[bytes], context: grpc.ServicerContext, timeout_s: float) -> bytes:
    """The call's one request message; the call is cancelled if it has not come within timeout_s."""
    entry = _watchdog.watch(timeout_s, context)
    try:
        return next(messages)
    except StopIteration:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
    finally:
        entry[2] = None
    raise AssertionError("unreachable: abort raises")


class _Watchdog:
    """One thread that cancels calls whose message is late: no timer thread per call.

    Entries are [deadline, sequence, context]; a call that got its message clears its context
    and the entry is dropped when it reaches the top of the heap. The thread wakes at most
    every TICK_S while anything is watched, never when nothing is.
    """

    TICK_S = 0.1

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._heap: list[list[Any]] = []
        self._sequence = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, timeout_s: float, context: grpc.ServicerContext) -> list[Any]:
        entry = [time.monotonic() + timeout_s, next(self._sequence), context]
        with self._ready:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grpc-receive-timeout", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:
                self._ready.notify()
        return entry

    def _run(self) -> None:
        while True:
            late = []
            with self._ready:
                while self._heap and (self._heap[0][2] is None or self._heap[0][0] <= time.monotonic()):
                    context = heapq.heappop(self._heap)[2]
                    if context is not None:
                        late.append(context)
                if not late:
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._ready.wait(None if wait is None else max(wait, self.TICK_S))
            for context in late:
                context.cancel()


_watchdog = _Watchdog()
