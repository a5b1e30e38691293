"""Triton's restricted API categories: which calls need a header, and the check.

HTTP_RESTRICTED_API and GRPC_RESTRICTED_PROTOCOL hold Triton's `--http-restricted-api` and
`--grpc-restricted-protocol` groups (app/ops/settings.py): each restricts its categories to
callers that send header `key` (REST) or metadata key `triton-grpc-protocol-<key>` (gRPC) with
its value. RESTRICTED_MODEL_CONTROL=key=value is the `model-repository` category of both; on gRPC
its bare key `key` is taken too, as it was before Triton's spelling. A refusal is Triton's:
REST 403 `This API is restricted, expecting header 'key'`, gRPC UNAVAILABLE `This protocol is
restricted, expecting header 'triton-grpc-protocol-key'` (app/grpc/calls.py gives the code),
and one warning line that names the call and the key, never a value. A key sent twice passes
only if every value matches.

Which calls belong to which category is each door's: a route's `category` (app/http/routes.py),
a gRPC method's in app/grpc/v2.py.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from app.core.errors import Forbidden
from app.ops.settings import Settings

log = logging.getLogger(__name__)

MODEL_REPOSITORY = "model-repository"
GRPC_PREFIX = "triton-grpc-protocol-"


class Restriction(NamedTuple):
    """One category's key: the header (or metadata keys) that must carry `value`."""

    header: str
    value: bytes
    # gRPC: every metadata key that may carry it (RESTRICTED_MODEL_CONTROL's bare key too).
    keys: tuple[str, ...] = ()

    def check(self, call: str, sent: list[str], *, noun: str) -> None:
        """Refuse `call` unless every value sent (`sent`, in order; at least one) is the value."""
        if sent and all(hmac.compare_digest(value.encode(), self.value) for value in sent):
            return
        log.warning("refused %s: no valid '%s' header", call, self.header)
        raise Forbidden(f"This {noun} is restricted, expecting header '{self.header}'")

    def header_values(self, text: str | None) -> list[str]:
        """The values of a REST header. The WSGI server joins a repeated header's with ',' (Gunicorn;
        Werkzeug's test client ', '): the text is one value where it is the restriction's (which may
        hold a ','), else each of its parts is one."""
        if text is None:
            return []
        if hmac.compare_digest(text.encode(), self.value):
            return [text]
        return [part.strip(" \t") for part in text.split(",")]


def http_restrictions(settings: Settings) -> dict[str, Restriction]:
    """Category -> its restriction on REST: HTTP_RESTRICTED_API and RESTRICTED_MODEL_CONTROL."""
    restrictions = _groups(settings.http_restricted_api, prefix="")
    key, _, value = settings.restricted_model_control.partition("=")
    if key:
        restrictions[MODEL_REPOSITORY] = Restriction(key, value.encode())
    return restrictions


def grpc_restrictions(settings: Settings) -> dict[str, Restriction]:
    """Category -> its restriction on gRPC: GRPC_RESTRICTED_PROTOCOL and RESTRICTED_MODEL_CONTROL."""
    restrictions = _groups(settings.grpc_restricted_protocol, prefix=GRPC_PREFIX)
    key, _, value = settings.restricted_model_control.partition("=")
    if key:
        restrictions[MODEL_REPOSITORY] = Restriction(GRPC_PREFIX + key, value.encode(), (GRPC_PREFIX + key, key))
    return restrictions


def _groups(groups: Iterable[tuple[tuple[str, ...], str, str]], *, prefix: str) -> dict[str, Restriction]:
    restrictions = {}
    for categories, key, value in groups:
        for category in categories:
            restrictions[category] = Restriction(prefix + key, value.encode(), (prefix + key,))
    return restrictions


def metadata_values(restriction: Restriction, metadata: Any) -> list[str]:
    """Every value gRPC metadata gives the restriction's keys (one entry per value sent)."""
    return [value if isinstance(value, str) else "" for key, value in metadata or () if key in restriction.keys]
