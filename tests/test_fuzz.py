"""Fuzzing a live server against its own OpenAPI document (GET /openapi.json).

Two generators, both bounded in count and every request in time:

- Schemathesis turns the document into cases, both fitting it (positive) and breaking it
  (negative), and checks each answer: no 5xx, a status the document lists for the route,
  the listed content type, headers and body schema, and a 4xx for data that breaks it.
- Hypothesis mutates what Schemathesis does not: bytes near a valid body, arbitrary JSON,
  deep nesting, odd content types and headers, wrong methods and odd model names.

Every error must be {"error": "..."} with a status the document lists for that route.
"""

from __future__ import annotations

import json
import os

import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.http import openapi
from tests.conftest import Server

POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE

# (connect, read) seconds: a request that gets no answer in time fails the test as a hang.
CLIENT_TIMEOUT_S = (5, 30)
MAX_REQUEST_BYTES = 8192
MAX_QUEUE_ROWS = 16
# At least 2,000 requests in all; FUZZ_SCALE=10 runs ten times as many, for a longer hunt.
SCALE = int(os.environ.get("FUZZ_SCALE", "1"))
SCHEMATHESIS_EXAMPLES = 1000 * SCALE
MUTATION_EXAMPLES = 1100 * SCALE
FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,  # no example database left in the working tree
    phases=[Phase.explicit, Phase.generate],  # shrinking a failure would only cost time here
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
SPEC = openapi.spec()


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path):
    running = Server(tmp_path_factory.mktemp("fuzz"), {
        "MODEL_PATH": str(exact_model_path),
        "MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
        "MAX_QUEUE_ROWS": str(MAX_QUEUE_ROWS),
        "ACCESS_LOG": "false",
    }).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def session():
    with requests.Session() as shared:
        yield shared


CONTROL = {"/v2/repository/models/{name}/load", "/v2/repository/models/{name}/unload"}
CONTROL_OFF = b'{"error":"explicit model load / unload is not allowed if polling is enabled"}'


def documented_statuses(template: str) -> set[int]:
    return {int(status) for operation in SPEC["paths"][template].values() for status in operation["responses"]}


def check_answer(template: str, where: str, status: int, content_type: str | None, content: bytes) -> None:
    """The invariant of every answer: a listed status, and every error a JSON {"error": string}."""
    where = f"{where} -> {status}: {content[:300]!r}"
    # 503 only where it is the answer: /readyz, and model control's, off on this server as Triton's is by default.
    control_off = template in CONTROL and content == CONTROL_OFF
    assert status < 500 or status == 503 and (template == "/readyz" or control_off), where
    assert status in documented_statuses(template), where
    if status >= 400 and template != "/readyz":
        assert content_type == "application/json", where
        body = orjson.loads(content)
        assert isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str), where
        assert body["error"], where


def test_openapi_document_describes_every_route(server):
    # The served app checked the document against its own routes as it started
    # (openapi.init_app); tests/test_v2_edges.py holds that check to a failing case.
    documented = {(path, method) for path, operations in SPEC["paths"].items() for method in operations}
    assert ("/v2/models/{name}/infer", "post") in documented
    assert len(documented) == 37

    served = requests.get(server.url + "/openapi.json", timeout=CLIENT_TIMEOUT_S)
    assert served.status_code == 200
    assert served.headers["Content-Type"] == "application/json"
    document = served.json()
    # Beside the routes, each model's signature as served now (a handler's, where a model has one).
    assert document.pop("x-model-signatures") == {"default": {
        "inputs": {"features": {"dtype": "float32", "shape": [4]}},
        "outputs": {"scores": {"dtype": "float32", "shape": [3]}}}}
    assert document == SPEC
    assert SPEC["paths"]["/v1/models/{name}:predict"]["post"]["responses"].keys() == {
        "200", "400", "404", "405", "413", "415", "500", "503", "504"}


@schemathesis.check
def negative_data_refused(ctx, response, case):
    """Schemathesis' negative-data check, with 413 among the refusals: a body over the derived
    MAX_REQUEST_BYTES is refused for its size before its shape is read, which is as much a refusal."""
    if response.status_code == 413:
        return None
    return negative_data_rejection(ctx, response, case)


@schemathesis.check
def no_undocumented_server_error(ctx, response, case):
    """Schemathesis' server-error check, less a 503 the operation documents: Triton's (and so this
    server's) repository load and unload answer 503 while model control is not explicit."""
    if response.status_code == 503 and "503" in case.operation.definition.raw.get("responses", {}):
        return None
    return not_a_server_error(ctx, response, case)


def test_schemathesis_cases_get_documented_answers(server, session):
    schema = schemathesis.openapi.from_dict(SPEC)
    operations = [result.ok() for result in schema.get_all_operations()]
    # Free path parameters mostly name no model (404): half the cases aim at the served one.
    served = {"name": "default", "version": 1}
    strategies = []
    for operation in operations:
        fixed = {name: served[name] for name in ("name", "version") if name in operation.path_parameters}
        strategies.append(operation.as_strategy(generation_mode=POSITIVE))
        if fixed:
            strategies.append(operation.as_strategy(generation_mode=POSITIVE, path_parameters=fixed))
        if operation.path_parameters:
            strategies.append(operation.as_strategy(generation_mode=NEGATIVE))
        if operation.body:
            strategies.append(operation.as_strategy(generation_mode=NEGATIVE, path_parameters=fixed or None))
    checks = [no_undocumented_server_error, status_code_conformance, content_type_conformance,
              response_headers_conformance, response_schema_conformance, negative_data_refused]
    sent = []

    @settings(FUZZ_SETTINGS, max_examples=SCHEMATHESIS_EXAMPLES)
    @given(case=st.one_of(strategies))
    def answer_as_documented(case):
        response = case.call(base_url=server.url, session=session, timeout=CLIENT_TIMEOUT_S)
        sent.append(response.status_code)
        case.validate_response(response, checks=checks)
        check_answer(case.operation.path, f"{case.method} {case.formatted_path}", response.status_code,
                     response.headers.get("content-type", [None])[0], response.content)

    answer_as_documented()
    assert len(sent) >= SCHEMATHESIS_EXAMPLES
    assert {400, 404} <= set(sent)  # the cases reached the routing and the codec
    assert not [status for status in sent if status >= 500 and status != 503]


# -- hand-written mutations ------------------------------------------------------------

VALID_BODY = b'{"instances": [[1, 2, 3, 4], [-9, 0, 9, 5]]}'
VALID_V2_BODY = b'{"id": "a", "inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 4], ' \
                b'"data": [1, 2, 3, 4, -9, 0, 9, 5]}], "outputs": [{"name": "scores"}]}'
PREDICT_TEMPLATES = ["/predict", "/v1/models/{name}:predict", "/v1/models/{name}/versions/{version}:predict",
                     "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"]
GET_TEMPLATES = ["/v1/models/{name}", "/v1/models/{name}/versions/{version}", "/v1/models/{name}/metadata",
                 "/v1/models/{name}/versions/{version}/metadata", "/healthz", "/readyz", "/openapi.json",
                 "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/ready",
                 "/v2/models/{name}/versions/{version}", "/v2/models/{name}/versions/{version}/ready"]

# Header values requests will send: printable, no CR/LF, no leading space.
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60).map(str.lstrip)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=40)
numbers = st.one_of(st.integers(-(2**64), 2**64), st.floats(), st.sampled_from([1e39, -1e39, 3.4e38, 1e-46, -0.0]))


@st.composite
def mutated_bytes(draw) -> bytes:
    body = bytearray(draw(st.sampled_from([VALID_BODY, b'{"inputs": [[1, 2, 3, 4]]}',
                                           b'{"instances": [{"features": [1, 2, 3, 4]}]}', VALID_V2_BODY])))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(body)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if action == "flip" and position < len(body):
            body[position] ^= 1 << draw(st.integers(0, 7))
        elif action == "insert":
            body[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del body[position:position + draw(st.integers(1, 8))]
        else:
            del body[position:]
    return bytes(body)


bodies = st.one_of(
    mutated_bytes(),
    json_values.map(orjson.dumps),
    st.builds(lambda key, value: orjson.dumps({key: value}), st.sampled_from(["instances", "inputs"]), json_values),
    # Python's json writes big integers (400, not 500) and NaN and Infinity (read as TF Serving reads them).
    st.lists(st.lists(numbers, min_size=1, max_size=6), min_size=1, max_size=20)
    .map(lambda rows: json.dumps({"instances": rows}).encode()),
    st.integers(1, 5000).map(lambda depth: b'{"instances": ' + b"[" * depth + b"1" + b"]" * depth + b"}"),
    st.integers(1, MAX_REQUEST_BYTES // 10).map(lambda rows: b'{"instances": [' + b",".join(
        [b"[1, 2, 3, 4]"] * rows) + b"]}"),
    st.binary(max_size=256),
)
content_types = st.one_of(
    st.sampled_from(["application/json", "application/json; charset=utf-8", "Application/JSON", "text/plain",
                     "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx",
                     "application/json; charset=latin-1", ""]),
    header_text,
)
extra_headers = st.dictionaries(
    st.sampled_from(["Accept", "X-Request-ID", "Content-Encoding", "Accept-Encoding", "Cookie", "Origin",
                     "Inference-Header-Content-Length"]),
    header_text, max_size=3)
model_names = st.one_of(st.just("default"), st.just("default"), st.just("default"),
                        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,70}", fullmatch=True),
                        st.sampled_from(["..", "../etc", "..%2F..%2Fetc", "%2e%2e", "a%00b", "a:b", "~root", "a b"]))
versions = st.one_of(st.just("1"), st.just("1"), st.just("1"), st.integers(-5, 2**70).map(str),
                     st.sampled_from(["01", "1.0", "x", "%31"]))


@st.composite
def requests_to_send(draw):
    if draw(st.integers(0, 3)):
        template = draw(st.sampled_from(PREDICT_TEMPLATES))
        method = draw(st.sampled_from(["POST"] * 12 + ["GET", "PUT", "DELETE", "PATCH"]))
    else:
        template = draw(st.sampled_from(GET_TEMPLATES))
        method = draw(st.sampled_from(["GET"] * 6 + ["POST", "PUT", "DELETE"]))
    path = template.replace("{name}", draw(model_names)).replace("{version}", draw(versions))
    headers = draw(extra_headers)
    content_type = draw(content_types)
    if content_type and method != "GET":
        headers["Content-Type"] = content_type
    return template, method, path, headers, draw(bodies)


def test_mutated_requests_get_documented_json_errors(server, session):
    sent = []

    @settings(FUZZ_SETTINGS, max_examples=MUTATION_EXAMPLES)
    @given(request=requests_to_send())
    def answer_as_documented(request):
        template, method, path, headers, body = request
        response = session.request(method, server.url + path, data=body, headers=headers, timeout=CLIENT_TIMEOUT_S)
        sent.append(response.status_code)
        check_answer(template, f"{method} {path} {headers}", response.status_code,
                     response.headers.get("Content-Type"), response.content)

    answer_as_documented()
    assert len(sent) >= MUTATION_EXAMPLES
    assert {200, 400, 404, 405} <= set(sent)
    # The server answered all of them and still serves.
    answer = session.post(server.url + "/predict", data=VALID_BODY, headers={"Content-Type": "application/json"},
                          timeout=CLIENT_TIMEOUT_S)
    assert answer.status_code == 200

