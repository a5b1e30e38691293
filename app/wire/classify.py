"""TensorFlow Serving's :classify, :regress and MultiInference: tf.Examples in, results out.

Its rules (servables/tensorflow/classifier.cc, regressor.cc, multi_inference.cc): which
signature a call may use, what its one input and its outputs must be, and the shape of the
results, checked here and run on the request layer's `run` (app/core/serving.py) as any call;
and its REST API's JSON (util/json_tensor.cc). The gRPC door reads the same requests' protos
(app/wire/tfs_proto.py).

Request, as TF Serving reads it (FillClassifyRegressRequestFromJson):
{"signature_name": "...", "context": {feature: value|list}, "examples": [{feature: value|list}, ...]}.
A JSON integer is an int64 feature, a number with a fraction or exponent a float feature,
a string or {"b64": ...} a bytes feature. Context features are merged into each example,
as TF Serving serializes an ExampleListWithContext.

Answer (MakeJsonFromClassificationResult / MakeJsonFromRegressionResult):
classify: {"results": [[[label, score], ...], ...]}; regress: {"results": [value, ...]}.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from app.core.batching import Tensors, check_rows
from app.core.call import Call, ModelSpec
from app.core.errors import BadRequest, InvalidInput, MethodNotAllowed
from app.core.models import CLASSIFY_METHOD, DEFAULT_SIGNATURE, REGRESS_METHOD, STRING, LoadedModel, Signature
from app.core.registry import Servable
from app.core.serving import Answer, Decode, RequestLayer, braced
from app.wire import codec


def parse(body: bytes, method: str) -> tuple[str, Callable[[int], np.ndarray]]:
    """The signature name asked for ('' if none), and what builds one serialized tf.Example per
    example once the limit is known: more examples than its `max_rows` are refused before any is built."""
    document = codec.parse_json(body)
    if not isinstance(document, dict):
        raise BadRequest(f"the request body must be a JSON object, not {codec._json_type(document)}")
    signature_name = document.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise BadRequest("'signature_name' key must be a string value.")
    context = _features(document["context"], "context") if "context" in document else {}
    if "examples" not in document:
        raise BadRequest(f"When method is {method}, key 'examples' is expected and was not found")
    examples = document["examples"]
    if not isinstance(examples, list):
        raise BadRequest("Expecting 'examples' value to be an list/array")
    if not examples:
        raise BadRequest("'examples' value is an empty array")
    return signature_name, lambda max_rows: _serialize(examples, context, max_rows)


def _serialize(examples: list[Any], context: dict[str, Any], max_rows: int) -> np.ndarray:
    from tensorflow.core.example import example_pb2

    check_rows(len(examples), max_rows, unit="examples")
    serialized = np.empty(len(examples), dtype=object)
    for index, value in enumerate(examples):
        example = example_pb2.Example()
        for name, feature in {**context, **_features(value, f"examples[{index}]")}.items():
            example.features.feature[name].CopyFrom(feature)
        serialized[index] = example.SerializeToString()
    return serialized


def _features(value: Any, where: str) -> dict[str, Any]:
    from tensorflow.core.example import feature_pb2

    if not isinstance(value, dict) or codec._is_b64(value):
        raise InvalidInput(f"{where}: Example must be JSON object but got JSON {codec._json_type(value)}")
    features = {}
    for name, content in value.items():
        items = content if isinstance(content, list) else [content]
        kinds = {_kind(item, name, where) for item in items}
        if len(kinds) > 1:
            raise InvalidInput(f"{where}: feature '{name}' mixes {' and '.join(sorted(kinds))} values; "
                               "a feature holds one kind (a number with a fraction is a float)")
        feature = feature_pb2.Feature()
        kind = kinds.pop() if kinds else "float"
        if kind == "bytes":
            feature.bytes_list.value.extend(_bytes(item, name, where) for item in items)
        elif kind == "int64":
            if any(not -2**63 <= item < 2**63 for item in items):
                raise InvalidInput(f"{where}: Feature: {name} has an integer outside int64. Only int64 is supported.")
            feature.int64_list.value.extend(items)
        else:
            feature.float_list.value.extend(items)
        features[name] = feature
    return features


def _kind(item: Any, name: str, where: str) -> str:
    if isinstance(item, bool) or item is None or isinstance(item, list) or (
            isinstance(item, dict) and not codec._is_b64(item)):
        raise InvalidInput(f"{where}: Feature: {name} has element with unexpected JSON type: "
                           f"{codec._json_type(item)}")
    if isinstance(item, int):
        return "int64"
    if isinstance(item, float):
        return "float"
    return "bytes"


def _bytes(item: Any, name: str, where: str) -> bytes:
    if isinstance(item, str):
        return item.encode()
    try:
        return base64.b64decode(item["b64"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise InvalidInput(f"{where}: feature '{name}': a 'b64' value is not valid base64") from None


def encode_classes(classes: Classes) -> bytes:
    results = [[[label, score] for label, score in zip(labels, scores, strict=True)]
               for labels, scores in zip(classes.labels, classes.scores, strict=True)]
    return orjson.dumps({"results": results}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_regressions(values: np.ndarray) -> bytes:
    return orjson.dumps({"results": values}, option=orjson.OPT_SERIALIZE_NUMPY)


CLASSIFY, REGRESS = "classify", "regress"


# The signature keys TF Serving's classify and regress read (tensorflow/cc/saved_model/signature_constants.h).
EXAMPLES_INPUT = "inputs"


_EXAMPLE_METHODS = {CLASSIFY: (CLASSIFY_METHOD, "classification"), REGRESS: (REGRESS_METHOD, "regression")}


_TASK_METHODS = {CLASSIFY_METHOD: CLASSIFY, REGRESS_METHOD: REGRESS}


@dataclasses.dataclass(frozen=True)
class Classes:
    """A classify answer, one row per example: labels ('' where the model has none) and scores (0 where none)."""

    labels: list[list[str]]
    scores: np.ndarray  # float32, rows x classes


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a MultiInference: a model and signature, and TF Serving's method name to run it by."""

    model_name: str
    signature_name: str
    method_name: str


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """One task's answer: `classes` for a classify task, `regressions` for a regress task."""

    signature: Signature
    classes: Classes | None = None
    regressions: np.ndarray | None = None


def text(value: Any) -> str:
    """A label as text: bytes decoded as UTF-8 (bad bytes replaced), anything else as str()."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def examples_decode(examples: Callable[[int], np.ndarray]) -> Decode:
    """Classify's, regress's and MultiInference's decode: `examples(max_rows)`, the serialized
    tf.Examples (refused over max_rows before any is built), as the signature's one input;
    built once, however many of a MultiInference's tasks read them."""
    built: list[np.ndarray] = []

    def decode(_signature: Signature, max_rows: int) -> Tensors:
        if not built:
            built.append(examples(max_rows))
        return {EXAMPLES_INPUT: built[0]}

    return decode


def multi_inference_spec(first: ModelSpec) -> ModelSpec:
    """The model a MultiInference runs on: its first task's, which must name one
    (model_servers/multi_inference_helper.cc, server_core.cc); no task: no name."""
    if not first.name:
        raise BadRequest("ModelSpec has no name specified.")
    return first


def multi_inference_plan(model: LoadedModel, tasks: list[Task], *,
                         check_method_name: bool = False) -> list[tuple[str, Signature]]:
    """Each task's kind (CLASSIFY or REGRESS) and signature, in order, after TF Serving's checks
    (servables/tensorflow/multi_inference.cc): one model for all, no signature twice, a known
    method name, and the signature's fit for its method. Nothing runs unless every task passes."""
    plan: list[tuple[str, Signature]] = []
    seen: set[str] = set()
    for task in tasks:
        if not task.model_name:
            raise BadRequest("Found ModelSpec with an empty model name.")
        if task.model_name != tasks[0].model_name:
            raise BadRequest("All ModelSpecs in a MultiInferenceRequest must access the same model name.")
        key = task.signature_name or DEFAULT_SIGNATURE
        if key in seen:
            raise BadRequest(f"Duplicate evaluation of signature: {key}")
        seen.add(key)
        if key not in model.signatures:
            raise BadRequest(f"Requested signature not found in model graph: {key}")
        method = _TASK_METHODS.get(task.method_name)
        if method is None:
            # UNIMPLEMENTED over gRPC, as TF Serving answers it.
            raise MethodNotAllowed(f"Unsupported signature method_name: {task.method_name}")
        signature, _ = example_signature(model, key, method, check_method_name=check_method_name)
        plan.append((method, signature))
    return plan


def example_signature(model: LoadedModel, name: str, method: str, *,
                      check_method_name: bool = False) -> tuple[Signature, str]:
    """Classify's or regress's signature and the name of its one input, with TF Serving's checks
    (servables/tensorflow/classifier.cc, regressor.cc: PreProcessClassification, PreProcessRegression).

    The method name is checked only when asked (--enable_signature_method_name_check); otherwise any
    signature fits whose one input is 'inputs' and whose outputs are 'classes' and/or 'scores'
    (classify) or 'outputs' (regress). Without a name: serving_default, or the model's main signature
    where it has no serving_default.
    """
    if not name and DEFAULT_SIGNATURE not in model.signatures:
        name = model.default_signature
    key = name or DEFAULT_SIGNATURE
    signature = model.signatures.get(key)
    if signature is None:
        raise BadRequest(f"No signature was found with the name: {key}")
    method_name, kind = _EXAMPLE_METHODS[method]
    if check_method_name and signature.method_name != method_name:
        raise BadRequest(f"Expected {kind} signature method_name to be {method_name}. "
                         f"Was: {signature.method_name}")
    if len(signature.inputs) != 1:
        raise BadRequest("Expected one input Tensor.")
    outputs = {spec.name for spec in signature.outputs}
    if method == CLASSIFY and len(outputs) not in (1, 2):
        raise BadRequest(f"Expected one or two output Tensors, found {len(outputs)}")
    if method == REGRESS and len(outputs) != 1:
        raise BadRequest("Expected one output Tensor.")
    if signature.inputs[0].name != EXAMPLES_INPUT:
        raise BadRequest(f"No {kind} inputs found in SignatureDef '{signature.name}': its input is "
                         f"'{signature.inputs[0].name}', not '{EXAMPLES_INPUT}'")
    if method == CLASSIFY and not outputs & {"classes", "scores"}:
        raise BadRequest('Expected classification signature outputs to contain at least one of "classes" or '
                         f'"scores". Signature \'{signature.name}\' has {braced(outputs)}')
    if method == REGRESS and outputs != {"outputs"}:
        raise BadRequest(f"No regression outputs found in SignatureDef '{signature.name}': its output is "
                         f"{braced(outputs)}, not 'outputs'")
    if signature.inputs[0].dtype != STRING:
        raise BadRequest(f"Expected one input Tensor of serialized tf.Examples in signature '{signature.name}'")
    return signature, EXAMPLES_INPUT


def classes(outputs: dict[str, np.ndarray], rows: int) -> Classes:
    """TF Serving's classification result from a signature's 'classes' and/or 'scores' outputs."""
    labels, scores = outputs.get("classes"), outputs.get("scores")
    if labels is not None:
        width = labels.reshape(rows, -1).shape[1]
    elif scores is not None:
        width = scores.reshape(rows, -1).shape[1]
    else:
        raise BadRequest("Expected classification signature outputs to contain 'classes' or 'scores'")
    texts = ([[text(value) for value in row] for row in labels.reshape(rows, width)] if labels is not None
             else [[""] * width for _ in range(rows)])
    values = (scores.reshape(rows, width).astype(np.float32) if scores is not None
              else np.zeros((rows, width), np.float32))
    return Classes(texts, values)


def regressions(outputs: dict[str, np.ndarray], rows: int) -> np.ndarray:
    """TF Serving's regression result: the 'outputs' output (or the only one), one value per example."""
    values = np.asarray(outputs.get("outputs", next(iter(outputs.values()))))
    if values.size != rows:
        raise BadRequest(f"Expected output Tensor shape to be [{rows}] or [{rows}, 1]; got {list(values.shape)}")
    return values.reshape(rows).astype(np.float32)


# -- TF Serving's :classify, :regress and MultiInference, on the request layer's run --------------


def classify(layer: RequestLayer, call: Call, decode: Decode) -> tuple[Answer, Classes]:
    """Classify serialized tf.Examples (one per row) with TF Serving's checks of the answer."""
    answer = _examples(layer, call, CLASSIFY, decode)
    return answer, classes(answer.outputs, answer.rows)


def regress(layer: RequestLayer, call: Call, decode: Decode) -> tuple[Answer, np.ndarray]:
    """Regress serialized tf.Examples: one float32 value per example."""
    answer = _examples(layer, call, REGRESS, decode)
    return answer, regressions(answer.outputs, answer.rows)


def _examples(layer: RequestLayer, call: Call, method: str, decode: Decode) -> Answer:
    servable = layer.model(call.model, call.exchange)
    layer.predict_only(servable)
    signature, _input_name = example_signature(servable.model, call.signature, method,
                                               check_method_name=layer.check_method_name)
    return layer.run(call, servable, signature, decode)


def multi_inference(layer: RequestLayer, call: Call, tasks: list[Task], decode: Decode
                    ) -> tuple[Servable, list[TaskResult]]:
    """Every task over the same examples, in the tasks' order, once all of them passed TF Serving's checks.

    TF Serving feeds the examples once and fetches every task's outputs from one session run;
    here each task's signature runs on its own batcher, within the call's one deadline. Later
    tasks go to the version that answered the first, so every result names one version.
    """
    servable = layer.model(call.model, call.exchange)
    layer.predict_only(servable)
    plan = multi_inference_plan(servable.model, tasks, check_method_name=layer.check_method_name)
    results = []
    for method, signature in plan:
        answer = layer.run(call, servable, signature, decode)
        servable = answer.servable
        if method == CLASSIFY:
            results.append(TaskResult(answer.signature, classes=classes(answer.outputs, answer.rows)))
        else:
            results.append(TaskResult(answer.signature, regressions=regressions(answer.outputs, answer.rows)))
    return servable, results
