"""A body that is one matrix of numbers is read by simdjson straight into numpy (codec._numeric_matrix);
everything it reads must come out bit for bit as the general path (orjson, then numpy) reads it, and
everything else must get the general path's own answer, array or refusal."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import orjson
import pytest

from app.core.errors import ServingError
from app.core.models import TensorInfo
from app.wire import codec

F16, F32, F64, I32 = np.dtype("float16"), np.dtype("float32"), np.dtype("float64"), np.dtype("int32")
I64, U8, I8 = np.dtype("int64"), np.dtype("uint8"), np.dtype("int8")
TF_NAMES = {F16: "DT_HALF", F32: "DT_FLOAT", F64: "DT_DOUBLE", I32: "DT_INT32", I64: "DT_INT64", U8: "DT_UINT8",
            I8: "DT_INT8"}


@dataclasses.dataclass
class Spec:
    inputs: list[TensorInfo]
    outputs: list[TensorInfo] = dataclasses.field(default_factory=list)


def spec(width: int, dtype: np.dtype = F32, *, inputs: int = 1) -> Spec:
    return Spec([TensorInfo(f"x{index}" if index else "x", (width,), dtype, TF_NAMES[dtype])
                 for index in range(inputs)])


def outcome(body: bytes, model: Spec, **kwargs):
    """What the codec makes of `body`: the arrays and the parse's fields, or the refusal."""
    try:
        parsed = codec.parse_request(body, **kwargs)
        arrays = codec.decode_inputs(parsed, model)
    except ServingError as exc:
        return type(exc).__name__, exc.message
    fields = (parsed.format, parsed.signature_name, parsed.rows, parsed.scalar_rows)
    return fields, {name: (array.dtype.str, array.shape, array.tobytes(), array.flags.writeable)
                    for name, array in arrays.items()}


def served_as_matrix(body: bytes, model: Spec) -> bool:
    """Whether the arrays came from the matrix, the body never read again by the general path."""
    parsed = codec.parse_request(body)
    codec.decode_inputs(parsed, model)
    return parsed.matrix is not None and parsed.payload is None


def both(body: bytes, model: Spec, monkeypatch, **kwargs):
    """(the outcome, the general path's outcome, whether the matrix path read the body)."""
    taken = codec._numeric_matrix(body) is not None
    fast = outcome(body, model, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(codec, "_numeric_matrix", lambda body: None)
        general = outcome(body, model, **kwargs)
    return fast, general, taken


def number_texts(rng: np.random.Generator, count: int) -> list[str]:
    """Numbers written the ways clients write them: repr, short and long decimals, exponents,
    integers, negative zero, subnormals and float32's smallest (all under 2**53: larger ones take
    the general path, below)."""
    special = ["-0.0", "0", "-0", "1e-45", "1.4e-45", "1.17549435e-38", "-4.5e15", "1e-320",
               "5e-324", "2.2250738585072014e-308", "1E5", "1e+5", "0.1e1", "123456789", "-9007199254740991",
               "9007199254740991", "16777217", "0.30000000000000004",
               "1.00000000000000011102230246251565404236316680908203125"]
    texts = []
    for index in range(count):
        value = rng.standard_normal() * 10.0 ** rng.integers(-8, 9)
        style = index % 6
        texts.append(special[index % len(special)] if style == 0 else
                     repr(float(value)) if style == 1 else
                     f"{value:.3e}" if style == 2 else
                     f"{value:.9g}" if style == 3 else
                     str(int(value)) if style == 4 else
                     repr(float(np.float32(value))))
    return texts


@pytest.mark.parametrize("dtype", [F32, F64, F16])
@pytest.mark.parametrize("rows,width", [(1, 1024), (7, 5), (3, 1)])
@pytest.mark.parametrize("form", ["instances", "inputs", "spaced", "named"])
def test_a_matrix_reads_bit_for_bit_as_the_general_path(dtype, rows, width, form, monkeypatch):
    rng = np.random.default_rng(rows * 1000 + width)
    texts = number_texts(rng, rows * width)
    if dtype == F16:  # float16 holds up to 65504: past it, the general path refuses (below)
        texts = [text if abs(float(text)) < 6e4 else "1.5" for text in texts]
    matrix = [texts[row * width:(row + 1) * width] for row in range(rows)]
    separator = ",\n\t " if form == "spaced" else ","
    rows_text = separator.join("[" + separator.join(row) + "]" for row in matrix)
    key = "inputs" if form == "inputs" else "instances"
    name = ', "signature_name": "servé"' if form == "named" else ""
    body = f' {{"{key}": [{rows_text}]{name}}}\n'.encode()
    fast, general, taken = both(body, spec(width, dtype), monkeypatch)
    assert taken and served_as_matrix(body, spec(width, dtype))
    assert fast == general
    assert fast[1]["x"][0] == dtype.str and fast[1]["x"][1] == (rows, width)


@pytest.mark.parametrize("dtype", [I32, I64, U8, I8, F32, F64])
@pytest.mark.parametrize("width", [5, None])
def test_an_integer_matrix_reads_as_the_general_path_for_integer_and_float_inputs(dtype, width, monkeypatch):
    """Integers only: read as int64, as numpy reads such a list, range-checked for an integer input;
    an input whose row length is open (None) takes rows of any one width."""
    limits = np.iinfo(dtype) if dtype.kind in "iu" else np.iinfo(np.int64)
    rng = np.random.default_rng(3)
    values = rng.integers(max(limits.min, -2**62), min(limits.max, 2**62), (4, 5), endpoint=True)
    values[0, :2] = [max(limits.min, -2**63), limits.max]  # each end of the range
    body = orjson.dumps({"instances": values.tolist()})
    model = Spec([TensorInfo("x", (width,), dtype, TF_NAMES[dtype])])
    fast, general, taken = both(body, model, monkeypatch)
    assert taken and served_as_matrix(body, model)
    assert fast == general


ROWS = [[1.5, -2.0], [3.25, 4.0]]


@pytest.mark.parametrize("body", [
    b'{"instances": [[1, 2], [3]]}',  # ragged
    b'{"instances": [[1, [2, 3]], [4, 5]]}',  # nested
    b'{"instances": [[1, [2, 3]], 4]}',  # as many arrays and numbers as a matrix, not one
    b'{"instances": [[[1, 2], []], [3, 4]]}',  # rows of the right length, nested within
    b'{"instances": [[1, true], [3, 4]]}',  # a boolean where numbers go
    b'{"instances": [[1, 2]], "note": true}',  # a boolean elsewhere
    b'{"instances": [[1, null], [3, 4]]}',
    b'{"instances": [[1, "2"], [3, 4]]}',
    b'{"instances": [[1, {"a": 1}], [3, 4]]}',
    b'{"instances": [[NaN, 1], [Infinity, -Infinity]]}',  # read by the general path's json fallback
    b'{"instances": [[1, 2], [3, 4]], "instances": [[5, 6], [7, 8]]}',  # orjson keeps the last
    b'\xef\xbb\xbf{"instances": [[1, 2], [3, 4]]}',  # simdjson skips a byte-order mark, orjson refuses it
    b'{"instances": [[1, 2], [3, 4]], "signature_name": "serving_defaul\\u0074"}',
    b'{"instances": [[1, 2], [3, 4]], "signature_name": "[x]"}',
    b'{"instances": [[1, 2], [3, 4]], "signature_name": 7}',
    b'{"instances": [[1, 2], [3, 4]], "other": [1]}',
    b'{"instances": [[1, 2]], "inputs": [[3, 4]]}',
    b'{"instances": [[9007199254740993, 2]]}',  # past 2**53: int64 -> float32 is one rounding, not two
    b'{"instances": [[-9007199254740993, 2]]}',
    b'{"instances": [[9007199791611905, 2]]}',  # 2**53 + 2**29 + 1: float32 via a double would round it down
    b'{"instances": [[9223372586610589697, 2]]}',  # 2**63 + 2**39 + 1: numpy reads uint64, one rounding
    b'{"instances": [[9223372586610589697, 2.5]]}',
    b'{"instances": [[-9223372036854775808, 2]]}',
    b'{"instances": [[300, -1]]}',  # past uint8, int8
    b'{"instances": [[70000, 2]]}',  # past float16
    b'{"instances": [[1, 2]], "signature_name": "\\ud800"}',  # a lone surrogate
    b'{"instances": [[18446744073709551615, 2]]}',
    b'{"instances": [[123456789012345678901234567890, 2]]}',
    b'{"instances": [[1e39, 2]]}',  # past float32
    b'{"instances": [[1e400, 2]]}',
    b'{"instances": []}',
    b'{"instances": [[]]}',
    b'{"instances": [[1, 2, 3], [4, 5, 6]]}',  # wider than the input
    b'{"instances": [1, 2]}',
    b'{"instances": [[1, 2], [3, 4]]',  # cut short
    b'{"instances": [[1, 2], [3, 4]]} []',
    b'[[1, 2], [3, 4]]',
    b'{"instances": [[1, 2], [3, 4]], "signature_name": "\xff"}',  # not UTF-8
])
@pytest.mark.parametrize("dtype", [F16, F32, F64, I32, I64, U8, I8])
def test_anything_else_gets_the_general_paths_own_answer(body, dtype, monkeypatch):
    fast, general, _taken = both(body, spec(2, dtype), monkeypatch)
    assert fast == general


def test_bodies_that_are_not_a_plain_matrix_never_take_the_matrix_path():
    for body in (b'{"instances": [[1, 2], [3, 4]], "instances": [[5, 6], [7, 8]]}',
                 b'\xef\xbb\xbf{"instances": [[1, 2], [3, 4]]}',
                 b'{"instances": [[9007199254740993, 2.5]]}',
                 b'{"instances": [[9223372586610589697, 2]]}',
                 b'{"instances": [[1, [2, 3]], 4]}',
                 b'{"instances": [[[1, 2], []], [3, 4]]}'):
        assert codec._numeric_matrix(body) is None, body


def test_the_matrix_path_is_refused_as_the_general_one_for_other_signatures(monkeypatch):
    """Read as a matrix, then not what the signature takes: two inputs, an integer input, another width."""
    body = json.dumps({"instances": ROWS}).encode()
    for model in (spec(2, inputs=2), spec(2, I32), spec(3), Spec([TensorInfo("x", (None,), F32, "DT_FLOAT")])):
        fast, general, taken = both(body, model, monkeypatch)
        assert taken and fast == general


def test_the_row_limit_refuses_a_matrix_before_any_array(monkeypatch):
    body = json.dumps({"instances": [[1.0, 2.0]] * 5}).encode()
    fast, general, taken = both(body, spec(2), monkeypatch, max_rows=4)
    assert taken and fast == general
    assert fast == ("PayloadTooLarge", "the request holds 5 rows; this model takes at most 4 rows per request "
                                       "(MAX_REQUEST_ROWS)")


def test_bodies_with_objects_in_rows_or_strings_are_not_parsed_twice(monkeypatch):
    """Several inputs (rows of objects) and text inputs never make a matrix: simdjson is spared them."""
    parsed = []
    monkeypatch.setattr(codec.simdjson, "Parser", lambda: parsed.append(1))
    for body in (b'{"instances": [{"a": [1, 2], "b": 3}, {"a": [4, 5], "b": 6}]}',
                 b'{"instances": [["a", "b"], ["c", "d"]]}',
                 b'{"inputs": {"a": [[1, 2]], "b": [[3]]}}'):
        assert codec._numeric_matrix(body) is None
    assert parsed == []


@pytest.mark.parametrize("shape", [(1,), (499,), (500,), (501,), (1, 1024), (7, 300), (4000,), (4001,), (3, 2000)])
@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_the_gil_keeping_cast_and_peak_are_numpys_astype_and_peak(shape, dtype):
    """Cast and largest magnitude in pieces of 500 (small arrays) or whole: numpy's own answers, bit for bit."""
    values = np.random.default_rng(sum(shape)).uniform(-1000.0, 1000.0, shape)
    values.reshape(-1)[-1] = -2000.0 - shape[-1]  # the peak in the last piece, negative
    cast = codec.astype_keeping_gil(values, dtype)
    assert (cast.dtype, cast.shape, cast.tobytes()) == (dtype, values.shape, values.astype(dtype).tobytes())
    assert codec.peak(values.reshape(-1)) == float(np.abs(values).max()) == 2000.0 + shape[-1]
