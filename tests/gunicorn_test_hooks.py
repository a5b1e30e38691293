"""Gunicorn settings for tests: the real gunicorn.conf.py, plus a way to kill a batch thread.

`gunicorn -c tests/gunicorn_test_hooks.py wsgi:app` runs with every setting and hook of
gunicorn.conf.py, and adds to each worker, after Gunicorn installed its own signal handlers:

- SIGUSR2: raise KilledBatchThread in every batch thread of the worker, as an
  interpreter-level failure would (tests/model_process_hooks/batch_thread_killer.py, which a
  model process loads too).
- With HOLD_REPLACEMENT=1, the worker's own call to be replaced waits for SIGRTMIN, so a
  test can look at the broken worker (/readyz, /healthz) before it goes.
- With MODULES_REPORT=<folder>, each worker writes the names of the modules it imported to
  <folder>/<pid>.txt as it exits (what a server without tracing never imports).
- With PREDICT_GATE=<folder>, a predict call whose inputs hold GATE_VALUE is held inside
  the model, past the engine's last look at its clients, until the worker gets SIGRTMIN+1
  (one signal lets one held call go); while held, <folder>/held-<pid> exists. Calls
  without the value run as usual, and a held call's answer is still the model's own.

Production code has no such hooks: this file exists for tests only.
"""

import os
import runpy
import signal
import sys
import threading
from pathlib import Path

from tests.model_process_hooks.batch_thread_killer import kill_batch_threads_on

_real = runpy.run_path(str(Path(__file__).resolve().parent.parent / "gunicorn.conf.py"))
globals().update({name: value for name, value in _real.items() if not name.startswith("__")})


GATE_VALUE = 77.0
GATE_RELEASE = signal.SIGRTMIN + 1


def _hold_replacement(app):
    replace, let_go = app.services.replace_worker, threading.Event()

    def held() -> None:
        threading.Thread(target=lambda: let_go.wait() and replace(), daemon=True).start()

    app.services.replace_worker = held
    signal.signal(signal.SIGRTMIN, lambda signum, frame: let_go.set())


def _gate_predicts(app, folder: Path) -> None:
    release = threading.Semaphore(0)
    signal.signal(GATE_RELEASE, lambda signum, frame: release.release())
    held = folder / f"held-{os.getpid()}"

    def gated(predict):
        def run(inputs):
            if any(value.dtype.kind == "f" and (value == GATE_VALUE).any() for value in inputs.values()):
                held.touch()
                release.acquire()
                held.unlink()
            return predict(inputs)

        return run

    for servable in app.services.registry.servables():
        for batcher in servable.batchers.values():
            batcher.executor._predict_fn = gated(batcher.executor._predict_fn)


def post_worker_init(worker):
    if "post_worker_init" in _real:
        _real["post_worker_init"](worker)
    kill_batch_threads_on(signal.SIGUSR2)
    if os.environ.get("HOLD_REPLACEMENT") == "1":
        _hold_replacement(worker.wsgi)
    if os.environ.get("PREDICT_GATE"):
        _gate_predicts(worker.wsgi, Path(os.environ["PREDICT_GATE"]))


def worker_exit(server, worker):
    _real["worker_exit"](server, worker)
    report = os.environ.get("MODULES_REPORT")
    if report:
        Path(report, f"{os.getpid()}.txt").write_text("\n".join(sorted(sys.modules)))
