"""Every exchange of a process, opened and closed here whatever its transport.

    exchange = exchanges.open(HttpExchange(environ, ...))   # the transport's outermost layer
    ...                                                    # the door, the request layer fill it in
    exchanges.close(exchange)                              # its status known

Opening counts it in flight. Closing counts and times it by route, method and status (the
request metrics), writes its access line (unless its transport leaves it out: probes) and ends
its trace with the status its client got. Nothing else writes a request's line or its metrics.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from app.core.call import Exchange
from app.ops import logs
from app.ops.metrics import OTHER, Metrics, RequestCounts
from app.ops.patches import value_of

_E = TypeVar("_E", bound=Exchange)


class Exchanges:
    """Opens and closes the exchanges of one process's transports."""

    def __init__(self, metrics: Metrics, *, writer: logs.AccessWriter | None = None) -> None:
        self._in_flight = value_of(metrics.in_flight)
        self._counts = RequestCounts(metrics)
        # Access lines go to the process's access-log thread (None: written on the closing thread).
        self._writer = writer

    def open(self, exchange: _E) -> _E:
        self._in_flight.inc(1)
        return exchange

    def close(self, exchange: Exchange) -> None:
        self._in_flight.inc(-1)
        self._counts.count(exchange.route or OTHER, exchange.metric_method, str(exchange.status), exchange.seconds())
        if logs.access_log.isEnabledFor(logging.INFO) and exchange.logged:
            logs.log_access(exchange.access_fields(), writer=self._writer)
        if exchange.trace is not None:
            exchange.trace.finish(exchange.status, exchange.route)
