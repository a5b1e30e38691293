"""A model's signatures as TensorFlow Serving's GetModelMetadata describes them: every
signature of the version with its method name (servables/tensorflow/get_model_metadata_impl.cc
copies the SignatureDefs of the MetaGraph), as JSON for REST and as a SignatureDef for gRPC.

Shapes are the declared ones, batch dimension included: -1 for a dimension of any size, and
`unknown_rank: true` with no dims for a tensor of unknown rank. Names are the graph's tensors
(`x:0`, `tf_example:0`, `serving_default_x:0`); a Keras model, which has no graph tensors to
name, gets the names a TF2 export of it would show (`serving_default_<input>:0`).
"""

from __future__ import annotations

from typing import Any

from app.core.models import LoadedModel, Signature, TensorInfo


def _tensor_name(spec: TensorInfo, signature: Signature, *, is_input: bool) -> str:
    if spec.tensor_name:
        return spec.tensor_name
    return f"{signature.name}_{spec.name}:0" if is_input else f"{spec.name}:0"


def _tensor(spec: TensorInfo, signature: Signature, *, is_input: bool) -> dict[str, Any]:
    if spec.dims is None:
        shape: dict[str, Any] = {"dim": [], "unknown_rank": True}
    else:
        shape = {"dim": [{"size": str(-1 if dim is None else dim), "name": ""} for dim in spec.dims],
                 "unknown_rank": False}
    return {"dtype": spec.tf_dtype, "tensor_shape": shape,
            "name": _tensor_name(spec, signature, is_input=is_input)}


def _signature(signature: Signature) -> dict[str, Any]:
    return {
        "inputs": {spec.name: _tensor(spec, signature, is_input=True) for spec in signature.inputs},
        "outputs": {spec.name: _tensor(spec, signature, is_input=False) for spec in signature.outputs},
        "method_name": signature.method_name,
        "defaults": {},
    }


def describe(model: LoadedModel) -> dict[str, Any]:
    signatures = {key: _signature(signature) for key, signature in sorted(model.signatures.items())}
    return {
        "model_spec": {"name": model.name, "signature_name": "", "version": str(model.version)},
        "metadata": {"signature_def": {"signature_def": signatures}},
    }


def signature_def(signature: Signature) -> Any:
    """The same signature as describe() gives, as a SignatureDef proto (gRPC GetModelMetadata)."""
    from tensorflow.core.framework import types_pb2
    from tensorflow.core.protobuf import meta_graph_pb2

    proto = meta_graph_pb2.SignatureDef(method_name=signature.method_name)
    for target, specs, is_input in ((proto.inputs, signature.inputs, True),
                                    (proto.outputs, signature.outputs, False)):
        for spec in specs:
            info = target[spec.name]
            info.name = _tensor_name(spec, signature, is_input=is_input)
            info.dtype = types_pb2.DataType.Value(spec.tf_dtype)
            if spec.dims is None:
                info.tensor_shape.unknown_rank = True
            for dim in spec.dims or ():
                info.tensor_shape.dim.add().size = -1 if dim is None else dim
    return proto
