"""Byte sizes as users write them: ``16GB``, ``512MiB``, ``1.5G``, a bare number, parsed to bytes.

One rule for the cache sizes (``host_cache_size``, ``gpu_cache_size``) in every entry point,
``cache_size``: a unitless number below ``GIB_BELOW`` is GiB, from it up bytes.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["GIB_BELOW", "cache_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


# A unitless number below this is GiB for the cache sizes (the seeds' ``host_cache_size: 16``);
# from it up, bytes. A cache is at least this many bytes (and 64 Ki GiB is no cache), so the two
# never overlap and a size in bytes reads back as itself.
GIB_BELOW = 1 << 16


def parse_size(value: Any, *, bare_unit: int = 1, name: str = "size", bare_gib_below: int = 0) -> int:
    """Parse a byte size: an int, a float, or a string such as "16GB", "512MiB", "1.5G".

    A number without a unit is multiplied by ``bare_unit``; with ``bare_gib_below`` set, a
    unitless number below it is GiB instead (the rule for ``host_cache_size`` and
    ``gpu_cache_size``, the same wherever the size is written: see ``cache_size``).
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size, got a boolean {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), None
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}: cannot parse size {value!r}; expected a number with an optional unit "
                f"such as '16GB', '512MiB' or '1.5G'"
            )
        number, unit = float(m.group(1)), (_UNITS[m.group(2).lower()] if m.group(2) else None)
    else:
        raise ValueError(f"{name}: expected a size (int or string like '16GB'), got {type(value).__name__}")
    if unit is None:
        unit = (1 << 30) if 0 <= number < bare_gib_below else bare_unit
    nbytes = value * unit if isinstance(value, int) else int(number * unit)
    if nbytes < 0:
        raise ValueError(f"{name}: size must not be negative, got {value!r}")
    return nbytes


def cache_size(value: Any, name: str = "host_cache_size") -> int:
    """The one rule for ``host_cache_size`` / ``gpu_cache_size``, in every entry point (keyword,
    dict, YAML, JSON, TorchTitan, environment): a string with a unit means that unit; a number
    without a unit (``16``, ``"16"``, ``0.5``) is GiB below 65536 and bytes from 65536 up
    (``64 << 20``)."""
    return parse_size(value, name=name, bare_gib_below=GIB_BELOW)
