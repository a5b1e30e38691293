"""The engine's face: what the registry and the request layer may ask of a batcher.

`Batcher` (this package, the default mode) and `RemoteBatcher` (app/model_process/client.py,
a batcher living in a model process) both implement `Engine`; nothing above the engine
reaches past it. Their fixed limits and knobs are one `EngineInfo`, which a model process
sends its workers as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from app.batching.rows import Tensors
from app.batching.work import BatchResult
from app.call import Call


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    """A batcher's name, limits and knobs, as /readyz and the request limits read them."""

    name: str
    max_request_rows: int
    max_batch_size: int
    batch_timeout_s: float
    fill_under_load: bool
    # One request per call as sent: a signature with no batch dimension.
    whole: bool
    # Variable-length padding is on for this signature.
    padded: bool

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Engine(Protocol):
    """One signature's batcher, local or in a model process."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def alive(self) -> bool: ...

    @property
    def broken(self) -> bool: ...

    @property
    def queued_rows(self) -> int: ...

    @property
    def batches_run(self) -> int: ...

    def predict(self, call: Call, inputs: Tensors) -> BatchResult:
        """The call's rows through the model, answered within its deadline."""
        ...

    def flush(self, *, later_too: bool = False) -> None:
        """Run what is queued now without waiting out its window (a stopping worker's or process's)."""
        ...

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None: ...
