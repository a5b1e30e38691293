# The model server's image.
#
#   CPU (the default target):  docker build -t model-server .
#   GPU:                       docker build --target gpu -t model-server:gpu .
#   Load tests:                docker build --target loadtest -t model-server:loadtest .
#
# Requirements are installed in a layer of their own, before the code is copied, so that
# a code change does not reinstall TensorFlow. BuildKit builds only the stages a target needs.

FROM python:3.11-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# A numeric id, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app app
WORKDIR /srv/model-server
# How every target below runs, unless it says otherwise.
EXPOSE 8000
# Liveness only (/readyz also fails while a model loads, no reason to restart); the port follows BIND.
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('BIND', '0.0.0.0:8000').rpartition(':')[2]; urllib.request.urlopen('http://127.0.0.1:' + port + '/healthz', timeout=4)"]
CMD ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]

FROM base AS deps-cpu
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt

# Locust against a running server (docker-compose.yml's locust service); locust is a dev dependency.
FROM deps-cpu AS loadtest
COPY requirements-dev.txt ./
RUN pip install --no-cache-dir -r requirements-dev.txt
COPY wsgi.py gunicorn.conf.py locustfile.py ./
COPY app/ app/
USER 10001:10001
EXPOSE 8089
HEALTHCHECK NONE
CMD ["locust", "-f", "locustfile.py", "--host", "http://api:8000"]

# tensorflow[and-cuda] brings CUDA and cuDNN as wheels: the host needs only the NVIDIA
# driver and container toolkit. Everything else as pinned in requirements.txt, less its
# CPU TensorFlow, which would shadow the GPU one.
FROM base AS gpu
COPY requirements.txt ./
RUN grep -v '^tensorflow' requirements.txt > /tmp/requirements-gpu.txt \
    && pip install --no-cache-dir -r /tmp/requirements-gpu.txt "tensorflow[and-cuda]==2.21.0" \
    && rm /tmp/requirements-gpu.txt
COPY wsgi.py gunicorn.conf.py ./
COPY app/ app/
USER 10001:10001

# The last stage is the default target: the CPU server.
FROM deps-cpu AS cpu
COPY wsgi.py gunicorn.conf.py ./
COPY app/ app/
USER 10001:10001
