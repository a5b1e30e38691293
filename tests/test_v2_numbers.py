"""v2 JSON requests whose floating-point `data` simdjson reads flat into a float64 buffer
(v2_rest._numbers_read_whole): every answer, values or refusal, is the general path's (orjson,
then v2_tensors' reading), byte for byte."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from app.http import v2 as v2_rest
from tests.conftest import FEATURES


def request(data, *, shape=(2, FEATURES), datatype="FP32", name=None, **extra) -> dict:
    return {"inputs": [{"name": name, "datatype": datatype, "shape": list(shape), "data": data}], **extra}


FLAT = [1, -2.5, 3e-3, 4, 0.1, -0.0, 7, 1e-45]
NESTED = [FLAT[:4], FLAT[4:]]
BODIES = [
    request(FLAT),
    request(NESTED),
    request([[FLAT[:2], FLAT[2:4]], [FLAT[4:6], FLAT[6:]]]),
    request([FLAT[:4], FLAT[4:], []]),  # nesting that is not a matrix: the values flattened, as Triton reads them
    request([FLAT[:3], [FLAT[3:]]]),
    request(FLAT[:7]),  # fewer values than the shape holds
    request(FLAT + [1]),
    request([1, 2, 3, "4", 5, 6, 7, 8]),
    request([1, 2, 3, None, 5, 6, 7, 8]),
    request([1, 2, 3, True, 5, 6, 7, 8]),
    request([9007199254740993, 2**63 + 2**40 + 1, 18446744073709551615, 4, 5, 6, 7, 8]),  # through a double, both ways
    request(FLAT, datatype="INT32"),
    request(FLAT, datatype="FP64"),
    request(FLAT, datatype="BYTES"),
    request(FLAT, shape=(2, FEATURES + 1)),
    request(FLAT, parameters={"signature_name": "serving_default", "binary_data_output": False}),
    request(FLAT, id="7", outputs=[{"name": "output_0"}]),
    request(FLAT, outputs=[{"name": "output_0", "parameters": {"binary_data": True}}]),
    {"inputs": []},
    {"inputs": "x"},
    {"inputs": [[1, 2]]},
    {"id": 3, **request(FLAT)},
    # A key holding NUL: simdjson would look it up cut short at the NUL, to another key or none.
    {"x\u0000y": 1, **request(FLAT)},
    {"id\u0000x": "b", "id": "a", **request(FLAT)},
    {"inputs": [{"name": None, "datatype": "FP32", "shape": [2, FEATURES], "data": FLAT, "shape\u0000": [1]}]},
    # Past float32's range: refused, as TF Serving's REST door refuses it; float32's largest, and
    # a value that rounds to it rather than to infinity, served.
    request(FLAT[:7] + [3.5e38]),
    request(FLAT[:6] + [-3.4028235e38, 3.40282356e38]),
]
RAW_BODIES = [
    b'{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [2, 4], "data": [1, 2, 3, NaN, 5, 6, 7, Infinity]}]}',
    b'{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [2, 4], "data": [1, 2, 3, 4, 5, 6, 7, 8],'
    b' "data": [8, 7, 6, 5, 4, 3, 2, 1]}]}',  # orjson keeps the last
    b'{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],'
    b' "inputs": [{"name": "NAME", "datatype": "FP32", "shape": [1, 4], "data": [4, 3, 2, 1]}]}',
    b'\xef\xbb\xbf{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}',
    b'{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [1, 4],'
    b' "data": [1, 2, 3, 123456789012345678901234567890]}]}',
    b'{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],'
    b' "parameters": {"a": 1, "a": 2}}',
    b'{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 1e39]}]}',
    b'{"inputs": [{"name": "NAME", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]',
]


@pytest.fixture
def client(in_process_app, exact_model_path):
    return in_process_app(model_path=str(exact_model_path)).test_client()


def answers(client, bodies: list[bytes]) -> list[tuple[int, bytes]]:
    return [(response.status_code, response.get_data())
            for response in (client.post("/v2/models/default/infer", data=body) for body in bodies)]


def test_answers_are_the_general_paths_byte_for_byte(client, exact_model, monkeypatch):
    name = exact_model.inputs[0].name
    bodies = [orjson.dumps({**body, "inputs": [{**tensor, "name": name} for tensor in body["inputs"]]})
              if isinstance(body.get("inputs"), list) and all(isinstance(t, dict) for t in body["inputs"])
              else orjson.dumps(body) for body in BODIES]
    bodies += [body.replace(b"NAME", name.encode()) for body in RAW_BODIES]
    read_whole = [v2_rest._numbers_read_whole(body) for body in bodies]
    fast = answers(client, bodies)
    monkeypatch.setattr(v2_rest, "_numbers_read_whole", lambda text: None)
    general = answers(client, bodies)
    assert fast == general
    # The common shapes took the new path, and were served: the model's own answer.
    assert isinstance(read_whole[0]["inputs"][0]["data"], np.ndarray)
    assert isinstance(read_whole[3]["inputs"][0]["data"], np.ndarray)
    assert [read_whole[len(BODIES) + index] for index in (0, 1, 2, 3, 4)] == [None] * 5
    # Integer and string data keep their JSON values: their checks (range, fractions) need them.
    assert [type(read_whole[index]["inputs"][0]["data"]) for index in (11, 13)] == [list, list]
    expected = exact_model.predict(np.asarray(FLAT, np.float32).reshape(2, FEATURES))
    assert fast[0][0] == 200
    assert orjson.loads(fast[0][1])["outputs"][0]["data"] == expected.reshape(-1).tolist()
    assert [status for status, _ in fast] == [200] * 5 + [400] * 5 + [200] + [400] * 4 + [200] + [400] * 6 + [
        200] * 3 + [400, 200] + [200, 200, 200, 400, 200, 200, 400, 400]
    # The values past float32's range took the new path, and were refused in the general path's words.
    assert isinstance(read_whole[len(BODIES) - 2]["inputs"][0]["data"], np.ndarray)
    assert orjson.loads(fast[len(BODIES) - 2][1]) == {"error": f"input '{name}': a value is outside the range of FP32"}
