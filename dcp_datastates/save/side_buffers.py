"""The small items copied at the request into a side buffer, reused between saves.

Small tensors are copied at the request instead of lazily (``copy_at_request_max_bytes``;
``copy_at_request.py`` says which).

The lazy guarantee rests on the tensors not changing between ``stage()`` and the end of their
copy. Parameters and optimizer state change only in ``optimizer.step()``, which waits for staging
(the global step pre-hook, runtime/inflight.py). Forward does change some state: BatchNorm updates
``running_mean`` / ``running_var`` inside its kernel (no version bump, so the guard cannot see
it) and ``num_batches_tracked`` in place. Such state is small, so it is copied right here, on the
training thread: host memory with one memcpy per item, CUDA memory device-to-device on the
caller's current stream, where every kernel queued later (the next forward) runs after the copy.
The engine then copies from that side buffer lazily like any other item.

Side buffers are reused: a fresh one costs a page fault per 4 KiB page on first touch, on the
training thread (most of the call's time when such items are large). A buffer
is given back (``give_back``) only once the engine job reading it is staged, so no copy of an
earlier save can still read what the next request writes into it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..forking import new_locks_in_child

__all__ = ["copy_small_at_request", "give_back"]

_ALIGN = 16
_POOL_BYTES = 256 << 20  # at most this much kept between saves (a few buffers: one per layout)
_pool: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
_pool_lock = threading.Lock()
new_locks_in_child(globals(), "_pool_lock")


def _take(device: torch.device, nbytes: int) -> torch.Tensor:
    with _pool_lock:
        buffer = _pool.pop((str(device), nbytes), None)
    return buffer if buffer is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)


def give_back(buffer: torch.Tensor) -> None:
    """Keep ``buffer`` (a side buffer no engine copy reads any more) for a later request."""
    if buffer.numel() > _POOL_BYTES:
        return
    with _pool_lock:
        _pool[(str(buffer.device), buffer.numel())] = buffer
        _pool.move_to_end((str(buffer.device), buffer.numel()))
        while sum(b.numel() for b in _pool.values()) > _POOL_BYTES:
            _pool.popitem(last=False)


def copy_small_at_request(engine, device: int, stream: int, spans: list, keepalive: list, max_bytes: int,
                          what: str) -> tuple[list, list, torch.Tensor | None]:
    """``spans`` (pointer, nbytes, file offset) with every item of 1..``max_bytes`` bytes copied
    now into one side buffer and pointing there, the keep-alives (the buffer appended, the small
    items' owners dropped), and the buffer (None: nothing to copy, the rest unchanged). The
    buffer may be one an earlier save gave back: the caller gives it back in turn once its job
    is staged."""
    if max_bytes <= 0:
        return spans, keepalive, None
    small = [i for i, span in enumerate(spans) if 0 < span[1] <= max_bytes]
    if not small:
        return spans, keepalive, None
    offsets, total = [], 0
    for i in small:
        offsets.append(total)
        total += -(-spans[i][1] // _ALIGN) * _ALIGN
    # On the device the items' memory is on (their keep-alive: a tensor or an untyped storage).
    buffer = _take(keepalive[small[0]].device, total)
    base = buffer.data_ptr()
    engine.snapshot(device, stream, base, [(spans[i][0], spans[i][1], off) for i, off in zip(small, offsets)], what)
    spans, keepalive = list(spans), list(keepalive)
    for i, off in zip(small, offsets):
        ptr, nbytes, file_offset = spans[i]
        spans[i] = (base + off, nbytes, file_offset)
        keepalive[i] = None
    keepalive.append(buffer)
    return spans, keepalive, buffer
