"""Gunicorn settings, all from the environment; command-line flags still override them.

Importing this file only reads: the hooks do the work (on_starting checks the settings and
prepares the metrics folder and the run folder where workers share a reloaded model config;
post_fork, post_worker_init, worker_exit, child_exit, on_exit).
The master never imports TensorFlow: the app is loaded in each worker after the fork
(no preload_app), and post_fork sizes TensorFlow's thread pools and GPU memory in the
worker before the model loads.
"""

import os
import shutil
import signal
import tempfile

from gunicorn import glogging

from app.ops import logs
from app.core import shared_config
from app.ops.runtime import default_workers, usable_cpus
from app.ops.settings import Settings, model_configs, parse, validate_pos_int

# Validated here, in the master, so a bad value stops start-up once with a clear message.
_settings = Settings.from_env()


def _env(name, default, validator=validate_pos_int):
    # Empty is unset: docker-compose.yml passes every knob, THREADS="" when it is left to derive.
    return parse(name, os.environ[name], validator) if os.environ.get(name, "").strip() else default


bind = os.environ.get("BIND", "0.0.0.0:8000")
# Derived from the CPUs this process may use (affinity, cgroup CPU quota), not the host's
# count: one worker per CPUS_PER_WORKER of them (app/ops/runtime.py has the measurements).
workers = _env("WORKERS", default_workers(usable_cpus().count))
# Gunicorn's gthread worker, less a drain's two GIL-releasing system calls per kept-alive
# request when the body was read to its end (app/worker.py).
worker_class = "app.worker.ThreadWorker"
# A batch can only hold as many requests as there are threads waiting on it, and overload
# must meet the queue's fast 503 (MAX_QUEUE_ROWS) before it meets a thread pool where
# requests would wait unseen: enough threads for a running batch, a full queue and more.
threads = _env("THREADS", _settings.max_queue_rows + 2 * _settings.max_batch_size)
timeout = _env("TIMEOUT", 120)
graceful_timeout = _env("GRACEFUL_TIMEOUT", 30)
keepalive = _env("KEEPALIVE", 5)
preload_app = False
# Gunicorn 27's control socket lives at one fixed path per user: two servers on a machine
# would fight over it, and nothing here uses it.
control_socket_disable = True
loglevel = _settings.log_level.lower()
# One handler, set up here in the master before any worker forks: Gunicorn's error and access
# lines, the app's and TensorFlow's Python loggers all come out in LOG_FORMAT (app/ops/logs.py).
logconfig_dict = logs.gunicorn_logconfig(_settings.log_level, _settings.log_format)


class _Logger(glogging.Logger):
    """Gunicorn's logger without its access line.

    The app writes one access line per request (app.access: request id, rows, batch, model);
    with logconfig_dict set, Gunicorn would also build its own for every request (a few % of
    the request threads' time under load) only to drop it.
    """

    access_log_enabled = False

    def access(self, resp, req, environ, request_time):
        pass


logger_class = _Logger


def on_starting(server):
    # A stopping worker answers what it accepted only if a batch window closes within its grace.
    longest_window_s = max(config.batch_timeout_ms for config in model_configs(_settings)) / 1000
    if longest_window_s >= server.cfg.graceful_timeout:
        raise SystemExit(f"BATCH_TIMEOUT_MS={longest_window_s * 1000:g} must stay below GRACEFUL_TIMEOUT="
                         f"{server.cfg.graceful_timeout} s, or a stopping worker could end before its queued "
                         "requests run")
    server.own_metrics_dir = prepare_metrics_dir(os.environ)
    # Always fresh: a reload's config lasts as long as the server, as in TF Serving.
    server.run_dir = shared_config.prepare_run_dir(os.environ)
    if _settings.model_processes:
        start_model_processes(server)
    # Connections are descriptors: workers inherit the soft limit raised to the hard one.
    from app.worker import raise_descriptor_limit

    raise_descriptor_limit()


def start_model_processes(server):
    """MODEL_PROCESSES: the models load once, in processes of their own, before any worker forks;
    workers find their sockets through the folder named in their environment (app/model_process/)."""
    from app.model_process import supervisor

    # Fresh interpreters, not forks: the master never imports TensorFlow, and must not.
    server.model_processes = supervisor.start(_settings.model_processes, drain_s=server.cfg.graceful_timeout,
                                              environ=os.environ)
    os.environ[supervisor.FOLDER_VARIABLE] = server.model_processes.folder


def prepare_metrics_dir(environ):
    """prometheus_client's multiprocess mode: each worker writes its values to files in this
    folder and /metrics adds them up. It must be named before any worker starts, and start
    empty, or counts from an earlier run would be added in. Returns the folder it made, if any."""
    if "PROMETHEUS_MULTIPROC_DIR" not in environ:
        environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="model-server-metrics-")
        return environ["PROMETHEUS_MULTIPROC_DIR"]
    folder = environ["PROMETHEUS_MULTIPROC_DIR"]
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name.endswith(".db"):
            os.remove(os.path.join(folder, name))
    return None


def post_fork(server, worker):
    # Before anything slow: a stop signal from now on is the worker's, not the master's.
    worker.catch_early_stops()
    if _settings.model_processes:
        # The models run in the model processes; this worker imports no TensorFlow.
        from app.ops.runtime import uses_jax

        worker.tensorflow = {"model_processes": _settings.model_processes,
                             "model_process_gpus": server.model_processes.gpus}  # CUDA_VISIBLE_DEVICES of each
        if uses_jax():  # /readyz names the backend the model processes run
            worker.tensorflow["keras_backend"] = "jax"
        return
    from app.ops import runtime

    # Before the app loads its models; post_worker_init hands the app what was set.
    worker.tensorflow = runtime.configure(_settings, workers=server.cfg.workers)


def post_worker_init(worker):
    services = getattr(worker.wsgi, "services", None)
    if services is not None:  # the server's app (scripts/floor_app.py is a plain Flask app)
        _serve(worker, services)
    else:
        worker.wsgi.tensorflow = worker.tensorflow
    from app.ops import runtime

    runtime.freeze_heap()


def _serve(worker, services):
    services.tensorflow.update(worker.tensorflow)
    # A worker whose batch thread died stops gracefully, so the master starts a fresh one.
    services.replace_worker = lambda: os.kill(os.getpid(), signal.SIGTERM)
    # A stopping worker's requests run at once, not once their batch window closes: on SIGTERM
    # gthread answers its open connections (some still being read) before worker_exit drains.
    # With MODEL_PROCESSES the registry's flush tells the model process.
    worker.when_stopping(lambda: services.registry.flush(later_too=True))
    # gRPC starts in the worker once its models are loaded: grpc's threads would not survive
    # a fork, so the master never imports it.
    if _settings.grpc_bind or _settings.grpc_socket_path:
        from app.grpc import server as grpc_server

        grpc_server.serve_in_worker(worker)


def worker_exit(server, worker):
    app = getattr(worker, "wsgi", None)
    if getattr(app, "services", None) is not None:
        from app import shutdown_app

        # Accepted gRPC calls finish first: they still need the batchers.
        for grpc_server in (getattr(worker, "grpc_socket", None), getattr(worker, "grpc_server", None)):
            if grpc_server is not None:
                grpc_server.drain(timeout_s=server.cfg.graceful_timeout)

        shutdown_app(app, timeout_s=server.cfg.graceful_timeout)


def child_exit(server, worker):
    # Gauges of a dead worker (queue rows, requests in flight) stop counting.
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    model_processes = getattr(server, "model_processes", None)
    if model_processes is not None:
        # The workers are gone: what the model processes still hold drains, then they stop.
        model_processes.stop(timeout_s=server.cfg.graceful_timeout + 5)
        shutil.rmtree(model_processes.folder, ignore_errors=True)
    made = getattr(server, "own_metrics_dir", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
    shared_config.remove_run_dir(os.environ, getattr(server, "run_dir", None))
