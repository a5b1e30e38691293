"""The dynamic batching engine: request threads submit rows, one daemon thread per model predicts.

Its parts, one job each (docs/batching.md is the manual):

- `work`: the work item, a request's rows with its future and partial results;
- `row_queue`: the queue of work items, counted in rows (a `queue.Queue` subclass);
- `fill`: the fill policy, pure: whether a batch that is not full waits for more rows;
- `rows`: which requests may share a batch, how their rows join and pad to a bucket;
- `execution`: one batch through the model, bisected on failure, rows sliced back;
- `batcher`: the thread, its loop, and its life (submit, close, a thread that dies);
- `engine`: the face the registry sees (`Engine`), which a model process's batcher implements too;
- `observer`: the hooks metrics listen on.

It imports no TensorFlow and no Flask: the predict function is injected, and the unit tests
drive the engine with a fake one.
"""

from app.core.batching.batcher import Batcher
from app.core.batching.engine import Engine, EngineInfo, awaited, wait
from app.core.batching.execution import PredictFn, max_predict_calls
from app.core.batching.fill import CallStats, FillPolicy, FillWait
from app.core.batching.observer import BatchObserver
from app.core.batching.rows import Tensors, bucket_sizes, check_rows, row_count
from app.core.batching.work import BatchResult

__all__ = ["BatchObserver", "BatchResult", "Batcher", "CallStats", "Engine", "EngineInfo", "FillPolicy", "FillWait",
           "PredictFn", "Tensors", "awaited", "bucket_sizes", "check_rows", "max_predict_calls", "wait",
           "row_count"]
