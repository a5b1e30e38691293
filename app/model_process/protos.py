"""TensorFlow's protocol buffer modules, without TensorFlow's runtime, for a worker of MODEL_PROCESSES.

TF Serving's API protos (tensorflow_serving.apis) import TensorFlow's own (tensor_pb2,
example_pb2, ...), which live inside the `tensorflow` package: importing them runs
`tensorflow/__init__.py`, which loads the whole runtime (hundreds of MB and seconds per
worker) that a worker in this mode never uses. A bare package module in its place, with
the real package's folder as its path, lets those pure-Python modules load alone.

Only for a worker whose models run elsewhere: after this, `import tensorflow` gives the bare
package, with no ops at all.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def without_tensorflow() -> bool:
    """Install the bare package, unless TensorFlow is imported already; True if installed."""
    if "tensorflow" in sys.modules:
        return False
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return False  # not installed: nothing imports its protos either
    package = types.ModuleType("tensorflow", "TensorFlow's folder, for its protocol buffer modules only")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["tensorflow"] = package
    return True
