"""Whole numbers in a client's text (a header, gRPC metadata, a part of a URL, a protobuf string):
ASCII digits only, bounded before int() reads them.

int() also reads '１' (fullwidth), Arabic-Indic digits and '1_000', and past 4,300 digits it
raises ValueError (CPython's guard against quadratic conversions): a 500 and a traceback per
request if a client's text reached it. Here a number has at most as many digits as its bound
(leading zeros aside), so int() never sees more than twenty.
"""

from __future__ import annotations

INT64_MAX = 2**63 - 1  # TF Serving's and Triton's model versions are int64
UINT64_MAX = 2**64 - 1


def whole_number(text: str, most: int) -> int | None:
    """`text` as a whole number from 0 to `most`; None if it is anything else."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0")
    if len(digits) > len(str(most)):
        return None
    number = int(digits or "0")
    return number if number <= most else None
