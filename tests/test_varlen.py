"""Variable-length inputs: padding, length buckets, cutting outputs back, and the safety check.

The engine tests use a fake model that masks zeros, gated by events so that what a batch
holds is decided, not timed. The TensorFlow tests build a small text classifier from seeds
(Embedding with mask_zero feeding masked pooling), and a live server serves it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import grpc
import numpy as np
import pytest
import requests

from app.core.batching import Batcher, BatchObserver
from app.core.batching.rows import Padding, batch_key, join_padded
from app.core.call import Call
from app.core.errors import InvalidInput
from app.ops.settings import ModelConfig, Settings, SettingsError, model_configs
from scripts.text_model import build_text_model, token_rows

WAIT_S = 10  # upper bound for events that should come at once; never reached when passing


class MaskingFake:
    """A fake text model that masks zeros: per-token running sums, and the sum of the tokens."""

    def __init__(self) -> None:
        self.calls: list[np.ndarray] = []
        self._hold: tuple[threading.Event, threading.Event] | None = None

    def hold(self) -> tuple[threading.Event, threading.Event]:
        self._hold = (threading.Event(), threading.Event())
        return self._hold

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["ids"]
        self.calls.append(ids.copy())
        if self._hold is not None:
            started, release = self._hold
            self._hold = None
            started.set()
            assert release.wait(WAIT_S)
        return {"tokens": np.cumsum(ids, axis=1).astype("float32"),
                "total": ids.sum(axis=1, keepdims=True).astype("float32"),
                "classes": np.zeros((len(ids), 5), "float32")}


def ids(length: int, rows: int = 1, start: int = 1) -> dict[str, np.ndarray]:
    return {"ids": (np.arange(rows * length).reshape(rows, length) % 9 + start).astype("int32")}


def alone(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return MaskingFake()(inputs)


TEXT_PADDING = Padding(inputs={"ids": (0,)}, outputs={"tokens": (0,), "classes": (0,)})


def held_batcher(model: MaskingFake, padding: Padding | None, **kwargs):
    """A batcher whose model is busy with a first request until release is set."""
    batcher = Batcher(model, max_batch_size=8, padding=padding, **kwargs)
    started, release = model.hold()
    first = batcher.submit(Call(), ids(1))
    assert started.wait(WAIT_S)
    return batcher, first, release


def test_rows_of_different_lengths_share_one_call_and_get_their_own_answers():
    model = MaskingFake()
    batcher, first, release = held_batcher(model, TEXT_PADDING)
    lengths = [3, 7, 2, 5]
    futures = [batcher.submit(Call(), ids(n)) for n in lengths]
    release.set()
    for n, future in zip(lengths, futures, strict=True):
        result = future.result(WAIT_S)
        assert result.batch_requests == 4
        want = alone(ids(n))
        assert set(result.outputs) == set(want)
        for name in want:
            np.testing.assert_array_equal(result.outputs[name], want[name])
    first.result(WAIT_S)
    batcher.close()
    # The held call, then one call of 4 rows padded to the longest, 7, with zeros.
    assert [call.shape for call in model.calls] == [(1, 1), (4, 7)]
    np.testing.assert_array_equal(model.calls[1][2], [1, 2, 0, 0, 0, 0, 0])


EMPTY_REFUSED = "input 'ids' has shape [2, 0]: its dimension 1 is variable-length and must hold at least one element"


def test_an_empty_sequence_is_refused_alone_and_in_company_before_it_is_queued():
    model = MaskingFake()
    batcher = Batcher(model, max_batch_size=8, padding=TEXT_PADDING)
    with pytest.raises(InvalidInput) as alone_refused:
        batcher.submit(Call(), ids(0, rows=2))
    started, release = model.hold()
    first = batcher.submit(Call(), ids(1))
    assert started.wait(WAIT_S)
    company = batcher.submit(Call(), ids(3))
    with pytest.raises(InvalidInput) as refused_in_company:
        batcher.submit(Call(), ids(0, rows=2))
    release.set()
    np.testing.assert_array_equal(company.result(WAIT_S).outputs["total"], alone(ids(3))["total"])
    first.result(WAIT_S)
    batcher.close()
    assert str(alone_refused.value) == str(refused_in_company.value) == EMPTY_REFUSED
    assert [call.shape for call in model.calls] == [(1, 1), (1, 3)]


def test_without_padding_each_length_waits_for_its_own_call():
    model = MaskingFake()
    batcher, first, release = held_batcher(model, None)
    futures = [batcher.submit(Call(), ids(n)) for n in (3, 7, 3)]
    release.set()
    assert [future.result(WAIT_S).batch_requests for future in futures] == [2, 1, 2]
    batcher.close()
    assert [call.shape for call in model.calls] == [(1, 1), (2, 3), (1, 7)]


def test_length_buckets_group_similar_lengths_oldest_group_first():
    model = MaskingFake()
    padding = Padding(inputs={"ids": (0,)}, outputs={"tokens": (0,)}, length_buckets=(4, 8))
    batcher, first, release = held_batcher(model, padding)
    lengths = [6, 2, 30, 3, 8, 4]
    futures = [batcher.submit(Call(), ids(n)) for n in lengths]
    release.set()
    for n, future in zip(lengths, futures, strict=True):
        np.testing.assert_array_equal(future.result(WAIT_S).outputs["tokens"], alone(ids(n))["tokens"])
    batcher.close()
    # The held request (length 1) was padded to its bucket, 4. Then bucket 8 (its oldest came
    # first), then bucket 4 (three rows, padded to a batch bucket of 4); 30 is past the largest
    # bucket: its own length, unpadded.
    assert [call.shape for call in model.calls] == [(1, 4), (2, 8), (4, 4), (1, 30)]


def test_a_request_split_across_batches_joins_its_rows_at_its_own_length():
    model = MaskingFake()
    batcher, first, release = held_batcher(model, TEXT_PADDING)
    long = batcher.submit(Call(), ids(9))
    split = batcher.submit(Call(), ids(4, rows=12))
    release.set()
    np.testing.assert_array_equal(long.result(WAIT_S).outputs["tokens"], alone(ids(9))["tokens"])
    got = split.result(WAIT_S).outputs
    for name, want in alone(ids(4, rows=12)).items():
        np.testing.assert_array_equal(got[name], want)
    batcher.close()
    assert [call.shape for call in model.calls] == [(1, 1), (8, 9), (8, 4)]


def test_pad_value_and_strings():
    padding = Padding(inputs={"ids": (0,), "words": (1,)}, value=-1)
    inputs, cut = join_padded([({"ids": np.array([[5, 6]]), "words": np.array([[[b"a", b"b"]]], dtype=object)}, 0, 1),
                               ({"ids": np.array([[7, 8, 9]]), "words": np.array([[[b"c", b"d", b"e"]]], dtype=object)},
                                0, 1)], padding)
    np.testing.assert_array_equal(inputs["ids"], [[5, 6, -1], [7, 8, 9]])
    assert inputs["words"].tolist() == [[[b"a", b"b", b""]], [[b"c", b"d", b"e"]]]
    assert cut.own == [{("ids", 0): 2, ("words", 1): 2}, {("ids", 0): 3, ("words", 1): 3}]


def test_only_outputs_that_follow_the_padded_length_are_cut():
    padding = Padding(inputs={"ids": (0,)}, outputs={"tokens": (0,), "classes": (0,)})
    _inputs, cut = join_padded([(ids(2), 0, 1), (ids(4), 0, 1)], padding)
    outputs = {"tokens": np.zeros((1, 4)), "classes": np.zeros((1, 5)), "fixed": np.zeros((1, 4))}
    got = cut.cut(0, outputs)
    # tokens follows the length (4 = the padded length); classes is None but 5 long; fixed is declared.
    assert {name: arr.shape for name, arr in got.items()} == {"tokens": (1, 2), "classes": (1, 5), "fixed": (1, 4)}


def test_batch_keys_compare_buckets_only_where_padding_allows():
    buckets = Padding(inputs={"ids": (0,)}, length_buckets=(4, 8))
    assert batch_key(ids(3), buckets) == batch_key(ids(4), buckets) != batch_key(ids(5), buckets)
    assert batch_key(ids(3), TEXT_PADDING) == batch_key(ids(40), TEXT_PADDING)
    assert batch_key(ids(3)) != batch_key(ids(4))
    # Another dtype or rank never shares, padded or not.
    assert batch_key({"ids": ids(3)["ids"].astype("int64")}, TEXT_PADDING) != batch_key(ids(3), TEXT_PADDING)
    assert batch_key({"ids": np.ones((1, 3, 1), "int32")}, TEXT_PADDING) != batch_key(ids(3), TEXT_PADDING)


class WasteRecorder(BatchObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def length_padding(self, *, real_elements: int, padded_elements: int) -> None:
        self.calls.append((real_elements, padded_elements))


def test_padding_waste_is_reported_per_call():
    model = MaskingFake()
    recorder = WasteRecorder()
    batcher, first, release = held_batcher(model, TEXT_PADDING, observer=recorder)
    futures = [batcher.submit(Call(), ids(n)) for n in (2, 6, 4)]
    release.set()
    for future in futures:
        future.result(WAIT_S)
    batcher.close()
    # The held call: 1 element, none added; then 2 + 6 + 4 = 12 real, 4 + 0 + 2 = 6 added
    # (the fourth row that fills the batch bucket of 4 is counted as a padded row, not here).
    assert recorder.calls == [(1, 0), (12, 6)]


# -- settings -------------------------------------------------------------------------


def test_settings_parse_padding_and_length_buckets(tmp_path):
    settings = Settings.from_env({"PAD_VARIABLE_LENGTH": "true", "PAD_VALUE": "-1", "LENGTH_BUCKETS": "16, 32,64"})
    assert (settings.pad_variable_length, settings.pad_value, settings.length_buckets) == (True, -1.0, (16, 32, 64))
    assert Settings.from_env({}).pad_variable_length is False
    assert Settings.from_env({}).length_buckets == ()
    for bad in ("32,16", "0,8", "8,8", "a"):
        with pytest.raises(SettingsError, match="LENGTH_BUCKETS"):
            Settings.from_env({"LENGTH_BUCKETS": bad})
    config_path = tmp_path / "models.json"
    config_path.write_text('{"models": [{"name": "text", "pad_variable_length": true, "length_buckets": [8, 16]},'
                           ' {"name": "other"}]}')
    text, other = model_configs(Settings.from_env({"MODEL_CONFIG": str(config_path), "PAD_VALUE": "3"}))
    assert (text.pad_variable_length, text.pad_value, text.length_buckets) == (True, 3.0, (8, 16))
    assert (other.pad_variable_length, other.length_buckets) == (False, ())


# -- TensorFlow: a masking text classifier built from seeds ----------------------------

@pytest.fixture(scope="module")
def text_model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.keras"
    build_text_model().save(path)
    return path


def padded_config(**kwargs) -> ModelConfig:
    return ModelConfig("text", None, max_batch_size=8, batch_timeout_ms=0, max_queue_rows=64,
                       pad_variable_length=True, **kwargs)


def test_start_up_check_accepts_a_masking_model_and_refuses_one_that_does_not_mask(tmp_path, caplog):
    from app.core import models, padding

    masking = models._from_keras(build_text_model(), name="text", version=1, source="test", method="function")
    plain = models._from_keras(build_text_model(mask=False), name="plain", version=1, source="test",
                               method="function")
    config = padded_config(length_buckets=(8, 32))
    assert padding.model_paddings(masking, config) == {"serving_default": Padding(
        inputs={"tokens": (0,)}, outputs={"token_scores": (0,)}, value=0.0, length_buckets=(8, 32))}
    with caplog.at_level(logging.ERROR, logger="app.core.padding"):
        assert padding.model_paddings(plain, config) == {"serving_default": None}
    message, = [record.getMessage() for record in caplog.records]
    assert "model 'plain' v1, signature 'serving_default': variable-length padding refused" in message
    assert "output 'scores' differs by up to" in message and "padded from 3 to 32" in message
    # Off unless asked for, and nothing to pad in a signature without a None dimension.
    assert padding.model_paddings(masking, ModelConfig("text", None, max_batch_size=8, batch_timeout_ms=0,
                                                       max_queue_rows=64)) == {"serving_default": None}


def test_warm_up_covers_every_batch_and_length_bucket_so_nothing_is_new_under_load():
    from app.core import models, padding

    model = models._from_keras(build_text_model(), name="text", version=1, source="test", method="function")
    config = padded_config(length_buckets=(8, 16, 32))
    seen: list[tuple[int, ...]] = []
    signature = model.signatures["serving_default"]
    real_predict = signature.predict

    def recording(batch):
        seen.append(batch["tokens"].shape)
        return real_predict(batch)

    signature.predict = model.predict = recording
    buckets = (1, 2, 4, 8)
    models.warm_up(model, buckets, padding.warm_lengths(config))
    warmed = set(seen)
    assert {(rows, length) for rows in buckets for length in (8, 16, 32)} <= warmed
    # The start-up check runs at start too (its shapes need no warming: nothing waits on them).
    text_padding = padding.model_paddings(model, config)["serving_default"]
    traces = model.tracing_count()
    seen.clear()
    batcher = Batcher(recording, max_batch_size=8, buckets=buckets, padding=text_padding)
    rng = np.random.default_rng(5)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        lengths = rng.integers(1, 33, 64)
        results = list(pool.map(lambda n: batcher.predict(Call.within(60), {"tokens": token_rows(int(n), int(n))}),
                                lengths))
    batcher.close()
    assert all(result.outputs["token_scores"].shape == (1, n, 2) for result, n in zip(results, lengths, strict=True))
    assert set(seen) <= warmed, sorted(set(seen) - warmed)
    assert model.tracing_count() == traces == 1


def test_padded_to_the_longest_with_real_tensorflow_equals_each_request_alone():
    from app.core import models, padding

    keras_model = build_text_model()
    model = models._from_keras(keras_model, name="text", version=1, source="test", method="function")
    batcher = Batcher(model.predict, max_batch_size=8,
                      padding=padding.model_paddings(model, padded_config())["serving_default"])
    rows = [token_rows(n, seed=n, rows=1 + n % 2) for n in (1, 5, 17, 3, 64, 9, 2, 33)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: batcher.predict(Call.within(60), {"tokens": r}), rows))
    batcher.close()
    for row, result in zip(rows, results, strict=True):
        want = keras_model(row, training=False)
        np.testing.assert_allclose(result.outputs["scores"], want["scores"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result.outputs["token_scores"], want["token_scores"], rtol=1e-5, atol=1e-6)


def test_live_server_batches_mixed_lengths_and_answers_each_as_if_alone(start_server, text_model_path):
    import keras

    server = start_server({"MODEL_PATH": str(text_model_path), "PAD_VARIABLE_LENGTH": "true",
                           "LENGTH_BUCKETS": "8,16,32", "MAX_BATCH_SIZE": "16", "BATCH_TIMEOUT_MS": "1000"})
    ready = requests.get(server.url + "/readyz", timeout=30).json()
    assert ready["models"]["default"]["padded_signatures"] == ["serving_default"]
    assert "warmed for batch sizes [1, 2, 4, 8, 16] and lengths [8, 16, 32]" in server.log()
    model = keras.models.load_model(text_model_path, compile=False)
    lengths = [int(n) for n in np.random.default_rng(3).integers(1, 41, 24)]

    def ask(index_length):
        index, length = index_length
        row = token_rows(length, seed=index)
        response = requests.post(server.url + "/v1/models/default:predict", json={"instances": row.tolist()},
                                 timeout=60)
        return row, response

    def ask_empty(rows):
        tensor = {"name": "tokens", "datatype": "INT32", "shape": [rows, 0], "data": []}
        return requests.post(server.url + "/v2/models/default/infer", json={"inputs": [tensor]}, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        # Empty sequences in the same window as the others (BATCH_TIMEOUT_MS), and alone after.
        empties = [pool.submit(ask_empty, rows) for rows in (1, 2)]
        answers = list(pool.map(ask, enumerate(lengths)))
    # Over gRPC (v2) as INVALID_ARGUMENT, in the same words.
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="default", raw_input_contents=[b""])
    request.inputs.add(name="tokens", datatype="INT32", shape=[2, 0])
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError) as raised:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, (
        "input 'tokens' has shape [2, 0]: its dimension 1 is variable-length and must hold at least one element"))
    # TF Serving's REST API too (which answers "got a fractional number" for [[]]).
    tf_serving = requests.post(server.url + "/v1/models/default:predict", json={"instances": [[]]}, timeout=60)
    for rows, refused in zip((1, 2, 1, 2, 1), [future.result() for future in empties] + [ask_empty(1), ask_empty(2),
                                                                                        tf_serving], strict=True):
        assert refused.status_code == 400, refused.text
        assert refused.json() == {"error": f"input 'tokens' has shape [{rows}, 0]: its dimension 1 is "
                                           "variable-length and must hold at least one element"}
    shared = 0
    for row, response in answers:
        assert response.status_code == 200, response.text
        prediction, = response.json()["predictions"]
        want = model(row, training=False)
        np.testing.assert_allclose(prediction["scores"], want["scores"][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(prediction["token_scores"], want["token_scores"][0], rtol=1e-5, atol=1e-6)
        shared += int(response.headers["X-Batch-Requests"]) > 1
    assert shared > 0
    calls = server.metric("model_server_batch_size_requests_count")
    assert calls < len(lengths)  # warm-up calls are not counted: the requests shared calls
    assert server.metric("model_server_length_padding_padded_elements_total") > 0
    real = server.metric("model_server_length_padding_real_elements_total")
    assert real == sum(lengths)
