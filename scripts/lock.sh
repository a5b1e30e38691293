#!/usr/bin/env bash
# Regenerate the fully pinned lock files from the top-level requirements, with uv's
# pip-compile (uv is pinned in requirements-dev.txt). Run it after changing any
# requirements*.txt, and commit the *.lock files it writes:
#
#   bash scripts/lock.sh
#
# Locks are for the image and CI: Linux x86_64 (manylinux_2_28), Python 3.11.
#   requirements-cpu.lock       the server, TensorFlow's CPU build        (Dockerfile cpu)
#   requirements-gpu.lock       the server, tensorflow[and-cuda]          (Dockerfile gpu)
#   requirements-dev.lock       the server (CPU) and the test tools       (.ci/run)
#   requirements-loadtest.lock  Locust and what locustfile.py imports    (Dockerfile loadtest)
#   requirements-kserve.lock    the KServe SDK's v2 client, its own venv  (.ci/run)
#   requirements-pytriton.lock  PyTriton, its own venv (python -m scripts.benchmark.peers; not CI)
#   requirements-litserve.lock  LitServe, its own venv (python -m scripts.benchmark handler; not CI)
# requirements-nodeps.txt is not locked: tensorflow-serving-api declares the full `tensorflow`
# as a dependency, which would shadow tensorflow-cpu, so it is installed with --no-deps after
# a lock; what it imports (grpcio, protobuf) is in the locks. requirements-tensorflow-cuda.txt
# and requirements-jax.txt are exact pins for venvs beside the project's (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

uv=${UV:-uv}
command -v "$uv" >/dev/null || uv=.venv/bin/uv
compile() {
    "$uv" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
        --no-header --annotation-style split "$@"
}

compile requirements.txt -o requirements-cpu.lock
compile requirements-dev.txt -o requirements-dev.lock
compile requirements-loadtest.txt -o requirements-loadtest.lock
compile requirements-kserve.txt -o requirements-kserve.lock
compile requirements-litserve.txt -o requirements-litserve.lock
# PyTriton's wheels (a tritonserver binary inside) are manylinux_2_35: glibc 2.35 or newer.
"$uv" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_35 \
    --no-header --annotation-style split requirements-pytriton.txt -o requirements-pytriton.lock
# The GPU server: requirements.txt with tensorflow[and-cuda] of the same version in place of
# its CPU TensorFlow.
tf_version=$(sed -n 's/^tensorflow-cpu==\([0-9.]*\).*/\1/p' requirements.txt)
gpu_input=$(mktemp --suffix=.txt)
trap 'rm -f "$gpu_input"' EXIT
{ grep -v '^tensorflow' requirements.txt; echo "tensorflow[and-cuda]==$tf_version"; } > "$gpu_input"
compile "$gpu_input" -o requirements-gpu.lock
# The temporary input's name would otherwise appear in the annotations.
sed -i "s#$gpu_input#requirements.txt (tensorflow[and-cuda] for tensorflow-cpu)#" requirements-gpu.lock
