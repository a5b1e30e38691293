"""What a model process tells its workers about the models it serves, as plain JSON values.

Workers need a model's signatures (to parse and validate requests), its versions, labels
and states (to resolve them), its batchers' limits (to refuse early) and its MODEL_CONFIG
entry (v2's model configuration); never the model. A model's handler runs in the workers: they
import it by the reference given here, and check what its preprocess makes against the model's
own signatures, sent beside the ones clients see.
"""

from __future__ import annotations

from typing import Any

from app.core import handlers
from app.core.models import LoadedModel, Signature, TensorInfo
from app.core.registry import ModelRegistry, Servable
from app.model_process.wire import dtype_from_text, dtype_text


def describe(registry: ModelRegistry) -> dict[str, Any]:
    """Every model the registry serves or knows (unloaded, failed to load): versions served,
    labels and states (model process side)."""
    models = []
    for name in registry.names():
        versions = [_servable(registry.get(name, version)) for version in registry.versions(name)]
        models.append({"name": name, "labels": _labels(registry, name), "versions": versions,
                       "states": registry.model_status(name), "config": registry.config_entry(name)})
    return {"default": registry.default_name, "models": models}


def batcher_stats(registry: ModelRegistry) -> dict[str, tuple[int, int]]:
    """Rows queued and batches run of every batcher, by `batcher_key` (/readyz in a worker)."""
    return {batcher_key(servable.model.name, servable.model.version, key): (batcher.queued_rows, batcher.batches_run)
            for servable in registry.servables() for key, batcher in servable.batchers.items()}


def batcher_key(model: str, version: int, signature: str) -> str:
    return f"{model}/{version}/{signature}"


def _labels(registry: ModelRegistry, name: str) -> dict[str, int]:
    live = registry.live_config
    config = live.configs.get(name) if live is not None else None
    return dict(config.version_labels) if config is not None else {}


def _servable(servable: Servable) -> dict[str, Any]:
    model = servable.model
    handled = servable.handler
    return {
        "version": model.version,
        "source": model.source,
        "load_s": model.load_s,
        "warmup_s": model.warmup_s,
        "default_signature": model.default_signature,
        "signatures": [_signature(signature) for signature in model.signatures.values()],
        "batchers": {key: batcher.info.as_json() for key, batcher in servable.batchers.items()},
        "handler": None if handled is None else {
            "reference": handled.handler.reference,
            "model_signatures": {key: _signature(signature) for key, signature in handled.model_signatures.items()}},
    }


def _signature(signature: Signature) -> dict[str, Any]:
    return {"name": signature.name, "method_name": signature.method_name,
            "inputs": [_tensor(info) for info in signature.inputs],
            "outputs": [_tensor(info) for info in signature.outputs]}


def _tensor(info: TensorInfo) -> dict[str, Any]:
    return {"name": info.name, "shape": list(info.shape), "dtype": dtype_text(info.dtype), "tf_dtype": info.tf_dtype,
            "tensor_name": info.tensor_name, "dims": None if info.dims is None else list(info.dims),
            "narrowed_to": None if info.narrowed_to is None else dtype_text(info.narrowed_to)}


def loaded_model(name: str, version: dict[str, Any]) -> LoadedModel:
    """A model as a worker sees it: its signatures, and predict functions that must never run here."""
    signatures = {entry["name"]: _signature_from(entry, name) for entry in version["signatures"]}
    main = signatures[version["default_signature"]]
    return LoadedModel(name, version["version"], version["source"], main.inputs, main.outputs, main.predict,
                       load_s=version["load_s"], warmup_s=version["warmup_s"], signatures=signatures)


def handled(version: dict[str, Any], name: str) -> handlers.Handled | None:
    """The version's handler, imported in this worker (ModelLoadError if it cannot be, or if it
    imports Keras: a worker has no TensorFlow), bound to the model's signatures."""
    entry = version.get("handler")
    if entry is None:
        return None
    handler = handlers.load(entry["reference"], without_keras=True)
    return handlers.Handled(handler, {key: _signature_from(item, name)
                                      for key, item in entry["model_signatures"].items()})


def _signature_from(entry: dict[str, Any], name: str) -> Signature:
    return Signature(entry["name"], entry["method_name"], [_info(item) for item in entry["inputs"]],
                     [_info(item) for item in entry["outputs"]], _not_here(name))


def _info(item: dict[str, Any]) -> TensorInfo:
    dims = None if item["dims"] is None else tuple(item["dims"])
    narrowed = item["narrowed_to"]
    return TensorInfo(item["name"], tuple(item["shape"]), dtype_from_text(item["dtype"]), item["tf_dtype"],
                      item["tensor_name"], dims, None if narrowed is None else dtype_from_text(narrowed))


def _not_here(name: str) -> Any:
    # A fresh function per signature: LoadedModel finds its main signature by its predict's identity.
    def predict(_inputs: Any) -> Any:
        raise RuntimeError(f"model '{name}' runs in a model process, not in this worker")

    return predict
