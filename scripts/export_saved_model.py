"""Export a Keras model to the SavedModel layout TensorFlow Serving loads: BASE/VERSION/.

    python scripts/export_saved_model.py --base /models/default              # the built-in model, next version
    python scripts/export_saved_model.py --model my.keras --base /models/my --version 3

The version folder appears at once, complete (exported beside it, then renamed), so a
server polling BASE (this one, or tensorflow/serving) never loads half a model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def export(model_path: str | None, base: Path, version: int | None = None) -> Path:
    import keras

    from app.core.models import available_versions, build_default_model

    model = keras.models.load_model(model_path, compile=False) if model_path else build_default_model()
    base.mkdir(parents=True, exist_ok=True)
    versions = available_versions(str(base))
    version = version or max(versions, default=0) + 1
    target = base / str(version)
    # '3' and '00000003' are the same version to a server reading BASE.
    if target.exists() or version in versions:
        raise SystemExit(f"version {version} exists already in {base}; choose another --version")
    staging = Path(tempfile.mkdtemp(prefix=f".export-{version}-", dir=base))
    try:
        model.export(str(staging / "model"), format="tf_saved_model", verbose=False)
        os.rename(staging / "model", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .keras or .h5 file; default: the built-in default model")
    parser.add_argument("--base", required=True, type=Path, help="base folder; the version is a sub-folder")
    parser.add_argument("--version", type=int, help="version number; default: one above the highest present")
    args = parser.parse_args(argv)
    print(export(args.model, args.base, args.version))


if __name__ == "__main__":
    main()
