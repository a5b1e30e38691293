"""The Gunicorn worker class (app/worker.py), on Gunicorn's own request parser over a real socket pair."""

from __future__ import annotations

import os
import socket
import threading
from concurrent import futures

import pytest
from gunicorn.config import Config
from gunicorn.glogging import Logger
from gunicorn.http.parser import RequestParser
from gunicorn.workers.gthread import DEFAULT_WORKER_DATA_TIMEOUT, TConn

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


# -- the next request on a kept-alive connection, answered by the thread that answered the last --

@pytest.fixture
def worker():
    """A real gthread worker, not started: handle() runs in the test's thread, as in a request thread."""
    cfg = Config()
    made = ThreadWorker(age=1, ppid=os.getppid(), sockets=[], app=None, timeout=30, cfg=cfg, log=Logger(cfg))
    made.tpool = futures.ThreadPoolExecutor(1)
    made.served = []

    def app(environ, start_response):
        made.served.append(environ["wsgi.input"].read())
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    made.wsgi = app
    yield made
    made.tpool.shutdown(wait=True)
    made.tmp.close()


def read_answers(client: socket.socket, count: int) -> bytes:
    """What the client reads until `count` whole answers (each ends in its 2-byte body 'ok') or the end."""
    got = b""
    while got.count(b"\r\n\r\nok") < count:
        chunk = client.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def answers(client: socket.socket, count: int) -> int:
    return read_answers(client, count).count(b"\r\n\r\nok")


def closed_loop(client: socket.socket, bodies: list[bytes], read: list[int]) -> threading.Thread:
    """A client that sends each body as soon as it has read the answer to the one before."""
    def run() -> None:
        for body in bodies:
            send(client, body)
            read.append(answers(client, 1))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def kept_alive(worker):
    server, client = socket.socketpair()
    yield TConn(worker.cfg, server, ("127.0.0.1", 1), ("127.0.0.1", 8000)), client
    server.close()
    client.close()


def test_the_thread_that_answered_answers_the_next_request_on_its_connection(worker, kept_alive):
    conn, client = kept_alive
    read: list[int] = []
    client_thread = closed_loop(client, [b"first", b"second", b"third"], read)
    # One call of handle(), as one request thread: every request the client sent within the
    # wait after an answer was answered here, none went back through gthread's poller.
    assert worker.handle(conn) is True
    client_thread.join(5)
    assert worker.served == [b"first", b"second", b"third"] and read == [1, 1, 1]


def test_a_request_read_in_place_after_the_worker_began_stopping_is_answered_and_the_connection_closed(
        worker, kept_alive):
    conn, client = kept_alive
    got: list[bytes] = []

    def client_run() -> None:
        send(client, b"first")
        answers(client, 1)
        worker.alive = False  # the stop comes while the thread waits for the next request
        send(client, b"second")
        got.append(read_answers(client, 1))

    client_thread = threading.Thread(target=client_run, daemon=True)
    client_thread.start()
    # Answered, as gthread answers a kept-alive connection's request during a stop, with
    # "Connection: close"; the connection is not kept.
    assert worker.handle(conn) is False
    client_thread.join(5)
    assert worker.served == [b"first", b"second"]
    assert b"\r\nConnection: close\r\n" in got[0] and got[0].endswith(b"ok")


def test_no_thread_waits_on_a_connection_while_other_requests_wait_for_a_thread(worker, kept_alive):
    conn, client = kept_alive
    release = threading.Event()
    worker.tpool.submit(release.wait, 5)  # the pool's one thread is taken
    queued = worker.tpool.submit(lambda: None)  # and a request waits for it
    client_thread = closed_loop(client, [b"first", b"second"], [])
    try:
        assert worker.handle(conn) is True
        assert worker.served == [b"first"]
    finally:
        release.set()
    queued.result(5)
    # The second request, sent as the first was answered, is served the poller's way: a later handle().
    assert worker.handle(conn) is True
    client_thread.join(5)
    assert worker.served == [b"first", b"second"]


def test_a_request_the_parser_already_read_ahead_is_answered_without_waiting_on_the_socket(worker, kept_alive):
    conn, client = kept_alive
    # Both in one write: reading the first, the parser reads the second too, which leaves the
    # socket with nothing to make it readable.
    client.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirst"
                   b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nsecond")
    assert worker.handle(conn) is True
    assert worker.served == [b"first", b"second"]
    assert answers(client, 2) == 2
