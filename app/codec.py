"""JSON bodies to numpy and back, in TensorFlow Serving's two formats.

Row format: {"instances": [row, ...]}, each row a value of the input's per-row shape,
or, for several inputs, an object keyed by input name. Answer: {"predictions": [...]}.
Columnar format: {"inputs": tensor} or {"inputs": {name: tensor}}. Answer: {"outputs": ...}.
String inputs take plain strings or {"b64": "..."}; binary outputs answer as {"b64": "..."}.

The fast path hands the whole list to numpy at once; only when that fails does a slower
walk find the first offending row, so that the 400 says what is wrong and where.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import orjson

from app.errors import BadRequest, InvalidInput, PayloadTooLarge
from app.models import STRING, LoadedModel, TensorInfo

ROW = "row"
COLUMNAR = "columnar"
DEFAULT_SIGNATURE = "serving_default"


def parse_json(body: bytes) -> Any:
    if not body:
        raise BadRequest("the request body is empty; send a JSON object with 'instances' or 'inputs'")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A predict body read as JSON and checked for its form, before any array is built."""

    payload: Any  # the value of 'instances' (ROW) or 'inputs' (COLUMNAR)
    format: str
    signature_name: str
    rows: int
    # numpy reads [true, 2] as [1, 2]: look for booleans only when the body could hold one.
    booleans: bool = True


class TensorSpecs(Protocol):
    """What the codec needs of a model or one of its signatures."""

    inputs: list[TensorInfo]
    outputs: list[TensorInfo]


def parse_request(body: bytes, *, max_rows: int | None = None) -> ParsedRequest:
    """Read a predict body (JSON whatever its Content-Type) and refuse, before decoding, more rows than max_rows."""
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
    signature_name = signature_name or DEFAULT_SIGNATURE
    value = payload["instances"] if has_rows else payload["inputs"]
    rows = _count_rows(value)
    if max_rows is not None and rows > max_rows:
        raise PayloadTooLarge(
            f"the request holds {rows} rows; this model takes at most {max_rows} rows per request (MAX_REQUEST_ROWS)"
        )
    return ParsedRequest(value, ROW if has_rows else COLUMNAR, signature_name, rows,
                         booleans=b"true" in body or b"false" in body)


def _count_rows(value: Any) -> int:
    """The batch size the body claims: the length of the list, or of the longest named batch."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, dict) and not _is_b64(value):
        return max((len(item) for item in value.values() if isinstance(item, list)), default=0)
    return 0


def decode_inputs(parsed: ParsedRequest, spec: TensorSpecs) -> dict[str, np.ndarray]:
    """One array per input of `spec`; which signature `spec` is, is the caller's business."""
    if parsed.format == ROW:
        return _decode_rows(parsed.payload, spec, parsed.booleans)
    return _decode_columns(parsed.payload, spec, parsed.booleans)


def decode_request(body: bytes, model: LoadedModel) -> tuple[dict[str, np.ndarray], str]:
    """Parse a predict body into one array per model input, and say which format it used."""
    parsed = parse_request(body)
    if parsed.signature_name != DEFAULT_SIGNATURE:
        raise BadRequest(f"unknown signature_name {parsed.signature_name!r}; this model serves 'serving_default'")
    return decode_inputs(parsed, model), parsed.format


def _decode_rows(instances: Any, model: TensorSpecs, booleans: bool) -> dict[str, np.ndarray]:
    if not isinstance(instances, list):
        raise BadRequest(f"'instances' must be a list of rows, not {_json_type(instances)}")
    if not instances:
        raise BadRequest("'instances' is empty; send at least one row")
    keyed = isinstance(instances[0], dict) and not _is_b64(instances[0])
    if len(model.inputs) > 1 and not keyed:
        names = ", ".join(repr(spec.name) for spec in model.inputs)
        raise BadRequest(f"this model takes several inputs ({names}): each instance must be an object keyed by name")
    if not keyed:
        return {model.inputs[0].name: _to_array(instances, model.inputs[0], "instances", booleans)}
    columns: dict[str, list[Any]] = {spec.name: [] for spec in model.inputs}
    for index, row in enumerate(instances):
        if not isinstance(row, dict) or _is_b64(row):
            raise BadRequest(f"instances[{index}] must be an object keyed by input name, like instances[0]")
        _check_names(row.keys(), model, f"instances[{index}]")
        for name, value in row.items():
            columns[name].append(value)
    return {spec.name: _to_array(columns[spec.name], spec, f"instances[*].{spec.name}", booleans) for spec in model.inputs}


def _decode_columns(inputs: Any, model: TensorSpecs, booleans: bool) -> dict[str, np.ndarray]:
    if isinstance(inputs, dict) and not _is_b64(inputs):
        _check_names(inputs.keys(), model, "inputs")
        return {spec.name: _to_array(inputs[spec.name], spec, f"inputs.{spec.name}", booleans) for spec in model.inputs}
    if len(model.inputs) > 1:
        names = ", ".join(repr(spec.name) for spec in model.inputs)
        raise BadRequest(f"this model takes several inputs ({names}): 'inputs' must be an object keyed by name")
    if not isinstance(inputs, list):
        raise BadRequest(f"'inputs' must be a list (a batch of rows), not {_json_type(inputs)}")
    if not inputs:
        raise BadRequest("'inputs' is empty; send at least one row")
    return {model.inputs[0].name: _to_array(inputs, model.inputs[0], "inputs", booleans)}


def _check_names(names: Any, model: TensorSpecs, where: str) -> None:
    expected = {spec.name for spec in model.inputs}
    given = set(names)
    if given != expected:
        missing, unknown = sorted(expected - given), sorted(given - expected)
        parts = []
        if missing:
            parts.append(f"missing input(s) {missing}")
        if unknown:
            parts.append(f"unknown input(s) {unknown}")
        raise BadRequest(f"{where}: {' and '.join(parts)}; the model's inputs are {sorted(expected)}")


def _to_array(value: Any, spec: TensorInfo, where: str, booleans: bool = True) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise InvalidInput(f"{where} must be a non-empty list of rows for input '{spec.name}'")
    if spec.dtype == STRING:
        return _to_string_array(value, spec, where)
    try:
        raw = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        raise InvalidInput(_describe_bad_rows(value, spec, where)) from None
    kind = raw.dtype.kind
    if booleans and kind in "iuf" and isinstance(_first_non_number(value), bool):
        kind = "b"
    if kind == "b" and spec.dtype.kind != "b":
        raise InvalidInput(f"{where}: true/false where input '{spec.name}' takes numbers ({spec.tf_dtype})")
    if spec.dtype.kind == "b" and kind != "b":
        raise InvalidInput(f"{where}: input '{spec.name}' takes true/false values ({spec.tf_dtype})")
    if kind not in "biuf":
        raise InvalidInput(_describe_bad_rows(value, spec, where))
    if spec.dtype.kind in "iu" and kind == "f":
        raise InvalidInput(f"{where}: input '{spec.name}' takes integers ({spec.tf_dtype}); got a fractional number")
    if spec.dtype.kind in "iu" and raw.size:
        limits = np.iinfo(spec.dtype)
        if raw.min() < limits.min or raw.max() > limits.max:
            raise InvalidInput(f"{where}: a value is outside the range of {spec.tf_dtype} for input '{spec.name}'")
    _check_shape(raw.shape, spec, where)
    with np.errstate(over="ignore"):
        array = raw.astype(spec.dtype, copy=False)
    if spec.dtype.kind == "f" and raw.dtype.kind in "iuf" and not np.isfinite(array).all():
        raise InvalidInput(f"{where}: a value is too large for {spec.tf_dtype} (input '{spec.name}')")
    return array


def _check_shape(shape: Sequence[int], spec: TensorInfo, where: str) -> None:
    if len(shape) < 1 or not spec.accepts_row_shape(shape[1:]):
        raise InvalidInput(
            f"{where}: each row of input '{spec.name}' must have shape {_shape_text(spec.shape)}; "
            f"got rows of shape {list(shape[1:])}"
        )


def _describe_bad_rows(rows: list[Any], spec: TensorInfo, where: str) -> str:
    """The slow path: find the first row that is ragged or holds something not numeric."""
    first_shape = None
    for index, row in enumerate(rows):
        bad = _first_non_number(row)
        if bad is not _NOTHING:
            return f"{where}[{index}]: {_json_type(bad)} {_preview(bad)} where input '{spec.name}' takes numbers"
        try:
            shape = np.shape(row)
        except ValueError:
            return f"{where}[{index}] is ragged: its nested lists differ in length (input '{spec.name}')"
        if first_shape is None:
            first_shape = shape
        elif shape != first_shape:
            return (f"{where}: rows are ragged: row 0 has shape {list(first_shape)} but row {index} "
                    f"has shape {list(shape)}; input '{spec.name}' takes rows of shape {_shape_text(spec.shape)}")
    return f"{where}: cannot read the rows of input '{spec.name}' as {spec.tf_dtype}"


_NOTHING = object()


def _first_non_number(value: Any) -> Any:
    """The first leaf that is not a JSON number (booleans included), or _NOTHING."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, bool) or not isinstance(item, (int, float)):
            return item
    return _NOTHING


def _to_string_array(rows: list[Any], spec: TensorInfo, where: str) -> np.ndarray:
    def convert(item: Any) -> Any:
        if isinstance(item, list):
            return [convert(inner) for inner in item]
        if isinstance(item, str):
            return item.encode()
        if _is_b64(item):
            try:
                return base64.b64decode(item["b64"], validate=True)
            except (binascii.Error, TypeError, ValueError):
                raise InvalidInput(f"{where}: a 'b64' value is not valid base64") from None
        raise InvalidInput(f"{where}: {_json_type(item)} {_preview(item)} where input '{spec.name}' takes strings")

    converted = [convert(row) for row in rows]
    try:
        shape = np.shape(converted)
    except ValueError:
        raise InvalidInput(f"{where}: rows are ragged (input '{spec.name}')") from None
    _check_shape(shape, spec, where)
    array = np.empty(shape, dtype=object)
    array[...] = converted
    return array


def encode_response(outputs: dict[str, np.ndarray], model: TensorSpecs, fmt: str) -> bytes:
    names = [spec.name for spec in model.outputs if spec.name in outputs] or list(outputs)
    if fmt == ROW:
        if len(names) == 1:
            body: Any = {"predictions": _jsonable(outputs[names[0]])}
        else:
            columns = {name: _jsonable(outputs[name]) for name in names}
            rows = len(next(iter(columns.values())))
            body = {"predictions": [{name: columns[name][i] for name in names} for i in range(rows)]}
    else:
        if len(names) == 1:
            body = {"outputs": _jsonable(outputs[names[0]])}
        else:
            body = {"outputs": {name: _jsonable(outputs[name]) for name in names}}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype == object:
        return _encode_binary(array.tolist())
    if array.dtype.kind == "f" and array.dtype.itemsize < 4:
        array = array.astype(np.float32)
    # orjson writes numpy arrays natively (and floats in their shortest exact form), but
    # only native-endian C-contiguous ones.
    return np.ascontiguousarray(array)


def _encode_binary(value: Any) -> Any:
    if isinstance(value, list):
        return [_encode_binary(item) for item in value]
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
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
    text = orjson.dumps(value).decode() if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _shape_text(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("-1" if dim is None else str(dim) for dim in shape) + "]"
