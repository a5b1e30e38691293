"""A model's signatures in TensorFlow Serving's GetModelMetadata JSON form: every signature
of the version, each with its method name (servables/tensorflow/get_model_metadata_impl.cc)."""

from __future__ import annotations

from typing import Any

from app.models import LoadedModel, Signature, TensorInfo

def _tensor(spec: TensorInfo, prefix: str) -> dict[str, Any]:
    dims = [{"size": "-1", "name": ""}] + [{"size": str(-1 if d is None else d), "name": ""} for d in spec.shape]
    return {
        "dtype": spec.tf_dtype,
        "tensor_shape": {"dim": dims, "unknown_rank": False},
        "name": f"{prefix}{spec.name}:0",
    }


def _signature(signature: Signature) -> dict[str, Any]:
    return {
        "inputs": {spec.name: _tensor(spec, f"{signature.name}_") for spec in signature.inputs},
        "outputs": {spec.name: _tensor(spec, "") for spec in signature.outputs},
        "method_name": signature.method_name,
        "defaults": {},
    }


def describe(model: LoadedModel) -> dict[str, Any]:
    signatures = {key: _signature(signature) for key, signature in sorted(model.signatures.items())}
    return {
        "model_spec": {"name": model.name, "signature_name": "", "version": str(model.version)},
        "metadata": {"signature_def": {"signature_def": signatures}},
    }
