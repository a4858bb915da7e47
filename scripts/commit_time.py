"""Time of the metadata work: the ``.metadata`` document of a checkpoint of N tensors, encoded
and checked (``format.metadata.encode_commit``, what ``commit.write_commit`` runs), for comparison
encoded then decoded (what the commit did before), and decoded (``decode_metadata``, what every
load runs first). Medians of 9, with Python's cyclic GC on (as in a training process) and paused.

    python scripts/commit_time.py [--tensors 1612 10000]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.format.metadata import decode_metadata, encode_commit, encode_metadata


def _median_ms(fn, runs: int = 9) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, nargs="+", default=[1612, 10000])
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    for n in args.tensors:
        state = {"model": {f"l{i // 8}.w{i % 8}": torch.randn(1000) for i in range(n)}, "step": 3}
        folder = tempfile.mkdtemp(prefix="commit_time_")
        dcp.save(state, storage_writer=DataStatesWriter(folder))
        with open(f"{folder}/.metadata", "rb") as f:
            raw = f.read()
        md, _ = decode_metadata(raw, folder)
        locations = dict(md.storage_data)

        runs = (("encode + decode", lambda md=md, loc=locations, f=folder: decode_metadata(encode_metadata(md, loc), f)),
                ("encode_commit", lambda md=md, loc=locations, f=folder: encode_commit(md, loc, f)),
                ("decode", lambda raw=raw, f=folder: decode_metadata(raw, f)))
        for name, fn in runs:
            with_gc = _median_ms(fn)
            gc.disable()
            try:
                without = _median_ms(fn)
            finally:
                gc.enable()
            print(f"{n} tensors, {name}: {with_gc} ms (GC paused: {without} ms)")


if __name__ == "__main__":
    main()
