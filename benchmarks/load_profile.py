"""Where a load's time goes, step by step, into CPU or CUDA tensors (it found why a load into CUDA
tensors took 10.7x the raw host read on an H200: benchmarks/results/history-benchmarks.md,
"H200, 2026-11-26").

One checkpoint of the bench's state (``bench.build_state``: large 2-D tensors plus tiny ones) is
saved once, then loaded ``--loads`` times with ``dcp.load`` + ``DataStatesReader`` into existing
tensors on ``--device``. Each load's time is split by timing the reader's steps in place (the
functions are wrapped for this process only):

  metadata      ``read_metadata`` (the commit read and decoded)
  plan          DCP's planning between read_metadata and read_data
  targets       ``load.read.targets``: where each item lands (a buffer for each CPU item not
                read in place; CUDA destinations get theirs from DeviceStaging's slots)
  read          ``load.read.read_targets``: the storage reads, checksums verified
  deliver       ``load.read.deliver``: copies into the destinations (queued on a side stream
                for CUDA), planner commits
  device_copy   ``load.read.DeviceStaging.copy``: queueing the copies out of the pinned slots
                into CUDA destinations, planner commits
  device_wait   ``load.read.DeviceStaging.finish``: waiting for the last of those copies (the
                code before DeviceStaging: ``finish_device_copies``, for A/B runs)

and, side by side in the same run, the baselines of the same bytes: a raw read of the data
file into fresh memory (``raw_bound``), ``torch.load`` of a ``torch.save`` of the state with
``map_location`` = the device, and (CUDA) a plain ``copy_`` of a pinned host copy of the state
into the destinations, and the same from pageable memory. Medians; ``--json`` keeps every sample.

    python benchmarks/load_profile.py [--device cuda] [--size 512MiB] [--tensors 2256] [--loads 5] [--cold]

``--cold`` evicts the files (the checkpoint's, the raw bound's, torch.save's) before each load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = ("metadata", "plan", "targets", "read", "deliver", "device_copy", "device_wait")


def _sibling(name: str):
    sys.path.insert(0, HERE)
    try:
        return __import__(name)
    finally:
        sys.path.remove(HERE)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class StepClock:
    """Seconds spent in each wrapped function during one load."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.marks: dict[str, float] = {}

    def wrap(self, owner, attr: str, step: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.spent[step] += t1 - t0
                self.marks[f"{step}_end"] = t1
                self.marks.setdefault(f"{step}_start", t0)

        setattr(owner, attr, timed)


def profile(device: str, size: int, tensors: int, loads: int, root: str, cold: bool = False) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_datastates.load.read as read_mod
    import dcp_datastates.reader as reader_mod
    from dcp_datastates import DataStatesReader, DataStatesWriter

    bench = _sibling("bench")
    raw_bound = _sibling("raw_bound")
    large = min(256, tensors // 2)
    state, nbytes, count = bench.build_state(bench.StateSpec(size, large, tensors - large, ["float32", "float32", "bfloat16"],
                                                             device))
    folder = os.path.join(root, "ckpt")
    dcp.save(state, storage_writer=DataStatesWriter(folder))
    load_into = bench.empty_like_state(state)  # existing destinations, as a resume has

    clock = StepClock()
    clock.wrap(reader_mod.DataStatesReader, "read_metadata", "metadata")
    clock.wrap(read_mod, "targets", "targets")
    clock.wrap(read_mod, "read_targets", "read")
    clock.wrap(read_mod, "deliver", "deliver")
    if hasattr(read_mod, "DeviceStaging"):
        clock.wrap(read_mod.DeviceStaging, "copy", "device_copy")
        clock.wrap(read_mod.DeviceStaging, "finish", "device_wait")
    else:  # the code before DeviceStaging (2026-11-26), for A/B runs
        clock.wrap(read_mod, "finish_device_copies", "device_wait")
    clock.wrap(reader_mod.DataStatesReader, "read_data", "read_data")

    evict = bench._Cold("fadvise" if cold else None)
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(loads):
        bench.scrub_state(load_into)
        evict(folder)  # --cold: the checkpoint's files out of the page cache (fsync + fadvise)
        clock.spent.clear()
        clock.marks.clear()
        _sync(device)
        t0 = time.perf_counter()
        dcp.load(load_into, storage_reader=DataStatesReader(folder))
        _sync(device)
        total = time.perf_counter() - t0
        samples["total"].append(total)
        for step in STEPS:
            if step == "plan":
                continue
            samples[step].append(clock.spent.get(step, 0.0))
        samples["plan"].append(clock.marks.get("read_data_start", t0) - clock.marks.get("metadata_end", t0))
        samples["bitwise_equal"].append(float(bench.states_equal(load_into, state)))

    data_files = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    data_bytes = sum(os.path.getsize(os.path.join(folder, n)) for n in data_files)
    # cold: as many raw samples as loads, each read after evicting the raw file
    raw = raw_bound.measure_raw(os.path.join(root, "raw"), data_bytes, loads if cold else 1, evict if cold else None)
    pt = os.path.join(root, "state.pt")
    torch.save(state, pt)
    for _ in range(loads):
        evict(pt)
        _sync(device)
        t0 = time.perf_counter()
        torch.load(pt, map_location=device, weights_only=True)
        _sync(device)
        samples["torch_load"].append(time.perf_counter() - t0)
    if device == "cuda":
        pageable = [t.detach().to("cpu") for t in _tensors(bench, state)]
        for name, host in (("pinned_h2d_copy", [t.pin_memory() for t in pageable]), ("pageable_h2d_copy", pageable)):
            for _ in range(loads):
                _sync(device)
                t0 = time.perf_counter()
                for src, dst in zip(host, _tensors(bench, load_into)):
                    dst.copy_(src, non_blocking=True)
                _sync(device)
                samples[name].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    import dcp_datastates

    return {"package": os.path.dirname(dcp_datastates.__file__), "device": device, "bytes": nbytes, "tensors": count, "data_file_bytes": data_bytes, "loads": loads, "cold": cold,
            "medians_s": medians, "samples_s": dict(samples), "raw": raw,
            "cuda": torch.cuda.get_device_name() if device == "cuda" else None}


def _tensors(bench, state: dict) -> list:
    """The state's tensors in its (flattened) order."""
    import torch

    return [v for v in bench.flatten(state).values() if isinstance(v, torch.Tensor)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--size", default="512MiB", help="tensor bytes of the state (default 512MiB)")
    p.add_argument("--tensors", type=int, default=2256, help="tensors in the state (default 2256; at most 256 large)")
    p.add_argument("--loads", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to save (default: a new folder under /tmp)")
    p.add_argument("--cold", action="store_true", help="evict the files from the page cache before each load "
                   "(fsync + posix_fadvise(DONTNEED), as bench's cold loads; not on tmpfs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    from dcp_datastates.config import parse_size

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    if args.loads < 1 or args.tensors < 2:
        p.error("--loads must be >= 1 and --tensors >= 2")
    root = tempfile.mkdtemp(prefix="load_profile_", dir=args.dir)
    try:
        out = profile(args.device, parse_size(args.size), args.tensors, args.loads, root, args.cold)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    m = out["medians_s"]
    print(f"dcp_datastates from {out['package']}")
    print(f"{out['tensors']} tensors, {out['bytes'] / 2**20:.0f} MiB into {args.device}"
          + (f" ({out['cuda']})" if out["cuda"] else "") + f", medians of {args.loads}:")
    print(f"  dcp.load + DataStatesReader {m['total'] * 1e3:8.1f} ms (bitwise equal: {m['bitwise_equal'] == 1.0})")
    for step in STEPS:
        print(f"    {step:<12} {m[step] * 1e3:8.1f} ms")
    print(f"  torch.load(map_location)    {m['torch_load'] * 1e3:8.1f} ms")
    if "pinned_h2d_copy" in m:
        print(f"  pinned host -> device copy  {m['pinned_h2d_copy'] * 1e3:8.1f} ms")
        print(f"  pageable host -> device     {m['pageable_h2d_copy'] * 1e3:8.1f} ms")
    raw = out["raw"]
    print(f"  raw read into fresh memory  {raw.get('read_warm_s', float('nan')) * 1e3:8.1f} ms ({raw.get('read_warm_how')})")
    if args.cold:
        print(f"  raw cold read               {raw.get('read_cold_s', float('nan')) * 1e3:8.1f} ms ({raw.get('read_cold_how')})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
