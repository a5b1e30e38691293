"""Models with the structure of TensorFlow Serving's own test models, built here.

TF Serving's integration tests (model_servers/tensorflow_model_server_test.py) run against
SavedModels in servables/tensorflow/testdata, written by its export scripts
(saved_model_half_plus_two.py, export_counter.py, export_bad_half_plus_two.py). These
generators build models of the same structure from our own code, so the same requests can be
sent here and the answers checked against each model's own arithmetic:

- half_plus_two (TF1): a placeholder `tf_example` of serialized tf.Examples with NO shape
  (unknown rank), parsed into x and x2 (x2 defaults to 0); y = 0.5 x + 2, y2 = 0.5 x + 3,
  y3 = 0.5 x2 + 3 (a2, c2: variables of their own); signatures serving_default (x -> y),
  regress_x_to_y, regress_x_to_y2, regress_x2_to_y3, classify_x_to_y; an asset foo.txt whose
  file name a variable is assigned from in the init op (legacy_init_op, or main_op).
- half_plus_three (TF1): y = 0.5 x + 3, exported as TF 1.0 wrote it: every signature tensor
  and the placeholder declared a scalar (an empty TensorShapeProto) although it carries a
  batch, in a graph of producer version 21, parsed by TF 1.0's ParseExample op.
  tf.saved_model.load cannot load it under TF 2 (it rebuilds each signature from the declared
  scalar shapes and fails on the rank); a session can, as TF Serving's loader does. Its signatures:
  serving_default (x -> y) and tensorflow/serving/regress (tf_example -> y).
- half_plus_two_2_versions: half_plus_two in 00000123 and 00000124.
- counter (TF1): a float variable; get_counter, incr_counter, reset_counter take no input,
  incr_counter_by takes `delta` (unknown rank); all answer a scalar.
- bad_half_plus_two: a checkpoint and a MetaGraph (export.meta) but no saved_model.pb, so it
  cannot load; TF Serving answers FAILED_PRECONDITION for it.
- half_plus_two_tf2: tf.saved_model.save of a tf.Module with the same six signatures;
  serving_default and the x2 signatures take shape [1] (no batch dimension).
- tf_saved_model_save: x of unknown rank -> y = 3 * 2 * x (TensorSpec(None)).
- multiple_signatures: serving_default answers the scalar 1.0, custom_signature_key 2.0.
- tf_text_regression: y = 0.5 x + b, where b is the number of words TF Text's
  WhitespaceTokenizer finds in "half plus two", less one (2): an op TensorFlow itself lacks.
- keras_sequential, keras_sequential_mirrored (build_keras, in a process of their own): a
  Keras Sequential model of input x, shape (1,), saved by tf.saved_model.save; y = x, the
  mirrored one through a Dense layer of ones made under a two-CPU MirroredStrategy.

Every value is exact in float32 (halves and small integers), so answers compare with ==.
The tests build them (tests/tfs_models.py), and so does examples/make_models.py, from the
project's install alone: nothing here imports pytest.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

VERSION = 123


def _version_dir(base: Path, version: int = VERSION) -> Path:
    return base / f"{version:08d}"


def save_half_plus_two_tf1(path: Path, *, b: float = 2.0, c: float = 3.0, use_main_op: bool = False) -> None:
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a, b_var, c_var = _variable(0.5, "a"), _variable(b, "b"), _variable(c, "c")
        serialized = v1.placeholder(tf.string, name="tf_example")  # no shape: unknown rank
        features = v1.io.parse_example(serialized, {
            "x": v1.io.FixedLenFeature([1], tf.float32),
            "x2": v1.io.FixedLenFeature([1], tf.float32, default_value=[0.0]),
        })
        x = tf.identity(_batch_of_one(features["x"]), name="x")
        y = tf.identity(a * x + b_var, name="y")
        y2 = tf.identity(a * x + c_var, name="y2")
        x2 = tf.identity(_batch_of_one(features["x2"]), name="x2")
        a2, c2 = _variable(0.5, "a2"), _variable(c, "c2")
        y3 = tf.identity(a2 * x2 + c2, name="y3")
        init_op = _asset_init_op(path)
        session.run(v1.global_variables_initializer())
        signature = v1.saved_model.signature_def_utils.build_signature_def
        info = v1.saved_model.utils.build_tensor_info
        regress, classify = "tensorflow/serving/regress", "tensorflow/serving/classify"
        signatures = {
            "serving_default": signature({"x": info(x)}, {"y": info(y)}, "tensorflow/serving/predict"),
            "regress_x_to_y": signature({"inputs": info(serialized)}, {"outputs": info(y)}, regress),
            "regress_x_to_y2": signature({"inputs": info(serialized)}, {"outputs": info(y2)}, regress),
            "regress_x2_to_y3": signature({"inputs": info(x2)}, {"outputs": info(y3)}, regress),
            "classify_x_to_y": signature({"inputs": info(serialized)}, {"scores": info(y)}, classify),
        }
        builder = v1.saved_model.Builder(str(path))
        init = {"main_op": tf.group(v1.tables_initializer(), init_op)} if use_main_op else {"legacy_init_op": init_op}
        builder.add_meta_graph_and_variables(
            session, ["serve"], signature_def_map=signatures,
            assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS), **init)
        builder.save()


def _variable(value, name: str | None = None, **kwargs):
    """A reference variable, as TF1 made them: assign ops are tensors a signature can fetch."""
    import tensorflow as tf

    return tf.compat.v1.Variable(value, name=name, use_resource=False, **kwargs)


def _batch_of_one(tensor):
    """TF1's parse_example gave [?, 1] for an input of unknown rank; TF 2's leaves the shape unknown."""
    tensor.set_shape([None, 1])
    return tensor


def _asset_init_op(path: Path):
    """An asset file (assets/foo.txt once saved) and the op that assigns its name to a variable,
    as TF Serving's half_plus_two does: the loader must run it."""
    import tensorflow as tf

    v1 = tf.compat.v1
    source = path.parent / f".assets-{path.name}"
    source.mkdir(parents=True, exist_ok=True)
    (source / "foo.txt").write_text("asset-file-contents")
    v1.add_to_collection(v1.GraphKeys.ASSET_FILEPATHS, tf.constant(str(source / "foo.txt")))
    filename = _variable("foo.txt", "filename_tensor", trainable=False, collections=[])
    return tf.group(filename.assign("foo.txt"))


def save_half_plus_three_tf1(path: Path) -> None:
    """y = 0.5 x + 3 with signatures declared as TF 1.0 exported them: scalar shapes."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a, c = _variable(0.5, "a"), _variable(3.0, "c")
        serialized = v1.placeholder(tf.string, name="tf_example")
        # The ParseExample op of TF 1.0 (parse_example now builds ParseExampleV2).
        parsed = tf.raw_ops.ParseExample(serialized=serialized, names=tf.constant([], tf.string), sparse_keys=[],
                                         dense_keys=[tf.constant("x")], dense_defaults=[tf.constant([], tf.float32)],
                                         sparse_types=[], dense_shapes=[[1]])
        x = tf.identity(parsed.dense_values[0], name="x")
        y = tf.identity(a * x + c, name="y")
        init_op = _asset_init_op(path)
        session.run(v1.global_variables_initializer())
        signature = v1.saved_model.signature_def_utils.build_signature_def
        info = v1.saved_model.utils.build_tensor_info
        builder = v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={
            "serving_default": signature({"x": info(x)}, {"y": info(y)}, "tensorflow/serving/predict"),
            "tensorflow/serving/regress": signature({"inputs": info(serialized)}, {"outputs": info(y)},
                                                    "tensorflow/serving/regress"),
        }, assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS), legacy_init_op=init_op)
        builder.save()
    # TF 1.0 wrote an empty TensorShapeProto (a scalar) where the shape was unknown, in the
    # signatures and in the placeholder's shape attribute, in a graph of producer version 21:
    # TensorFlow's graph import still reads such a placeholder as of unknown shape.
    proto_path = path / "saved_model.pb"
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString(proto_path.read_bytes())
    meta_graph = saved_model.meta_graphs[0]
    for signature_def in meta_graph.signature_def.values():
        for tensor in [*signature_def.inputs.values(), *signature_def.outputs.values()]:
            tensor.tensor_shape.Clear()
    for node in meta_graph.graph_def.node:
        if node.op == "Placeholder":
            node.attr["shape"].shape.Clear()
    meta_graph.graph_def.versions.producer = 21
    proto_path.write_bytes(saved_model.SerializeToString())


def save_counter_tf1(path: Path) -> None:
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        counter = _variable(0.0, "counter", dtype=tf.float32)
        with tf.name_scope("incr_counter_op"):
            incr_counter = v1.assign_add(counter, 1.0)
        delta = v1.placeholder(tf.float32, name="delta")
        with tf.name_scope("incr_counter_by_op"):
            incr_counter_by = v1.assign_add(counter, delta)
        with tf.name_scope("reset_counter_op"):
            reset_counter = v1.assign(counter, 0.0)
        session.run(v1.global_variables_initializer())
        signature = v1.saved_model.signature_def_utils.build_signature_def
        info = v1.saved_model.utils.build_tensor_info
        predict = "tensorflow/serving/predict"
        builder = v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={
            "get_counter": signature({}, {"output": info(counter)}, predict),
            "incr_counter": signature({}, {"output": info(incr_counter)}, predict),
            "incr_counter_by": signature({"delta": info(delta)}, {"output": info(incr_counter_by)}, predict),
            "reset_counter": signature({}, {"output": info(reset_counter)}, predict),
        })
        builder.save()


def save_bad_half_plus_two(path: Path) -> None:
    """A TF1 checkpoint and MetaGraph without a SavedModel or any signature."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a, b = _variable(0.5), _variable(2.0)
        x = v1.placeholder(tf.float32)
        tf.add(tf.multiply(a, x), b)
        session.run(v1.global_variables_initializer())
        saver = v1.train.Saver()
        path.mkdir(parents=True, exist_ok=True)
        saver.export_meta_graph(filename=str(path / "export.meta"))
        saver.save(session, str(path / "export"), write_meta_graph=False)


def save_half_plus_two_tf2(path: Path) -> None:
    import tensorflow as tf

    source = path.parent / f".assets-{path.name}"
    source.mkdir(parents=True, exist_ok=True)
    (source / "foo.txt").write_text("asset-file-contents")
    parse_spec = {"x": tf.io.FixedLenFeature([1], tf.float32),
                  "x2": tf.io.FixedLenFeature([1], tf.float32, default_value=[0.0])}
    examples = tf.TensorSpec([None], tf.string, name="inputs")
    one = tf.TensorSpec([1], tf.float32, name="inputs")

    class HalfPlusTwo(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = tf.Variable(0.5), tf.Variable(2.0), tf.Variable(3.0)
            self.asset = tf.saved_model.Asset(str(source / "foo.txt"))

        def parse(self, serialized):
            return tf.io.parse_example(serialized, parse_spec)["x"]

        @tf.function(input_signature=[tf.TensorSpec([1], tf.float32)])
        def predict(self, x):
            return {"y": self.a * x + self.b}

        @tf.function(input_signature=[examples])
        def regress_xy(self, serialized):
            return {"outputs": self.a * self.parse(serialized) + self.b}

        @tf.function(input_signature=[examples])
        def regress_xy2(self, serialized):
            return {"outputs": self.a * self.parse(serialized) + self.c}

        @tf.function(input_signature=[one])
        def regress_x2y3(self, x2):
            return {"outputs": self.a * x2 + self.c}

        @tf.function(input_signature=[examples])
        def classify_xy(self, serialized):
            return {"scores": self.a * self.parse(serialized) + self.b}

        @tf.function(input_signature=[one])
        def classify_x2y3(self, x2):
            return {"scores": self.a * x2 + self.c}

    module = HalfPlusTwo()
    tf.saved_model.save(module, str(path), signatures={
        "serving_default": module.predict, "regress_x_to_y": module.regress_xy,
        "regress_x_to_y2": module.regress_xy2, "regress_x2_to_y3": module.regress_x2y3,
        "classify_x_to_y": module.classify_xy, "classify_x2_to_y3": module.classify_x2y3,
    })


def save_tf_saved_model_save(path: Path) -> None:
    import tensorflow as tf

    root = tf.train.Checkpoint()
    root.v1, root.v2 = tf.Variable(3.0), tf.Variable(2.0)
    root.f = tf.function(lambda x: {"y": root.v1 * root.v2 * x})
    tf.saved_model.save(root, str(path), root.f.get_concrete_function(tf.TensorSpec(None, tf.float32)))


def save_multiple_signatures(path: Path) -> None:
    import tensorflow as tf

    root = tf.train.Checkpoint()
    root.f = tf.function(lambda x: {"y": 1.0}, input_signature=[tf.TensorSpec(None, tf.float32)])
    root.g = tf.function(lambda x: {"y": 2.0}, input_signature=[tf.TensorSpec(None, tf.float32)])
    tf.saved_model.save(root, str(path), signatures={"serving_default": root.f, "custom_signature_key": root.g})


def save_tf_text_regression(path: Path) -> None:
    import tensorflow as tf
    import tensorflow_text

    class TextRegression(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.float32, name="x")])
        def serve(self, x):
            words = tensorflow_text.WhitespaceTokenizer().tokenize(tf.constant(["half plus two"]))
            return {"y": 0.5 * x + tf.cast(words.row_lengths()[0] - 1, tf.float32)}

    module = TextRegression()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def save_sequential_keras(path: Path, *, mirrored: bool = False) -> None:
    """TF Serving's test_sequential_keras_saved_model_save model (test_distrat_... when mirrored).

    Its tf.keras (Keras 2) named the saved signature's tensors after the layers, x and y; Keras 3
    names them inputs and output_0, so the signature is given here with the names Keras 2 wrote.
    """
    import keras
    import tensorflow as tf

    def build() -> keras.Model:
        model = keras.models.Sequential()
        model.add(keras.layers.Input(dtype="float32", shape=(1,), name="x"))
        if mirrored:
            model.add(keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros"))
        model.add(keras.layers.Lambda(lambda x: x, name="y"))
        return model

    if mirrored:
        with tf.distribute.MirroredStrategy(devices=("/cpu:0", "/cpu:1")).scope():
            model = build()
    else:
        model = build()
    serve = tf.function(lambda x: {"y": model(x)}, input_signature=[tf.TensorSpec([None, 1], tf.float32, name="x")])
    tf.saved_model.save(model, str(path), signatures={"serving_default": serve})


def build_keras(root: Path) -> dict[str, Path]:
    """The two Keras models under `root/<name>/<version>`. The mirrored one needs two virtual CPUs,
    which TensorFlow allows only before it first runs: call it in a fresh process (`python -m
    scripts.tfs_models ROOT`)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    bases = {name: root / name for name in ("keras_sequential", "keras_sequential_mirrored")}
    save_sequential_keras(_version_dir(bases["keras_sequential"]))
    save_sequential_keras(_version_dir(bases["keras_sequential_mirrored"]), mirrored=True)
    return bases


# Model name -> (generator, version folders) under one base folder each.
GENERATORS = {
    "half_plus_two": (save_half_plus_two_tf1, (VERSION,)),
    "half_plus_two_main_op": (lambda path: save_half_plus_two_tf1(path, use_main_op=True), (VERSION,)),
    "half_plus_three": (save_half_plus_three_tf1, (VERSION,)),
    "half_plus_two_2_versions": (save_half_plus_two_tf1, (VERSION, VERSION + 1)),
    "counter": (save_counter_tf1, (VERSION,)),
    "bad_half_plus_two": (save_bad_half_plus_two, (VERSION,)),
    "half_plus_two_tf2": (save_half_plus_two_tf2, (VERSION,)),
    "tf_saved_model_save": (save_tf_saved_model_save, (VERSION,)),
    "multiple_signatures": (save_multiple_signatures, (VERSION,)),
    "tf_text_regression": (save_tf_text_regression, (VERSION,)),
}


def build_all(root: Path) -> dict[str, Path]:
    """Every model under `root/<name>/<version>`; returns name -> base folder."""
    bases = {}
    for name, (generate, versions) in GENERATORS.items():
        bases[name] = root / name
        for version in versions:
            generate(_version_dir(root / name, version))
    for leftover in root.glob("*/.assets-*"):  # the assets' sources: copied into each export
        for file in leftover.iterdir():
            file.unlink()
        os.rmdir(leftover)
    return bases


if __name__ == "__main__":
    build_keras(Path(sys.argv[1]))
