"""Copies small tensors at the request instead of lazily (``copy_at_request_max_bytes``).

The lazy guarantee rests on the tensors not changing between ``stage()`` and the end of their
copy. Parameters and optimizer state change only in ``optimizer.step()``, which waits for staging
(the global step pre-hook, runtime/staging_wait.py). Forward does change some state: BatchNorm updates
``running_mean`` / ``running_var`` inside its kernel (no version bump, so the guard cannot see
it) and ``num_batches_tracked`` in place. Such state is small, so it is copied right here, on the
training thread: host memory with one memcpy per item, CUDA memory device-to-device on the
caller's current stream, where every kernel queued later (the next forward) runs after the copy.
The engine then copies from that side buffer lazily like any other item.
"""

from __future__ import annotations

import torch

__all__ = ["copy_small_at_request"]

_ALIGN = 16


def copy_small_at_request(engine, device: int, stream: int, spans: list, keepalive: list, max_bytes: int,
                          what: str) -> tuple[list, list]:
    """``spans`` (pointer, nbytes, file offset) with every item of 1..``max_bytes`` bytes copied
    now into one side buffer and pointing there, and the keep-alives (the buffer appended, the
    small items' owners dropped). Unchanged when there is nothing to copy."""
    if max_bytes <= 0:
        return spans, keepalive
    small = [i for i, span in enumerate(spans) if 0 < span[1] <= max_bytes]
    if not small:
        return spans, keepalive
    offsets, total = [], 0
    for i in small:
        offsets.append(total)
        total += -(-spans[i][1] // _ALIGN) * _ALIGN
    # On the device the items' memory is on (their keep-alive: a tensor or an untyped storage).
    buffer = torch.empty(total, dtype=torch.uint8, device=keepalive[small[0]].device)
    base = buffer.data_ptr()
    engine.snapshot(device, stream, base, [(spans[i][0], spans[i][1], off) for i, off in zip(small, offsets)], what)
    spans, keepalive = list(spans), list(keepalive)
    for i, off in zip(small, offsets):
        ptr, nbytes, file_offset = spans[i]
        spans[i] = (base + off, nbytes, file_offset)
        keepalive[i] = None
    keepalive.append(buffer)
    return spans, keepalive
