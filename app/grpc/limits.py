"""The gRPC server's limits, from settings, as the HTTP side's come from theirs: one builder.

`build_server` makes every worker's `grpc.aio.server`. What bounds a client, and why:

- connections: at most GRPC_MAX_CONNECTIONS per worker (default a quarter of the process's
  descriptor limit), so connections held open on the gRPC port cannot take the descriptors
  the HTTP listener needs (app/worker.py backs off if they run out all the same); a
  connection with no call for GRPC_CONNECTION_IDLE_MS, or older than GRPC_CONNECTION_AGE_MS,
  gets a GOAWAY, and its calls still running are cancelled REQUEST_TIMEOUT_MS later;
- streams: at most GRPC_MAX_STREAMS_PER_CONNECTION calls at once on one connection, when set
  (advertised in SETTINGS; grpc-core refuses more, and ends a connection that keeps
  opening and resetting streams beyond it). Unset by default: with grpc 1.85's server, a
  limit of N refuses every stream of a connection after about N + 4 calls, sequential ones
  included (REFUSED_STREAM); the call limit and the receive timeout bound what streams can
  hold meanwhile;
- metadata: GRPC_MAX_METADATA_BYTES, both the soft limit (what the server advertises in
  SETTINGS_MAX_HEADER_LIST_SIZE) and the hard one, so what is advertised is what is held;
- messages: MAX_REQUEST_BYTES (the limit the app derived for REST bodies);
- calls, the wait for a call's message, Health outside both: app/grpc/calls.py, the path
  every call takes.

GRPC_CHANNEL_ARGUMENTS (TF Serving's --grpc_channel_arguments) may replace any of the
channel arguments above, as TF Serving lets its own be replaced (`channel_options`).
"""

from __future__ import annotations

import resource
from concurrent import futures

import grpc

from app.ops.settings import Settings

# Descriptors per worker the gRPC server may hold as connections, by default: the rest serve
# REST connections, model files, pipes and TensorFlow.
CONNECTION_SHARE_OF_FDS = 4


def descriptor_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def max_connections(settings: Settings) -> int:
    return settings.grpc_max_connections or max(1, descriptor_limit() // CONNECTION_SHARE_OF_FDS)


def channel_options(settings: Settings, *, max_bytes: int) -> list[tuple[str, int | str]]:
    """The grpc-core channel arguments, each from a setting, then GRPC_CHANNEL_ARGUMENTS.

    An argument GRPC_CHANNEL_ARGUMENTS names replaces this server's own value for it; each key
    is passed once. TF Serving sets only the message size limits itself, so every other
    argument a user gives takes effect there; here the limits are many, each a setting's
    default, and a user's argument takes effect all the same. grpc.so_reuseport cannot be
    turned off (app/ops/settings.py): every worker binds the same port.
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


def build_server(settings: Settings, *, max_bytes: int, threads: futures.ThreadPoolExecutor,
                 path: grpc.aio.ServerInterceptor) -> grpc.aio.Server:
    """A worker's grpc.aio.server with every limit above, `path` its one interceptor (the call
    path), `threads` where handlers that block run; services are added by the caller. Made on
    the loop that will serve it."""
    return grpc.aio.server(migration_thread_pool=threads, interceptors=[path],
                           options=channel_options(settings, max_bytes=max_bytes))
