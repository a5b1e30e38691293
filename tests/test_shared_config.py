"""The coordination of a reload across workers (app/core/shared_config.py), in one process: each
SharedConfig is a worker's end, with its real Unix socket, state file and lock in a run folder;
what a worker does to apply a config is a callable here, so a sibling can be held, fail or
leave at a chosen point. tests/test_tfs_live_config.py checks the same on real workers."""

from __future__ import annotations

import socket
import threading

import pytest

from app.core import errors
from app.core.shared_config import Generation, SharedConfig

HERE, SIBLING = 1001, 1002
DOCUMENT = {"models": [{"name": "a"}]}


class Worker:
    """A worker's end of the folder, and the generations it was asked to apply."""

    def __init__(self, folder, pid: int, *, error: str = "", hold: threading.Event | None = None) -> None:
        self.shared = SharedConfig(folder, worker=pid)
        self.applied: list[Generation] = []
        self.error = error
        self.hold = hold
        self.started = threading.Event()

    def apply(self, generation: Generation) -> tuple[int, str]:
        self.started.set()
        if self.hold is not None:
            self.hold.wait()
        self.applied.append(generation)
        return generation.number, self.error


@pytest.fixture
def workers(tmp_path):
    made: list[Worker] = []

    def make(pid: int, **kwargs) -> Worker:
        worker = Worker(tmp_path, pid, **kwargs)
        made.append(worker)
        if pid != HERE:
            worker.shared.listen(worker.apply)
        return worker

    yield make
    for worker in made:
        if worker.hold is not None:
            worker.hold.set()
        worker.shared.close()


def test_every_sibling_applies_each_generation_before_publish_returns(workers):
    here, sibling = workers(HERE), workers(SIBLING)
    here.shared.publish(DOCUMENT, here.apply, timeout_s=30)
    second = {"models": [{"name": "b"}]}
    here.shared.publish(second, here.apply, timeout_s=30)
    expected = [Generation(1, DOCUMENT), Generation(2, second)]
    assert here.applied == expected and sibling.applied == expected
    # What a worker starting now reads.
    assert SharedConfig(here.shared.folder, worker=1003).latest() == Generation(2, second)


def test_a_sibling_silent_at_the_deadline_is_named(workers):
    here, held = workers(HERE), workers(SIBLING, hold=threading.Event())
    with pytest.raises(errors.DeadlineExceeded, match=rf"worker\(s\) \[{SIBLING}\] had not reported"):
        here.shared.publish(DOCUMENT, here.apply, timeout_s=0.5)
    assert here.applied == [Generation(1, DOCUMENT)] and held.started.is_set() and held.applied == []


def test_a_failure_is_named_where_it_happened(workers):
    here, _failing = workers(HERE), workers(SIBLING, error="model 'a': ModelLoadError: out of memory")
    with pytest.raises(errors.ServingError) as failed:
        here.shared.publish(DOCUMENT, here.apply, timeout_s=30)
    assert type(failed.value) is errors.ServingError
    assert failed.value.message == ("the model config was applied by this worker, but not by "
                                    f"worker {SIBLING}: model 'a': ModelLoadError: out of memory")
    here.error = "model 'a': ModelLoadError: no such folder"
    with pytest.raises(errors.BadRequest, match="^model 'a': ModelLoadError: no such folder$"):
        here.shared.publish(DOCUMENT, here.apply, timeout_s=30)


def test_a_killed_workers_socket_is_passed_over_and_removed(workers, tmp_path):
    here = workers(HERE)
    left = tmp_path / "1003.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(left))
    dead.close()  # as the kernel closes it when a worker is killed: the file stays, nothing listens
    here.shared.publish(DOCUMENT, here.apply, timeout_s=30)
    assert here.applied == [Generation(1, DOCUMENT)] and not left.exists()


def test_one_reload_at_a_time_and_a_waiting_one_leaves_at_its_deadline(workers):
    here, held = workers(HERE), workers(SIBLING, hold=threading.Event())
    first = threading.Thread(target=here.shared.publish, args=(DOCUMENT, here.apply), kwargs={"timeout_s": None})
    first.start()
    held.started.wait()
    with pytest.raises(errors.DeadlineExceeded, match="another reload of the model config was still running"):
        here.shared.publish(DOCUMENT, here.apply, timeout_s=0.3)
    held.hold.set()
    first.join()
    # The lock the one that left waited for is released once taken: the next reload goes ahead.
    here.shared.publish(DOCUMENT, here.apply, timeout_s=30)
    assert [generation.number for generation in here.applied] == [1, 2]
