"""Reading a data file's wanted bytes into DCP's targets, verified, in three steps:

1. ``targets``: where each requested item lands: straight into the destination tensor when it
   is a contiguous CPU tensor of the stored dtype covering a whole stored chunk, otherwise into
   a buffer holding the requested sub-box's bytes (resharding), widened to whole checksum
   pieces when verifying;
2. ``read_targets``: the storage fills every buffer (``Storage.read_into``) and checks every
   piece the reads cover against its CRC32C (the engine checks local reads while hot; object
   stores through ``format.pieces``), raising ``ChecksumMismatchError`` naming file, item and
   bytes;
3. ``deliver``: tensors are narrowed and copied into ``planner.resolve_tensor``'s targets (dtype
   casts, strides) and committed; stored values pass the restricted unpickler unless the reader
   is trusted.

CUDA destinations take steps 2 and 3 in batches instead, through ``DeviceStaging``'s two pinned
slots (reads into one while the copies out of the other run on the device).
"""

from __future__ import annotations

import ctypes
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..channel import channel_for
from ..format import safe_unpickle
from ..format.layout import name_to_dtype
from ..format.locations import ItemLocation
from ..format.pieces import piece_ranges
from ..storage import Storage
from .verify import checksum_mismatch

__all__ = ["ReadTarget", "DeviceStaging", "targets", "read_targets", "deliver"]

log = logging.getLogger("dcp_datastates")


@dataclass
class ReadTarget:
    """Where one requested item of a data file lands.

    Attributes:
        ptr: where the stored bytes land (the destination's own memory on the direct path).
        nbytes: how many are read there.
        dst: the tensor destination (None for bytes items).
        read_start: the file offset of the byte at ``ptr``.
        src: the requested sub-box, a view into ``buf`` (non-direct tensors).
        buf: owns the memory at ``ptr`` when it is not the destination's.
        staged: a CUDA destination read through the pinned slots (``DeviceStaging``).
        view: (pad, begin, strides): how ``src`` sits in its buffer (``_bind``).
        dst_offset: a part of a whole item: copied bytewise to this offset in ``dst``.
        last_part: the planner commits ``dst`` after this part.
    """

    req: ReadItem
    loc: ItemLocation
    ptr: int
    nbytes: int
    dst: torch.Tensor | None
    direct: bool
    read_start: int = 0
    src: torch.Tensor | None = None
    buf: torch.Tensor | None = None
    staged: bool = False
    view: tuple | None = None
    dst_offset: int | None = None
    last_part: bool = True

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
    # Whether the destination is the stored chunk, byte for byte.
    whole = (
        not any(req.storage_offsets)
        and tuple(req.lengths) == loc.shape
        and dst.is_contiguous()
        # A conjugate or negative view: copy_ applies its bit, bytes would not.
        and not dst.is_conj()
        and not dst.is_neg()
        and dst.dtype == name_to_dtype(loc.dtype)
        and dst.nbytes == loc.length
    )
    staged = _through_staging(dst)
    if whole and not staged:
        # Read straight into the destination's memory.
        return ReadTarget(req, loc, dst.data_ptr() if loc.length else 0, loc.length, dst, True, loc.offset)
    if any(n == 0 for n in req.lengths):
        return ReadTarget(req, loc, 0, 0, dst, False, loc.offset, torch.empty(tuple(req.lengths), dtype=dst.dtype))
    p = _span_target(req, loc, dst, verify)
    if staged:
        p.staged = True
        # Whole items may be read and copied in parts.
        p.dst_offset = 0 if whole else None
    else:
        _bind(p)
    return p


def _span_target(req: ReadItem, loc: ItemLocation, dst: torch.Tensor, verify: bool) -> ReadTarget:
    """Read only the bytes between the first and last element of the requested sub-box
    (resharding), widened to whole checksum pieces when verifying. No buffer yet (``_bind``)."""
    esize = name_to_dtype(loc.dtype).itemsize
    strides = [1] * len(loc.shape)
    for d in range(len(loc.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * loc.shape[d + 1]
    first = sum(o * st for o, st in zip(req.storage_offsets, strides))
    last = sum((o + n - 1) * st for o, n, st in zip(req.storage_offsets, req.lengths, strides))
    lo, hi = loc.offset + first * esize, loc.offset + (last + 1) * esize
    if verify and loc.crc32c:
        pieces = [(a, a + n) for a, n in piece_ranges(loc) if a + n > lo and a < hi]
        lo, hi = pieces[0][0], pieces[-1][1]
    begin = loc.offset + first * esize - lo
    # Padded so that the sub-box's first element is aligned for its dtype.
    pad = -begin % 16
    return ReadTarget(req, loc, 0, hi - lo, dst, False, lo, view=(pad, begin, tuple(strides)))


def _through_staging(dst: torch.Tensor) -> bool:
    """Whether reads for ``dst`` go through DeviceStaging (CUDA destinations)."""
    return dst.is_cuda


def _bind(p: ReadTarget, raw: torch.Tensor | None = None) -> None:
    """Give span target ``p`` its buffer: ``raw`` (a slot's range) holds its padding and its
    bytes; without it, a pageable buffer of its own."""
    pad, begin, strides = p.view
    if raw is None:
        raw = torch.empty(pad + p.nbytes, dtype=torch.uint8)
    p.buf = raw[pad : pad + p.nbytes]
    p.ptr = p.buf.data_ptr()
    if p.dst_offset is not None:
        # Copied bytewise (DeviceStaging.copy).
        return
    dtype = name_to_dtype(p.loc.dtype)
    count = 1 + sum((n - 1) * st for n, st in zip(p.req.lengths, strides))
    flat = p.buf[begin : begin + count * dtype.itemsize].view(dtype)
    p.src = torch.as_strided(flat, tuple(p.req.lengths), strides, flat.storage_offset())


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
    bad = channel_for(storage).read_into(engine, name, ranges, _checks(reading) if verify else None, threads)
    if bad is not None:
        index, off, length, expected, got = bad
        raise checksum_mismatch(checkpoint, reading[index].loc.file, reading[index].req.storage_index,
                                off, length, expected, got)


def deliver(pending: list[ReadTarget], planner: LoadPlanner, *, trusted: bool, checkpoint: str) -> None:
    """Hand every read item to the planner: tensors copied into their targets and committed,
    values decoded and loaded (CUDA destinations go through ``DeviceStaging`` instead)."""
    written = [p.dst for p in pending if p.direct and p.nbytes]
    if written:
        # The engine wrote into their memory: bump their versions as copy_ would have.
        increment_version(written)
    for p in pending:
        if p.dst is None:
            _load_value(p, planner, trusted, checkpoint)
            continue
        if not p.direct:
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

# The pinned slots of DeviceStaging: 32 MiB, a power of two, which PyTorch's pinned allocator
# keeps for the next load (it rounds every size up to one).
SLOT_BYTES = 32 << 20
#: Every buffer in a slot starts on a cache line (aligned for every dtype).
_ALIGN = 64
#: Stands for "a buffer of its own" where a slot index is expected.
_OWN = 2


class DeviceStaging:
    """Reads for CUDA destinations land in two pinned slots used in turn: the copies out of one
    slot run on the device (queued on the current stream: ordered after the work that made the
    destinations, before what is queued later, the planner's commits included) while the next
    batch is read into the other. Pinning is slow (most of a first load's time when every item had
    a pinned buffer of its own), and copies from pageable memory are several times slower than from
    pinned (docs/benchmarks.md, "GPU"): two slots are pinned once, and reused.

    A whole item larger than a slot is read and copied in parts of whole checksum pieces; a
    resharded read larger than a slot gets a pageable buffer of its own, whose copy is awaited
    at once (a copy from pageable memory may return before the driver has taken the bytes)."""

    def __init__(self) -> None:
        self.slot_bytes = SLOT_BYTES
        self._slots: list[torch.Tensor] = []
        # Events per slot, and for the buffers of their own.
        self._events: list[list[Any]] = [[], [], []]
        self._turn = 0
        # The slot the batch last handed out is bound to, or _OWN.
        self._slot_of_batch = 0

    def batches(self, staged: list[ReadTarget]) -> Iterator[list[ReadTarget]]:
        """``staged`` (one file's) in batches bound to buffers: read each, then ``copy`` it,
        before taking the next."""
        total = sum(_rounded(p.view[0] + p.nbytes) for p in staged)
        size = min(self.slot_bytes, max(1 << 16, 1 << (total - 1).bit_length()))
        batch: list[tuple[ReadTarget, int]] = []
        used = 0
        for part in self._parts(staged, size):
            need = _rounded(part.view[0] + part.nbytes)
            if need > size:
                # A resharded read, or an item of pieces, larger than a slot.
                _bind(part)
                self._slot_of_batch = _OWN
                yield [part]
                continue
            if used + need > size:
                yield self._bound(batch, size)
                batch, used = [], 0
            batch.append((part, used))
            used += need
        if batch:
            yield self._bound(batch, size)

    def copy(self, batch: list[ReadTarget], planner: LoadPlanner) -> None:
        """Queue the copies of a batch that was read, commit the items it completes."""
        devices = set()
        for p in batch:
            if p.dst_offset is not None:
                whole = p.dst.reshape(-1).view(torch.uint8)
                whole[p.dst_offset : p.dst_offset + p.nbytes].copy_(p.buf, non_blocking=True)
            else:
                p.dst.copy_(p.src, non_blocking=True)
            devices.add(p.dst.device)
            if p.last_part:
                planner.commit_tensor(p.req, p.dst)
        self._events[self._slot_of_batch].extend(self._record(devices))
        if self._slot_of_batch == _OWN:
            # Its buffer goes when the next batch is taken.
            self._wait_slot(_OWN)

    def finish(self) -> None:
        """Wait for every copy out of the slots: the load is complete when read_data returns."""
        for k in range(len(self._events)):
            self._wait_slot(k)

    # The device side, in three small steps (a test drives the rest with CPU memory).
    def _new_slot(self, size: int) -> torch.Tensor:
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            # No pinned memory here (a locked-memory limit): slower, as correct.
            log.warning("dcp_datastates: could not pin a %d-byte load buffer (%s); loading into CUDA tensors "
                        "through pageable memory", size, exc)
            return torch.empty(size, dtype=torch.uint8)

    def _record(self, devices: set[torch.device]) -> list[Any]:
        """Marks, on each device's current stream, after the copies just queued."""
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events

    def _wait_slot(self, k: int) -> None:
        """Wait until the copies out of slot ``k`` (or the buffers of their own) are done."""
        for event in self._events[k]:
            event.synchronize()
        self._events[k].clear()

    def _parts(self, staged: list[ReadTarget], size: int) -> Iterator[ReadTarget]:
        """Whole items larger than a slot cut into parts of whole checksum pieces (any bytes
        when the item has no checksums); everything else as it is."""
        for p in staged:
            if p.dst_offset is None or p.nbytes <= size:
                yield p
                continue
            loc = p.loc
            pieces = piece_ranges(loc) if loc.crc32c else [(a, min(size, loc.offset + loc.length - a))
                                                            for a in range(loc.offset, loc.offset + loc.length, size)]
            if any(n > size for _, n in pieces):
                # Pieces larger than a slot: one pageable buffer.
                yield p
                continue
            start = end = pieces[0][0]
            for a, n in pieces:
                if a + n - start > size:
                    yield self._part(p, start, end, last=False)
                    start = a
                end = a + n
            yield self._part(p, start, end, last=True)

    @staticmethod
    def _part(p: ReadTarget, start: int, end: int, *, last: bool) -> ReadTarget:
        return ReadTarget(p.req, p.loc, 0, end - start, p.dst, False, start, staged=True, view=(0, 0, ()),
                          dst_offset=start - p.loc.offset, last_part=last)

    def _bound(self, batch: list[tuple[ReadTarget, int]], size: int) -> list[ReadTarget]:
        """Bind a batch to the next slot, once the copies out of it are done."""
        k, self._turn = self._turn, self._turn ^ 1
        self._wait_slot(k)
        if len(self._slots) <= k:
            self._slots.append(self._new_slot(size))
        elif self._slots[k].numel() < size:
            self._slots[k] = self._new_slot(size)
        slot = self._slots[k]
        self._slot_of_batch = k
        for p, offset in batch:
            _bind(p, slot[offset : offset + p.view[0] + p.nbytes])
        return [p for p, _ in batch]


def _rounded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
