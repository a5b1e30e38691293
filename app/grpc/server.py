"""Each Gunicorn worker's gRPC server, beside its HTTP port.

Every worker starts a `grpc.aio` server on GRPC_BIND once its app and models are loaded
(Gunicorn's post_worker_init: grpc's threads must not exist before the fork, and the
master never imports grpc), on an event loop thread of its own. All workers bind the same
port with SO_REUSEPORT, so the kernel spreads connections over them as it does for
Gunicorn's shared socket.

The doors on it: TensorFlow Serving's services (app/grpc/tfs.py) and the Open Inference
Protocol's (app/grpc/v2.py). Every call takes one path (app/grpc/calls.py): its exchange
(app/grpc/exchange.py) counts it in model_server_requests (route: the full method name,
method: GRPC, status: the code's name) and writes its access line, like an HTTP request's,
with the status its client got.

On SIGTERM the server stops taking calls at once and lets every accepted one finish; the
worker's exit waits for them before the batchers close.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc
from tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc

from app.core.services import Services
from app.grpc import calls as grpc_calls
from app.grpc import limits as grpc_limits
from app.grpc import socket as grpc_socket
from app.grpc import tls
from app.grpc import v2 as v2_grpc
from app.grpc.tfs import HealthServicer, ModelServicer, PredictionServicer

log = logging.getLogger(__name__)


_T = TypeVar("_T")


class GrpcServer:
    """One worker's gRPC server, on an event loop thread of its own: start after the app loaded,
    stop with every accepted call answered."""

    def __init__(self, services: Services, *, bind: str, threads: int) -> None:
        self.bind = bind
        self.health = HealthServicer(services.layer)
        self._stopped: threading.Event | None = None
        self._lock = threading.Lock()
        self._threads = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc")
        self._loop = asyncio.new_event_loop()
        # Where a call on the loop runs what must not block it (a model handler's stages, app/core/serving.py).
        self._loop.set_default_executor(self._threads)
        self._loop_thread = threading.Thread(target=self._run_loop, name="grpc-loop", daemon=True)
        self._loop_thread.start()
        try:
            self._server, self.port = self._on_loop(self._build(services, bind, threads))
        except BaseException:
            self._close_loop()
            raise

    async def _build(self, services: Services, bind: str, threads: int) -> tuple[grpc.aio.Server, int]:
        layer, settings = services.layer, services.settings
        max_bytes = layer.max_request_bytes  # REST's body limit: MAX_REQUEST_BYTES, or derived from the models
        path = grpc_calls.CallPath(
            services.exchanges, max_calls=threads, receive_timeout_s=settings.grpc_receive_timeout_ms / 1000.0,
            timeout_s=layer.timeout_s, threads=self._threads, tracing=services.tracing,
            restricted=v2_grpc.restriction(settings))
        # Connections, streams, metadata and messages (app/grpc/limits.py); calls and their
        # message's wait, the exchange, the trace, errors to codes (app/grpc/calls.py).
        server = grpc_limits.build_server(settings, max_bytes=max_bytes, threads=self._threads, path=path)
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
            PredictionServicer(layer, tensor_content=settings.grpc_tensor_content), server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(layer), server)
        v2_grpc.add_to_server(server, layer, services.repository)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            port = tls.add_port(server, bind, settings.grpc_ssl_config_file)
        except RuntimeError as exc:
            raise RuntimeError(f"GRPC_BIND={bind!r}: cannot listen there: {exc}") from None
        return server, port

    def _on_loop(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def start(self) -> GrpcServer:
        self._on_loop(self._server.start())
        log.info("gRPC (TensorFlow Serving's PredictionService and ModelService) on %s, pid %d",
                 self.bind, os.getpid())
        return self

    def stop(self, *, grace_s: float) -> threading.Event:
        """Refuse new calls at once; cancel those still running after grace_s. Safe to call twice."""
        with self._lock:
            if self._stopped is None:
                self.health.stopping = True
                stopped = self._stopped = threading.Event()

                def ended(_future: Any) -> None:
                    self._threads.shutdown(wait=False)
                    self._close_loop()
                    stopped.set()

                asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).add_done_callback(ended)
            return self._stopped

    def drain(self, *, timeout_s: float) -> bool:
        """Stop, and wait until every accepted call is answered; False if some were still running."""
        return self.stop(grace_s=timeout_s).wait(timeout_s)

    def _run_loop(self) -> None:
        self._loop.run_forever()
        self._loop.close()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def serve_in_worker(worker: Any) -> GrpcServer | None:
    """Gunicorn's post_worker_init: start gRPC, and refuse new calls as soon as a stop is asked.

    The stop runs on the worker's stopping thread, not in a signal handler: gRPC's stop takes
    locks and starts a thread, and a second signal would interrupt the first one's handler
    while it holds them (app/worker.py). None when the worker was asked to stop while starting.
    """
    services = getattr(worker.wsgi, "services", None)
    if services is None or not worker.alive:
        return None
    grace_s = float(worker.cfg.graceful_timeout)
    settings = services.settings

    def serve(bind: str) -> GrpcServer:
        return GrpcServer(services, bind=bind, threads=worker.cfg.threads).start()

    if settings.grpc_socket_path:
        # One worker at a time serves the Unix socket; the others wait to take it over.
        owner = grpc_socket.SocketOwner(settings.grpc_socket_path, serve).start()
        worker.grpc_socket = owner
        worker.when_stopping(lambda: owner.stop(grace_s=grace_s))
    if not settings.grpc_bind:
        return None
    server = serve(settings.grpc_bind)
    worker.grpc_server = server
    worker.when_stopping(lambda: server.stop(grace_s=grace_s))
    return server


@contextmanager
def serving(services: Services, *, bind: str, threads: int = 16) -> Iterator[GrpcServer]:
    """A gRPC server for `services` outside Gunicorn (tests, a plain `flask run`)."""
    server = GrpcServer(services, bind=bind, threads=threads).start()
    try:
        yield server
    finally:
        server.drain(timeout_s=10)
