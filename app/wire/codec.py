"""JSON bodies to numpy and back, in TensorFlow Serving's two formats.

Row format: {"instances": [row, ...]}, each row a value of the input's per-row shape,
or, for several inputs, an object keyed by input name. Answer: {"predictions": [...]}.
Columnar format: {"inputs": tensor} or {"inputs": {name: tensor}}. Answer: {"outputs": ...}.
String inputs take plain strings or {"b64": "..."}; string outputs whose name ends in
`_bytes` always answer as {"b64": "..."}, others as text ({"b64": ...} when not UTF-8).
Floats may be NaN, Infinity and -Infinity both ways, as TensorFlow Serving reads and
writes them (its util/json_tensor.cc).

Two steps, so that a request costs no more than a valid one could: `parse_request` reads
the JSON and refuses too many rows before any array is built; `decode_inputs` checks the
first row's shape against the signature before numpy reads the rest. The fast path hands
the whole list to numpy at once; only when that fails does a slower walk find the first
offending row, and that walk gives up after MAX_SCAN values, so a bad body costs bounded
work too.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any, Protocol

import ml_dtypes
import numpy as np
import orjson
import simdjson

from app.core.errors import BadRequest, InvalidInput, PayloadTooLarge
from app.core.models import DEFAULT_SIGNATURE, STRING, TensorInfo

ROW = "row"
COLUMNAR = "columnar"
BYTES_SUFFIX = "_bytes"  # TF Serving's mark of a binary string output (borrowed from Cloud ML Engine)
MAX_SCAN = 100_000  # values an error description looks at before it stops and says so


@dataclasses.dataclass
class ParsedRequest:
    """A predict body read as JSON and checked for its form, before any array is built."""

    payload: Any  # the value of 'instances' (ROW) or 'inputs' (COLUMNAR)
    format: str
    signature_name: str
    rows: int
    # numpy reads [true, 2] as [1, 2]: look for booleans only when the body could hold one.
    booleans: bool = True
    # Set by decode_inputs: rows of scalars were given for an input declared [-1, 1].
    scalar_rows: bool = False
    # A body that is one matrix of numbers (see _numeric_matrix): its rows as float64, `payload`
    # left None until decode_inputs needs the general path after all, which reads `body` then.
    matrix: np.ndarray | None = None
    body: bytes = b""
    # The matrix's largest magnitude: a cast to a float input it stays under cannot overflow.
    matrix_peak: float = 0.0


class TensorSpecs(Protocol):
    """What the codec needs of a model or one of its signatures."""

    inputs: list[TensorInfo]
    outputs: list[TensorInfo]


def parse_json(body: bytes) -> Any:
    if not body:
        raise BadRequest("the request body is empty; send a JSON object with 'instances' or 'inputs'")
    return loads(body)


def loads(body: bytes | memoryview) -> Any:
    """A JSON document that may hold NaN, Infinity and -Infinity; 400 if it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        body = bytes(body)
        if b"NaN" not in body and b"Infinity" not in body:
            raise BadRequest(f"malformed JSON: {exc}") from None
    # orjson keeps to RFC 8259; TF Serving's and Triton's parser (rapidjson, kParseNanAndInfFlag)
    # also read NaN, Infinity and -Infinity. Python's json does too, more slowly: only for such bodies.
    try:
        document = json.loads(body.decode(), parse_float=_finite_float, parse_int=_orjson_int)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"malformed JSON: {exc}") from None
    # Python's json, unlike orjson, reads a lone surrogate escape ("\ud800") into a str that no
    # encoder can write: refused here, before any view, error message or log line meets it.
    if _SURROGATE_ESCAPE.search(body):
        check_encodable(document)
    return document


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_encodable(document: Any, where: str = "the request body") -> None:
    """400 if any string (key or value) in a parsed JSON document is not valid Unicode text."""
    pending = [document]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                pending.append(item)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"malformed JSON: {where} holds a lone surrogate (\\u{ord(text[exc.start]):04x}): "
                           "a string is not valid Unicode") from None


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # '1e400' is too big for a double; only the token 'Infinity' means infinity
        raise ValueError(f"number {text[:40]} is too big for a double")
    return value


def _orjson_int(text: str) -> int | float:
    # An integer as orjson reads one: exact within int64 and uint64, past them a double. int()
    # would read up to 4,300 digits exactly, and raise past them.
    if len(text) <= 20:
        number = int(text)
        if -2**63 <= number < 2**64:
            return number
    return _finite_float(text)


def parse_request(body: bytes, *, max_rows: int | None = None) -> ParsedRequest:
    """Read a predict body (JSON whatever its Content-Type) and refuse, before decoding, more rows than max_rows."""
    booleans = may_hold_booleans(body)
    found = None if booleans else _numeric_matrix(body)
    if found is not None:
        matrix, peak, fmt, signature_name = found
        _check_row_count(len(matrix), max_rows)
        return ParsedRequest(None, fmt, signature_name or DEFAULT_SIGNATURE, len(matrix), booleans=False,
                             matrix=matrix, body=body, matrix_peak=peak)
    payload = parse_json(body)
    if not isinstance(payload, dict):
        raise BadRequest(f"the request body must be a JSON object, not {_json_type(payload)}")
    has_rows, has_columns = "instances" in payload, "inputs" in payload
    if has_rows and has_columns:
        raise BadRequest("give either 'instances' (row format) or 'inputs' (columnar format), not both")
    if not has_rows and not has_columns:
        raise BadRequest("the request body needs 'instances' (row format) or 'inputs' (columnar format)")
    signature_name = payload.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise BadRequest(f"'signature_name' must be a string, not {_json_type(signature_name)}")
    value = payload["instances"] if has_rows else payload["inputs"]
    rows = _count_rows(value)
    _check_row_count(rows, max_rows)
    return ParsedRequest(value, ROW if has_rows else COLUMNAR, signature_name or DEFAULT_SIGNATURE, rows,
                         booleans=booleans)


def _check_row_count(rows: int, max_rows: int | None) -> None:
    if max_rows is not None and rows > max_rows:
        raise PayloadTooLarge(
            f"the request holds {rows} rows; this model takes at most {max_rows} rows per request (MAX_REQUEST_ROWS)"
        )


BOM = b"\xef\xbb\xbf"
_MATRIX_KEYS = {"instances": ROW, "inputs": COLUMNAR}
# Integers from here on may round twice on the way to float32 (int -> double -> float32), where
# numpy's reading of the same list converts int64 -> float32 once.
_EXACT_IN_DOUBLE = 2.0**53


def _numeric_matrix(body: bytes) -> tuple[np.ndarray, float, str, str] | None:
    """The rows of a body that is only a matrix of numbers (int64 if every one is an integer,
    else float64, as numpy reads the list), their largest magnitude, the format and signature
    name; None for anything else, which the general path (orjson, then numpy) reads and words.

    The common request, {"instances": [[1.5, 2, ...], ...]}, costs orjson one Python object per
    number and numpy a pass over them; simdjson reads the numbers straight into one buffer.
    Only bodies both readers take alike come this way: no byte-order mark (simdjson skips one,
    orjson refuses it; both refuse lone surrogates and bad UTF-8), no repeated key (orjson keeps
    the last), no key but the two formats' and 'signature_name', no JSON boolean (the caller
    looks first; where numbers go simdjson refuses one anyway), and exactly one array per row
    plus the outer one in the whole body, every row an array of the first row's length: a
    matrix, nothing ragged or nested. A number simdjson cannot hold (past 64 bits, past a
    double's range) makes it raise, and the general path decides.
    """
    # Objects in rows (several inputs) or strings (text inputs) are never a matrix: spare those
    # bodies the parse. One object is the body; its keys and a signature name are six quotes.
    if body.startswith(BOM) or _occurrences(body, b"{", 1) != 1 or _occurrences(body, b'"', 6) > 6:
        return None
    try:
        # A parser per body: one may not parse again while values of its last document live.
        document = simdjson.Parser().parse(body)
        if not isinstance(document, simdjson.Object):
            return None
        keys = list(document.keys())
        formats = [_MATRIX_KEYS[key] for key in keys if key in _MATRIX_KEYS]
        if len(formats) != 1 or not unique_keys(document) or not set(keys) <= {*_MATRIX_KEYS, "signature_name"}:
            return None
        # Not document.get: simdjson looks a missing key up at some microseconds' cost.
        signature_name = document["signature_name"] if "signature_name" in keys else ""
        value = document["instances" if formats[0] == ROW else "inputs"]
        if not isinstance(signature_name, str) or not isinstance(value, simdjson.Array) or not len(value):
            return None
        rows = len(value)
        if _occurrences(body, b"[", rows + 1) != rows + 1:
            return None
        first = value[0]
        width = len(first) if isinstance(first, simdjson.Array) else 0
        if not width or not all(isinstance(row, simdjson.Array) and len(row) == width for row in value):
            return None
        # A '.' anywhere (a signature name may hold one too) nearly always means a fraction, and
        # then integers cannot be all there is: the int64 read would only fail.
        found = _numbers(value, integers=b"." not in body)
    except (ValueError, TypeError, RuntimeError):  # not JSON to simdjson, or not all numbers: the general path
        return None
    if found is None or found[0].size != rows * width:
        return None
    flat, peak = found
    return flat.reshape(rows, width), peak, formats[0], signature_name


def _occurrences(body: bytes, byte: bytes, most: int) -> int:
    """How often `byte` is in `body`, counted up to most + 1: bytes.count walks byte by byte,
    find is memchr, some twenty times faster over a 20 KB body."""
    found, at = 0, body.find(byte)
    while at >= 0 and found <= most:
        found += 1
        at = body.find(byte, at + 1)
    return found


def unique_keys(value: simdjson.Object) -> bool:
    """Whether no key of a simdjson object repeats: where one does, orjson keeps its last value."""
    keys = list(value.keys())
    return len(set(keys)) == len(keys)


def _numbers(value: simdjson.Array, *, integers: bool) -> tuple[np.ndarray, float] | None:
    """The numbers of `value` flat, and their largest magnitude."""
    if integers:
        try:
            flat = np.frombuffer(value.as_buffer(of_type="i"), dtype=np.int64)
            # Python ints: numpy's abs of the smallest int64 is that number again.
            return flat, float(max(-int(flat.min()), int(flat.max())))
        except (TypeError, ValueError):  # a fraction, an exponent, or an integer past int64
            pass
    flat = np.frombuffer(value.as_buffer(of_type="d"), dtype=np.float64)
    largest = peak(flat)
    # numpy reads integers past int64 among others as uint64 and casts them to float32 in one
    # rounding; through a double they would round twice. Only those are that large.
    return (flat, largest) if largest < _EXACT_IN_DOUBLE else None


# numpy lets the GIL go for a loop over more than 500 values (NPY_BEGIN_THREADS_THRESHOLDED). For
# a request's few thousand values that costs far more than the loop: the thread must win the GIL
# back from the others (a 1,024-value cast: 0.5 us alone, 156 us beside one busy Python thread).
# Up to a few thousand values, the loops run in pieces that keep it.
_GIL_KEPT = 500
_IN_PIECES_UP_TO = 8 * _GIL_KEPT


def peak(flat: np.ndarray) -> float:
    """The largest magnitude in `flat` (1-D, not empty)."""
    if flat.size > _IN_PIECES_UP_TO:
        return float(np.abs(flat).max())
    return max(float(np.abs(flat[start:start + _GIL_KEPT]).max()) for start in range(0, flat.size, _GIL_KEPT))


def astype_keeping_gil(matrix: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """matrix.astype(dtype) (a cast numpy allows as 'same_kind'), in pieces where it is small."""
    if matrix.size > _IN_PIECES_UP_TO:
        return matrix.astype(dtype)
    result = np.empty(matrix.shape, dtype)
    into, values = result.reshape(-1), matrix.reshape(-1)
    for start in range(0, values.size, _GIL_KEPT):
        into[start:start + _GIL_KEPT] = values[start:start + _GIL_KEPT]
    return result


def within_range(flat: np.ndarray, dtype: np.dtype, peak: float) -> np.ndarray | None:
    """`flat` (finite numbers, the largest `peak` in magnitude) as the float `dtype`, as numpy
    casts it; None where a value is past the dtype's range: the cast would make it infinite."""
    if peak < _largest(dtype):  # nothing rounds to infinity: the one common case, spared two passes
        return astype_keeping_gil(flat, dtype) if dtype.kind == "f" else flat.astype(dtype)
    with np.errstate(over="ignore"):
        array = flat.astype(dtype)
    return array if np.isfinite(array).all() else None


def _largest(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).max if dtype.kind == "f" else ml_dtypes.finfo(dtype).max)  # 'V': bfloat16


def may_hold_booleans(body: bytes) -> bool:
    """False only if the JSON text `body` holds no `true` or `false` (outside strings or in)."""
    # One-byte searches (memchr) first: most bodies hold neither a 'u' nor an 'l', and a
    # four-byte search reads all of a large body (about as long as numpy takes to read it).
    return (b"u" in body and b"true" in body) or (b"l" in body and b"false" in body)


def _count_rows(value: Any) -> int:
    """The batch size the body claims: the length of the list, or of the longest named batch."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, dict) and not _is_b64(value):
        return max((len(item) for item in value.values() if isinstance(item, list)), default=0)
    return 0


def decode_inputs(parsed: ParsedRequest, spec: TensorSpecs) -> dict[str, np.ndarray]:
    """One array per input of `spec`; which signature `spec` is, is the caller's business."""
    if parsed.matrix is not None:
        array = _matrix_input(parsed.matrix, parsed.matrix_peak, spec)
        if array is not None:
            return {spec.inputs[0].name: array}
        # Not what this signature takes as it is: the general path reads the body and says why.
        parsed.payload = loads(parsed.body)["instances" if parsed.format == ROW else "inputs"]
    decoder = _Decoder(spec, parsed.booleans)
    if parsed.format == ROW:
        arrays = decoder.rows(parsed.payload)
    else:
        arrays = decoder.columns(parsed.payload)
    parsed.scalar_rows = decoder.scalar_rows
    return arrays


def _matrix_input(matrix: np.ndarray, peak: float, spec: TensorSpecs) -> np.ndarray | None:
    """The matrix as the one number input of `spec` whose rows it fits, as the general path
    would make it; None where that path must say why not (or read it at all)."""
    if len(spec.inputs) != 1:
        return None
    info = spec.inputs[0]
    kind = "" if info.dtype == STRING else info.dtype.kind
    if kind not in ("i", "u", "f") or not info.batched or not info.accepts_row_shape(matrix.shape[1:]):
        return None
    if kind == "f":
        # Past float32's range (or float16's): the general path refuses it in its words.
        return within_range(matrix, info.dtype, peak)
    limits = np.iinfo(info.dtype)
    # A fraction for an integer input, or a value outside its range: refused there, in its words.
    if matrix.dtype.kind != "i" or matrix.min() < limits.min or matrix.max() > limits.max:
        return None
    return matrix.astype(info.dtype)


class _Decoder:
    def __init__(self, spec: TensorSpecs, booleans: bool) -> None:
        self.inputs = spec.inputs
        self.booleans = booleans
        self.scalar_rows = False

    def rows(self, instances: Any) -> dict[str, np.ndarray]:
        if not isinstance(instances, list):
            raise BadRequest(f"'instances' must be a list of rows, not {_json_type(instances)}")
        if not instances:
            raise BadRequest("'instances' is empty; send at least one row")
        keyed = isinstance(instances[0], dict) and not _is_b64(instances[0])
        if len(self.inputs) > 1 and not keyed:
            raise BadRequest(f"this model takes several inputs ({self._names()}): "
                             "each instance must be an object keyed by name")
        if not keyed:
            return {self.inputs[0].name: self.array(instances, self.inputs[0], "instances")}
        columns: dict[str, list[Any]] = {spec.name: [] for spec in self.inputs}
        for index, row in enumerate(instances):
            if not isinstance(row, dict) or _is_b64(row):
                raise BadRequest(f"instances[{index}] must be an object keyed by input name, like instances[0]")
            _check_names(row.keys(), self.inputs, f"instances[{index}]")
            for name, value in row.items():
                columns[name].append(value)
        return {spec.name: self.array(columns[spec.name], spec, f"instances[*].{spec.name}") for spec in self.inputs}

    def columns(self, inputs: Any) -> dict[str, np.ndarray]:
        if isinstance(inputs, dict) and not _is_b64(inputs):
            _check_names(inputs.keys(), self.inputs, "inputs")
            return {spec.name: self.array(inputs[spec.name], spec, f"inputs.{spec.name}") for spec in self.inputs}
        if len(self.inputs) > 1:
            raise BadRequest(f"this model takes several inputs ({self._names()}): "
                             "'inputs' must be an object keyed by name")
        if not isinstance(inputs, list):
            raise BadRequest(f"'inputs' must be a list (a batch of rows), not {_json_type(inputs)}")
        if not inputs:
            raise BadRequest("'inputs' is empty; send at least one row")
        return {self.inputs[0].name: self.array(inputs, self.inputs[0], "inputs")}

    def array(self, value: Any, spec: TensorInfo, where: str) -> np.ndarray:
        if not spec.batched and isinstance(value, (int, float, str)):
            # A tensor without a batch dimension may be a scalar, as TF Serving's columnar format allows.
            return _scalar(value, spec, where)
        if not isinstance(value, list) or not value:
            raise InvalidInput(f"{where} must be a non-empty list of rows for input '{spec.name}'")
        # The first row's shape, read along first elements, before numpy reads every row.
        first = _leading_shape(value[0], len(spec.shape) + 1)
        _check_shape([len(value), *first], spec, where)
        if spec.dtype == STRING:
            array = _to_string_array(value, spec, where)
        else:
            values = len(value) * math.prod(dim for dim in first if isinstance(dim, int))  # no '...': checked above
            array = _to_number_array(value, spec, where, self.booleans, values)
        if _check_shape(array.shape, spec, where):
            # TF Serving never holds a batch to the signature's shape (util/json_tensor.cc):
            # its graph gets [N] for an input declared [-1, 1], and outputs come back as [N].
            self.scalar_rows = True
            array = array.reshape(-1, 1)
        return array

    def _names(self) -> str:
        return ", ".join(repr(spec.name) for spec in self.inputs)


def _scalar(value: int | float | str, spec: TensorInfo, where: str) -> np.ndarray:
    if spec.dtype == STRING:
        if not isinstance(value, str):
            raise InvalidInput(f"{where}: input '{spec.name}' takes strings, not {_json_type(value)}")
        return np.array(value.encode(), dtype=object)
    if isinstance(value, str):
        raise InvalidInput(f"{where}: input '{spec.name}' takes numbers, not a string")
    try:
        return np.asarray(value, dtype=spec.dtype)
    except (OverflowError, ValueError) as exc:
        raise InvalidInput(f"{where}: {value!r} does not fit input '{spec.name}' ({spec.dtype}): {exc}") from None


def _check_names(names: Any, inputs: list[TensorInfo], where: str) -> None:
    expected = {spec.name for spec in inputs}
    given = set(names)
    if given != expected:
        missing, unknown = sorted(expected - given), sorted(given - expected)
        parts = []
        if missing:
            parts.append(f"missing input(s) {missing}")
        if unknown:
            # A name per key could make the message as large as the body: name the first few.
            shown = ", ".join(repr(name[:40]) for name in unknown[:5])
            parts.append(f"unknown input(s) [{shown}{', ...' if len(unknown) > 5 else ''}]")
        raise BadRequest(f"{where}: {' and '.join(parts)}; the model's inputs are {sorted(expected)}")


def _leading_shape(row: Any, limit: int) -> list[int | str]:
    """A row's shape as numpy would read it if the row is even, looking no deeper than `limit`."""
    shape: list[int | str] = []
    while isinstance(row, list):
        if len(shape) == limit:
            shape.append("...")
            break
        shape.append(len(row))
        if not row:
            break
        row = row[0]
    return shape


def _check_shape(shape: Sequence[int | str], spec: TensorInfo, where: str) -> bool:
    """Raise unless the rows fit the input; True when they are scalars for an input declared [-1, 1]."""
    rows = tuple(shape[1:])
    if len(shape) >= 1 and "..." not in rows and spec.accepts_row_shape(rows):  # type: ignore[arg-type]
        return False
    if len(shape) == 1 and spec.shape == (1,):
        return True
    raise InvalidInput(
        f"{where}: each row of input '{spec.name}' must have shape {_shape_text(spec.shape)}; "
        f"got rows of shape {_shape_text(rows)}"
    )


def _to_number_array(value: list[Any], spec: TensorInfo, where: str, booleans: bool, values: int) -> np.ndarray:
    text = None
    if values > MAX_SCAN:
        # One string among millions of numbers makes numpy write every number as text
        # first (seconds of CPU): orjson writes the rows back at C speed, and a '"' there
        # is a string or an object among them.
        try:
            text = orjson.dumps(value)
        except orjson.JSONEncodeError:  # nested past orjson's limit, or an integer past 64 bits
            raise InvalidInput(_describe_bad_rows(value, spec, where)) from None
        if b'"' in text:
            raise InvalidInput(_describe_bad_rows(value, spec, where))
    try:
        raw = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        raise InvalidInput(_describe_bad_rows(value, spec, where)) from None
    kind = raw.dtype.kind
    if booleans and kind in "iuf" and _holds_boolean(value, text):
        kind = "b"
    if kind == "b" and spec.dtype.kind != "b":
        raise InvalidInput(f"{where}: true/false where input '{spec.name}' takes numbers ({spec.tf_dtype})")
    if spec.dtype.kind == "b" and kind != "b":
        raise InvalidInput(f"{where}: input '{spec.name}' takes true/false values ({spec.tf_dtype})")
    if kind not in "biuf":
        raise InvalidInput(_describe_bad_rows(value, spec, where))
    # An empty list reads as float64 and holds nothing fractional: it is refused, if at all, for its shape.
    if spec.dtype.kind in "iu" and kind == "f" and raw.size:
        what = "a fractional number" if np.isfinite(raw).all() else "NaN or Infinity"
        raise InvalidInput(f"{where}: input '{spec.name}' takes integers ({spec.tf_dtype}); got {what}")
    if spec.dtype.kind in "iu" and raw.size:
        limits = np.iinfo(spec.dtype)
        if raw.min() < limits.min or raw.max() > limits.max:
            raise InvalidInput(f"{where}: a value is outside the range of {spec.tf_dtype} for input '{spec.name}'")
    with np.errstate(over="ignore"):
        array = raw.astype(spec.dtype, copy=False)
    if spec.dtype.kind in "fV" and not np.isfinite(array).all() and (np.isfinite(raw) & ~np.isfinite(array)).any():
        raise InvalidInput(f"{where}: a value is too large for {spec.tf_dtype} (input '{spec.name}')")
    return array


def _holds_boolean(value: list[Any], text: bytes | None) -> bool:
    # numpy read it as numbers, so it holds only numbers, booleans and lists: orjson writes
    # it back at C speed, and a boolean is the only way 'true' or 'false' can appear.
    text = text if text is not None else orjson.dumps(value)
    return b"true" in text or b"false" in text


class _Scan:
    """How many more values an error description may look at."""

    def __init__(self, limit: int = MAX_SCAN) -> None:
        self.left = limit


_NOTHING = object()
_GAVE_UP = object()


def _describe_bad_rows(rows: list[Any], spec: TensorInfo, where: str) -> str:
    """The slow path: find the first row that is ragged or holds something not numeric, within MAX_SCAN values."""
    scan = _Scan()
    first_shape = None
    for index, row in enumerate(rows):
        bad = _first_non_number(row, scan)
        if bad is _GAVE_UP:
            return (f"{where}: cannot read the rows of input '{spec.name}' as {spec.tf_dtype} "
                    f"(no cause found in the first {MAX_SCAN} values; looked no further)")
        if bad is not _NOTHING:
            return f"{where}[{index}]: {_json_type(bad)} {_preview(bad)} where input '{spec.name}' takes numbers"
        try:
            shape = np.shape(row)  # at C speed, and only on rows already walked within the budget
        except ValueError:
            return f"{where}[{index}] is ragged: its nested lists differ in length (input '{spec.name}')"
        if first_shape is None:
            first_shape = shape
        elif shape != first_shape:
            return (f"{where}: rows are ragged: row 0 has shape {list(first_shape)} but row {index} "
                    f"has shape {list(shape)}; input '{spec.name}' takes rows of shape {_shape_text(spec.shape)}")
    return f"{where}: cannot read the rows of input '{spec.name}' as {spec.tf_dtype}"


def _first_non_number(value: Any, scan: _Scan) -> Any:
    """The first leaf that is not a JSON number (booleans included), _NOTHING, or _GAVE_UP past the budget."""
    stack = [value]
    while stack:
        scan.left -= 1
        if scan.left < 0:
            return _GAVE_UP
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, bool) or not isinstance(item, (int, float)):
            return item
    return _NOTHING


def _to_string_array(rows: list[Any], spec: TensorInfo, where: str) -> np.ndarray:
    deepest = len(spec.shape) + 1  # row scalars for an input declared [-1, 1] are one level less

    def convert(item: Any, depth: int) -> Any:
        if isinstance(item, list):
            if depth >= deepest:
                raise InvalidInput(f"{where}: rows nested deeper than input '{spec.name}' takes "
                                   f"(shape {_shape_text(spec.shape)})")
            return [convert(inner, depth + 1) for inner in item]
        if isinstance(item, str):
            try:
                return item.encode()
            except UnicodeEncodeError:  # a lone surrogate escape, as Python's json reads '\ud800'
                raise InvalidInput(f"{where}: a string is not valid Unicode (input '{spec.name}')") from None
        if _is_b64(item):
            try:
                return base64.b64decode(item["b64"], validate=True)
            except (binascii.Error, TypeError, ValueError):
                raise InvalidInput(f"{where}: a 'b64' value is not valid base64") from None
        raise InvalidInput(f"{where}: {_json_type(item)} {_preview(item)} where input '{spec.name}' takes strings")

    converted = [convert(row, 0) for row in rows]
    try:
        shape = np.shape(converted)
    except ValueError:
        raise InvalidInput(f"{where}: rows are ragged (input '{spec.name}')") from None
    array = np.empty(shape, dtype=object)
    array[...] = converted
    return array


def encode_response(outputs: dict[str, np.ndarray], spec: TensorSpecs, fmt: str | ParsedRequest) -> bytes:
    """The answer body, as TF Serving writes it (util/json_tensor.cc, MakeJsonFromTensors).

    `fmt` is the request's format, or the ParsedRequest itself: then outputs of rows [1]
    answer as scalars where the request gave scalars for an input declared [-1, 1].
    """
    squeeze = isinstance(fmt, ParsedRequest) and fmt.scalar_rows
    fmt = fmt.format if isinstance(fmt, ParsedRequest) else fmt
    names = [info.name for info in spec.outputs if info.name in outputs] or list(outputs)
    arrays = {name: _squeezed(np.asarray(outputs[name])) if squeeze else np.asarray(outputs[name]) for name in names}
    text = orjson.dumps(_answer_body(arrays, names, fmt, finite=False), option=orjson.OPT_SERIALIZE_NUMPY)
    # orjson writes NaN and the infinities as null, and a number array has no other way to
    # write one: a body without "null" needs no look for them (a pass over every float), and
    # only one with a null is written again, those values as TF Serving writes them. (A
    # string output may hold the text "null"; written again, it comes out the same.)
    if b"null" in text:
        text = orjson.dumps(_answer_body(arrays, names, fmt, finite=True), option=orjson.OPT_SERIALIZE_NUMPY)
    return text


def _answer_body(arrays: dict[str, np.ndarray], names: list[str], fmt: str, *, finite: bool) -> Any:
    """The answer for orjson; `finite`: NaN and the infinities written out (non_finite_fragment)."""
    if fmt == ROW:
        batch = _batch_size(arrays)
        if len(names) == 1:
            return {"predictions": _jsonable(arrays[names[0]], names[0], finite)}
        # [i, ...] keeps a 0-d array (a plain [i] would give bytes or a numpy scalar).
        return {"predictions": [{name: _jsonable(arrays[name][i, ...], name, finite) for name in names}
                                for i in range(batch)]}
    if len(names) == 1:
        return {"outputs": _jsonable(arrays[names[0]], names[0], finite)}
    return {"outputs": {name: _jsonable(arrays[name], name, finite) for name in names}}


def _squeezed(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1) if array.ndim == 2 and array.shape[1] == 1 else array


def _batch_size(arrays: dict[str, np.ndarray]) -> int:
    """Rows need one batch size for all outputs; TF Serving's 400 messages otherwise."""
    batch = -1
    for name, array in arrays.items():
        if array.ndim == 0:
            raise BadRequest(f"Tensor name: {name} has no shape information ")
        if batch >= 0 and array.shape[0] != batch:
            raise BadRequest(f"Tensor name: {name} has inconsistent batch size: {array.shape[0]} expecting: {batch}")
        batch = array.shape[0]
    return batch


def _jsonable(array: np.ndarray, name: str, finite: bool) -> Any:
    if array.dtype == object:
        return _encode_strings(array.tolist(), as_bytes=name.endswith(BYTES_SUFFIX))
    if array.dtype.kind == "f" and array.dtype.itemsize < 4:
        array = array.astype(np.float32)
    if finite and array.dtype.kind == "f":
        fragment = non_finite_fragment(array)
        if fragment is not None:
            return fragment
    if array.ndim == 0:
        return array[()]  # a numpy scalar: orjson writes float32 0.1 as 0.1, where float() would not
    # orjson writes numpy arrays natively (each float in its shortest exact form for its
    # width), but only native-endian C-contiguous ones.
    return np.ascontiguousarray(array)


def non_finite_fragment(array: np.ndarray) -> orjson.Fragment | None:
    """A float array's JSON where it holds NaN or an infinity (None where it does not), written
    as TF Serving and Triton write them (rapidjson, kWriteNanAndInfFlag): orjson alone would
    write null, an answer the model never gave."""
    finite = np.isfinite(array)
    return None if finite.all() else orjson.Fragment(_non_finite_json(array, finite))


def _non_finite_json(array: np.ndarray, finite: np.ndarray) -> bytes:
    """orjson writes NaN and infinities as null; TF Serving writes NaN, Infinity, -Infinity."""
    if array.ndim == 0:
        return _token(array.item())
    # The array holds only numbers, so its k-th null is its k-th non-finite value in C order.
    pieces = orjson.dumps(np.ascontiguousarray(array), option=orjson.OPT_SERIALIZE_NUMPY).split(b"null")
    tokens = [_token(value) for value in array[~finite].tolist()]
    out = [pieces[0]]
    for token, piece in zip(tokens, pieces[1:], strict=True):
        out += [token, piece]
    return b"".join(out)


def _token(value: float) -> bytes:
    if math.isnan(value):
        return b"NaN"
    return b"-Infinity" if value < 0 else b"Infinity"


def _encode_strings(value: Any, *, as_bytes: bool) -> Any:
    if isinstance(value, list):
        return [_encode_strings(item, as_bytes=as_bytes) for item in value]
    if isinstance(value, bytes):
        if not as_bytes:
            try:
                return value.decode()
            except UnicodeDecodeError:
                pass  # TF Serving would write the raw bytes, which is not JSON: base64 instead
        return {"b64": base64.b64encode(value).decode()}
    return value


def _is_b64(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and "b64" in value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _preview(value: Any) -> str:
    try:
        text = orjson.dumps(value).decode() if not isinstance(value, bytes) else repr(value)
    except TypeError:  # nested deeper than orjson writes
        text = "[[[..."
    return text if len(text) <= 40 else text[:37] + "..."


def _shape_text(shape: Sequence[int | str | None]) -> str:
    return "[" + ", ".join("-1" if dim is None else str(dim) for dim in shape) + "]"
