"""The app's Flask subclass (app/http/patches.py): what it changes of Flask's per-request work."""

from __future__ import annotations

from flask import Flask

from app.core.call import Call
from app.http.patches import CachedEnsureSync


def test_flask_asks_once_per_function_whether_it_is_a_coroutine(monkeypatch):
    asked = []
    original = Flask.ensure_sync

    def counting(self, func):
        asked.append(func)
        return original(self, func)

    monkeypatch.setattr(Flask, "ensure_sync", counting)
    app = CachedEnsureSync("factory")
    app.add_url_rule("/", "root", lambda: "ok")
    app.before_request(lambda: None)
    with app.test_client() as client:
        for _ in range(3):
            assert client.get("/").text == "ok"
    # Flask asks for the view and the hook on every request; the subclass, once each.
    assert len(asked) == 2 and len(set(asked)) == 2


def test_a_dead_batch_thread_calls_the_apps_own_replace_worker_once(exact_model_path):
    import ctypes
    import threading

    from app import create_app
    from app.core.errors import BatcherBroken
    from app.ops.settings import Settings
    from tests.conftest import integer_rows

    class Killed(BaseException):
        pass

    calls = []
    app = create_app(Settings(model_path=str(exact_model_path), access_log=False, model_poll_seconds=0),
                     replace_worker=lambda: calls.append("replace"))
    try:
        servable = app.services.registry.get()
        batcher = servable.batcher
        (tensor,) = servable.signature().inputs
        for thread in threading.enumerate():
            if thread.name.startswith("batcher-"):
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Killed))
        # The submit wakes the thread, which dies at its next line: its own last defence answers.
        future = batcher.submit(Call(), {tensor.name: integer_rows(1).astype(tensor.dtype)})
        try:
            future.result(60)
        except BatcherBroken:
            pass
        batcher.join(60)
        assert batcher.broken and calls == ["replace"]
    finally:
        app.services.registry.close(drain=False)


_CONFIGURE_TWICE = """
import json, sys
from app.ops import runtime
from app.ops.settings import Settings
first = runtime.configure(Settings(tf_intra_op_threads=1, tf_inter_op_threads=1), workers=1)
second = runtime.configure(Settings(tf_intra_op_threads=2, tf_inter_op_threads=3), workers=2)
tf = sys.modules["tensorflow"]
print(json.dumps([first["intra_op_threads"], second["intra_op_threads"], second["inter_op_threads"],
                  second["workers"], tf.config.threading.get_intra_op_parallelism_threads()]))
"""


def test_configure_does_what_each_call_asks_and_keeps_no_state():
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    # A fresh process: TensorFlow's pools can only be sized before its first op runs.
    done = subprocess.run([sys.executable, "-c", _CONFIGURE_TWICE], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [1, 2, 3, 2, 2]
