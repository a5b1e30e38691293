"""A model's priority levels and the queue policy of each, as MODEL_CONFIG gives them.

Triton's names (model_config.proto, `dynamic_batching`): `priority_levels`,
`default_priority_level`, `default_queue_policy` and `priority_queue_policy` (by level), each
policy a ModelQueuePolicy of which this server takes `max_queue_size` (in rows, as every
queue limit here is counted) and `default_timeout_microseconds`. Level 1 is the highest.

Pure: read by the settings at start and by the engine's row queue; no Flask, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from app.ops.numerals import whole_number

KEYS = ("priority_levels", "default_priority_level", "default_queue_policy", "priority_queue_policy")
_POLICY_KEYS = ("max_queue_size", "default_timeout_microseconds")


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    """One priority level's queue policy (Triton's ModelQueuePolicy, in rows and seconds)."""

    max_queue_rows: int = 0  # 0: only the model's own limit
    default_timeout_s: float = 0.0  # 0: only the request's deadline


@dataclasses.dataclass(frozen=True)
class Priorities:
    """A model's priority levels: 1 (highest) to `levels`; a request asking for 0, or for a
    level the model does not have, gets `default_level` (as Triton does)."""

    levels: int = 1
    default_level: int = 1
    policies: tuple[QueuePolicy, ...] = ()  # per level, from level 1; missing ones: QueuePolicy()

    def __post_init__(self) -> None:
        if self.levels < 1 or not 1 <= self.default_level <= self.levels:
            raise ValueError(f"default_priority_level must be one of 1..{self.levels}; got {self.default_level}")
        if len(self.policies) > self.levels:
            raise ValueError(f"{len(self.policies)} queue policies for {self.levels} priority levels")

    def index(self, priority: int) -> int:
        """The 0-based level of a request's priority value."""
        return (priority if 0 < priority <= self.levels else self.default_level) - 1

    def policy(self, index: int) -> QueuePolicy:
        return self.policies[index] if index < len(self.policies) else QueuePolicy()


# A model without priority levels: one level, the model's own queue limit, no queue timeout.
ONE_LEVEL = Priorities()


def from_entry(entry: Mapping[str, Any]) -> Priorities:
    """The priorities of a MODEL_CONFIG model entry; ValueError names the key that is wrong."""
    levels = _whole(entry.get("priority_levels", 0), "priority_levels")
    if not levels:
        unwanted = [key for key in KEYS[1:] if key in entry]
        if unwanted:
            raise ValueError(f"{unwanted[0]} needs priority_levels (1 or more)")
        return ONE_LEVEL
    default_level = _whole(entry.get("default_priority_level", 0), "default_priority_level")
    if not 1 <= default_level <= levels:
        raise ValueError(f"default_priority_level must be one of 1..{levels} (1 is the highest); "
                         f"got {entry.get('default_priority_level')!r}")
    default = _policy(entry.get("default_queue_policy", {}), "default_queue_policy")
    by_level = entry.get("priority_queue_policy", {})
    if not isinstance(by_level, dict):
        raise ValueError('priority_queue_policy must be an object like {"1": {"max_queue_size": 64}}')
    policies = [default] * levels
    for key, value in by_level.items():
        where = f"priority_queue_policy[{key!r}]"
        level = (whole_number(key, levels) if isinstance(key, str) else None) or 0
        if not 1 <= level <= levels:
            raise ValueError(f"{where}: a level must be one of 1..{levels}")
        policies[level - 1] = _policy(value, where)
    return Priorities(levels, default_level, tuple(policies))


def _policy(value: Any, where: str) -> QueuePolicy:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object with {' and/or '.join(_POLICY_KEYS)}")
    unknown = sorted(set(value) - set(_POLICY_KEYS))
    if unknown:
        raise ValueError(f"{where} has unsupported key(s) {unknown}; allowed: {', '.join(_POLICY_KEYS)}")
    rows = _whole(value.get("max_queue_size", 0), f"{where}.max_queue_size")
    timeout_us = _whole(value.get("default_timeout_microseconds", 0), f"{where}.default_timeout_microseconds")
    return QueuePolicy(max_queue_rows=rows, default_timeout_s=timeout_us / 1e6)


def _whole(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be a whole number of 0 or more; got {value!r}")
    return value
