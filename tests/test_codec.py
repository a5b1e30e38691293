"""The codec alone, no server: JSON bodies to arrays and arrays to JSON, as TF Serving reads and writes them.

TF Serving's behaviour is read from tensorflow_serving/util/json_tensor.cc (and its
json_tensor_test.cc) and tensorflow_serving/g3doc/api_rest.md; each test names what it follows.
"""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import pytest

from app.core.errors import BadRequest, InvalidInput, PayloadTooLarge
from app.core.models import STRING, TensorInfo
from app.wire import codec

F32, F64, I32 = np.dtype("float32"), np.dtype("float64"), np.dtype("int32")


def tensor(name: str, shape: tuple, dtype: np.dtype = F32) -> TensorInfo:
    tf_name = {F32: "DT_FLOAT", F64: "DT_DOUBLE", I32: "DT_INT32", STRING: "DT_STRING"}.get(dtype, "DT_BOOL")
    return TensorInfo(name, shape, dtype, tf_name)


@dataclasses.dataclass
class Spec:
    inputs: list[TensorInfo]
    outputs: list[TensorInfo] = dataclasses.field(default_factory=list)


FEATURES = Spec([tensor("features", (4,))], [tensor("scores", (3,))])
COLUMN = Spec([tensor("x", (1,))], [tensor("y", (1,))])  # TF Serving's half_plus_two: x and y are [-1, 1]


def decode(body, spec=FEATURES, **kwargs) -> dict[str, np.ndarray]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return codec.decode_inputs(codec.parse_request(raw, **kwargs), spec)


# -- parse_request: the form of the body, before any array ------------------------------------

def test_parse_request_reads_format_rows_and_signature():
    parsed = codec.parse_request(b'{"instances": [[1, 2, 3, 4], [5, 6, 7, 8]]}')
    assert (parsed.format, parsed.rows, parsed.signature_name) == (codec.ROW, 2, "serving_default")
    named = codec.parse_request(b'{"signature_name": "classify", "inputs": {"a": [1, 2, 3], "b": [[1]]}}')
    assert (named.format, named.rows, named.signature_name) == (codec.COLUMNAR, 3, "classify")


def test_empty_signature_name_means_serving_default():
    """json_tensor.cc FillSignature + http_rest_api_handler.cc GetInfoMap: "" is the default signature."""
    assert codec.parse_request(b'{"signature_name": "", "instances": [1]}').signature_name == "serving_default"


def test_signature_name_must_be_a_string():
    """json_tensor.cc FormatSignatureError: 'signature_name' key must be a string value."""
    with pytest.raises(BadRequest, match="'signature_name' must be a string"):
        codec.parse_request(b'{"signature_name": 3, "instances": [1]}')


def test_too_many_rows_are_refused_before_anything_is_decoded(monkeypatch):
    def no_decoding(*args, **kwargs):
        raise AssertionError("rows were decoded before the row count was checked")

    monkeypatch.setattr(codec, "_to_number_array", no_decoding)
    monkeypatch.setattr(codec, "_to_string_array", no_decoding)
    body = json.dumps({"instances": [["not", "numbers", None, {}]] * 9}).encode()
    with pytest.raises(PayloadTooLarge, match="holds 9 rows; this model takes at most 8 rows .*MAX_REQUEST_ROWS"):
        codec.parse_request(body, max_rows=8)
    columns = json.dumps({"inputs": {"a": [1] * 3, "b": [1] * 9}}).encode()
    with pytest.raises(PayloadTooLarge, match="holds 9 rows"):
        codec.parse_request(columns, max_rows=8)
    assert codec.parse_request(body, max_rows=9).rows == 9


def test_decode_inputs_decodes_for_any_signature_it_is_given():
    """Which signature a name means is the caller's business: the codec never refuses one."""
    parsed = codec.parse_request(b'{"signature_name": "other", "instances": [[1, 2, 3, 4]]}')
    np.testing.assert_array_equal(codec.decode_inputs(parsed, FEATURES)["features"], [[1, 2, 3, 4]])


# -- NaN and Infinity ---------------------------------------------------------------------------

def test_nan_and_infinity_are_read_as_tf_serving_reads_them():
    """api_rest.md 'JSON conformance'; json_tensor.cc ParseJson uses rapidjson's kParseNanAndInfFlag."""
    rows = decode(b'{"instances": [[NaN, Infinity, -Infinity, 1.5]]}')["features"]
    assert rows.dtype == F32
    assert np.isnan(rows[0, 0]) and rows[0, 1] == np.inf and rows[0, 2] == -np.inf and rows[0, 3] == 1.5
    double = decode(b'{"inputs": [NaN, -Infinity]}', Spec([tensor("d", (), F64)]))["d"]
    assert double.dtype == F64 and np.isnan(double[0]) and double[1] == -np.inf


@pytest.mark.parametrize("body,words", [
    (b'{"instances": [[1e400, NaN, 0, 0]]}', "too big for a double"),  # rapidjson: 'Number too big'
    (b'{"instances": [[NaN, 1, 2, 3]', "malformed JSON"),
    (b'{"instances": [[nan, 1, 2, 3]]}', "malformed JSON"),
    (b'{"instances": [[1e39, 1, 2, 3]]}', "too large for DT_FLOAT"),
])
def test_numbers_that_are_not_nan_or_infinity_are_still_refused(body, words):
    with pytest.raises(BadRequest, match=words):
        decode(body)


def test_a_bfloat16_input_refuses_a_value_past_its_range_as_float32_does():
    import ml_dtypes

    bf16 = Spec([TensorInfo("b", (2,), np.dtype(ml_dtypes.bfloat16), "DT_BFLOAT16")])
    with pytest.raises(InvalidInput, match=r"^instances: a value is too large for DT_BFLOAT16 \(input 'b'\)$"):
        decode(b'{"instances": [[3.4e38, 1]]}', bf16)
    assert decode(b'{"instances": [[3.38e38, -Infinity]]}', bf16)["b"].astype(float).tolist() == [
        [float(np.float32(3.38e38).astype(ml_dtypes.bfloat16)), -np.inf]]


def test_nan_for_an_integer_input_is_refused():
    """json_tensor.cc AddValueToTensor: DT_INT32 takes only IsInt() values."""
    with pytest.raises(InvalidInput, match="takes integers .*got NaN or Infinity"):
        decode(b'{"instances": [NaN]}', Spec([tensor("i", (), I32)]))


def test_nan_and_infinity_are_written_as_tf_serving_writes_them():
    """json_tensor.cc WriteDecimal: non-finite floats are written as NaN, Infinity and -Infinity."""
    spec = Spec([], [tensor("y", ())])
    y = np.array([0.1, np.nan, np.inf, -np.inf, 3.0], F32)
    assert codec.encode_response({"y": y}, spec, codec.ROW) == b'{"predictions":[0.1,NaN,Infinity,-Infinity,3.0]}'
    assert codec.encode_response({"y": y}, spec, codec.COLUMNAR) == b'{"outputs":[0.1,NaN,Infinity,-Infinity,3.0]}'
    two = Spec([], [tensor("a", (2,), F64), tensor("b", ())])
    outputs = {"a": np.array([[np.nan, 1.0], [2.0, -np.inf]]), "b": np.array([np.inf, 0.5], np.float16)}
    assert codec.encode_response(outputs, two, codec.ROW) == (
        b'{"predictions":[{"a":[NaN,1.0],"b":Infinity},{"a":[2.0,-Infinity],"b":0.5}]}')
    assert codec.encode_response(outputs, two, codec.COLUMNAR) == (
        b'{"outputs":{"a":[[NaN,1.0],[2.0,-Infinity]],"b":[Infinity,0.5]}}')
    # Python's json module reads the answer back, as api_rest.md says clients do.
    assert json.loads(codec.encode_response({"y": y}, spec, codec.ROW))["predictions"][2] == float("inf")


def test_only_an_answer_written_with_a_null_is_looked_through_for_nan_and_infinity(monkeypatch):
    """A finite answer is written in one pass; a string that reads "null" costs a second, same bytes."""
    looked: list[np.ndarray] = []
    real = codec.non_finite_fragment
    monkeypatch.setattr(codec, "non_finite_fragment", lambda array: looked.append(array) or real(array))
    spec = Spec([], [tensor("y", (2,))])
    assert codec.encode_response({"y": np.array([[0.5, 1.0]], F32)}, spec, codec.ROW) == b'{"predictions":[[0.5,1.0]]}'
    assert looked == []
    noted = Spec([], [tensor("y", ()), tensor("note", (), STRING)])
    outputs = {"y": np.array([0.5], F32), "note": np.array([b"null"], object)}
    assert codec.encode_response(outputs, noted, codec.ROW) == b'{"predictions":[{"y":0.5,"note":"null"}]}'
    assert len(looked) == 1


# -- _bytes outputs -----------------------------------------------------------------------------

def test_outputs_named_bytes_are_always_base64():
    """api_rest.md 'Output of binary values'; json_tensor.cc IsNamedTensorBytes: DT_STRING named *_bytes."""
    spec = Spec([], [tensor("image_bytes", (), STRING), tensor("caption", (), STRING)])
    outputs = {"image_bytes": np.array([b"plain", b"\xff\x00"], object),
               "caption": np.array([b"seaside", b"\xff"], object)}
    b64 = lambda raw: {"b64": base64.b64encode(raw).decode()}  # noqa: E731
    assert json.loads(codec.encode_response(outputs, spec, codec.ROW)) == {"predictions": [
        {"image_bytes": b64(b"plain"), "caption": "seaside"},
        # TF Serving writes bytes that are not UTF-8 raw, which is not JSON: base64 here.
        {"image_bytes": b64(b"\xff\x00"), "caption": b64(b"\xff")},
    ]}
    assert json.loads(codec.encode_response({"image_bytes": outputs["image_bytes"]}, spec, codec.COLUMNAR)) == {
        "outputs": [b64(b"plain"), b64(b"\xff\x00")]}


# -- outputs of different batch sizes -----------------------------------------------------------

def test_row_format_outputs_of_different_batch_sizes_are_a_400_with_tf_servings_message():
    """json_tensor.cc MakeRowFormatJsonFromTensors; the columnar format writes each tensor as it is."""
    spec = Spec([], [tensor("a", ()), tensor("b", ())])
    outputs = {"a": np.zeros(3, F32), "b": np.zeros(1, F32)}
    with pytest.raises(BadRequest, match="^Tensor name: b has inconsistent batch size: 1 expecting: 3$"):
        codec.encode_response(outputs, spec, codec.ROW)
    assert codec.encode_response(outputs, spec, codec.COLUMNAR) == b'{"outputs":{"a":[0.0,0.0,0.0],"b":[0.0]}}'
    with pytest.raises(BadRequest, match="Tensor name: a has no shape information"):
        codec.encode_response({"a": np.float32(1)}, Spec([], [tensor("a", ())]), codec.ROW)


# -- rows of scalars for an input declared [-1, 1] ----------------------------------------------

def test_scalar_rows_for_an_input_declared_minus_one_by_one_are_taken_and_answered_as_scalars():
    """json_tensor.cc: each instance becomes a tensor of its own shape, never held to the
    signature's, so TF Serving feeds [N] to half_plus_two's x [-1, 1] and answers y as [N]
    (api_rest.md and docker.md: {"instances": [1.0, 2.0, 5.0]} -> {"predictions": [2.5, 3.0, 4.5]})."""
    for body in (b'{"instances": [1.0, 2.0, 5.0]}', b'{"inputs": [1.0, 2.0, 5.0]}'):
        parsed = codec.parse_request(body)
        x = codec.decode_inputs(parsed, COLUMN)["x"]
        assert x.shape == (3, 1) and x.tolist() == [[1.0], [2.0], [5.0]]
        assert parsed.scalar_rows
        y = 0.5 * x + 2
        key = "predictions" if parsed.format == codec.ROW else "outputs"
        assert json.loads(codec.encode_response({"y": y}, COLUMN, parsed)) == {key: [2.5, 3.0, 4.5]}
    # Rows given as [1] keep their shape both ways, as they do in TF Serving.
    parsed = codec.parse_request(b'{"instances": [[1.0], [2.0]]}')
    x = codec.decode_inputs(parsed, COLUMN)["x"]
    assert not parsed.scalar_rows
    assert json.loads(codec.encode_response({"y": 0.5 * x + 2}, COLUMN, parsed)) == {"predictions": [[2.5], [3.0]]}


def test_scalar_rows_for_other_shapes_are_refused():
    with pytest.raises(InvalidInput, match=r"must have shape \[4\]; got rows of shape \[\]"):
        decode(b'{"instances": [1, 2, 3, 4]}')
    with pytest.raises(InvalidInput, match="must have shape"):
        decode(b'{"instances": [1, 2]}', Spec([tensor("x", (2,))]))
    with pytest.raises(InvalidInput, match="must have shape"):
        decode(b'{"instances": [[[1]]]}', COLUMN)


def test_scalar_rows_of_a_named_input_declared_minus_one_by_one():
    spec = Spec([tensor("x", (1,)), tensor("tag", (), STRING)])
    parsed = codec.parse_request(b'{"instances": [{"x": 1.0, "tag": "a"}, {"x": 2.0, "tag": "b"}]}')
    arrays = codec.decode_inputs(parsed, spec)
    assert arrays["x"].shape == (2, 1) and arrays["tag"].tolist() == [b"a", b"b"] and parsed.scalar_rows


# -- bounded cost -------------------------------------------------------------------------------

def test_first_row_shape_is_checked_before_numpy_reads_the_rows(monkeypatch):
    def no_array(*args, **kwargs):
        raise AssertionError("an array was built for rows of the wrong shape")

    monkeypatch.setattr(codec, "_to_number_array", no_array)
    with pytest.raises(InvalidInput, match=r"must have shape \[4\]; got rows of shape \[100000\]"):
        decode({"instances": [[0] * 100_000, [1, 2, 3, 4]]})
    with pytest.raises(InvalidInput, match=r"got rows of shape \[1, 1, \.\.\.\]"):
        decode({"instances": [[[[[[1]]]]]]})


def test_error_description_stops_after_a_bounded_number_of_values():
    rows = [[1.0, 2.0, 3.0, 4.0]] * 60_000 + [[1.0, 2.0, 3.0, "x"]]
    with pytest.raises(InvalidInput, match=f"no cause found in the first {codec.MAX_SCAN} values; looked no further"):
        decode({"instances": rows})
    # Within the budget the description names the row and the value.
    with pytest.raises(InvalidInput, match=r'instances\[1000\]: a string "x" where input'):
        decode({"instances": rows[:1000] + rows[-1:]})


def test_deeply_nested_strings_are_a_400_not_a_recursion_error():
    spec = Spec([tensor("tag", (), STRING)])
    deep = "[" * 900 + '"a"' + "]" * 900
    with pytest.raises(InvalidInput, match="nested deeper than input 'tag' takes"):
        decode(('{"instances": ["a", ' + deep + "]}").encode(), spec)


def test_booleans_among_numbers_are_found_however_the_body_spells_true():
    with pytest.raises(InvalidInput, match="true/false where input 'features' takes numbers"):
        decode(b'{"instances": [[1, 2, 3, 4], [1, 2, 3, true]]}')
    # 'true' elsewhere in the body is no boolean among the numbers.
    arrays = decode(b'{"signature_name": "", "instances": [[1, 2, 3, 4]], "note": "true"}')
    np.testing.assert_array_equal(arrays["features"], [[1, 2, 3, 4]])


def test_lone_surrogate_string_is_a_400():
    spec = Spec([tensor("tag", (), STRING)])
    with pytest.raises(InvalidInput, match="not valid Unicode"):
        decode(b'{"instances": ["\\ud800", NaN]}', spec)


def test_unknown_input_names_are_named_a_few_at_a_time():
    body = json.dumps({"inputs": {f"k{i}": [1] for i in range(100_000)}}).encode()
    with pytest.raises(BadRequest) as raised:
        decode(body)
    assert raised.value.message == ("inputs: missing input(s) ['features'] and unknown input(s) "
                                    "['k0', 'k1', 'k10', 'k100', 'k1000', ...]; the model's inputs are ['features']")


def test_a_string_among_many_numbers_is_refused_before_numpy_reads_them(monkeypatch):
    """numpy would first write every number as text (seconds for a 16 MiB body)."""

    class NumpyReadingNoRows:
        def __getattr__(self, name):
            return getattr(np, name)

        def asarray(self, *args, **kwargs):
            raise AssertionError("numpy read rows that hold a string")

    monkeypatch.setattr(codec, "np", NumpyReadingNoRows())
    rows = [[1.0, 2.0, 3.0, 4.0]] * (codec.MAX_SCAN // 4) + [[1.0, 2.0, 3.0, "x"]]
    with pytest.raises(InvalidInput, match="cannot read the rows of input 'features' as DT_FLOAT"):
        decode({"instances": rows})
