"""Writes tests/data/format_v1: a small checkpoint in the library's file format, made with the code
of commit ef8db5f (before issue 13's restructuring). tests/test_format_v1.py loads it with the
current code: a checkpoint written before a change must still load, value for value.

    PYTHONPATH=<checkout of the old commit> python tests/data/make_format_v1.py tests/data/format_v1
"""

from __future__ import annotations

import io
import sys


def build_state() -> dict:
    """The saved state, rebuilt deterministically (fixed seeds)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    base = torch.randn(48, 40, generator=g)
    return {
        "model": {
            "embed.weight": torch.randn(64, 32, generator=g),
            "proj.weight_bf16": torch.randn(40, 24, generator=g).to(torch.bfloat16),
            "proj.bias_fp16": torch.randn(24, generator=g).to(torch.float16),
            "quant.int8": torch.randint(-128, 127, (33, 7), generator=g, dtype=torch.int8),
            "counts.int64": torch.randint(0, 1 << 40, (17,), generator=g, dtype=torch.int64),
            "mask.bool": torch.rand(29, generator=g) > 0.5,
            "empty": torch.zeros(0, 5),
            "scalar": torch.tensor(3.25),
            "transposed": base.t(),  # non-contiguous source
            "nested": {"deep": {"w": torch.arange(100, dtype=torch.float64).reshape(10, 10)}},
        },
        "step": 1234,
        "name": "format-v1",
        "schedule": [1, 2.5, "three", None],
        "blob": io.BytesIO(b"\x00\x01binary payload\xff" * 8),
    }


def main(folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    dcp.save(build_state(), storage_writer=DataStatesWriter(folder))


if __name__ == "__main__":
    main(sys.argv[1])
