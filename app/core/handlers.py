"""Handlers: the operator's Python around a model, run on each request's own thread.

    MODEL_HANDLER=examples.image_classifier.handler        (MODEL_CONFIG: a model's "handler")

A handler is a module (`pkg.module`), an object in one (`pkg.module:object`, a dotted path) or a
`.py` file, named only by the operator's settings or MODEL_CONFIG file (app/ops/settings.py): no
request names one. It may define, each optional (docs/handlers.md is its manual):

    signature = {"inputs": {name: {"dtype": "bytes", "shape": []}}, "outputs": {...}}
        what clients send and get: per-row shapes (None: any size), numpy's dtype names and
        "bytes" for strings. Metadata, v2 metadata and /openapi.json show it. Absent: the model's own.
    batch_key(inputs, parameters) -> a JSON scalar, or a list of them
        rows share a predict call only with rows of an equal key (and, as always, of one shape)
    preprocess(inputs, parameters) -> the model's inputs, as many rows as the request's
    postprocess(outputs, inputs, parameters) -> the signature's outputs, as many rows
    custom_objects() -> {name: Keras object}, called where the model loads, before it loads

`inputs` are the request's tensors as its door decoded them against `signature` (strings and
bytes: object arrays of bytes), `parameters` its v2 request parameters ({} on TF Serving's
doors), `outputs` the model's output rows of this request alone.

The request layer (app/core/serving.py) calls `stage` once the door decoded the request and
`finish` once its rows are back, on the request's own thread (a Gunicorn request thread, a gRPC
pool thread), never on the batch thread, which runs the model only. A ValueError is the
client's: InvalidInput, 400 / INVALID_ARGUMENT with its message. Any other exception, or a
result that breaks the contract (names, rows, shapes, dtypes), fails that request alone:
HandlerFailed, 500 / INTERNAL naming the request's id, its traceback logged once. Results are
cast to the declared dtypes by numpy's `same_kind` rule (float64 to float32, never float to int).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import logging
import math
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.core.call import Call
from app.core.errors import HandlerFailed, InvalidInput
from app.core.model_types import (
    DEFAULT_SIGNATURE,
    PREDICT_METHOD,
    STRING,
    LoadedModel,
    ModelLoadError,
    Signature,
    TensorInfo,
)

log = logging.getLogger(__name__)

# A signature's dtype names: numpy's, and "bytes" for TensorFlow's DT_STRING and v2's BYTES; each
# with the DataType name TF Serving's metadata shows.
DTYPES: dict[str, tuple[np.dtype, str]] = {
    "bool": (np.dtype(bool), "DT_BOOL"), "int8": (np.dtype("int8"), "DT_INT8"),
    "int16": (np.dtype("int16"), "DT_INT16"), "int32": (np.dtype("int32"), "DT_INT32"),
    "int64": (np.dtype("int64"), "DT_INT64"), "uint8": (np.dtype("uint8"), "DT_UINT8"),
    "uint16": (np.dtype("uint16"), "DT_UINT16"), "uint32": (np.dtype("uint32"), "DT_UINT32"),
    "uint64": (np.dtype("uint64"), "DT_UINT64"), "float16": (np.dtype("float16"), "DT_HALF"),
    "float32": (np.dtype("float32"), "DT_FLOAT"), "float64": (np.dtype("float64"), "DT_DOUBLE"),
    "bytes": (STRING, "DT_STRING"),
}
FUNCTIONS = ("preprocess", "postprocess", "batch_key", "custom_objects")


@dataclasses.dataclass(frozen=True)
class Handler:
    """A loaded handler: its public signature (None: the model's own is public) and its functions."""

    reference: str
    signature: Signature | None
    preprocess: Callable[..., Any] | None = None
    postprocess: Callable[..., Any] | None = None
    batch_key: Callable[..., Any] | None = None
    custom_objects: Callable[[], Mapping[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Handled:
    """A served version's handler, and the model's signature behind each public one it shows."""

    handler: Handler
    model_signatures: Mapping[str, Signature]

    def model_signature(self, public: Signature) -> Signature:
        """The model's signature that rows of `public` run on (itself where the handler shows none)."""
        return self.model_signatures.get(public.name, public)


# -- loading ----------------------------------------------------------------------------------


def load(reference: str, *, without_keras: bool = False) -> Handler:
    """The handler `reference` names; ModelLoadError if it cannot be imported or breaks the contract.
    `without_keras`: in a worker of MODEL_PROCESSES, which has no TensorFlow, the module must not
    import Keras (custom_objects() does, in the model process)."""
    had_keras = "keras" in sys.modules
    try:
        target = _import(reference)
    except Exception as exc:
        hint = " (a worker of MODEL_PROCESSES has no TensorFlow: import Keras inside custom_objects())" \
            if without_keras else ""
        raise ModelLoadError(f"handler {reference!r} cannot be imported: {type(exc).__name__}: {exc}{hint}") from exc
    if without_keras and not had_keras and "keras" in sys.modules:
        raise ModelLoadError(f"handler {reference!r} imports Keras: with MODEL_PROCESSES its module is imported "
                             "by workers, which run no model; import Keras inside custom_objects()")
    functions = {name: getattr(target, name, None) for name in FUNCTIONS}
    for name, function in functions.items():
        if function is not None and not callable(function):
            raise ModelLoadError(f"handler {reference!r}: {name} must be a function")
    declared = getattr(target, "signature", None)
    if declared is None and not any(functions.values()):
        raise ModelLoadError(f"handler {reference!r} defines none of signature, {', '.join(FUNCTIONS)}")
    if declared is None and (functions["preprocess"] or functions["postprocess"]):
        raise ModelLoadError(f"handler {reference!r}: preprocess and postprocess change what clients send and "
                             "get: declare it in `signature`")
    signature = None if declared is None else public_signature(declared, f"handler {reference!r}")
    return Handler(reference, signature, **functions)


def public_signature(declared: Any, where: str) -> Signature:
    """A handler's `signature` as the Signature clients see: serving_default, a predict, batched."""
    if not isinstance(declared, Mapping):
        raise ModelLoadError(f"{where}: signature must be a dict of 'inputs' and 'outputs'")
    inputs = _tensors(declared.get("inputs"), f"{where}: signature['inputs']")
    outputs = _tensors(declared.get("outputs"), f"{where}: signature['outputs']")

    def predict(_inputs: Any) -> Any:
        raise RuntimeError(f"{where}: its signature is what clients see; the model's own runs")

    return Signature(DEFAULT_SIGNATURE, PREDICT_METHOD, inputs, outputs, predict)


def _tensors(part: Any, where: str) -> list[TensorInfo]:
    if not isinstance(part, Mapping) or not part:
        raise ModelLoadError(f"{where} must be a non-empty dict of name to {{'dtype': ..., 'shape': [...]}}")
    tensors = []
    for name, spec in part.items():
        dtype, shape = (spec.get("dtype"), spec.get("shape")) if isinstance(spec, Mapping) else (None, None)
        if not isinstance(name, str) or dtype not in DTYPES or not isinstance(shape, (list, tuple)) or not all(
                dim is None or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0) for dim in shape):
            raise ModelLoadError(f"{where}[{name!r}]: expected {{'dtype': one of {sorted(DTYPES)}, 'shape': a list "
                                 f"of sizes or None}}; got {spec!r}")
        np_dtype, tf_dtype = DTYPES[dtype]
        tensors.append(TensorInfo(name, tuple(shape), np_dtype, tf_dtype))
    return tensors


def _import(reference: str) -> Any:
    if reference.endswith(".py"):
        return _import_file(Path(reference).resolve())
    module_name, _, attribute = reference.partition(":")
    target = importlib.import_module(module_name)
    for part in attribute.split(".") if attribute else ():
        target = getattr(target, part)
    return target


def _import_file(path: Path) -> Any:
    # One module per file, under a name no package takes; its folder on sys.path, so that it may
    # import the modules beside it.
    name = "model_server_handler_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no Python file at {path}")
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def custom_objects(handler: Handler | None) -> dict[str, Any] | None:
    """The handler's custom Keras objects, for the load about to happen in this process. Keras's
    registry of serializable names is global and wins over a load's own dict: a name another
    module of this process registered for another object is refused rather than loaded silently."""
    if handler is None or handler.custom_objects is None:
        return None
    try:
        objects = dict(handler.custom_objects())
    except Exception as exc:
        raise ModelLoadError(f"handler {handler.reference!r}: custom_objects() raised {type(exc).__name__}: "
                             f"{exc}") from exc
    import keras

    for name, value in objects.items():
        registered = keras.saving.get_registered_object(name)
        if registered is not None and registered is not value:
            raise ModelLoadError(f"handler {handler.reference!r}: custom object {name!r} is registered in this "
                                 "process for another object (Keras keeps one per name): register it under a "
                                 "package name of its own")
    return objects


def view(model: LoadedModel, handler: Handler) -> tuple[LoadedModel, Handled]:
    """The model as clients see it with this handler, and the handler bound to the model's signature:
    with a `signature`, the handler's alone, named serving_default, run on the model's main one."""
    if handler.signature is None:
        return model, Handled(handler, {})
    inner = model.signatures[model.default_signature]
    if not inner.batchable:
        raise ModelLoadError(f"model '{model.name}': handler {handler.reference!r} needs a batched signature, and "
                             f"'{inner.name}' has no batch dimension of any size")
    public = handler.signature
    shown = LoadedModel(model.name, model.version, model.source, public.inputs, public.outputs, public.predict,
                        load_s=model.load_s, warmup_s=model.warmup_s, keras_model=model.keras_model,
                        tracing_count=model.tracing_count, signatures={DEFAULT_SIGNATURE: public})
    return shown, Handled(handler, {DEFAULT_SIGNATURE: inner})


# -- on the request's thread --------------------------------------------------------------------


def stage(handled: Handled, call: Call, signature: Signature, inputs: Mapping[str, np.ndarray],
          rows: int) -> tuple[Mapping[str, np.ndarray], Hashable]:
    """A request's model inputs and its batch key (None: none), from its decoded inputs."""
    handler, parameters = handled.handler, call.parameters
    key = None
    if handler.batch_key is not None:
        key = _group(_run(handler, "batch_key", handler.batch_key, (inputs, parameters), call), handler, call)
    if handler.preprocess is None:
        return inputs, key
    prepared = _run(handler, "preprocess", handler.preprocess, (inputs, parameters), call)
    return _checked(handler, "preprocess", prepared, handled.model_signature(signature).inputs, rows, call), key


def finish(handled: Handled, call: Call, signature: Signature, inputs: Mapping[str, np.ndarray],
           outputs: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """The answer's tensors, from the request's own output rows."""
    handler = handled.handler
    if handler.postprocess is None:
        return outputs
    answer = _run(handler, "postprocess", handler.postprocess, (outputs, inputs, call.parameters), call)
    return _checked(handler, "postprocess", answer, signature.outputs, rows, call)


def _request_id(call: Call) -> str:
    return call.exchange.request_id if call.exchange is not None else ""


def _run(handler: Handler, stage: str, function: Callable[..., Any], args: tuple[Any, ...], call: Call) -> Any:
    try:
        return function(*args)
    except ValueError as exc:  # UnicodeDecodeError, binascii.Error, ... too: the client's
        raise InvalidInput(f"{stage}: {exc}") from None
    except Exception as exc:
        request_id = _request_id(call)
        log.exception("handler %s: %s raised, model %s, request_id=%s", handler.reference, stage,
                      call.exchange.model if call.exchange is not None else call.model.name, request_id)
        first = next(iter(str(exc).splitlines()), "")[:300]
        raise HandlerFailed(f"handler {stage} raised {type(exc).__name__}: {first} (request id {request_id})") \
            from None


def _failed(handler: Handler, stage: str, what: str, call: Call) -> HandlerFailed:
    """A result that breaks the contract: the handler's fault, logged once."""
    request_id = _request_id(call)
    log.error("handler %s: %s %s, request_id=%s", handler.reference, stage, what, request_id)
    return HandlerFailed(f"handler {stage} {what} (request id {request_id})")


def _checked(handler: Handler, stage: str, result: Any, tensors: Sequence[TensorInfo], rows: int,
             call: Call) -> dict[str, np.ndarray]:
    """A function's arrays, each cast to its tensor's dtype (`same_kind`) and checked for rows and
    per-row shape."""
    names = [tensor.name for tensor in tensors]
    if not isinstance(result, Mapping) or set(result) != set(names):
        got = sorted(map(str, result)) if isinstance(result, Mapping) else type(result).__name__
        raise _failed(handler, stage, f"returned {got}; expected {sorted(names)}", call)
    checked = {}
    for tensor in tensors:
        array = np.asarray(result[tensor.name])
        if array.dtype != tensor.dtype:
            if tensor.dtype == STRING and array.dtype.kind == "S":
                array = array.astype(object)
            elif tensor.dtype == STRING or not np.can_cast(array.dtype, tensor.dtype, "same_kind"):
                raise _failed(handler, stage, f"returned '{tensor.name}' as {array.dtype}; it is "
                                              f"{'bytes' if tensor.dtype == STRING else tensor.dtype}", call)
            else:
                array = array.astype(tensor.dtype)
        if array.ndim == 0 or array.shape[0] != rows or not tensor.accepts_row_shape(array.shape[1:]):
            shape = ["*" if dim is None else dim for dim in tensor.shape]
            raise _failed(handler, stage, f"returned '{tensor.name}' of shape {list(array.shape)}; expected "
                                          f"{rows} rows of {shape}", call)
        checked[tensor.name] = array
    return checked


def _group(key: Any, handler: Handler, call: Call) -> Hashable:
    """The batch key as the engine keeps it: a JSON scalar or a tuple of them, so that it crosses to
    a model process in the call's frame and compares equal there."""
    parts = list(key) if isinstance(key, (list, tuple)) else [key]
    values = []
    for part in parts:
        value = part.item() if isinstance(part, np.generic) else part
        if not (value is None or isinstance(value, (str, bool, int))
                or (isinstance(value, float) and math.isfinite(value))):
            raise _failed(handler, "batch_key", f"returned {type(part).__name__} {part!r}; expected a string, "
                                                "number, bool or None, or a list of them", call)
        values.append(value)
    return tuple(values) if isinstance(key, (list, tuple)) else values[0]
