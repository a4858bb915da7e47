"""Value serialization: the bytes of a non-tensor value of the state, as DCP's planners make them.

Made at the request (by the scan, or for the items of a plan-cache miss), so that later changes to
the object never reach the checkpoint.
"""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["serialize_object"]


def serialize_object(obj: Any) -> torch.Tensor:
    """The bytes DCP's planners produce for a non-tensor value (``torch.save``), made now so
    later changes to the object never reach the checkpoint, in a uint8 tensor of their own (what
    the engine copies them from)."""
    out = io.BytesIO()
    torch.save(obj, out)
    data = out.getvalue()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
