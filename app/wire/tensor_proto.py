"""TensorFlow's TensorProto to numpy and back, without TensorFlow ops.

A client sends a tensor either as `tensor_content` (the raw little-endian bytes, what
`tf.make_tensor_proto` writes for a numpy array) or in the typed repeated field of its
dtype (`float_val`, `int_val`, ..., `half_val` holding float16/bfloat16 bit patterns,
`string_val`). As TensorFlow's `Tensor::FromProto` does, a typed field with fewer values
than the shape holds is filled up with its last value (`make_tensor_proto(1.0, shape=[2, 4])`
sends one value) and an empty one means zeros; more values than the shape holds is refused.
A rank-1 tensor for an input declared [-1, 1] is taken as that many rows of one value, as
TF Serving feeds it (it never holds a tensor to the signature's shape); the answer then has
shape [N, 1] where TF Serving's graph answers [N].

Answers go out as TensorFlow Serving writes them by default (servables/tensorflow/
predict_util.cc, kAsProtoField): every value in the typed field of its dtype (`float_val`,
`int64_val`, `string_val`, ...); raw `tensor_content` only when asked, as TF Serving's
--enable_serialization_as_tensor_content asks (strings stay in `string_val` either way).

Why not `tf.make_ndarray`: it is numpy underneath too, and about as fast (12 us against 16
for one row here, 28 against 21 for 32 rows of float_val, on this 2-core machine), but it
checks nothing: a shape of a billion rows with one float_val value would be allocated whole.
Here the dtype and per-row shape are checked against the signature, and the rows and bytes
against the request limits, before anything is allocated, so bad input is a clear
INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.core.errors import InvalidInput, PayloadTooLarge
from app.core.models import STRING, TensorInfo


def _bfloat16() -> np.dtype:
    import ml_dtypes  # TensorFlow's own numpy extension types; installed with it

    return np.dtype(ml_dtypes.bfloat16)


# DataType name -> (numpy dtype, the typed field a client may use instead of tensor_content).
_DTYPES: dict[str, tuple[Any, str]] = {
    "DT_FLOAT": (np.float32, "float_val"),
    "DT_DOUBLE": (np.float64, "double_val"),
    "DT_HALF": (np.float16, "half_val"),
    "DT_BFLOAT16": (_bfloat16, "half_val"),
    "DT_INT8": (np.int8, "int_val"),
    "DT_INT16": (np.int16, "int_val"),
    "DT_INT32": (np.int32, "int_val"),
    "DT_UINT8": (np.uint8, "int_val"),
    "DT_UINT16": (np.uint16, "int_val"),
    "DT_INT64": (np.int64, "int64_val"),
    "DT_UINT32": (np.uint32, "uint32_val"),
    "DT_UINT64": (np.uint64, "uint64_val"),
    "DT_BOOL": (np.bool_, "bool_val"),
    "DT_STRING": (STRING, "string_val"),
}
_TYPED_FIELDS = sorted({field for _, field in _DTYPES.values()})
# Typed fields whose packed wire form is the values' own little-endian bytes: an answer writes
# them whole. Extending the field instead makes a Python float of every value first (1,000
# floats: about 30 us against 3 on the 2-core machine, and the same bytes on the wire).
_FIXED_WIDTH_FIELDS = ("float_val", "double_val")
_LENGTH_DELIMITED = 2  # the wire type of a packed repeated field


def _dtype_name(proto: Any) -> str:
    from tensorflow.core.framework import types_pb2

    try:
        return types_pb2.DataType.Name(proto.dtype)
    except ValueError:
        return f"DataType {proto.dtype}"


def _numpy_dtype(name: str) -> np.dtype:
    dtype = _DTYPES[name][0]
    return _bfloat16() if dtype is _bfloat16 else np.dtype(dtype)


def to_ndarray(proto: Any, spec: TensorInfo, where: str, *, max_rows: int, max_bytes: int) -> np.ndarray:
    """One input of a request: checked against the signature's dtype and per-row shape, and
    against the request limits (rows, and bytes once decoded) before it is allocated."""
    given = _dtype_name(proto)
    if given != spec.tf_dtype:
        raise InvalidInput(f"{where}: input '{spec.name}' takes {spec.tf_dtype}; the tensor is {given}")
    if proto.tensor_shape.unknown_rank:
        raise InvalidInput(f"{where}: the tensor's shape must be given (unknown_rank is set)")
    shape = tuple(dim.size for dim in proto.tensor_shape.dim)
    if any(size < 0 for size in shape):
        raise InvalidInput(f"{where}: the tensor's shape {list(shape)} has a negative size")
    if len(shape) == 1 and spec.shape == (1,) and not spec.unknown_rank:
        shape = (shape[0], 1)
    if len(shape) < 1 or not spec.accepts_row_shape(shape[1:]):
        wanted = "[" + ", ".join("-1" if dim is None else str(dim) for dim in spec.shape) + "]"
        raise InvalidInput(f"{where}: each row of input '{spec.name}' must have shape {wanted}; "
                           f"the tensor has shape {list(shape)}, rows of shape {list(shape[1:])}")
    if shape[0] > max_rows:
        raise PayloadTooLarge(f"{where}: the tensor holds {shape[0]} rows; this model takes at most {max_rows} "
                              "rows per request (MAX_REQUEST_ROWS)")
    count = int(np.prod(shape, dtype=object))
    dtype = _numpy_dtype(given)
    if count * dtype.itemsize > max_bytes:
        raise PayloadTooLarge(f"{where}: shape {list(shape)} holds {count} values, more than a request may "
                              f"carry ({max_bytes} bytes)")
    if proto.tensor_content:
        if dtype == STRING:
            raise InvalidInput(f"{where}: a DT_STRING tensor sends its values in string_val, not tensor_content")
        expected = count * dtype.itemsize
        if len(proto.tensor_content) != expected:
            raise InvalidInput(f"{where}: tensor_content holds {len(proto.tensor_content)} bytes; shape "
                               f"{list(shape)} of {given} needs {expected}")
        # Little-endian on the wire; the result is read-only, which the batcher never minds.
        return np.frombuffer(proto.tensor_content, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False) \
            .reshape(shape)
    return _from_typed_field(proto, given, dtype, shape, count, where)


def _from_typed_field(proto: Any, name: str, dtype: np.dtype, shape: tuple[int, ...], count: int,
                      where: str) -> np.ndarray:
    field = _DTYPES[name][1]
    values = getattr(proto, field)
    if not values:
        stray = next((other for other in _TYPED_FIELDS if other != field and getattr(proto, other)), None)
        if stray is not None:
            raise InvalidInput(f"{where}: a {name} tensor sends its values in {field} or tensor_content, "
                               f"not {stray}")
    if len(values) > count:
        raise InvalidInput(f"{where}: {field} holds {len(values)} values; shape {list(shape)} holds {count}")
    if dtype == STRING:
        flat = np.empty(count, dtype=object)
        flat[: len(values)] = list(values)
        flat[len(values):] = values[-1] if values else b""
        return flat.reshape(shape)
    if field == "half_val":
        # The 16-bit patterns of float16 or bfloat16, each in an int32.
        raw = np.asarray(values, dtype=np.int64)
        if raw.size and (raw.min() < 0 or raw.max() > 0xFFFF):
            raise InvalidInput(f"{where}: half_val holds a value that is not a 16-bit pattern")
        array = raw.astype(np.uint16).view(dtype)
    else:
        array = np.asarray(values)
        if dtype.kind in "iu" and array.size:
            limits = np.iinfo(dtype)
            if array.min() < limits.min or array.max() > limits.max:
                raise InvalidInput(f"{where}: {field} holds a value outside the range of {name}")
        array = array.astype(dtype, copy=False)
    if array.size < count:
        fill = array[-1] if array.size else dtype.type(0)
        array = np.concatenate([array, np.full(count - array.size, fill, dtype=dtype)])
    return array.reshape(shape)


def from_ndarray(array: np.ndarray, tf_dtype: str, proto: Any, *, tensor_content: bool = False) -> None:
    """Write an output into `proto` (a TensorProto), as TensorFlow Serving answers: values in
    the dtype's typed field, or with `tensor_content`, as raw little-endian bytes."""
    from tensorflow.core.framework import types_pb2

    proto.dtype = types_pb2.DataType.Value(tf_dtype)
    for size in array.shape:
        proto.tensor_shape.dim.add().size = size
    if array.dtype == STRING:
        proto.string_val.extend(item if isinstance(item, bytes) else str(item).encode() for item in array.flat)
        return
    wanted = _numpy_dtype(tf_dtype) if tf_dtype in _DTYPES else array.dtype
    if tensor_content or tf_dtype not in _DTYPES:
        proto.tensor_content = np.ascontiguousarray(array, dtype=wanted.newbyteorder("<")).tobytes()
        return
    field = _DTYPES[tf_dtype][1]
    if field in _FIXED_WIDTH_FIELDS:
        proto.MergeFromString(_packed(field, np.ascontiguousarray(array, dtype=wanted.newbyteorder("<"))))
        return
    values = np.ascontiguousarray(array, dtype=wanted).reshape(-1)
    if field == "half_val":
        values = values.view(np.uint16)  # float16 and bfloat16 travel as their bit patterns
    getattr(proto, field).extend(values.tolist())


def _packed(field: str, values: np.ndarray) -> bytes:
    """A TensorProto holding only `values` in the fixed-width repeated `field`, serialized."""
    from tensorflow.core.framework import tensor_pb2

    number = tensor_pb2.TensorProto.DESCRIPTOR.fields_by_name[field].number
    raw = values.tobytes()
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(len(raw)) + raw


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
