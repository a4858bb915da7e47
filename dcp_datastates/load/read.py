"""Reading a data file's wanted bytes into DCP's targets, verified, in four steps:

1. ``targets``: where each requested item lands: straight into the destination tensor when it
   is a contiguous CPU tensor of the stored dtype covering a whole stored chunk, otherwise into
   a buffer holding the requested sub-box's bytes (resharding), widened to whole checksum
   pieces when verifying;
2. ``read_targets``: the storage fills every buffer (``Storage.read_into``) and checks every
   piece the reads cover against its CRC32C (the engine checks local reads while hot; object
   stores through ``format.pieces``), raising ``ChecksumMismatchError`` naming file, item and
   bytes;
3. ``deliver``: tensors are narrowed and copied into ``planner.resolve_tensor``'s targets (dtype
   casts, strides, devices: CUDA copies run on a side stream, awaited once by
   ``finish_device_copies``) and committed; stored values pass the restricted unpickler unless
   the reader is trusted.
"""

from __future__ import annotations

import ctypes
import io
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..format import safe_unpickle
from ..format.layout import ItemLocation, name_to_dtype, piece_ranges
from ..storage import Storage
from .verify import checksum_mismatch

__all__ = ["ReadTarget", "targets", "read_targets", "deliver", "finish_device_copies"]


@dataclass
class ReadTarget:
    req: ReadItem
    loc: ItemLocation
    ptr: int  # where the stored bytes land (the destination's own memory on the direct path)
    nbytes: int  # how many are read there
    dst: torch.Tensor | None  # tensor destination (None for bytes items)
    direct: bool
    read_start: int = 0  # file offset of the byte at ptr
    src: torch.Tensor | None = None  # the requested sub-box, a view into buf (non-direct tensors)
    buf: torch.Tensor | None = None  # owns the memory at ptr when it is not the destination's

    @property
    def read_end(self) -> int:
        return self.read_start + self.nbytes


def targets(items: list[tuple[ReadItem, ItemLocation]], planner: LoadPlanner, *, verify: bool) -> list[ReadTarget]:
    """Where each requested item of one data file lands."""
    return [_target(req, loc, planner, verify) for req, loc in items]


def _target(req: ReadItem, loc: ItemLocation, planner: LoadPlanner, verify: bool) -> ReadTarget:
    if req.type == LoadItemType.BYTE_IO:
        buf = torch.empty(loc.length, dtype=torch.uint8)
        return ReadTarget(req, loc, buf.data_ptr(), loc.length, None, False, loc.offset, buf=buf)
    dst = planner.resolve_tensor(req)
    direct = (
        not any(req.storage_offsets)
        and tuple(req.lengths) == loc.shape
        and dst.device.type == "cpu"
        and dst.is_contiguous()
        and dst.dtype == name_to_dtype(loc.dtype)
        and dst.nbytes == loc.length
    )
    if direct:  # read straight into the destination's memory
        return ReadTarget(req, loc, dst.data_ptr() if loc.length else 0, loc.length, dst, True, loc.offset)
    return _span_target(req, loc, dst, verify)

def _span_target(req: ReadItem, loc: ItemLocation, dst: torch.Tensor, verify: bool) -> ReadTarget:
    """Read only the bytes between the first and last element of the requested sub-box
    (resharding), widened to whole checksum pieces when verifying."""
    dtype = name_to_dtype(loc.dtype)
    esize = dtype.itemsize
    strides = [1] * len(loc.shape)
    for d in range(len(loc.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * loc.shape[d + 1]
    if any(n == 0 for n in req.lengths):
        return ReadTarget(req, loc, 0, 0, dst, False, loc.offset, torch.empty(tuple(req.lengths), dtype=dtype))
    first = sum(o * st for o, st in zip(req.storage_offsets, strides))
    last = sum((o + n - 1) * st for o, n, st in zip(req.storage_offsets, req.lengths, strides))
    lo, hi = loc.offset + first * esize, loc.offset + (last + 1) * esize
    if verify and loc.crc32c:
        pieces = [(a, a + n) for a, n in piece_ranges(loc) if a + n > lo and a < hi]
        lo, hi = pieces[0][0], pieces[-1][1]
    # Pad the buffer so the sub-box's first element is aligned for its dtype.
    pad = (-(loc.offset + first * esize - lo)) % 16
    raw = torch.empty(pad + hi - lo, dtype=torch.uint8, pin_memory=dst.is_cuda)  # pinned: async H2D
    buf = raw[pad:]
    begin = loc.offset + first * esize - lo
    flat = buf[begin : begin + (last - first + 1) * esize].view(dtype)
    src = torch.as_strided(flat, tuple(req.lengths), tuple(strides), flat.storage_offset())
    return ReadTarget(req, loc, buf.data_ptr(), buf.numel(), dst, False, lo, src, buf)

def _checks(reading: list[ReadTarget]) -> list[tuple[int, int, int, int]]:
    """(range index, file offset, length, crc32c) of every stored piece each read covers
    (a resharding read may skip pieces of its item)."""
    out = []
    for i, p in enumerate(reading):
        if not p.loc.crc32c:
            continue
        start, end = p.read_start, p.read_end
        out.extend(
            (i, off, length, expected)
            for expected, (off, length) in zip(p.loc.crc32c, piece_ranges(p.loc))
            if off >= start and off + length <= end
        )
    return out

def read_targets(storage: Storage, name: str, reading: list[ReadTarget], engine, *, verify: bool, threads: int,
                 checkpoint: str) -> None:
    """Fill the buffers of ``reading`` (targets with bytes to read) from data file ``name``,
    checking every piece the reads cover unless ``verify`` is off."""
    ranges = [(p.ptr, p.read_start, p.nbytes) for p in reading]
    if not ranges:
        return
    bad = storage.read_into(engine, name, ranges, _checks(reading) if verify else None, threads)
    if bad is not None:
        index, off, length, expected, got = bad
        raise checksum_mismatch(checkpoint, reading[index].loc.file, reading[index].req.storage_index,
                                off, length, expected, got)


def deliver(pending: list[ReadTarget], planner: LoadPlanner, *, trusted: bool, checkpoint: str) -> None:
    """Hand every read item to the planner: tensors copied into their targets and committed,
    values decoded and loaded."""
    for p in pending:
        if p.dst is None:
            _load_value(p, planner, trusted, checkpoint)
            continue
        if not p.direct:
            if p.dst.is_cuda:
                _copy_to_device(p.dst, p.src)
            else:
                p.dst.copy_(p.src)
        planner.commit_tensor(p.req, p.dst)


def _load_value(p: ReadTarget, planner: LoadPlanner, trusted: bool, checkpoint: str) -> None:
    """Hand a stored non-tensor value to the planner. Unless trusted, it is decoded first with
    the restricted unpickler (this is where every value of every planner passes), and a
    planner of ours takes that decoded value instead of unpickling the bytes again."""
    data = ctypes.string_at(p.ptr, p.loc.length) if p.loc.length else b""
    if trusted:
        planner.load_bytes(p.req, io.BytesIO(data))
        return
    value = safe_unpickle.decode_value(data, checkpoint=checkpoint, item=p.req.storage_index.fqn)
    load_value = getattr(planner, "load_decoded_value", None)
    if load_value is None or not load_value(p.req, value):
        # This planner unpickles the bytes itself: they passed the restricted decode.
        planner.load_bytes(p.req, io.BytesIO(data))

# Restores into CUDA tensors: each copy runs from a pinned buffer on a side stream per device, so
# the reading thread never blocks on it (the next reads overlap it); read_data waits once, at its end.
_h2d_streams: dict[int, Any] = {}
_h2d_used = threading.local()


def _copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a CUDA ``dst``, asynchronous: ordered after the work queued on the
    current stream (which made ``dst``) and before the work queued on it later."""
    current = torch.cuda.current_stream(dst.device)
    side = _h2d_streams.get(dst.device.index)
    if side is None:
        side = _h2d_streams.setdefault(dst.device.index, torch.cuda.Stream(dst.device))
    side.wait_stream(current)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
    current.wait_stream(side)
    if not hasattr(_h2d_used, "streams"):
        _h2d_used.streams = {}
    _h2d_used.streams[dst.device.index] = side


def finish_device_copies() -> None:
    """Wait for the host -> device copies this thread started (their pinned sources can go)."""
    used = getattr(_h2d_used, "streams", {})
    _h2d_used.streams = {}
    for side in used.values():
        side.synchronize()
