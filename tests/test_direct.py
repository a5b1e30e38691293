"""The predict and infer routes answered below Flask (app/http/routes.py): the same URLs as Flask's
rules, and the same answers, access lines and request metrics as Flask's views give."""

from __future__ import annotations

import gc
import itertools
import logging
import socket
import weakref

import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect
from werkzeug.test import EnvironBuilder

from app.http.routes import DirectRoutes
from app.ops import logs
from tests.conftest import integer_rows


def direct_layer(app) -> DirectRoutes:
    layer = app.wsgi_app
    while not isinstance(layer, DirectRoutes):
        layer = layer.app
    return layer


def wsgi_path(path: str) -> str:
    """PATH_INFO as a WSGI server hands it over: the URL's bytes, each read as one latin-1 character."""
    return path.encode().decode("latin-1")


NAMES = ["default", "a", "A9", "a.b-c_d", "m" * 64, "m" * 65, "-a", ".a", "_a", "a b", "café", "a:b", "stats", ""]
VERSIONS = ["1", "007", "0", "-1", "1.5", "١", "²", "", "stable", "a.b", "é", "a:b"]
TEMPLATES = [
    "/predict", "/predict/", "//predict", "/PREDICT", "/predict:predict",
    "/v1/models/{n}:predict", "/v1/models/{n}:predict/", "/v1/models/{n}:PREDICT", "/v1/models/{n}:classify",
    "/v1/models/{n}/versions/{v}:predict", "/v1/models/{n}/labels/{v}:predict", "/v1/models/{n}/labels/{v}",
    "/v1/models/{n}//versions/{v}:predict", "/v1//models/{n}:predict",
    "/v2/models/{n}/infer", "/v2/models/{n}/versions/{v}/infer", "/v2/models/{n}/infer/", "/v2/models/{n}//infer",
    "/v2/models/{n}/versions/{v}/ready", "/v2/models/{n}/versions/{v}/x/infer",
]
PATHS = sorted({template.format(n=name, v=version)
                for template, name, version in itertools.product(TEMPLATES, NAMES, VERSIONS)})


def test_the_direct_table_takes_exactly_the_posts_that_flask_routes_to_the_same_rules(in_process_app, exact_model_path):
    app = in_process_app(model_path=str(exact_model_path))
    direct = direct_layer(app)
    direct_rules = {rule for _pattern, rule, _handler in direct.routes}
    taken = 0
    for path, method in itertools.product(PATHS, ("POST", "GET")):
        environ = {"REQUEST_METHOD": method, "PATH_INFO": wsgi_path(path), "SERVER_NAME": "x", "SERVER_PORT": "80",
                   "wsgi.url_scheme": "http", "SCRIPT_NAME": ""}
        try:
            rule, values = app.url_map.bind_to_environ(environ).match(return_rule=True)
        except (HTTPException, RequestRedirect):
            rule, values = None, {}
        matched = direct.match(environ)
        if matched is None:
            # Left to Flask, which answers it with the same view: a GET, a path Flask reaches by
            # dropping its extra leading slashes, one not in ASCII, or one no direct rule fits.
            assert (rule is None or rule.rule not in direct_rules or method != "POST" or path.startswith("//")
                    or not path.isascii()), (path, method)
            continue
        taken += 1
        assert method == "POST"
        text, _handler, groups = matched
        assert rule is not None and rule.rule == text, path
        # The same values, as the rule's converters make them ('007' is version 7 for both).
        assert [type(value)(group) for value, group in zip(values.values(), groups, strict=True)] == list(
            values.values()), path
    # Every direct rule was met, by more than one path each.
    assert taken > 4 * len(direct_rules)


def requests_by_route(client) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").get_data(as_text=True)
    return {(sample.labels["route"], sample.labels["status"]): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "model_server_requests_total" and sample.labels["method"] == "POST"}


def v2_binary(rows: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": list(rows.shape),
                                       "parameters": {"binary_data_size": rows.nbytes}}],
                           "parameters": {"binary_data_output": True}})
    return header + rows.astype(np.float32).tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def test_answers_access_lines_and_metrics_are_flasks_own(in_process_app, exact_model_path, exact_model, caplog,
                                                          monkeypatch):
    app = in_process_app(model_path=str(exact_model_path), access_log=True, max_request_bytes=200_000)
    client = app.test_client()
    rows = integer_rows(3)
    name = exact_model.inputs[0].name
    binary, binary_headers = v2_binary(rows)
    v2_json = {"inputs": [{"name": name, "datatype": "FP32", "shape": list(rows.shape),
                           "data": rows.reshape(-1).tolist()}]}
    asks = [
        ("/predict", {"json": {"instances": rows.tolist()}}),
        ("/v1/models/default:predict", {"json": {"inputs": rows.tolist()}}),
        ("/v1/models/default/versions/1:predict", {"json": {"instances": rows.tolist()}}),
        ("/v1/models/default/versions/9:predict", {"json": {"instances": rows.tolist()}}),
        ("/v1/models/default/labels/stable:predict", {"json": {"instances": rows.tolist()}}),
        ("/v1/models/nosuch:predict", {"json": {"instances": rows.tolist()}}),
        ("/predict", {"data": b"{not json"}),
        ("/predict", {"data": b'{"instances": []}'}),
        ("/predict", {"json": {"instances": rows.tolist()}, "headers": {"Content-Encoding": "gzip"}}),
        ("/predict", {"data": b" " * 300_000}),
        ("/predict", {"json": {"instances": rows.tolist()}, "headers": {"X-Priority": "x"}}),
        ("/v2/models/default/infer", {"json": v2_json}),
        ("/v2/models/default/versions/1/infer", {"json": v2_json}),
        ("/v2/models/default/infer", {"data": binary, "headers": binary_headers}),
        ("/v2/models/default/infer", {"json": {"inputs": []}}),
    ]

    def answers() -> tuple[list, list, dict]:
        before = requests_by_route(client)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="app.access"):
            got = []
            for path, kwargs in asks:
                response = client.post(path, **kwargs)
                headers = [(key, value) for key, value in response.headers if key != "X-Request-ID"]
                got.append((response.status, headers, response.get_data()))
            logs.flush_access_log()
        lines = [{key: value for key, value in dict(entry.fields).items() if key not in ("latency_ms", "request_id")}
                 for entry in caplog.records if entry.name == "app.access"]
        after = requests_by_route(client)
        return got, lines, {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}

    direct = answers()
    monkeypatch.setattr(direct_layer(app), "routes", [])  # every request through Flask's views
    flask = answers()
    assert direct == flask
    got, lines, counted = direct
    statuses = [status for status, _headers, _body in got]
    assert statuses == ["200 OK", "200 OK", "200 OK", "404 NOT FOUND", "400 BAD REQUEST", "404 NOT FOUND",
                        "400 BAD REQUEST", "400 BAD REQUEST", "415 UNSUPPORTED MEDIA TYPE",
                        "413 REQUEST ENTITY TOO LARGE", "400 BAD REQUEST", "200 OK", "200 OK", "200 OK",
                        "400 BAD REQUEST"]
    expected = exact_model.predict(rows.astype(np.float32))
    assert orjson.loads(got[0][2])["predictions"] == expected.tolist()
    assert np.array_equal(np.frombuffer(got[13][2][-expected.nbytes:], np.float32).reshape(expected.shape), expected)
    assert [line["path"] for line in lines] == [path for path, _ in asks]
    assert counted[("/v1/models/<model_name:name>/versions/<int:version>:predict", "404")] == 1
    assert counted[("/predict", "400")] == 3
    assert orjson.loads(got[4][2]) == {"error": "Unrecognized servable version label: stable"}
    assert counted[("/v2/models/<model_name:name>/infer", "200")] == 2


def test_an_unexpected_error_gets_flasks_500_and_its_log_line(in_process_app, exact_model_path, monkeypatch, caplog):
    """A bug below a direct route is answered and logged as Flask's catch-all handler does it."""
    from app.wire import codec

    app = in_process_app(model_path=str(exact_model_path), access_log=True)
    client = app.test_client()

    def broken(body, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(codec, "parse_request", broken)
    got = []
    for routes in (direct_layer(app).routes, []):
        monkeypatch.setattr(direct_layer(app), "routes", routes)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="app.http.errors"):
            response = client.post("/predict", json={"instances": [[1, 2, 3, 4]]}, headers={"X-Request-ID": "bug-1"})
        got.append((response.status_code, response.get_json(),
                    [entry.getMessage() for entry in caplog.records if entry.name == "app.http.errors"]))
    assert got[0] == got[1] == (500, {"error": "internal error: RuntimeError"}, ["unhandled error, request_id=bug-1"])


def test_an_answered_request_leaves_no_reference_cycle(in_process_app, exact_model_path, monkeypatch):
    """Its exchange holds its environ (the body, the client's socket and its poller): the environ
    must not keep the exchange in turn, or every request's objects wait for the cyclic garbage
    collector, whose collections then come several times as often and each frees many requests."""
    app = in_process_app(model_path=str(exact_model_path))
    exchanges = app.services.exchanges
    closed, close = [], exchanges.close

    def close_and_watch(exchange):
        closed.append(weakref.ref(exchange))
        close(exchange)

    monkeypatch.setattr(exchanges, "close", close_and_watch)
    statuses = []
    # A model that does not exist: the request builds its call (and its socket's poller) and is
    # refused before it reaches a batch thread, which would hold its last batch a while.
    environ = EnvironBuilder(path="/v1/models/nosuch:predict", method="POST",
                             json={"instances": integer_rows(1).tolist()}).get_environ()
    server_end, client_end = socket.socketpair()
    environ["gunicorn.socket"] = server_end
    gc.disable()
    try:
        b"".join(app(environ, lambda status, headers, exc_info=None: statuses.append(status)))
        del environ
        assert statuses == ["404 NOT FOUND"]
        assert closed[0]() is None  # freed by its reference count alone
    finally:
        gc.enable()
        server_end.close()
        client_end.close()
