"""TensorFlow Serving's ModelServerConfig (text format or message) as this server's MODEL_CONFIG document.

Read by the settings (a MODEL_CONFIG file in text format), by TF Serving's flags
(--model_config_file, app/tfs_flags.py) and by gRPC's HandleReloadConfigRequest; it imports
neither, so the settings stay below the flags.
"""

from __future__ import annotations

from typing import Any


class FlagError(ValueError):
    """A flag or a config file this server cannot honour; the message names it."""


def model_config_json(text: str) -> dict[str, Any]:
    """A ModelServerConfig in text format, as our MODEL_CONFIG JSON ({"models": [...]})."""
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        # TF Serving's own words, which its test looks for.
        raise FlagError(f"Error parsing text-format tensorflow.serving.ModelServerConfig: {exc}") from None
    return model_config_document(config)


def model_config_document(config: Any) -> dict[str, Any]:
    """A ModelServerConfig message, as our MODEL_CONFIG JSON document."""
    if config.HasField("custom_model_config"):
        raise FlagError("--model_config_file: custom_model_config is not supported; use model_config_list")
    models = []
    for entry in config.model_config_list.config:
        if entry.model_platform not in ("", "tensorflow"):
            raise FlagError(f"--model_config_file: model '{entry.name}': model_platform "
                            f"{entry.model_platform!r} is not supported; only 'tensorflow'")
        model: dict[str, Any] = {"name": entry.name, "path": entry.base_path}
        policy = entry.model_version_policy
        choice = policy.WhichOneof("policy_choice")
        if choice == "latest":
            model["model_version_policy"] = {"latest": {"num_versions": policy.latest.num_versions or 1}}
        elif choice == "all":
            model["model_version_policy"] = {"all": {}}
        elif choice == "specific":
            model["model_version_policy"] = {"specific": {"versions": list(policy.specific.versions)}}
        if entry.version_labels:
            model["version_labels"] = dict(entry.version_labels)
        if entry.HasField("logging_config"):
            # Only the rate: where records go is PAYLOAD_LOG_DIR / PAYLOAD_LOG_URL, not log_collector_config.
            model["payload_log_sampling_rate"] = entry.logging_config.sampling_config.sampling_rate
        models.append(model)
    if not models:
        raise FlagError("--model_config_file: model_config_list holds no config")
    return {"models": models, "default": models[0]["name"]}
