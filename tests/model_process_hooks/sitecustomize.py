"""For tests only: a way to kill the batch threads of a live model process.

tests/test_model_process_faults.py puts this folder first on PYTHONPATH, so every Python
process of its server imports this file at start-up; with KILL_BATCH_THREADS_ON_SIGUSR2=1,
SIGUSR2 then raises KilledBatchThread in every batch thread of the process that gets it
(CPython's PyThreadState_SetAsyncExc), as tests/gunicorn_test_hooks.py does in a worker.
It is a BaseException raised at whatever line the thread runs next (once a request wakes
it), so nothing in the engine can catch it on purpose: only its last line of defence answers.
The test signals the model process alone. Production code has no such hook.
"""

import ctypes
import os
import signal
import threading


class KilledBatchThread(BaseException):
    pass


def _kill_batch_threads(signum, frame):
    for thread in threading.enumerate():
        if thread.name.startswith("batcher-"):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(KilledBatchThread))


if os.environ.get("KILL_BATCH_THREADS_ON_SIGUSR2") == "1":
    signal.signal(signal.SIGUSR2, _kill_batch_threads)
