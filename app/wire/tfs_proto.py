"""TensorFlow Serving's request protos, read into what the request layer takes.

The gRPC door (app/grpc/tfs.py) and warm-up's records (app/wire/warmup.py) carry the same
PredictRequest, ClassificationRequest, RegressionRequest and MultiInferenceRequest: each is
read here into a Call (built by its exchange) and a decode, with TF Serving's refusals, so a
warm-up record meets exactly the checks a client's request would.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tensorflow.core.example import example_pb2

from app.core import errors
from app.core.batching import Tensors, check_rows
from app.core.call import Call, Exchange, ModelSpec
from app.core.models import LoadedModel, Signature
from app.core.serving import Decode, braced
from app.wire import tensor_proto
from app.wire.classify import Task, examples_decode, multi_inference_spec


def model_spec(proto: Any) -> ModelSpec:
    return ModelSpec(proto.name or None, proto.version.value if proto.HasField("version") else None,
                     proto.version_label or None)


def call(exchange: Exchange, request: Any, *, outputs: tuple[str, ...] = ()) -> Call:
    """A Predict's, Classify's or Regress's call: the model spec it must carry, its signature."""
    if not request.HasField("model_spec"):
        raise errors.BadRequest("Missing ModelSpec")
    return exchange.call(model_spec(request.model_spec), signature=request.model_spec.signature_name,
                         outputs=outputs)


def predict_call(exchange: Exchange, request: Any) -> Call:
    return call(exchange, request, outputs=tuple(request.output_filter))


def multi_inference_call(exchange: Exchange, request: Any) -> Call:
    """A MultiInference's call: the model of its first task; the default priority, whatever the metadata says."""
    spec = multi_inference_spec(model_spec(request.tasks[0].model_spec) if request.tasks else ModelSpec())
    return exchange.call(spec, priority=0)


def tasks(request: Any) -> list[Task]:
    """A MultiInferenceRequest's tasks, as app/wire/classify.py runs them."""
    return [Task(task.model_spec.name, task.model_spec.signature_name, task.method_name) for task in request.tasks]


def predict_decode(request: Any, *, max_bytes: int) -> Decode:
    """A PredictRequest's inputs, against the signature its call resolved to."""
    return lambda signature, max_rows: decode_inputs(request, signature, max_rows=max_rows, max_bytes=max_bytes)


def examples(request: Any) -> Decode:
    """Classify's, Regress's and MultiInference's decode: the request's tf.Examples, serialized."""
    return examples_decode(lambda max_rows: serialized_examples(request.input, max_rows=max_rows))


def serialized_examples(model_input: Any, *, max_rows: int) -> np.ndarray:
    """One serialized tf.Example per example; context features merged in, the example's own winning.

    TF Serving concatenates the serialized context and example (servables/tensorflow/util.cc),
    which parses as this merge.
    """
    kind = model_input.WhichOneof("kind")
    if kind == "example_list":
        listed, context = model_input.example_list.examples, None
    elif kind == "example_list_with_context":
        with_context = model_input.example_list_with_context
        listed, context = with_context.examples, with_context.context
    else:
        listed, context = [], None
    if not listed:
        raise errors.InvalidInput("Input is empty.")
    # Refused before any example is serialized, as the REST API refuses them before building.
    check_rows(len(listed), max_rows, unit="examples")
    serialized = np.empty(len(listed), dtype=object)
    for index, example in enumerate(listed):
        if context is not None:
            merged = example_pb2.Example()
            for name, feature in [*context.features.feature.items(), *example.features.feature.items()]:
                merged.features.feature[name].CopyFrom(feature)
            example = merged
        serialized[index] = example.SerializeToString()
    return serialized


def decode_inputs(request: Any, model: Signature, *, max_rows: int, max_bytes: int) -> Tensors:
    wanted = {spec.name for spec in model.inputs}
    given = set(request.inputs.keys())
    if given != wanted:
        raise errors.InvalidInput(
            f"input size does not match signature: {len(given)}!={len(wanted)} len({braced(given)}) != "
            f"len({braced(wanted)}). Sent extra: {braced(given - wanted)}. "
            f"Missing but required: {braced(wanted - given)}.")
    return {spec.name: tensor_proto.to_ndarray(request.inputs[spec.name], spec, f"inputs['{spec.name}']",
                                               max_rows=max_rows, max_bytes=max_bytes)
            for spec in model.inputs}


def set_model_spec(target: Any, model: LoadedModel, signature_name: str | None) -> None:
    """The model spec an answer names: the version that answered it."""
    target.name = model.name
    target.version.value = model.version
    if signature_name is not None:
        target.signature_name = signature_name
