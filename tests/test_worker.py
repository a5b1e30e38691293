"""The Gunicorn worker class (app/worker.py), on Gunicorn's own request parser over a real socket pair."""

from __future__ import annotations

import socket

import pytest
from gunicorn.config import Config
from gunicorn.http.parser import RequestParser
from gunicorn.workers.gthread import DEFAULT_WORKER_DATA_TIMEOUT

from app.worker import ThreadWorker, body_fully_read


class SpySocket:
    """A socket that records every timeout set on it: each is an ioctl releasing the GIL."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.timeouts: list[float | None] = []

    def settimeout(self, value: float | None) -> None:
        self.timeouts.append(value)
        self._sock.settimeout(value)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class Conn:
    def __init__(self, parser: RequestParser) -> None:
        self.parser = parser


@pytest.fixture
def connection():
    server, client = socket.socketpair()
    spy = SpySocket(server)
    yield spy, client, Conn(RequestParser(Config(), spy, ("127.0.0.1", 1)))
    server.close()
    client.close()


def keepalive_after(conn: Conn) -> bool:
    # The method uses nothing of the worker's own state: no worker process is needed.
    return ThreadWorker._keepalive_after(object.__new__(ThreadWorker), conn, True)


def drained_by_gunicorn(spy: SpySocket) -> None:
    """Gunicorn's drain ran: reads bounded by a timeout, then the socket's own (none) put back."""
    assert len(spy.timeouts) >= 2 and spy.timeouts[-1] is None
    assert all(0 < timeout <= DEFAULT_WORKER_DATA_TIMEOUT for timeout in spy.timeouts[:-1])


def send(client: socket.socket, body: bytes) -> None:
    client.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def test_a_body_read_to_its_end_keeps_the_connection_without_a_drain(connection):
    spy, client, conn = connection
    send(client, b'{"instances": [[1, 2]]}')
    send(client, b'{"second": 1}')
    request = next(conn.parser)
    assert request.body.read() == b'{"instances": [[1, 2]]}'
    assert body_fully_read(conn.parser)
    assert keepalive_after(conn) is True
    # Gunicorn's drain would have set a timeout and set it back: two GIL hand-offs for nothing.
    assert spy.timeouts == []
    # The next request on the connection starts where it should.
    assert next(conn.parser).body.read() == b'{"second": 1}'


def test_a_body_left_unread_is_drained_by_gunicorn_as_before(connection):
    spy, client, conn = connection
    send(client, b"unread body")
    send(client, b"next")
    request = next(conn.parser)
    assert request.body.read(3) == b"unr"
    assert not body_fully_read(conn.parser)
    assert keepalive_after(conn) is True
    drained_by_gunicorn(spy)
    assert next(conn.parser).body.read() == b"next"


def test_a_chunked_body_takes_gunicorns_path(connection):
    spy, client, conn = connection
    client.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbody\r\n0\r\n\r\n")
    request = next(conn.parser)
    assert request.body.read() == b"body"
    assert not body_fully_read(conn.parser)
    assert keepalive_after(conn) is True
    drained_by_gunicorn(spy)


def test_a_request_without_a_body_keeps_the_connection_without_a_drain(connection):
    spy, client, conn = connection
    client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    send(client, b"next")
    next(conn.parser)
    assert keepalive_after(conn) is True and spy.timeouts == []
    assert next(conn.parser).body.read() == b"next"


def test_a_body_whose_read_failed_closes_the_connection_as_gunicorn_does(connection):
    spy, client, conn = connection
    send(client, b"body")
    request = next(conn.parser)
    assert request.body.read() == b"body"
    # Where the next request starts is unknown after a failed read: Gunicorn's own answer.
    request.body.failed = True
    assert not body_fully_read(conn.parser)
    assert keepalive_after(conn) is False
