"""The wire between two peers: typed messages over the peer group, and one data file sent and received.

Every message of an exchange goes with ``TAG`` (per sender and receiver pair they arrive in
order). A file travels in blocks, each prefixed with its length (``ABORT``: the sender could
not read the rest of its file, which it verifies piece by piece while reading), then the CRC32C
of the whole file as sent. The receiver writes it under a temporary name, checks every checksum
piece in the block that holds it and the whole file's CRC32C, fsyncs, and only then renames it
into place; a file that fails a check is dropped with a warning naming the sender, the file and
the piece. Any error of the group itself raises ``OutOfStep``: the group can no longer be
trusted to carry the next exchange.
"""

from __future__ import annotations

import json
import logging
import uuid

import torch
import torch.distributed as dist

from ..channel import channel_for
from ..storage import open_storage
from .file_copy import copy_verified

log = logging.getLogger("dcp_datastates")

__all__ = ["OutOfStep", "TAG", "ABORT", "send_tensor", "recv_tensor", "send_int", "recv_int", "send_json", "recv_json", "Wire",
           "between_pieces_crc", "send_file", "receive_file"]

TAG = 0x5EE  # every message of an exchange: per (sender, receiver) pair they arrive in order
ABORT = -1  # a block length: the sender could not read the rest of this file
MAX_MANIFEST = 64 << 20


class OutOfStep(RuntimeError):
    """The peer group can no longer be trusted to carry the next exchange (a peer timed out or
    sent something other than this exchange)."""


def send_tensor(peers, dst: int, t: torch.Tensor, what: str, tag: int = TAG) -> None:
    try:
        dist.send(t, dst, group=peers.group, tag=tag)
    except Exception as exc:  # noqa: BLE001 - gloo's own errors (timeout, connection closed)
        raise OutOfStep(f"sending {what} to rank {dst}: {exc}") from exc


def recv_tensor(peers, src: int, t: torch.Tensor, what: str, tag: int = TAG) -> torch.Tensor:
    try:
        dist.recv(t, src, group=peers.group, tag=tag)
    except Exception as exc:  # noqa: BLE001 - gloo's own errors (timeout, connection closed)
        raise OutOfStep(f"receiving {what} from rank {src}: {exc}") from exc
    return t


def send_int(peers, dst: int, value: int, what: str, tag: int = TAG) -> None:
    send_tensor(peers, dst, torch.tensor([value], dtype=torch.int64), what, tag=tag)


def recv_int(peers, src: int, what: str, tag: int = TAG) -> int:
    return int(recv_tensor(peers, src, torch.zeros(1, dtype=torch.int64), what, tag=tag)[0])


class Wire:
    """A binary file object (for ``file_copy.copy_verified``) that sends each block it is given to
    ``dst``, length first, and chains the CRC32C of everything sent."""

    def __init__(self, peers, dst: int, name: str, engine) -> None:
        self._peers, self._dst, self._name, self._engine = peers, dst, name, engine
        self.crc = 0
        self.out_of_step: BaseException | None = None

    def write(self, block) -> int:
        data = torch.frombuffer(block, dtype=torch.uint8) if len(block) else torch.empty(0, dtype=torch.uint8)
        self.crc = self._engine.crc32c(data.data_ptr(), data.numel(), self.crc)
        try:
            send_int(self._peers, self._dst, data.numel(), f"a block of {self._name}")
            send_tensor(self._peers, self._dst, data, f"a block of {self._name}")
        except OutOfStep as exc:
            self.out_of_step = exc
            raise
        return data.numel()


def send_json(peers, dst: int, raw: bytes, what: str, tag: int = TAG) -> None:
    send_int(peers, dst, len(raw), what, tag=tag)
    send_tensor(peers, dst, torch.frombuffer(bytearray(raw), dtype=torch.uint8), what, tag=tag)


def recv_json(peers, src: int, what: str, tag: int = TAG):
    size = recv_int(peers, src, f"{what} (its length)", tag=tag)
    if not 0 < size <= MAX_MANIFEST:
        raise OutOfStep(f"rank {src} sent a length of {size} bytes for {what}")
    raw = recv_tensor(peers, src, torch.empty(size, dtype=torch.uint8), what, tag=tag)
    try:
        return json.loads(bytes(raw.numpy()))
    except ValueError as exc:
        raise OutOfStep(f"rank {src} sent {what} that does not read: {exc}") from exc


def between_pieces_crc(path: str, size: int, pieces: list, engine) -> int:
    """The CRC32C of the bytes of the file at ``path`` that no checksum piece covers (its header
    and padding), in file order: with the pieces' own checksums, every byte of a file is
    compared when a mirror is checked."""
    crc, at = 0, 0
    with open(path, "rb") as f:
        for off, length, *_ in [*pieces, (size, 0)]:
            if off > at:
                f.seek(at)
                gap = bytearray(f.read(off - at))
                if gap:
                    t = torch.frombuffer(gap, dtype=torch.uint8)
                    crc = engine.crc32c(t.data_ptr(), t.numel(), crc)
            at = max(at, off + length)
    return crc


def send_file(peers, dst: int, store, name: str, size: int, pieces: list, engine) -> bool:
    """Send the file ``name`` of ``store`` to ``dst`` (``receive_file`` there): its blocks (cut
    so that no checksum piece spans two), then the CRC32C of all of it; False when it could not
    be read (the receiver is told and drops it). The pieces' checksums are checked by the
    receiver, against those the save recorded, not here as well: one pass less on this node,
    which is draining the same files meanwhile."""
    wire = Wire(peers, dst, name, engine)
    # The block cuts only.
    unchecked = [(p[0], p[1], None, p[3]) for p in pieces]
    try:
        copy_verified(store, name, wire, size, unchecked, engine)
    except Exception as exc:  # noqa: BLE001 - a damaged or vanished local file: the peer drops it
        if wire.out_of_step is not None:
            raise wire.out_of_step from None
        log.warning("dcp_datastates: peer copy of %s to rank %d not made: %s", store.where(name), dst, exc)
        send_int(peers, dst, ABORT, f"the end of {name}")
        return False
    send_int(peers, dst, wire.crc, f"the checksum of {name}")
    return True


def receive_file(peers, src: int, folder: str, name: str, size: int, pieces: list, engine, config) -> bool:
    """One file's blocks from ``src`` (``send_file`` there), checked and written under a temporary name, renamed into
    ``folder`` when every check holds. Every block is read off the wire even after a check
    failed (the next file follows it)."""
    pending = sorted((int(p[0]), int(p[1]), int(p[2]), str(p[3])) for p in pieces)
    problem: str | None = None
    crc, got = 0, 0
    tmp = f".{name}.peer-{uuid.uuid4().hex[:8]}.tmp"
    store = open_storage(folder)
    try:
        with channel_for(store).create_streamed(tmp, sync=config.sync_files) as out:
            while got < size:
                n = recv_int(peers, src, f"a block of {name}")
                if n == ABORT:
                    return _dropped(folder, name, src, "the sender could not read its own file", store, tmp)
                if not 0 < n <= size - got:
                    raise OutOfStep(f"rank {src} sent a block of {n} bytes at offset {got} of {name} ({size} bytes)")
                block = recv_tensor(peers, src, torch.empty(n, dtype=torch.uint8), f"a block of {name}")
                crc = engine.crc32c(block.data_ptr(), n, crc)
                if problem is None:
                    problem = _check_pieces(block, got, pending, engine, name)
                if problem is None:
                    out.write(memoryview(block.numpy()))
                got += n
            sent_crc = recv_int(peers, src, f"the checksum of {name}")
        if problem is None and pending:
            problem = f"piece of item {pending[0][3]!r} at offset {pending[0][0]} did not arrive whole in one block"
        if problem is None and sent_crc != crc:
            problem = f"the file's crc32c as sent is {sent_crc:#010x}, as received {crc:#010x}"
        if problem is not None:
            return _dropped(folder, name, src, problem, store, tmp)
        store.move(tmp, store, name)
        return True
    except BaseException:
        store.remove_quietly(tmp)
        raise


def _check_pieces(block: torch.Tensor, start: int, pending: list, engine, name: str) -> str | None:
    """Check the pieces that lie wholly in ``block`` (file bytes [start, start + len)), taking
    them off ``pending``; the first mismatch, described, or None."""
    end = start + block.numel()
    inside = [p for p in pending if p[0] >= start and p[0] + p[1] <= end]
    if not inside:
        return None
    crcs = engine.crc32c_ranges(block.data_ptr(), [(off - start, length) for off, length, _, _ in inside])
    for (off, length, want, item), got in zip(inside, crcs):
        if got != want:
            return (f"item {item!r}, bytes [{off}, {off + length}) of {name}: recorded crc32c {want:#010x}, "
                    f"received {got:#010x}")
    done = set(inside)
    pending[:] = [p for p in pending if p not in done]
    return None


def _dropped(folder: str, name: str, src: int, why: str, store, tmp: str) -> bool:
    store.remove_quietly(tmp)
    log.warning("dcp_datastates: the peer copy of %s from rank %d was not kept in %s: %s", name, src, folder, why)
    return False
