# The model server's image.
#
#   CPU (the default target):  docker build -t model-server:1.0.0 .
#   GPU:                       docker build --target gpu -t model-server:1.0.0-gpu .
#   Load tests:                docker build --target loadtest -t model-server:1.0.0-loadtest .
#
# Every Python package comes from a lock file that pins the whole tree (scripts/lock.sh
# writes them from the requirements*.txt files), so a rebuild next month is the same server.
# Requirements are installed in a layer of their own, before the code is copied, so that a
# code change does not reinstall TensorFlow. BuildKit builds only the stages a target needs.

FROM python:3.11-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# A numeric id, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app app
WORKDIR /srv/model-server
# How every target below runs, unless it says otherwise: HTTP, and gRPC (GRPC_BIND).
EXPOSE 8000 8500
# Liveness only (/readyz also fails while a model loads, no reason to restart); the port
# follows BIND. A worker answers /healthz once its model is loaded and warm, and during the
# start period the check runs every 2 s, so compose's service_healthy dependants start then.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --start-interval=2s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('BIND', '0.0.0.0:8000').rpartition(':')[2]; urllib.request.urlopen('http://127.0.0.1:' + port + '/healthz', timeout=4)"]
CMD ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]

# tensorflow-serving-api declares the full `tensorflow` as a dependency, which would shadow
# tensorflow-cpu: it is installed without dependencies; what it imports is in the lock.
FROM base AS deps-cpu
COPY requirements-cpu.lock requirements-nodeps.txt ./
RUN pip install --no-cache-dir -r requirements-cpu.lock \
    && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt

# tensorflow[and-cuda] brings CUDA and cuDNN as wheels: the host needs only the NVIDIA
# driver and container toolkit. Same pins as the CPU lock, TensorFlow's GPU build in its place.
FROM base AS gpu
COPY requirements-gpu.lock requirements-nodeps.txt ./
RUN pip install --no-cache-dir -r requirements-gpu.lock \
    && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
COPY wsgi.py gunicorn.conf.py ./
COPY app/ app/
# The derived worker count (one per 4 CPUs) is a CPU rule: on a GPU every worker holds a model
# copy on the card, so the image starts one; more take WORKERS with GPU_MEMORY_LIMIT_MB.
ENV WORKERS=1
USER 10001:10001

# TensorFlow Serving's gRPC stubs import TensorFlow's generated protocol buffer modules
# (tensorflow.core.framework.tensor_pb2, ...). The load generator needs those, not TensorFlow:
# take the *_pb2.py files out of the pinned wheel (about 1 MB of the wheel's 250).
FROM base AS tf-protos
ARG TENSORFLOW_VERSION=2.21.0
RUN pip download --no-cache-dir --no-deps --only-binary=:all: --dest /tmp/wheel "tensorflow-cpu==${TENSORFLOW_VERSION}" \
    && python -c "import glob, zipfile; wheel = zipfile.ZipFile(glob.glob('/tmp/wheel/*.whl')[0]); wheel.extractall('/protos', [n for n in wheel.namelist() if n.startswith('tensorflow/') and n.endswith('_pb2.py')])" \
    && rm -rf /tmp/wheel

# Locust against a running server (docker-compose.yml's locust service): only Locust, what
# locustfile.py imports and the gRPC stubs; no TensorFlow, no server.
FROM base AS loadtest
COPY requirements-loadtest.lock requirements-nodeps.txt ./
RUN pip install --no-cache-dir -r requirements-loadtest.lock \
    && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
COPY --from=tf-protos /protos/tensorflow /usr/local/lib/python3.11/site-packages/tensorflow
COPY locustfile.py ./
USER 10001:10001
EXPOSE 8089
HEALTHCHECK NONE
CMD ["locust", "-f", "locustfile.py", "--host", "http://api:8080"]

# The last stage is the default target: the CPU server.
FROM deps-cpu AS cpu
COPY wsgi.py gunicorn.conf.py ./
COPY app/ app/
USER 10001:10001
