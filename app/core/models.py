"""Loading a model, describing its signature, and the fast predict function.

`load_model()` accepts a `.keras` or `.h5` file, a SavedModel folder (written by TF2 or
by a TF1 graph), a TensorFlow Serving base folder of numbered versions (`00000123` is
version 123; other names are ignored), or nothing: then the built-in default model is
built in-process from fixed seeds.

A model has one or more signatures (a SavedModel's signature_defs; a Keras model has
only serving_default), each with its own inputs, outputs, method name and predict
function. `LoadedModel.inputs/outputs/predict` are those of serving_default.

The predict path is a `tf.function` with a `None` batch dimension, traced once and then
called with batches padded to a few bucket sizes, each warmed before the worker is
ready. Keras 3's `model.predict` builds a data pipeline on every call (tens of ms on a
CPU, whatever the batch); it is kept only as the naive baseline (PREDICT_METHOD).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# What a loaded model is lives in app/core/model_types.py (app/core/jax_model.py builds it too); the
# layers above read it from here.
from app.core.model_types import (  # noqa: F401
    CLASSIFY_METHOD,
    DEFAULT_SIGNATURE,
    PREDICT_METHOD,
    REGRESS_METHOD,
    STRING,
    LoadedModel,
    ModelLoadError,
    PredictFn,
    Signature,
    TensorInfo,
)

log = logging.getLogger(__name__)

DEFAULT_FEATURES = 4
DEFAULT_OUTPUTS = 3
DEFAULT_WIDTH = 4096
DEFAULT_DEPTH = 4
DEFAULT_SEED = 1234

_VERSION_FOLDER = re.compile(r"[0-9]+")


def build_default_model(
    *,
    features: int = DEFAULT_FEATURES,
    width: int = DEFAULT_WIDTH,
    depth: int = DEFAULT_DEPTH,
    outputs: int = DEFAULT_OUTPUTS,
    seed: int = DEFAULT_SEED,
) -> Any:
    """A wide dense network (4 x 4096 x 4096 float32, about 268 MB of weights).

    At one row per call the weights are read once per row, so a call is memory-bound and
    a batch of 32 costs little more than a batch of 1: batching pays even on a CPU.
    """
    import keras

    # Weights from numpy's generator, not Keras's seeded initializers: those draw from each
    # backend's own generator, so TensorFlow and JAX would build two different models.
    rng = np.random.default_rng(seed)
    sizes = [features, *[width] * (depth + 1), outputs]
    inputs = keras.Input((features,), name="features")
    layers = [keras.layers.Dense(width, activation="relu", name="expand", kernel_initializer="zeros"),
              *(keras.layers.Dense(width, activation="relu", name=f"hidden_{index}", kernel_initializer="zeros")
                for index in range(depth)),
              keras.layers.Dense(outputs, name="scores", kernel_initializer="zeros")]
    scores = inputs
    for layer in layers:
        scores = layer(scores)
    for layer, fan_in, fan_out in zip(layers, sizes[:-1], sizes[1:], strict=True):
        limit = np.float32(np.sqrt(6.0 / (fan_in + fan_out)))  # Glorot uniform
        kernel = rng.random((fan_in, fan_out), dtype=np.float32) * (2 * limit) - limit
        layer.set_weights([kernel, np.zeros(fan_out, np.float32)])
    return keras.Model(inputs, scores, name="default")


def load_model(path: str | None, *, name: str, method: str = "function", version: int | None = None,
               custom_objects: Mapping[str, Any] | None = None) -> LoadedModel:
    """Load `path`; for a base folder of versions, `version` (default: the newest). `custom_objects`:
    the Keras objects a `.keras` or `.h5` model needs by name (a handler's), on either backend."""
    started = time.perf_counter()
    if path is None:
        source = "built-in default model"
        model = _keras_servable(build_default_model(), name=name, version=1, source=source, method=method)
    else:
        resolved, version = resolve_version(path, version)
        source = resolved
        if os.path.isdir(resolved):
            model = _from_saved_model(resolved, name=name, version=version)
        elif resolved.endswith((".keras", ".h5", ".hdf5")):
            import keras

            try:
                keras_model = keras.models.load_model(resolved, compile=False, custom_objects=custom_objects)
            except Exception as exc:
                raise ModelLoadError(f"cannot load {resolved}: {type(exc).__name__}: {exc}") from exc
            model = _keras_servable(keras_model, name=name, version=version, source=source, method=method)
        else:
            raise ModelLoadError(
                f"MODEL_PATH={path!r}: expected a .keras or .h5 file, a SavedModel folder or a folder of versions"
            )
    model.load_s = time.perf_counter() - started
    return model


def resolve_version(path: str, version: int | None = None) -> tuple[str, int]:
    """A TensorFlow Serving base path (numbered sub-folders) resolves to one version, the newest by default."""
    if not os.path.exists(path):
        raise ModelLoadError(f"MODEL_PATH={path!r} does not exist")
    folders = version_folders(path)
    if folders:
        chosen = max(folders) if version is None else version
        if chosen not in folders:
            raise ModelLoadError(f"{path!r} has no version {chosen}; it has {sorted(folders)}")
        return folders[chosen], chosen
    return path, 1


def version_folders(path: str) -> dict[int, str]:
    """Version number -> folder, as TF Serving reads a base path: names of digits only, so
    '00000123' is version 123 and 'tmp' or '.export-2' are not versions. Of two names for
    one number ('7', '007') the first in sorted order wins, so the choice is stable."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "saved_model.pb")):
        return {}
    folders: dict[int, str] = {}
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if _VERSION_FOLDER.fullmatch(entry) and os.path.isdir(full):
            folders.setdefault(int(entry), full)
    return folders


def available_versions(path: str) -> list[int]:
    return sorted(version_folders(path))


def _dtype_info(dtype: Any) -> tuple[np.dtype, str]:
    import tensorflow as tf
    from tensorflow.core.framework import types_pb2

    # A TF1 signature may fetch a reference variable (DT_FLOAT_REF); what it answers is a DT_FLOAT.
    tf_dtype = tf.as_dtype(dtype).base_dtype
    enum_name = types_pb2.DataType.Name(tf_dtype.as_datatype_enum)  # DT_FLOAT, as TF Serving names it
    if tf_dtype == tf.string:
        return STRING, enum_name
    return np.dtype(tf_dtype.as_numpy_dtype), enum_name


def _info(name: str, shape: Any, dtype: Any, tensor_name: str = "") -> TensorInfo:
    """From a Keras tensor's or a TensorSpec's shape (a TensorShape of unknown rank gives dims None)."""
    np_dtype, tf_name = _dtype_info(dtype)
    if shape is None or getattr(shape, "rank", 0) is None:
        dims = None
    else:
        dims = tuple(None if dim is None else int(dim) for dim in (shape.as_list() if hasattr(shape, "as_list")
                                                                   else shape))
    return TensorInfo(name=name, shape=tuple(dims[1:]) if dims else (), dtype=np_dtype, tf_dtype=tf_name,
                      tensor_name=tensor_name, dims=dims)


def _info_from_proto(name: str, proto: Any) -> TensorInfo:
    """From a SignatureDef's TensorInfo: the graph's tensor name, and -1 sizes as any size."""
    shape = None if proto.tensor_shape.unknown_rank else [None if dim.size < 0 else dim.size
                                                           for dim in proto.tensor_shape.dim]
    return _info(name, shape, proto.dtype, tensor_name=proto.name)


def _keras_servable(keras_model: Any, *, name: str, version: int, source: str, method: str) -> LoadedModel:
    """A Keras model on the backend Keras runs: TensorFlow's tf.function, or JAX's jit (app/core/jax_model.py)."""
    from app.core import jax_model
    from app.ops import runtime

    if runtime.uses_jax():
        return jax_model.from_keras(keras_model, name=name, version=version, source=source, method=method,
                                    name_outputs=output_namer(keras_model))
    return _from_keras(keras_model, name=name, version=version, source=source, method=method)


def output_namer(keras_model: Any) -> Callable[[Any], dict[str, Any]]:
    """Names a Keras model's outputs: a dict's keys, else the model's output names, else output_N."""
    declared_outputs = list(getattr(keras_model, "output_names", None) or [])

    def name_outputs(result: Any) -> dict[str, Any]:
        if isinstance(result, Mapping):
            return dict(result)
        if isinstance(result, (list, tuple)):
            names = (declared_outputs if len(declared_outputs) == len(result)
                     else [f"output_{i}" for i in range(len(result))])
            return dict(zip(names, result, strict=True))
        return {declared_outputs[0] if len(declared_outputs) == 1 else "output_0": result}

    return name_outputs


def _from_keras(keras_model: Any, *, name: str, version: int, source: str, method: str) -> LoadedModel:
    import tensorflow as tf

    inputs = [_info(t.name, t.shape, t.dtype) for t in keras_model.inputs]
    single_input = len(inputs) == 1
    name_outputs = output_namer(keras_model)

    def call(tensors: dict[str, Any]) -> Any:
        return keras_model(tensors[inputs[0].name] if single_input else tensors, training=False)

    signature = [tf.TensorSpec((None, *spec.shape), tf.as_dtype(spec.dtype if spec.dtype != STRING else tf.string),
                               name=spec.name) for spec in inputs]

    @tf.function(input_signature=[signature])
    def serve(tensors: list[Any]) -> dict[str, Any]:
        return name_outputs(call({spec.name: tensor for spec, tensor in zip(inputs, tensors, strict=True)}))

    concrete = serve.get_concrete_function()
    outputs = [_info(key, tensor.shape, tensor.dtype) for key, tensor in concrete.structured_outputs.items()]

    if method == "keras_predict":
        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            result = keras_model.predict(batch[inputs[0].name] if single_input else batch, verbose=0)
            return {key: np.asarray(value) for key, value in name_outputs(result).items()}
    else:
        # The concrete function, traced once for a None batch dimension: calling it skips
        # tf.function's per-call signature matching (about 0.1 ms a call on a CPU).
        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            result = concrete([batch[spec.name] for spec in inputs])
            return {key: value.numpy() for key, value in result.items()}

    return LoadedModel(name=name, version=version, source=source, inputs=inputs, outputs=outputs,
                       predict=predict, keras_model=keras_model, tracing_count=serve.experimental_get_tracing_count)


def _from_saved_model(path: str, *, name: str, version: int) -> LoadedModel:
    """A TF2 SavedModel through tf.saved_model.load; a TF1 one (no object graph) through a v1
    session on its MetaGraph, as TF Serving's loader runs every SavedModel. tf.saved_model.load
    rebuilds a TF1 signature from its declared shapes, and those may be wrong: TF 1.0 wrote a
    scalar where the shape was unknown, so TF Serving's half_plus_three fails there
    ("Shape must be rank 1 but is rank 0 for ParseExample"); a session feeds what it is given.
    Signatures are described from the SignatureDefs themselves, as TF Serving's metadata is."""
    meta_graph = _serving_meta_graph(path)
    definitions = {key: definition for key, definition in meta_graph.signature_def.items()
                   if key != _INIT_OP_SIGNATURE}
    if not definitions:
        raise ModelLoadError(f"the SavedModel in {path} has no signatures to serve")
    _register_op_libraries(meta_graph)
    try:
        if meta_graph.object_graph_def.nodes:
            predicts = _tf2_predicts(path, sorted(definitions))
        else:
            predicts = _session_predicts(path, definitions)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load the SavedModel in {path}: {type(exc).__name__}: {exc}") from exc
    signatures = {}
    for key, definition in sorted(definitions.items()):
        signatures[key] = Signature(
            name=key,
            method_name=definition.method_name or PREDICT_METHOD,
            inputs=[_info_from_proto(k, info) for k, info in sorted(definition.inputs.items())],
            outputs=[_info_from_proto(k, info) for k, info in sorted(definition.outputs.items())],
            predict=predicts[key],
        )
    main = signatures.get(DEFAULT_SIGNATURE) or next(iter(signatures.values()))
    return LoadedModel(name=name, version=version, source=path, inputs=main.inputs, outputs=main.outputs,
                       predict=main.predict, signatures=signatures)


# TF2 exports list the init op as a signature; it is run at load, never served.
_INIT_OP_SIGNATURE = "__saved_model_init_op"
_SERVE_TAG = "serve"


def _serving_meta_graph(path: str) -> Any:
    """The MetaGraph tagged 'serve' of saved_model.pb (or .pbtxt), as TF Serving picks it."""
    from google.protobuf import text_format
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    binary, text = os.path.join(path, "saved_model.pb"), os.path.join(path, "saved_model.pbtxt")
    try:
        if os.path.exists(binary):
            with open(binary, "rb") as proto_file:
                saved_model.ParseFromString(proto_file.read())
        elif os.path.exists(text):
            with open(text, encoding="utf-8") as proto_file:
                text_format.Parse(proto_file.read(), saved_model)
        else:
            raise ModelLoadError(f"cannot load the SavedModel in {path}: it holds no saved_model.pb or "
                                 "saved_model.pbtxt")
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot read the SavedModel in {path}: {type(exc).__name__}: {exc}") from exc
    for meta_graph in saved_model.meta_graphs:
        if _SERVE_TAG in meta_graph.meta_info_def.tags:
            return meta_graph
    tags = [list(graph.meta_info_def.tags) for graph in saved_model.meta_graphs]
    raise ModelLoadError(f"the SavedModel in {path} has no MetaGraph tagged '{_SERVE_TAG}' (it has {tags})")


def _register_op_libraries(meta_graph: Any) -> None:
    """TF Serving's binary links in TF Text's ops; here the tensorflow-text package registers
    them, imported only when a model uses an op TensorFlow itself lacks (it costs start-up time).
    Without the package, the load fails naming the op."""
    from tensorflow.python.framework import op_def_registry

    used = {op.name for op in meta_graph.meta_info_def.stripped_op_list.op}
    if all(op_def_registry.get(name) is not None for name in used):
        return
    try:
        import tensorflow_text  # noqa: F401  (importing it registers its ops)
    except ImportError:
        pass


def _tf2_predicts(path: str, keys: Sequence[str]) -> dict[str, PredictFn]:
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    missing = sorted(set(keys) - set(loaded.signatures))
    if missing:
        raise ModelLoadError(f"the SavedModel in {path} lists signatures it cannot load: {missing}")

    def predict_for(key: str) -> PredictFn:
        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            # Through `loaded`, not a saved reference to the function: the signature's variables
            # live as long as the loaded object does.
            result = loaded.signatures[key](**{name: tf.constant(value) for name, value in batch.items()})
            return {name: value.numpy() for name, value in result.items()}

        return predict

    return {key: predict_for(key) for key in keys}


def _session_predicts(path: str, definitions: Mapping[str, Any]) -> dict[str, PredictFn]:
    """One v1 session holds the graph, its variables and what its init op (main_op or
    legacy_init_op, run by the loader with the assets in place) set up; each signature is a
    callable of that session fed by tensor name."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2

    v1 = tf.compat.v1
    threading = tf.config.threading
    graph = tf.Graph()
    session = v1.Session(graph=graph, config=v1.ConfigProto(
        intra_op_parallelism_threads=threading.get_intra_op_parallelism_threads(),
        inter_op_parallelism_threads=threading.get_inter_op_parallelism_threads()))
    with graph.as_default():
        v1.saved_model.loader.load(session, [_SERVE_TAG], path)

    def predict_for(definition: Any) -> PredictFn:
        input_names, output_names = sorted(definition.inputs), sorted(definition.outputs)
        # A callable made from CallableOptions runs in C++ without Python's feed checks, so, as
        # in TF Serving's C++ session, a value is not held to the tensor's static shape: a [N]
        # batch for an input declared [-1, 1] or a scalar is fed as it is. (Session.run and
        # make_callable with feeds refuse it.) Keras's TF1 backend used the same entry point.
        options = config_pb2.CallableOptions(
            feed=[definition.inputs[key].name for key in input_names],
            fetch=[definition.outputs[key].name for key in output_names])
        with graph.as_default():
            run = session._make_callable_from_options(options)

        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            values = run(*(batch[key] for key in input_names))
            return {key: np.asarray(value) for key, value in zip(output_names, values, strict=True)}

        return predict

    return {key: predict_for(definition) for key, definition in definitions.items()}


def example_batch(model: LoadedModel | Signature, rows: int, length: int = 1) -> dict[str, np.ndarray]:
    """A batch of the right shapes and dtypes, for warm-up: dynamic dimensions get size `length`."""
    batch = {}
    for spec in model.inputs:
        shape = (rows, *(length if dim is None else dim for dim in spec.shape))
        batch[spec.name] = np.full(shape, b"", dtype=object) if spec.dtype == STRING else np.zeros(shape, spec.dtype)
    return batch


def warm_up(model: LoadedModel, buckets: Sequence[int], lengths: Sequence[int] = ()) -> float:
    """Run every bucket size of every signature once so no request pays for a first call of its shape.

    With variable-length padding, every (bucket size, length bucket) pair too: `lengths` are
    the sizes the dynamic dimensions are padded to, besides 1.

    A signature that cannot run on placeholder values (serialized tf.Examples that must hold
    a feature, say) is left cold: its first request pays for the trace, and a broken
    serving_default still fails the load. So is one that cannot be batched: its shapes are
    fixed or unknown, and running it may change its state (TF Serving's counter model).
    """
    started = time.perf_counter()
    for signature in model.signatures.values():
        if not signature.batchable:
            continue
        try:
            for rows in buckets:
                for length in dict.fromkeys((1, *lengths)):
                    signature.predict(example_batch(signature, rows, length))
        except Exception as exc:
            if signature.predict is model.predict:
                raise
            log.warning("model '%s' v%d: signature '%s' not warmed (%s: %s)", model.name, model.version,
                        signature.name, type(exc).__name__, str(exc).splitlines()[0][:200])
    model.warmup_s = time.perf_counter() - started
    log.info("model '%s' warmed for batch sizes %s%s in %.2f s", model.name, list(buckets),
             f" and lengths {list(lengths)}" if lengths else "", model.warmup_s)
    return model.warmup_s
