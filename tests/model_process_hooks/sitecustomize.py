"""For tests only: a way to kill the batch threads of a live model process.

tests/test_model_process_faults.py puts this folder first on PYTHONPATH, so every Python
process of its server imports this file at start-up; with KILL_BATCH_THREADS_ON_SIGUSR2=1,
SIGUSR2 then kills every batch thread of the process that gets it (batch_thread_killer.py,
which tests/gunicorn_test_hooks.py uses in a worker). The test signals the model process
alone. Production code has no such hook.
"""

import os
import signal

if os.environ.get("KILL_BATCH_THREADS_ON_SIGUSR2") == "1":
    from batch_thread_killer import kill_batch_threads_on

    kill_batch_threads_on(signal.SIGUSR2)
