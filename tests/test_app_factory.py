"""The app's Flask subclass (app/patches.py): what it changes of Flask's per-request work."""

from __future__ import annotations

from flask import Flask

from app.patches import CachedEnsureSync


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
