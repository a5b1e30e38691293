"""Handlers in-process (app/core/handlers.py): how one is named and loaded, the contract's checks,
where its settings come from, the batch key in the engine and the call's frame, and the
repository's refusal. tests/test_handler_server.py serves the examples on a live server.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.core import handlers
from app.core.batching import Batcher
from app.core.call import Call, Exchange
from app.core.errors import HandlerFailed, InvalidInput
from app.core.models import ModelLoadError, Signature, TensorInfo
from app.ops.settings import RELOAD, ModelConfig, Settings, SettingsError, configs_from_document, model_configs
from tests.conftest import REPO
from tests.test_batching import WAIT_S, FakeModel, occupy, rows

TEXT = "examples.text_classifier.handler"


class ObjectHandler:
    """A handler as an object: `module:object`."""

    signature = {"inputs": {"x": {"dtype": "float32", "shape": [2]}}, "outputs": {"y": {"dtype": "float32",
                                                                                        "shape": [2]}}}

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def preprocess(self, inputs, parameters):
        return {"x": inputs["x"] * self.scale}


SCALED = ObjectHandler(3.0)


def test_a_handler_is_named_by_a_module_an_object_in_one_or_a_file(tmp_path):
    module = handlers.load(TEXT)
    assert [spec.name for spec in module.signature.inputs] == ["text"]
    assert module.batch_key({}, {"temperature": 0.5}) == 0.5
    by_object = handlers.load("tests.test_handlers:SCALED")
    assert by_object.preprocess({"x": np.ones(2)}, {})["x"].tolist() == [3.0, 3.0]
    assert by_object.postprocess is None and by_object.batch_key is None
    (tmp_path / "helper.py").write_text("LABEL = 'from beside it'\n")
    (tmp_path / "mine.py").write_text("from helper import LABEL\n\ndef batch_key(inputs, parameters):\n"
                                      "    return LABEL\n")
    by_file = handlers.load(str(tmp_path / "mine.py"))
    assert by_file.batch_key({}, {}) == "from beside it"
    assert by_file.signature is None  # the model's own signature stays public


@pytest.mark.parametrize("source, message", [
    ("x = 1\n", "defines none of signature, preprocess, postprocess, batch_key, custom_objects"),
    ("def preprocess(inputs, parameters):\n    return inputs\n",
     "preprocess and postprocess change what clients send and get: declare it in `signature`"),
    ("batch_key = 3\n", "batch_key must be a function"),
    ("signature = {'inputs': {'x': {'dtype': 'float33', 'shape': []}}, 'outputs': {'y': {'dtype': 'bytes', "
     "'shape': []}}}\n", "signature['inputs']['x']: expected {'dtype': one of"),
    ("signature = {'inputs': {'x': {'dtype': 'bytes', 'shape': [-1]}}, 'outputs': {}}\n",
     "signature['inputs']['x']: expected"),
    ("signature = {'inputs': {'x': {'dtype': 'bytes', 'shape': []}}}\n",
     "signature['outputs'] must be a non-empty dict"),
    ("import no_such_module_56\n", "cannot be imported: ModuleNotFoundError: No module named 'no_such_module_56'"),
])
def test_a_handler_that_breaks_the_contract_is_refused_when_it_loads(tmp_path, source, message):
    path = tmp_path / f"broken_{abs(hash(source))}.py"
    path.write_text(source)
    with pytest.raises(ModelLoadError) as refused:
        handlers.load(str(path))
    assert message in str(refused.value)
    assert str(path) in str(refused.value)


def test_custom_objects_may_not_take_a_name_another_object_holds_in_keras():
    import keras

    @keras.saving.register_keras_serializable(package="handler_test")
    class Taken(keras.layers.Layer):
        pass

    class Other(keras.layers.Layer):
        pass

    same = handlers.Handler("same", None, custom_objects=lambda: {"handler_test>Taken": Taken})
    assert handlers.custom_objects(same) == {"handler_test>Taken": Taken}
    other = handlers.Handler("other", None, custom_objects=lambda: {"handler_test>Taken": Other})
    with pytest.raises(ModelLoadError, match="custom object 'handler_test>Taken' is registered in this process for "
                                             "another object"):
        handlers.custom_objects(other)


def test_a_worker_of_model_processes_refuses_a_handler_that_imports_keras(tmp_path):
    # A fresh interpreter, as a worker's: Keras not imported. A stand-in `keras` module makes it quick.
    (tmp_path / "keras.py").write_text("")
    (tmp_path / "eager.py").write_text("import keras  # noqa\n\ndef batch_key(inputs, parameters):\n    return 1\n")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from app.core import handlers\n"
              "try:\n    handlers.load('eager', without_keras=True)\nexcept Exception as exc:\n    print(exc)\n"
              "handlers.load('eager')\nprint('loaded where Keras may be')\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.splitlines() == [
        "handler 'eager' imports Keras: with MODEL_PROCESSES its module is imported by workers, which run no model; "
        "import Keras inside custom_objects()", "loaded where Keras may be"]


# -- the contract on the request's thread -------------------------------------------------------


def bound(**functions) -> tuple[handlers.Handled, Signature]:
    """A handler of `functions` over a model of one float32 input `x` of 2 and one int32 `n`."""
    public = handlers.public_signature({"inputs": {"text": {"dtype": "bytes", "shape": []}},
                                        "outputs": {"y": {"dtype": "float32", "shape": [2]}}}, "test")
    model = Signature("serving_default", "tensorflow/serving/predict",
                      [TensorInfo("x", (2,), np.dtype("float32"), "DT_FLOAT"),
                       TensorInfo("n", (), np.dtype("int32"), "DT_INT32")],
                      [TensorInfo("y", (2,), np.dtype("float32"), "DT_FLOAT")], lambda batch: batch)
    handler = handlers.Handler("test", public, **functions)
    return handlers.Handled(handler, {"serving_default": model}), public


CALL = Call(exchange=Exchange("request-56"), parameters={"p": 1})
TEXTS = {"text": np.array([b"a", b"b"], dtype=object)}


def test_preprocess_results_are_cast_by_same_kind_and_checked_for_rows_and_shapes():
    handled, public = bound(preprocess=lambda inputs, parameters: {"x": np.ones((2, 2)), "n": [1, 2]})
    made, key = handlers.stage(handled, CALL, public, TEXTS, 2)
    assert (made["x"].dtype, made["n"].dtype, key) == (np.float32, np.int32, None)

    def refused(result, message):
        handled, public = bound(preprocess=lambda inputs, parameters: result)
        with pytest.raises(HandlerFailed) as failed:
            handlers.stage(handled, CALL, public, TEXTS, 2)
        assert failed.value.message == f"handler preprocess {message} (request id request-56)"
        assert failed.value.status_code == 500

    refused({"x": np.ones((2, 2))}, "returned ['x']; expected ['n', 'x']")
    refused({"x": np.ones((2, 2)), "n": [1.5, 2.5]}, "returned 'n' as float64; it is int32")
    refused({"x": np.ones((2, 2)), "n": [1, 2, 3]}, "returned 'n' of shape [3]; expected 2 rows of []")
    refused({"x": np.ones((2, 3)), "n": [1, 2]}, "returned 'x' of shape [2, 3]; expected 2 rows of [2]")
    refused([1, 2], "returned list; expected ['n', 'x']")


def test_a_value_error_is_the_clients_and_any_other_exception_the_handlers(caplog):
    def bad(inputs, parameters):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    handled, public = bound(preprocess=bad)
    with pytest.raises(InvalidInput, match="^preprocess: 'utf-8' codec can't decode byte 0xff"):
        handlers.stage(handled, CALL, public, TEXTS, 2)
    assert not caplog.records  # the client's error: nothing logged

    handled, public = bound(postprocess=lambda outputs, inputs, parameters: outputs["missing"])
    with pytest.raises(HandlerFailed) as failed:
        handlers.finish(handled, CALL, public, TEXTS, {"y": np.ones((2, 2), np.float32)}, 2)
    assert failed.value.message == "handler postprocess raised KeyError: 'missing' (request id request-56)"
    [record] = caplog.records
    assert record.getMessage() == "handler test: postprocess raised, model None, request_id=request-56"
    assert record.exc_info is not None  # its traceback, once


@pytest.mark.parametrize("key, group", [
    (0.5, 0.5), (np.float32(0.5), 0.5), ([512, 512, "steps", None, True], (512, 512, "steps", None, True)),
    ((np.int64(3),), (3,)), (None, None),
])
def test_a_batch_key_is_kept_as_json_values(key, group):
    handled, public = bound(batch_key=lambda inputs, parameters: key)
    assert handlers.stage(handled, CALL, public, TEXTS, 2)[1] == group


@pytest.mark.parametrize("key", [math.nan, {"a": 1}, [[1]], object()])
def test_a_batch_key_that_cannot_compare_equal_across_processes_is_refused(key):
    handled, public = bound(batch_key=lambda inputs, parameters: key)
    with pytest.raises(HandlerFailed, match="^handler batch_key returned"):
        handlers.stage(handled, CALL, public, TEXTS, 2)


def test_the_batch_group_crosses_to_a_model_process_in_the_calls_frame():
    frame = json.loads(json.dumps(Call(group=(512, "steps", 0.5)).frame()))
    assert Call.from_frame(frame, signature="serving_default").group == (512, "steps", 0.5)
    assert Call.from_frame(json.loads(json.dumps(Call().frame())), signature="").group is None


def test_rows_of_another_group_never_share_a_call():
    fake = FakeModel()
    batcher = Batcher(fake, max_batch_size=8)
    try:
        first, release = occupy(batcher, fake)
        futures = [batcher.submit(Call(group=group), rows(value)) for value, group in
                   [(1.0, "a"), (2.0, "b"), (3.0, "a"), (4.0, None), (5.0, ("b",)), (6.0, "b")]]
        release.set()
        for future, value in zip(futures, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], strict=True):
            np.testing.assert_array_equal(future.result(WAIT_S).outputs["y"], rows(10 * value)["x"])
        # The oldest group first, then the next: "b" and ("b",) are two keys.
        assert [call["x"][:, 0].tolist() for call in fake.calls[1:]] == [[1.0, 3.0], [2.0, 6.0], [4.0], [5.0]]
    finally:
        batcher.close(drain=False, timeout_s=WAIT_S)


# -- settings: only the operator names a handler --------------------------------------------------


def test_model_handler_names_the_single_models_and_is_refused_beside_a_config(tmp_path):
    [config] = model_configs(Settings(model_path="m.keras", model_handler=TEXT))
    assert config.handler == TEXT
    with pytest.raises(SettingsError, match="MODEL_HANDLER='x' names the handler of MODEL_PATH's model; with "
                                            "MODEL_CONFIG, name it in the model's entry"):
        Settings(model_config=str(tmp_path / "c.json"), model_handler="x")
    with pytest.raises(SettingsError, match="MODEL_REPOSITORY_HANDLERS=true imports handler.py from "
                                            "MODEL_REPOSITORY's folders: set MODEL_REPOSITORY"):
        Settings(model_repository_handlers=True)
    with pytest.raises(SettingsError, match="MODEL_HANDLER='a b' is not valid"):
        Settings.from_env({"MODEL_HANDLER": "a b"})


def test_a_reload_cannot_name_a_handler_and_keeps_the_operators(tmp_path):
    file = tmp_path / "models.json"
    file.write_text(json.dumps({"models": [{"name": "a", "path": "a.keras", "handler": TEXT},
                                           {"name": "b", "path": "b.keras"}]}))
    settings = Settings(model_config=str(file))
    assert [config.handler for config in model_configs(settings)] == [TEXT, None]
    with pytest.raises(SettingsError, match=r"models\[0\].handler: a handler is named only by MODEL_HANDLER or "
                                            "the MODEL_CONFIG file"):
        configs_from_document({"models": [{"name": "a", "path": "a.keras", "handler": "os:system"}]}, settings,
                              RELOAD)
    # Bound by name and path: the same model keeps its handler; another path or name gets none.
    reloaded = configs_from_document({"models": [{"name": "a", "path": str(Path("a.keras").resolve())},
                                                 {"name": "b", "path": "a.keras"},
                                                 {"name": "a2", "path": "a.keras"}]}, settings, RELOAD)
    assert [(config.name, config.handler) for config in reloaded] == [("a", TEXT), ("b", None), ("a2", None)]


def test_a_repository_folders_handler_is_bound_only_with_the_setting(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "handler.py").write_text("")
    document = {"models": [{"name": "m", "path": str(tmp_path / "m")}]}
    allowed = Settings(model_repository=str(tmp_path), model_repository_handlers=True)
    [config] = configs_from_document(document, allowed, RELOAD)
    assert config.handler == str(tmp_path / "m" / "handler.py")
    [config] = configs_from_document(document, Settings(model_repository=str(tmp_path)), RELOAD)
    assert config.handler is None


def test_a_repository_load_of_a_folder_with_a_handler_is_refused_without_the_setting(
        tmp_path, in_process_app, exact_model_path):
    marker = tmp_path / "imported"
    (tmp_path / "repository" / "coded" / "1").mkdir(parents=True)
    (tmp_path / "repository" / "coded" / "handler.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    app = in_process_app(model_path=str(exact_model_path), model_repository=str(tmp_path / "repository"),
                         model_control_mode="explicit")
    answer = app.test_client().post("/v2/repository/models/coded/load", json={})
    assert (answer.status_code, answer.get_json()) == (400, {"error": (
        "failed to load 'coded': its folder holds handler.py, which is code; set MODEL_REPOSITORY_HANDLERS=true "
        "to import it")})
    assert not marker.exists()


def test_a_served_models_handler_does_not_change_live(tmp_path):
    from app.core.registry import LiveConfig, ModelRegistry
    from app.ops.metrics import Metrics

    (tmp_path / "1").mkdir()  # a base folder of versions: what may change live
    config = ModelConfig("a", str(tmp_path), 8, 0.0, 16, handler=TEXT)
    live = LiveConfig(ModelRegistry("a"), Settings(), Metrics())
    with pytest.raises(ModelLoadError, match="to change its path or its handler"):
        live._change(config, ModelConfig("a", str(tmp_path), 8, 0.0, 16, handler="tests.handler_faults"))
