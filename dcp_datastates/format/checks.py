"""The checks a ``.metadata`` document's codecs make on every value they read or write.

Decoding validates everything it reads, so a damaged or foreign file raises
``CheckpointFormatError`` naming the file and the field instead of crashing or allocating absurd
sizes later; a commit makes the same checks on the values it encodes (``format.metadata``).
Here: typed field accessors (``_Check``), the bounds they enforce, and the rules for data files
and checksums that every format version's codec applies (the checks of each chunk of version
1/2 live with that codec, ``format.items_codec``).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointFormatError
from .layout import METADATA_NAME
from .locations import FileInfo, split_reference

# Upper bounds that keep a corrupted file from driving huge allocations.
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 50
# Byte offsets, lengths and sizes are 63-bit (they become off_t and int64 in the engine and torch).
_MAX_INT = (1 << 63) - 1
# Pairwise chunk-overlap checks are quadratic: done up to this many chunks of one tensor (the
# volume check that always runs already proves full coverage when there is no overlap).
_MAX_OVERLAP_CHECK = 256


class _Check:
    """Small typed accessors that raise CheckpointFormatError naming the source and field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.source}: {what}")

    # Each accessor first tries the common case with exact-type tests (JSON gives exactly int,
    # list, dict, str), and only otherwise runs the full checks that name what is wrong: decoding
    # a large checkpoint's metadata is on every load's critical path.
    def get(self, obj: dict, key: str, typ: type | tuple, where: str) -> Any:
        value = obj.get(key) if type(obj) is dict else None
        if type(value) is typ:
            return value
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"missing field {key!r} in {where}")
        value = obj[key]
        if isinstance(value, bool) and typ is int or not isinstance(value, typ):
            raise self.fail(f"field {key!r} in {where} should be {_tname(typ)}, found {type(value).__name__}")
        return value

    def nonneg(self, obj: dict, key: str, where: str) -> int:
        value = obj.get(key) if type(obj) is dict else None
        if type(value) is int and 0 <= value <= _MAX_INT:
            return value
        value = self.get(obj, key, int, where)
        if value < 0:
            raise self.fail(f"field {key!r} in {where} is negative ({value})")
        if value > _MAX_INT:
            raise self.fail(f"field {key!r} in {where} is out of range ({value} > 2**63 - 1)")
        return value

    def dims(self, obj: dict, key: str, where: str) -> tuple[int, ...]:
        value = obj.get(key) if type(obj) is dict else None
        if type(value) is list and len(value) <= _MAX_DIMS and _all_dims(value):
            return tuple(value)
        value = self.get(obj, key, list, where)
        if len(value) > _MAX_DIMS or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_INT for v in value
        ):
            raise self.fail(
                f"field {key!r} in {where} is not a list of at most {_MAX_DIMS} non-negative 63-bit integers"
            )
        return tuple(value)

    def optional_str(self, obj: dict, key: str, where: str) -> str | None:
        value = obj.get(key)
        if value is not None and not isinstance(value, str):
            raise self.fail(f"field {key!r} in {where} should be a string or null, found {type(value).__name__}")
        return value


def _all_dims(values: list) -> bool:
    """Every value an exact int in [0, 2**63) (a plain loop: faster than all() on short lists)."""
    for v in values:
        if type(v) is not int or v < 0 or v > _MAX_INT:
            return False
    return True


def _tname(typ: type | tuple) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def _check_file(c: _Check, name: str, info: FileInfo, where: str, *, references: bool = False) -> None:
    """What a data file's entry must satisfy (the decoder's and the commit's check)."""
    _check_file_name(c, name, info.piece_size, where, references=references)
    if info.data_start > info.size:
        raise c.fail(f"{where}: data_start {info.data_start} lies past the file size {info.size}")


def _plain_name(name: str) -> bool:
    return not ("/" in name or "\\" in name or "\x00" in name or name in ("", ".", "..", METADATA_NAME))


def _check_file_name(c: _Check, name: str, piece_size: int, where: str, *, references: bool = False) -> None:
    ref = split_reference(name)
    if ref is not None and references:
        if not (_plain_name(ref[0]) and _plain_name(ref[1])):
            raise c.fail(f"{where}: a reference must name a data file of a checkpoint folder beside this one "
                         f"(../<folder>/<file>, two plain names)")
    elif not _plain_name(name):
        raise c.fail(f"{where}: file names must be plain names inside the checkpoint folder")
    if piece_size == 0:
        raise c.fail(f"{where}: piece_size must be positive")


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # dict() runs in C; a duplicate key shows as a shorter dict.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."
