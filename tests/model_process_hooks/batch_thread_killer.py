"""For tests only: kill every batch thread of this process, as an interpreter-level failure would.

`kill_batch_threads_on(signum)` makes that signal raise KilledBatchThread in each thread named
`batcher-…` (CPython's PyThreadState_SetAsyncExc). It is a BaseException raised at whatever
line the thread runs next (once a request wakes it), so nothing in the engine can catch it on
purpose: only its last line of defence answers.

Two test hooks load it, in two ways: a Gunicorn worker through tests/gunicorn_test_hooks.py
(the config file imports it as `tests.model_process_hooks.batch_thread_killer`), and a model
process through this folder's sitecustomize.py (the folder is on its PYTHONPATH). Production
code has no such hook.
"""

import ctypes
import signal
import threading


class KilledBatchThread(BaseException):
    pass


def kill_batch_threads(signum: int, frame: object) -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("batcher-"):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(KilledBatchThread))


def kill_batch_threads_on(signum: int) -> None:
    signal.signal(signum, kill_batch_threads)
