"""Open Inference Protocol (KServe v2) tensors: datatypes, shapes and data, for both its front doors.

A v2 tensor is a name, a datatype (BOOL, INT8-64, UINT8-64, FP16, FP32, FP64, BYTES; BF16
too), a shape whose first dimension is the rows, and its values: as a JSON array (nested or
flat, row-major), or as raw little-endian bytes (Triton's binary tensor extension over
HTTP, `raw_input_contents` over gRPC), where a BYTES element is a 4-byte little-endian
length followed by that many bytes. Signatures map onto these names one for one
(DT_FLOAT is FP32, DT_STRING is BYTES, ...), and a variable dimension is -1.

As app/wire/codec.py and app/wire/tensor_proto.py do for TF Serving, each input is checked against
the signature (datatype, per-row shape) and against the row limit before its array is
built, and its data against its shape: a short or long tensor is a clear 400, never a
reshape error.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from app.core.batching import check_rows
from app.core.call import ModelSpec
from app.core.errors import BadRequest, InvalidInput, NotFound, ServingError
from app.core.models import STRING, LoadedModel, Signature, TensorInfo
from app.core.serving import braced
from app.ops.numerals import INT64_MAX, whole_number
from app.wire import codec

SERVER_NAME = "tensorflow-model-server"
# The project ships no release numbers; this names the API generation a client may expect.
SERVER_VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "statistics", "model_repository", "model_configuration"]
BYTES = "BYTES"
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16), "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    BYTES: STRING,
}
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}
# The JSON values each kind of datatype takes (V: bfloat16).
_JSON_TYPES = {"b": (bool,), "i": (int,), "u": (int,), "f": (int, float), "V": (int, float)}
_LENGTH = struct.Struct("<I")
# The request parameters both front doors read, refused in the same words when mistyped.
SIGNATURE_NAME_ERROR = "the parameter 'signature_name' must be a string"
TIMEOUT_ERROR = "the parameter 'timeout' is microseconds, a whole number of 0 or more"


def model_spec(name: str, version: str | None) -> ModelSpec:
    """A v2 version string: digits are a version number, anything else a version label."""
    if not version:
        return ModelSpec(name)
    if not (version.isascii() and version.isdigit()):
        return ModelSpec(name, label=version)
    return ModelSpec(name, version_number(version))


# Triton's limit on how deep an input's JSON `data` may nest (common.h, HTTP_MAX_JSON_NESTING_DEPTH):
# a value under this many arrays, `data`'s own included, is refused.
MAX_JSON_DEPTH = 100
DEPTH_ERROR = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"
_UNKNOWN_LABEL = "Unrecognized servable version label"


def in_triton_words(exc: ServingError, spec: ModelSpec) -> ServingError:
    """The request layer's refusal as Triton words it, where Triton's clients read the words: an
    unknown model or version (model_repository_manager.cc), a version string that names nothing
    (common.cc, GetModelVersionFromString: here, an unknown label). The status stays ours."""
    if isinstance(exc, NotFound):
        version = "" if spec.version is None else f" version {spec.version}"
        return NotFound(f"Request for unknown model: '{spec.name}'{version} is not found")
    if spec.label is not None and exc.message.startswith(_UNKNOWN_LABEL):
        return BadRequest(f"failed to get model version from specified version string '{spec.label}': it is "
                          f"neither a version number nor a version label of model '{spec.name}'")
    return exc


def check_outputs(names: Sequence[str]) -> None:
    """Each output asked for once, in Triton's words (infer_request.cc, AddOriginalRequestedOutput)."""
    if len(set(names)) != len(names):
        seen: set[str] = set()
        duplicate = next(name for name in names if name in seen or seen.add(name))  # type: ignore[func-returns-value]
        raise InvalidInput(f"output '{duplicate}' already exists in request")


def raw_input(data: bytes | memoryview, signature: Signature, model: str) -> Tensor:
    """Triton's raw binary request (Inference-Header-Content-Length: 0): the whole body is the data
    of the signature's one input, one row, its shape deduced as Triton's core does
    (infer_request.cc, Normalize): at most one variable dimension, sized from the body; a BYTES
    input must take one element, the body. Triton's words for what cannot be deduced."""
    if len(signature.inputs) != 1:
        raise InvalidInput(f"Raw request must only have 1 input (found 1) to be deduced but got "
                           f"{len(signature.inputs)} inputs in '{model}' model configuration")
    spec = signature.inputs[0]
    dims: list[int | None] = [None] if spec.unknown_rank else list(spec.shape)
    variable = [index for index, size in enumerate(dims) if size is None]
    if len(variable) > 1:
        raise InvalidInput(f"The shape of the raw input '{spec.name}' can not be deduced because there are more "
                           "than one variable-sized dimension")
    if spec.dtype == STRING:
        if variable or math.prod(size or 0 for size in dims) != 1:
            raise InvalidInput(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        return Tensor(spec.name, BYTES, (1, *(1 for _ in dims)), values=[bytes(data)])
    if variable:
        fixed = math.prod(size or 1 for size in dims) * spec.dtype.itemsize
        dims[variable[0]] = len(data) // fixed if fixed else 0
    return Tensor(spec.name, datatype(spec), (1, *(size or 0 for size in dims)), raw=data)


def version_number(version: str) -> int:
    """A version of digits as a number; 400 past int64, as Triton refuses a version stol cannot read."""
    number = whole_number(version, INT64_MAX)
    if number is None:
        raise BadRequest(f"failed to get model version from specified version string '{version}', version "
                         f"should be an integral value from 0 to {INT64_MAX}")
    return number


def datatype(spec: TensorInfo) -> str:
    """The v2 datatype of a signature's tensor; a dtype v2 has no name for keeps TensorFlow's (DT_COMPLEX64)."""
    return _NAMES.get(spec.dtype, spec.tf_dtype)


def tensor_metadata(spec: TensorInfo) -> dict[str, Any]:
    return {"name": spec.name, "datatype": datatype(spec), "shape": [-1, *(-1 if d is None else d for d in spec.shape)]}


def model_metadata(model: LoadedModel, signature: Signature, versions: Sequence[int]) -> dict[str, Any]:
    return {
        "name": model.name,
        "versions": [str(version) for version in versions],
        "platform": "tensorflow",
        "inputs": [tensor_metadata(spec) for spec in signature.inputs],
        "outputs": [tensor_metadata(spec) for spec in signature.outputs],
    }


@dataclasses.dataclass
class Tensor:
    """One input as its wire format gave it: values in `data` (a JSON array), `raw` (bytes) or
    `values` (a typed list, as gRPC's InferTensorContents holds them)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any = None
    raw: bytes | memoryview | None = None
    values: Sequence[Any] | None = None
    # False only where the JSON text `data` came from holds no `true` or `false`: numpy, which
    # reads [true, 2] as [1, 2], may then read `data` at once (see _from_json).
    booleans: bool = True


def decode_inputs(tensors: list[Tensor], signature: Signature, *, max_rows: int) -> dict[str, np.ndarray]:
    """The request's inputs as arrays, each checked against the signature; every input once, no other."""
    given = [tensor.name for tensor in tensors]
    wanted = {spec.name: spec for spec in signature.inputs}
    known = [tensor for tensor in tensors if tensor.name in wanted]
    # Every shape checked before any array is built: a request over the row limit costs nothing.
    for tensor in known:
        _check(tensor, wanted[tensor.name], max_rows)
    # Each input's data read before the inputs are counted, as Triton reads them (its words for a
    # count that is not the shape's come first).
    arrays = {tensor.name: _array(tensor, wanted[tensor.name]) for tensor in known}
    if len(set(given)) != len(given) or set(given) != set(wanted):
        raise InvalidInput(f"the model's signature '{signature.name}' takes the inputs {braced(wanted)}, "
                           f"each once; the request gave {given}")
    return arrays


def _check(tensor: Tensor, spec: TensorInfo, max_rows: int) -> None:
    want = datatype(spec)
    if tensor.datatype != want:
        raise InvalidInput(f"input '{tensor.name}' takes datatype {want}; the request sent {tensor.datatype}")
    shape = tensor.shape
    _check_size(tensor, spec)
    if not shape or not spec.accepts_row_shape(shape[1:]) or any(size < 0 for size in shape):
        wanted = [-1, *(-1 if d is None else d for d in spec.shape)]
        raise InvalidInput(f"input '{tensor.name}' takes shape {wanted}; the request sent {list(shape)}")
    check_rows(shape[0], max_rows)


def _count(shape: Sequence[int]) -> int:
    return math.prod(shape)  # Python ints: exact, however large


def _check_size(tensor: Tensor, spec: TensorInfo) -> None:
    """Triton's refusals of a shape whose element count or byte size passes int64 (common.cc,
    GetElementCount; http_server.cc), in its words, before the data is read."""
    if all(size >= 0 for size in tensor.shape):
        count = _count(tensor.shape)
        if count > INT64_MAX:
            shape = ",".join(str(size) for size in tensor.shape)
            raise InvalidInput(f"invalid shape for input '{tensor.name}': shape [{shape}] causes total element "
                               f"count to exceed maximum size of {INT64_MAX}")
        if spec.dtype != STRING and count * spec.dtype.itemsize > INT64_MAX:
            raise InvalidInput(f"byte size overflow for input '{tensor.name}': element count ({count}) * data type "
                               f"size ({spec.dtype.itemsize}) exceeds maximum allowed size ({INT64_MAX})")


def _array(tensor: Tensor, spec: TensorInfo) -> np.ndarray:
    count = _count(tensor.shape)
    where = f"input '{tensor.name}'"
    if tensor.raw is not None:
        flat = from_bytes(tensor.raw, spec.dtype, count, where)
    elif tensor.values is not None:
        flat = _from_values(tensor.values, spec.dtype, count, where)
    else:
        flat = _from_json(tensor.data, spec.dtype, count, where, booleans=tensor.booleans)
    return flat.reshape(tensor.shape)


def _from_values(values: Sequence[Any], dtype: np.dtype, count: int, where: str) -> np.ndarray:
    if len(values) != count:
        raise InvalidInput(f"{where}: its contents hold {len(values)} values; its shape holds {count}")
    if dtype == STRING:
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:
        raise _past_range(dtype, where) from None


def from_bytes(raw: bytes | memoryview, dtype: np.dtype, count: int, where: str) -> np.ndarray:
    """`count` values from raw little-endian bytes (BYTES: length-prefixed elements), flat."""
    if dtype == STRING:
        return _deserialize_bytes(raw, count, where)
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(f"{where}: its data holds {len(raw)} bytes; its shape and datatype need "
                           f"{count * dtype.itemsize}")
    array = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
    if dtype == np.bool_ and array.size and array.view(np.uint8).max() > 1:
        raise InvalidInput(f"{where}: a BOOL element is a byte of 0 or 1")
    return array.astype(dtype, copy=False)


def _deserialize_bytes(raw: bytes | memoryview, count: int, where: str) -> np.ndarray:
    view, offset = memoryview(raw), 0
    values = np.empty(count, dtype=object)
    for index in range(count):
        if offset + 4 > len(view):
            raise InvalidInput(f"{where}: its data ends after {index} of its {count} BYTES elements")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise InvalidInput(f"{where}: BYTES element {index} says {length} bytes; {len(view) - offset} are left")
        values[index] = bytes(view[offset: offset + length])
        offset += length
    if offset != len(view):
        raise InvalidInput(f"{where}: its data holds {len(view) - offset} bytes past its {count} BYTES elements")
    return values


def _flatten(data: Any, where: str, *, bytes_data: bool = False) -> list[Any]:
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: 'data' must be a JSON array")
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) + 1 >= MAX_JSON_DEPTH:  # this array the 100th: its values under 100
                    raise depth_error(bytes_data=bytes_data)
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def depth_error(*, bytes_data: bool) -> InvalidInput:
    """Triton's refusal of `data` nested MAX_JSON_DEPTH deep (http_server.cc: BYTES while sized, others
    while read)."""
    return InvalidInput(DEPTH_ERROR if bytes_data else f"Unable to parse 'data': {DEPTH_ERROR}")


def nesting_depth(text: bytes | str) -> int:
    """How deep arrays nest in JSON text holding numbers and arrays only (simdjson's minified `data`)."""
    if not text:
        return 0
    view = np.frombuffer(text.encode() if isinstance(text, str) else text, dtype=np.uint8)
    steps = (view == ord("[")).astype(np.int32) - (view == ord("]"))
    return int(np.cumsum(steps).max())


def _from_json(data: Any, dtype: np.dtype, count: int, where: str, *, booleans: bool = True) -> np.ndarray:
    if isinstance(data, np.ndarray):  # numbers read flat, as doubles (app/http/v2.py, _numbers_read_whole)
        if data.size != count:
            raise _count_error(data.size, count)
        if dtype.itemsize >= data.dtype.itemsize:
            return codec.astype_keeping_gil(data, dtype)
        # simdjson reads no NaN or infinity: a value past the datatype's range is all that can overflow.
        array = codec.within_range(data, dtype, codec.peak(data) if data.size else 0.0)
        if array is None:
            raise _past_range(dtype, where)
        return array
    if dtype != STRING and not (booleans and dtype.kind != "b"):
        flat = _read_whole(data, dtype, count, where)
        if flat is not None:
            return flat
    return _from_json_by_item(data, dtype, count, where)


# The kinds of array numpy makes of JSON values each kind of datatype takes (its rules for
# mixing them: ints alone are i or u, with a float f; booleans alone are b).
_INFERRED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "V": "iuf"}


def _read_whole(data: Any, dtype: np.dtype, count: int, where: str) -> np.ndarray | None:
    """`data` read by numpy in one call, flat: the same array _from_json_by_item builds, or
    None where only that item-by-item walk can say what is wrong (or read it at all)."""
    if not isinstance(data, list):
        return None
    if count > codec.MAX_SCAN:
        # One string among millions of numbers makes numpy write every number as text first
        # (ten times its read): orjson writes the values back at C speed, and a '"' there is a
        # string or an object among them, for the walk to find.
        try:
            if b'"' in orjson.dumps(data):
                return None
        except orjson.JSONEncodeError:  # nested past orjson's limit, or an integer past 64 bits
            return None
    try:
        inferred = np.array(data)
    except (ValueError, TypeError, OverflowError):  # ragged, or a value numpy cannot hold
        return None
    if inferred.dtype.kind not in _INFERRED_KINDS[dtype.kind]:
        return None  # a string, null, object or a value of the wrong type: the walk words it
    if inferred.size != count:
        raise _count_error(inferred.size, count)
    flat = inferred.reshape(-1)
    if dtype.kind in "iu":
        # numpy's cast wraps where np.array(values, dtype) refuses; the range is checked first.
        limits = np.iinfo(dtype)
        if flat.size and (flat.min() < limits.min or flat.max() > limits.max):
            raise _past_range(dtype, where)
    elif dtype.kind != "b":
        # A whole number becomes a float through float64, as Python's int does (2**60 + 2**36 + 1
        # rounds differently straight to float32).
        return _floats(flat.astype(np.float64, copy=False), dtype, where)
    return flat.astype(dtype, copy=False)


def _from_json_by_item(data: Any, dtype: np.dtype, count: int, where: str) -> np.ndarray:
    flat = _flatten(data, where, bytes_data=dtype == STRING)
    if len(flat) != count:
        raise _count_error(len(flat), count)
    if dtype == STRING:
        if not all(isinstance(item, str) for item in flat):
            raise InvalidInput(f"{where}: BYTES data in JSON is strings")
        values = np.empty(count, dtype=object)
        values[:] = [item.encode() for item in flat]
        return values
    allowed = _JSON_TYPES[dtype.kind]
    # Checked by type, not left to numpy: it reads [0, 2**64 - 1] as float64 and True as 1.
    if not all(type(item) in allowed for item in flat):
        name = _NAMES.get(dtype, str(dtype))
        raise InvalidInput(f"{where}: {name} data must be {'booleans' if bool in allowed else 'numbers'}")
    try:
        if dtype.kind in "fV":
            # Through a double, as float() reads a number (ml_dtypes' bfloat16 takes no Python int
            # past int64: a TypeError, which was a 500).
            return _floats(np.array(flat, dtype=np.float64), dtype, where)
        return np.array(flat, dtype=dtype)
    except OverflowError:
        raise _past_range(dtype, where) from None


def _count_error(found: int, count: int) -> InvalidInput:
    """JSON `data` not as many values as its shape holds, in Triton's exact words (http_server.cc,
    ReadDataFromJson), which its test.sh matches whole."""
    if found < count:
        return InvalidInput("Failed to parse 'data' field: shape does not match true shape")
    return InvalidInput("Unable to parse 'data': Shape does not match true shape of 'data' field")


def _floats(wide: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    """float64 values as the float `dtype`; 400 for a finite one the cast would make infinite (as
    TF Serving's REST door refuses it). NaN and the infinities JSON spells out stay as they are."""
    with np.errstate(over="ignore"):
        array = wide.astype(dtype)
    if not np.isfinite(array).all() and (np.isfinite(wide) & ~np.isfinite(array)).any():
        raise _past_range(dtype, where)
    return array


def _past_range(dtype: np.dtype, where: str) -> InvalidInput:
    return InvalidInput(f"{where}: a value is outside the range of {_NAMES[dtype]}")


def output_array(array: np.ndarray, spec: TensorInfo) -> np.ndarray:
    """An output as the datatype its metadata names."""
    return array if spec.dtype == STRING else np.asarray(array, dtype=spec.dtype)


def to_bytes(array: np.ndarray) -> bytes:
    """An output's raw little-endian bytes (BYTES: length-prefixed elements)."""
    if array.dtype == STRING:
        items = [item if isinstance(item, bytes) else str(item).encode() for item in array.flat]
        return b"".join(_LENGTH.pack(len(item)) + item for item in items)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def to_json(array: np.ndarray, name: str) -> Any:
    """An output's values, flat, row-major; BYTES as text (binary data carries any other bytes);
    NaN and infinities as the tokens NaN, Infinity and -Infinity, as Triton writes them."""
    if array.dtype != STRING:
        flat = array.ravel()
        if flat.dtype.kind in "fV":
            # As float64, every float datatype (BF16 too) writes as tolist() would write it.
            flat = flat.astype(np.float64)
            if (fragment := codec.non_finite_fragment(flat)) is not None:
                return fragment
        # orjson writes the array's numbers in the text it writes their Python values in,
        # without making a Python object of each.
        return orjson.Fragment(orjson.dumps(flat, option=orjson.OPT_SERIALIZE_NUMPY))
    try:
        return [item.decode() if isinstance(item, bytes) else str(item) for item in array.flat]
    except UnicodeDecodeError:
        raise InvalidInput(f"output '{name}' holds bytes that are not UTF-8 text; ask for it with "
                           "the binary_data parameter") from None
