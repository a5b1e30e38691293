# The model server's image.
#
#   CPU (the default target):  docker build -t model-server:1.0.0 .
#   GPU:                       docker build --target gpu -t model-server:1.0.0-gpu .
#   Load tests:                docker build --target loadtest -t model-server:1.0.0-loadtest .
#
# It builds with Docker 20.10 and later and with buildah/podman 4 (`buildah bud --format
# docker`: the OCI format has no HEALTHCHECK); docs/image.md says which builders and how.
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
# How every target below runs, unless it says otherwise: HTTP, and gRPC (GRPC_BIND); with
# TF Serving's conventions (app/entrypoint.py), REST on 8501 as well.
EXPOSE 8000 8500 8501
# Liveness only (/readyz also fails while a model loads, no reason to restart). It asks the
# first address in BIND, as gunicorn.conf.py reads it: a wildcard host is asked on loopback.
# No --start-interval: Docker Engine before 25 and Debian 12's buildah stop at it; compose
# runs this command every 5 s instead (docker-compose.yml).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; host, _, port = os.environ.get('BIND', '0.0.0.0:8000').split(',')[0].strip().rpartition(':'); host = {'': '127.0.0.1', '0.0.0.0': '127.0.0.1', '[::]': '[::1]'}.get(host, host); urllib.request.urlopen('http://' + host + ':' + port + '/healthz', timeout=4)"]
CMD ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]

# tensorflow-serving-api declares the full `tensorflow` as a dependency, which would shadow
# tensorflow-cpu: it is installed without dependencies; what it imports is in the lock.
# libclang (61 MB) is TensorFlow's for generating code, never imported when serving.
FROM base AS deps-cpu
COPY requirements-cpu.lock requirements-nodeps.txt ./
RUN pip install --no-cache-dir -r requirements-cpu.lock \
    && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt \
    && pip uninstall --yes libclang

# tensorflow[and-cuda] brings CUDA and cuDNN as wheels: the host needs only the NVIDIA
# driver and container toolkit. Same pins as the CPU lock, TensorFlow's GPU build in its place.
FROM base AS gpu
COPY requirements-gpu.lock requirements-nodeps.txt ./
RUN pip install --no-cache-dir -r requirements-gpu.lock \
    && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt \
    && pip uninstall --yes libclang
COPY wsgi.py gunicorn.conf.py ./
COPY app/ app/
# The derived worker count (one per 4 CPUs) is a CPU rule: on a GPU every worker holds a model
# copy on the card, so the image starts one; more take WORKERS with GPU_MEMORY_LIMIT_MB.
ENV WORKERS=1
USER 10001:10001
ENTRYPOINT ["python", "-m", "app.entrypoint"]
# An ENTRYPOINT empties the CMD a stage inherits: the base's, named again.
CMD ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]

# TensorFlow Serving's gRPC stubs import TensorFlow's generated protocol buffer modules
# (tensorflow.core.framework.tensor_pb2, ...). The load generator needs those, not TensorFlow:
# take the *_pb2.py files out of the wheel the CPU lock pins (about 1 MB of its 274), into a
# tree that mirrors the base's own site-packages, wherever that is.
FROM base AS tf-protos
COPY requirements-cpu.lock ./
RUN pip download --no-cache-dir --no-deps --only-binary=:all: --dest /tmp/wheel \
        --constraint requirements-cpu.lock tensorflow-cpu \
    && python -c "import glob, sysconfig, zipfile; wheel = zipfile.ZipFile(glob.glob('/tmp/wheel/*.whl')[0]); wheel.extractall('/protos' + sysconfig.get_path('purelib'), [n for n in wheel.namelist() if n.startswith('tensorflow/') and n.endswith('_pb2.py')])" \
    && rm -rf /tmp/wheel

# Locust against a running server (docker-compose.yml's locust service): only Locust, what
# locustfile.py imports and the gRPC stubs; no TensorFlow, no server.
FROM base AS loadtest
COPY requirements-loadtest.lock requirements-nodeps.txt ./
RUN pip install --no-cache-dir -r requirements-loadtest.lock \
    && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
COPY --from=tf-protos /protos/ /
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
# The CMD as it is, or TF Serving's image conventions and flags (`docker run IMAGE --flag=...`).
ENTRYPOINT ["python", "-m", "app.entrypoint"]
# An ENTRYPOINT empties the CMD a stage inherits: the base's, named again.
CMD ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]
