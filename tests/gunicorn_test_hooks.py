"""Gunicorn settings for tests: the real gunicorn.conf.py, plus a way to kill a batch thread.

`gunicorn -c tests/gunicorn_test_hooks.py wsgi:app` runs with every setting and hook of
gunicorn.conf.py, and adds to each worker, after Gunicorn installed its own signal handlers:

- SIGUSR2: raise KilledBatchThread in every batch thread of the worker (CPython's
  PyThreadState_SetAsyncExc), as an interpreter-level failure would. It is a BaseException
  raised at whatever line the thread runs next (it runs once a request wakes it), so
  nothing in the engine can catch it on purpose: only its last line of defence answers.
- With HOLD_REPLACEMENT=1, the worker's own call to be replaced waits for SIGRTMIN, so a
  test can look at the broken worker (/readyz, /healthz) before it goes.
- With MODULES_REPORT=<folder>, each worker writes the names of the modules it imported to
  <folder>/<pid>.txt as it exits (what a server without tracing never imports).

Production code has no such hooks: this file exists for tests only.
"""

import ctypes
import os
import runpy
import signal
import sys
import threading
from pathlib import Path

_real = runpy.run_path(str(Path(__file__).resolve().parent.parent / "gunicorn.conf.py"))
globals().update({name: value for name, value in _real.items() if not name.startswith("__")})


class KilledBatchThread(BaseException):
    pass


def _kill_batch_threads(signum, frame):
    for thread in threading.enumerate():
        if thread.name.startswith("batcher-"):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(KilledBatchThread))


def _hold_replacement(app):
    replace, let_go = app.extensions["replace_worker"], threading.Event()

    def held() -> None:
        threading.Thread(target=lambda: let_go.wait() and replace(), daemon=True).start()

    app.extensions["replace_worker"] = held
    signal.signal(signal.SIGRTMIN, lambda signum, frame: let_go.set())


def post_worker_init(worker):
    if "post_worker_init" in _real:
        _real["post_worker_init"](worker)
    signal.signal(signal.SIGUSR2, _kill_batch_threads)
    if os.environ.get("HOLD_REPLACEMENT") == "1":
        _hold_replacement(worker.wsgi)


def worker_exit(server, worker):
    _real["worker_exit"](server, worker)
    report = os.environ.get("MODULES_REPORT")
    if report:
        Path(report, f"{os.getpid()}.txt").write_text("\n".join(sorted(sys.modules)))
