"""MODEL_PROCESSES: what a model process answers to a frame it has no operation for.

A worker of another release, say, could send one: the model process answers it with an error
(503) rather than dropping it, so that the worker's caller is not left waiting for an answer
that never comes. The test speaks to a real model process through the worker's own link.
"""

from __future__ import annotations

import pytest

from app.core.errors import Unavailable
from app.model_process.link import ModelProcessLink
from tests.conftest import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path):
    served = Server(tmp_path_factory.mktemp("model-process-ops"),
                    {"MODEL_PATH": str(exact_model_path), "MODEL_PROCESSES": "1"})
    served.start(workers=1)
    yield served
    served.stop()


def model_process_link(server: Server) -> ModelProcessLink:
    """A link to the server's model process, as a worker's: the test speaks for one more worker."""
    socket_path = next(process.cmdline()[process.cmdline().index("--socket") + 1] for process in server.processes()
                       if "app.model_process.server" in process.cmdline())
    link = ModelProcessLink(socket_path, arena_bytes=1 << 20, on_meta=lambda _description: None)
    link.connect()
    return link


def test_a_frame_the_model_process_does_not_know_is_answered_not_left_waiting(server):
    link = model_process_link(server)
    try:
        with pytest.raises(Unavailable, match="the model process has no operation 'rewind'"):
            link.request({"op": "rewind"}).result(30)
    finally:
        link.close()
