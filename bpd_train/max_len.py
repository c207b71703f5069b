"""The one max_len type: how many tokens a decoder may generate per row, as configs, manifests and reports write it.

Pure Python, below every layer: decoding/ (the decoders' default and checks) and data/ (a distilled corpus's
manifest) both read it.
"""

from __future__ import annotations

import numbers
from typing import Union

# How many tokens a decoder may generate per row (EOS not counted): an int, or (a, b) meaning int(a*src_len + b).
MaxLen = Union[int, tuple[float, float]]
DEFAULT_MAX_LEN: MaxLen = (1.5, 10)  # every decoder's and entry point's default: 1.5 * source tokens + 10


def parse_max_len(value, minimum: int = 0) -> MaxLen:
    """Any way a max_len is written (int, [a, b] from a config or the command line, a tuple) -> MaxLen.
    `minimum`: the fewest tokens it must allow (distillation wants >= 1). A bad value is a ValueError."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        if value < minimum:
            raise ValueError(f"max_len must be >= {minimum}, got {value}")
        return int(value)
    try:
        a, b = list(value)
        a, b = float(a), float(b)
    except (TypeError, ValueError):
        raise ValueError(f"max_len must be an int or [a, b] (a*src_len + b), got {value!r}") from None
    if a < 0 or (minimum > 0 and a + b < minimum):
        raise ValueError(
            f"max_len [a, b] must give at least {minimum} token(s) for a one-token source (a >= 0), got {value!r}"
        )
    return (a, b)


def max_len_json(value) -> int | list[float]:
    """A MaxLen as manifests and reports store it (JSON has no tuples)."""
    m = parse_max_len(value)
    return m if isinstance(m, int) else list(m)
