"""A model's signature in TensorFlow Serving's GetModelMetadata JSON form."""

from __future__ import annotations

from typing import Any

from app.models import LoadedModel, TensorInfo

SIGNATURE_NAME = "serving_default"


def _tensor(spec: TensorInfo, prefix: str) -> dict[str, Any]:
    dims = [{"size": "-1", "name": ""}] + [{"size": str(-1 if d is None else d), "name": ""} for d in spec.shape]
    return {
        "dtype": spec.tf_dtype,
        "tensor_shape": {"dim": dims, "unknown_rank": False},
        "name": f"{prefix}{spec.name}:0",
    }


def describe(model: LoadedModel) -> dict[str, Any]:
    signature = {
        "inputs": {spec.name: _tensor(spec, f"{SIGNATURE_NAME}_") for spec in model.inputs},
        "outputs": {spec.name: _tensor(spec, "") for spec in model.outputs},
        "method_name": "tensorflow/serving/predict",
        "defaults": {},
    }
    return {
        "model_spec": {"name": model.name, "signature_name": "", "version": str(model.version)},
        "metadata": {"signature_def": {"signature_def": {SIGNATURE_NAME: signature}}},
    }
