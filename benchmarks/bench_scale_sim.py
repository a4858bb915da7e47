"""Scale simulator: rank 0's and one chosen rank's part of a DCP save and load at N ranks.

One process per case reproduces what rank 0 (the coordinator) and one chosen rank do in a DCP
save and load at N simulated ranks (8 ... 16,384, millions of chunks), running the library
functions of the real path (never copies of them), for this backend ("datastates") and stock DCP
("dcp") side by side. Only the ``.metadata`` commit marker is written (to a temporary folder).

State dict: Llama-3 8B/70B/405B parameter shapes (70B: 723 parameters), parameters fp32, AdamW's
exp_avg/exp_avg_sq (fp32, sharded as the parameter) and ``step`` (a plain 0-dim fp32 tensor, as
under FSDP2) per parameter, and AdamW's param group, nested as ``get_state_dict`` returns them
(``{"model": ..., "optim": {"state": ..., "param_groups": [...]}}``) so DCP's own flattening names
the items. Layouts: ``fsdp`` Shard(0) over N; ``hsdp`` (Replicate, Shard(0)) on an (N/S, S) mesh,
S = min(N, 128); ``fsdp_tp`` (Shard(0), tp) on an (N/8, 8) mesh, tp = Shard(0) for
wq/wk/wv/w1/w3/output/tok_embeddings, Shard(1) for wo/w2, Replicate for norms.

Every simulated rank holds ``SimShard`` objects whose chunk boxes are DTensor's own arithmetic
(``_compute_local_shape_and_global_offset``: an empty shard has size 0 at offset = the dim's size);
DCP's planners take them through the duck-typed ``__create_write_items__`` /
``__create_chunk_list__`` as they take DTensors. The chosen rank holds REAL DTensors on a fake
process group (``FakeStore``, ``init_device_mesh("cpu")``, ``DTensor.from_local`` of a 0-dim tensor
expanded to the local shape: right shape and dtype, no memory; works at N=16384, ~0.3 ms each),
and each case checks that their local plan equals the SimShard one.

Figures (medians of up to --repeat runs; a step stops repeating past 30 s; Python's cyclic GC on,
as in training, except where the library pauses it itself: our commit runs paused, as the writer's
save does, and our metadata read, as the reader's load does; ``*_gc_s`` is the collector's share
of a step, measured through gc.callbacks):
  local_plan_s          chosen rank: ``create_local_plan`` (local_setup_s: ``set_up_planner``), on
                        DTensors: DataStatesSavePlanner (plan caching) / DefaultSavePlanner()
  global_plan_first_s   rank 0: ``create_global_plan`` of all N plans (each made by the method's
                        planner, prepared as its writer does, pickled + unpickled as gathered)
  gather_plans_s        rank 0: unpickling every rank's local plan of a first save, as DCP's gather
                        does (GC off): ours packed by ``wire_save_plan`` as its writer sends them
  global_plan_steady_s  the next save: ours sends the cached empty, unusable plans (checked on the
                        chosen rank: steady_plan_unusable); stock has no caching (= first)
  gather_results_s      rank 0: unpickling every rank's write results as DCP's gather does (GC off):
                        ours, each rank's packed by ``pack_write_results`` as its writer sends them
  commit_s              rank 0: ours: ``DataStatesWriter.finish``'s ``CommitLocations`` +
                        ``encode_commit``, steady (after a first commit, timed alone as
                        commit_first_s: what a steady state repeats is taken again from the commit
                        before); stock: ``FileSystemWriter.finish`` (pickle, write, fsync, rename)
  metadata_write_s      ours: ``Storage.put(".metadata", sync=True)`` (write, fsync, rename)
  md_read_s, load_plan_default_s, load_plan_ours_s, load_total_s
                        chosen rank, in a fresh process: ``DataStatesReader`` / ``FileSystemReader``
                        ``.read_metadata()``, then ``set_up_planner`` + ``create_local_plan`` of
                        DefaultLoadPlanner (both) and DataStatesLoadPlanner (ours; our reader pauses
                        the GC for a load); each planner gets a fresh read (decodes may be lazy)
  load_plan_bytes       the chosen rank's load plan (its method's own planner) pickled as its reader
                        sends it to the coordinator at every load (DCP gathers every rank's and
                        scatters them back: about 2 x N x this through rank 0)
  load_coordinator_s    rank 0 at every load, after the chosen rank's: N copies of that rank's
                        load plan unpickled as DCP's gather does, the method's global load plan
                        (its planner's and its reader's), each plan pickled for DCP's scatter (GC
                        off); every other rank waits for it
  gather_*/scatter_*/broadcast_metadata
                        pickled bytes through rank 0: local plans, scattered plans, write results,
                        and one copy of the metadata DCP broadcasts after finish
  peak_extra_mib        rank 0: VmHWM (reset via /proc/self/clear_refs) above VmRSS, over the global
                        plans, the gathered write results, commit and write; load_peak_extra_mib:
                        the chosen rank's load. RSS based: memory freed and reused is not counted.
Write results: ours ``ItemLocation``s in ``data_file_name(rank)``, back to back after the header
``plan_file`` makes for the chosen rank's items (the same data_start for every rank), one random
CRC per piece of the engine's grid (``piece_count``, 16 MiB); stock ``_StorageInfo`` in
``__<rank>_0.distcp``. The library calls of each method sit in METHODS: swap them there only.

    python benchmarks/bench_scale_sim.py                        # the default set, ~15 min on 2 cores
    python benchmarks/bench_scale_sim.py --layouts fsdp hsdp fsdp_tp --models 8b 70b 405b \
        --ranks 8 64 256 1024 --methods datastates dcp --repeat 3 --json out.json
    python benchmarks/bench_scale_sim.py --layouts fsdp --models 70b --ranks 1024 --case-timeout 3000 \
        --profile prof/                                          # + cProfile of the commit and load
    python benchmarks/bench_scale_sim.py --check                # simulator against real saves

A case whose memory estimate (rank 0's bytes per plan item, learned from the run's large cases)
exceeds 70% of MemAvailable is skipped with the estimate (e.g. 405B at 16,384 ranks: ~200 GB).

``--check``: (1) REAL 2- and 4-process gloo saves of a tiny model (FSDP2 ``fully_shard`` on CPU,
AdamW, ``get_state_dict``, ``dcp.save`` with DataStatesWriter; N=4 has an empty shard): each rank's
local plan and the committed ``.metadata`` (fqns, sizes, dtypes, chunks) must equal the
simulator's; (2) real DTensors on a fake process group, N=1024 and 16384, sampled ranks, all
layouts: DTensor local plans equal SimShard ones. Exit status 1 on any mismatch.

Known limits: no data file is written, so the commit's data-file size check, ``remember_commit``
and the folder cleanup do not run; stock lengths are raw tensor bytes (torch.save adds ~1 KB an
item); the writer's stage-time replica policy is applied (``skip_replicas``), plain tensors stay
in every plan as with the real writer; fsdp_tp uses plain Shard placements on both mesh dims (FSDP2
over dim-0 TP uses _StridedShard on dp: the same boxes, given to other ranks); gathers are pickling
only, no transport. DCP's ``_validate_global_plan`` is quadratic in the chunks of a tensor whose
sharded dim is not its largest (wk/wv/w2 under fsdp): a 1024-rank 70B case takes 12-26 min a
method, most of it rank 0's global plan and full GC passes over its ~8 GB heap; those GC passes
make single runs at that size vary by 2-4x (compare ``*_gc_s``).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import dataclasses
import datetime
import gc
import io
import json
import os
import pickle
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset, compute_local_shape_and_global_offset

from dcp_datastates import DataStatesConfig, DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner, DataStatesWriter
from dcp_datastates import planners as ds_planners
from dcp_datastates.format import layout as ds_layout
from dcp_datastates.format import locations as ds_locations
from dcp_datastates.format.dcp_plans import wire_save_plan
from dcp_datastates.format.metadata import encode_commit
from dcp_datastates.format.results import CommitLocations, pack_write_results
from dcp_datastates.native import engine_module
from dcp_datastates.runtime.gc_pause import gc_paused
from dcp_datastates.save import CommitNotice, skip_replicas
from dcp_datastates.save.in_flight import SaveRequest
from dcp_datastates.save.ownership import _dtensor_replicas
from dcp_datastates.storage import open_storage
from dcp_datastates.writer import RankReport

try:  # private: FileSystemWriter's storage_data (fine in a benchmark)
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover
    _StorageInfo = None

MODELS = {  # layers, dim, heads, kv_heads, ffn, vocab
    "tiny": (2, 64, 4, 1, 96, 6),  # vocab 6: an empty tok_embeddings/output shard at N=4
    "8b": (32, 4096, 32, 8, 14336, 128256),
    "70b": (80, 8192, 64, 8, 28672, 128256),
    "405b": (126, 16384, 128, 8, 53248, 128256),
}
LAYOUTS = ("fsdp", "hsdp", "fsdp_tp")
DTYPE = torch.float32
TP, HSDP_SHARD = 8, 128
PIECE = DataStatesConfig().chunk_size
PIECE_COUNT = engine_module().piece_count
STEP_BUDGET_S = 30.0  # a step repeats while its runs total less than this (it runs at least once)
# About 15 minutes on 2 cores (measured: 923 s); a 1024-rank fsdp 70B case alone takes 12-26 min a method.
DEFAULT_CASES = [("fsdp", "70b", 8), ("fsdp", "70b", 64), ("fsdp", "70b", 256), ("fsdp_tp", "8b", 256),
                 ("hsdp", "8b", 1024)]
# Rank 0's bytes per gathered plan item (plans, global plan, results, metadata) until a case of
# this run measures it (the largest figure seen is used then): 2,665 measured at 1024 ranks, 70B.
DEFAULT_ITEM_BYTES = 3000


def param_shapes(model: str) -> dict[str, tuple[int, ...]]:
    layers, dim, heads, kv, ffn, vocab = MODELS[model]
    kvd = kv * (dim // heads)
    out = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({p + "attention.wq.weight": (dim, dim), p + "attention.wk.weight": (kvd, dim),
                    p + "attention.wv.weight": (kvd, dim), p + "attention.wo.weight": (dim, dim),
                    p + "feed_forward.w1.weight": (ffn, dim), p + "feed_forward.w2.weight": (dim, ffn),
                    p + "feed_forward.w3.weight": (ffn, dim), p + "attention_norm.weight": (dim,),
                    p + "ffn_norm.weight": (dim,)})
    out["norm.weight"], out["output.weight"] = (dim,), (vocab, dim)
    return out


def mesh_shape(layout: str, n: int) -> tuple[int, ...]:
    if layout == "fsdp":
        return (n,)
    return (n // min(n, HSDP_SHARD), min(n, HSDP_SHARD)) if layout == "hsdp" else (n // TP, TP)


def placements(layout: str, fqn: str, ndim: int) -> tuple:
    if layout == "fsdp":
        return (Shard(0),)
    if layout == "hsdp":
        return (Replicate(), Shard(0))
    name = fqn.rsplit(".", 2)[-2]  # wq, w2, output, norm ...
    return (Shard(0), Shard(1) if name in ("wo", "w2") else Replicate() if ndim == 1 else Shard(0))


def coordinate(mshape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    out = []
    for size in reversed(mshape):  # row-major, as init_device_mesh lays out ranks
        rank, c = divmod(rank, size)
        out.append(c)
    return tuple(reversed(out))


def adamw_group(fqns) -> dict:
    """AdamW's own param group (its defaults) with the parameter names get_state_dict puts there."""
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    return dict(group, params=list(fqns))


# ------------------------------------------------------------------------------ the state dicts
class SimShard:
    """One rank's shard of a tensor (global shape, dtype, chunk box), planned by DCP through the
    hooks a DTensor answers. ``placements`` and ``device_mesh`` (coordinate and sizes only) are
    what the writer's replica policy reads."""

    __slots__ = ("shape", "dtype", "offsets", "sizes", "placements", "device_mesh")

    def __init__(self, shape, dtype, offsets, sizes, pls, mesh) -> None:
        self.shape, self.dtype, self.offsets, self.sizes = shape, dtype, offsets, sizes
        self.placements, self.device_mesh = pls, mesh

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes),
                                                      properties=TensorProperties(dtype=self.dtype), size=self.shape))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)]


_BOXES: dict = {}


def sim_leaf(layout: str, n: int, rank: int) -> Callable:
    mshape = mesh_shape(layout, n)
    coord = coordinate(mshape, rank)
    mesh = types.SimpleNamespace(get_coordinate=lambda: list(coord), size=lambda d: mshape[d])

    def leaf(shape, pls):
        key = (shape, mshape, coord, pls)
        box = _BOXES.get(key)
        if box is None:  # DTensor's own arithmetic, once per distinct shape, placement and rank
            sizes, offsets = _compute_local_shape_and_global_offset(shape, mshape, list(coord), pls)
            box = _BOXES[key] = (torch.Size(shape), torch.Size(offsets), torch.Size(sizes))
        return SimShard(box[0], DTYPE, box[1], box[2], pls, mesh)
    return leaf


def dtensor_leaf(mesh) -> Callable:
    base = torch.zeros((), dtype=DTYPE)

    def leaf(shape, pls):
        sizes, _ = compute_local_shape_and_global_offset(shape, mesh, pls)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(base.expand(sizes), mesh, pls, run_check=False, shape=torch.Size(shape), stride=stride)
    return leaf


def build_state(model: str, layout: str, leaf: Callable, steps: dict, group: dict) -> dict:
    msd, ostate = {}, {}
    for fqn, shape in param_shapes(model).items():
        pls = placements(layout, fqn, len(shape))
        msd[fqn] = leaf(shape, pls)
        ostate[fqn] = {"step": steps[fqn], "exp_avg": leaf(shape, pls), "exp_avg_sq": leaf(shape, pls)}
    return {"model": msd, "optim": {"state": ostate, "param_groups": [group]}}


def plain_values(model: str) -> tuple[dict, dict]:
    """The optimizer's step tensors (shared by the simulated ranks) and param group."""
    fqns = list(param_shapes(model))
    return {fqn: torch.tensor(0.0) for fqn in fqns}, adamw_group(fqns)


def chosen_state(case: dict) -> dict:
    """The chosen rank's state dict of real DTensors on a fake process group of N ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    layout, n = case["layout"], case["n"]
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=case["rank"], world_size=n, store=FakeStore())
    mesh = init_device_mesh("cpu", mesh_shape(layout, n))
    return build_state(case["model"], layout, dtensor_leaf(mesh), *plain_values(case["model"]))


# ------------------------------------------------------------------------------ the methods
def _ds_prepare_local_plan(plan: SavePlan, rank: int, flat: dict, folder: str) -> SavePlan:
    """DataStatesWriter.prepare_local_plan: a replicated DTensor shard stays in the plan of the
    replica that staged it only (``_dtensor_replicas``, ``skip_replicas``); the rank's report;
    packed for the gather (``wire_save_plan``)."""
    skipped = set()
    if plan.usable:
        for fqn, obj in flat.items():
            if isinstance(obj, (SimShard, DTensor)) and any(p.is_replicate() for p in obj.placements):
                key = (fqn, tuple(obj.__create_chunk_list__()[0].offsets))
                rep = _dtensor_replicas(obj, key, None)
                if rep is not None and rep.writer != rep.mine:
                    skipped.add(key)
    plan = skip_replicas(types.SimpleNamespace(request=SaveRequest(skipped=frozenset(skipped))), plan)
    return wire_save_plan(dataclasses.replace(plan, storage_data=RankReport(rank, folder)))


def _ds_location(file, offset, length, dtype, shape, data_start, file_size):
    crcs = tuple(random.getrandbits(32) for _ in range(PIECE_COUNT(offset, length, data_start, PIECE)))
    return ds_locations.ItemLocation(file, offset, length, dtype, shape, crcs, data_start, PIECE, file_size)


def _ds_commit(metadata, results, folder):
    """DataStatesWriter.finish up to the marker's bytes (what commit.write_commit encodes)."""
    if metadata.storage_meta is None:
        metadata = dataclasses.replace(metadata, storage_meta=StorageMeta(checkpoint_id=folder, save_id=uuid.uuid4().hex))
    # The writer's save runs with Python's cyclic GC paused from the request to the commit
    # (runtime/inflight.py): the commit is timed as it runs there.
    with gc_paused():
        return encode_commit(metadata, CommitLocations(results, metadata), "sim")[0]


def _ds_read(folder):
    reader = DataStatesReader(folder)
    return reader.read_metadata(), getattr(reader, "_end_load_pause", lambda: None)


def _ds_broadcast(metadata):
    metadata.storage_data = CommitNotice()  # finish leaves this in the metadata DCP broadcasts
    return metadata


def _dcp_commit(metadata, results, folder):
    writer = FileSystemWriter(folder)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    writer.finish(metadata, results)


@dataclass(frozen=True)
class Method:
    save_planner: Callable  # cache key -> the save planner every rank runs
    caching: bool  # a steady state with cached plans
    prepare_local_plan: Callable  # (plan, rank, flat state, folder) -> what the rank sends
    prepare_global_plan: Callable  # (folder, plans) -> what rank 0 scatters
    file_name: Callable  # rank -> its data file
    header_size: Callable  # [FileEntry] -> first data byte of a rank's file
    location: Callable  # (file, offset, length, dtype name, shape, data_start, file_size) -> storage_data
    send_results: Callable  # a rank's write results -> what its write_data returns
    commit: Callable  # (metadata, results, folder) -> payload (commit_s)
    write: Callable | None  # (payload, folder) (metadata_write_s)
    broadcast: Callable  # metadata after the commit -> what DCP broadcasts
    read_metadata: Callable  # folder -> (Metadata, end of the load)
    load_planners: dict
    prepare_load_plan: Callable  # (folder, load plan) -> what the rank sends the coordinator
    load_global_plan: Callable  # (folder, gathered load plans) -> what the coordinator scatters


METHODS = {
    "datastates": Method(
        save_planner=lambda key: DataStatesSavePlanner(cache_key=key), caching=True,
        prepare_local_plan=_ds_prepare_local_plan,
        prepare_global_plan=lambda folder, plans: DataStatesWriter(folder).prepare_global_plan(plans),
        file_name=ds_layout.data_file_name, header_size=lambda entries: ds_layout.plan_file(entries).data_start,
        location=_ds_location, send_results=pack_write_results, commit=_ds_commit,
        write=lambda data, folder: open_storage(folder).put(ds_layout.METADATA_NAME, data, sync=True),
        broadcast=_ds_broadcast, read_metadata=_ds_read,
        load_planners={"default": DefaultLoadPlanner, "ours": DataStatesLoadPlanner},
        prepare_load_plan=lambda folder, plan: DataStatesReader(folder).prepare_local_plan(plan),
        load_global_plan=lambda folder, plans: DataStatesReader(folder).prepare_global_plan(
            DataStatesLoadPlanner().create_global_plan(plans))),
    "dcp": Method(
        save_planner=lambda key: DefaultSavePlanner(), caching=False,
        prepare_local_plan=lambda plan, rank, flat, folder: plan,  # FileSystemWriter's, with collectives
        prepare_global_plan=lambda folder, plans: FileSystemWriter(folder).prepare_global_plan(plans),
        file_name=lambda rank: f"__{rank}_0.distcp", header_size=lambda entries: 0,
        location=lambda file, offset, length, *_: _StorageInfo(file, offset, length), send_results=lambda r: r,
        commit=_dcp_commit, write=None, broadcast=lambda md: md,
        read_metadata=lambda folder: (FileSystemReader(folder).read_metadata(), lambda: None),
        load_planners={"default": DefaultLoadPlanner},
        prepare_load_plan=lambda folder, plan: FileSystemReader(folder).prepare_local_plan(plan),
        load_global_plan=lambda folder, plans: FileSystemReader(folder).prepare_global_plan(
            DefaultLoadPlanner().create_global_plan(plans))),
}


# ------------------------------------------------------------------------------ measuring
def _proc(path: str, field: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def settle() -> None:
    """Garbage collected and free heap memory handed back (glibc), before a peak is taken."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Peak:
    """Peak RSS above the RSS at ``reset()`` (the kernel's VmHWM, reset through clear_refs)."""

    overall = 0

    def reset(self) -> None:
        self.base = _proc("/proc/self/status", "VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.ok = True
        except OSError:
            self.ok = False

    def extra_mib(self) -> float | None:
        hwm = _proc("/proc/self/status", "VmHWM")
        Peak.overall = max(Peak.overall, hwm)
        return round((hwm - self.base) / 2**20, 1) if self.ok else None


class GCClock:
    """Seconds the cyclic garbage collector ran (gc.callbacks), to tell its share of a step."""

    total, _start = 0.0, 0.0

    @classmethod
    def tick(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._start = time.perf_counter()
        else:
            cls.total += time.perf_counter() - cls._start


def timed(fn: Callable, repeat: int, prof: cProfile.Profile | None = None) -> tuple[float, object, float]:
    """Median seconds of up to ``repeat`` calls, the last result (the previous one dropped
    first) and the mean seconds the GC took of a call; with ``prof``, one more call, profiled
    and not timed."""
    times, gcs, out = [], [], None
    for _ in range(repeat):
        out = None
        t0, g0 = time.perf_counter(), GCClock.total
        out = fn()
        times.append(time.perf_counter() - t0)
        gcs.append(GCClock.total - g0)
        if sum(times) > STEP_BUDGET_S:
            break
    if prof is not None:
        prof.runcall(fn)
    return round(statistics.median(times), 4), out, round(statistics.mean(gcs), 4)


def drop_cached_plans(key: str) -> None:
    """Forget DCP's (and DataStatesSavePlanner's) cached plans of the planners made with ``key``."""
    full = DataStatesSavePlanner(cache_key=key)._cached_plans_key
    for cache in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata,
                  SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan, ds_planners._LOCAL_DTYPES):
        cache.pop(full, None)


def item_nbytes(item: WriteItem, value_sizes: dict) -> int:
    td = item.tensor_data
    return value_sizes[item.index.fqn] if td is None else td.chunk.sizes.numel() * td.properties.dtype.itemsize


def plan_signature(plan: SavePlan) -> list:
    return [(i.index.fqn, tuple(i.index.offset or ()), str(i.type),
             None if i.tensor_data is None else (tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes),
                                                 tuple(i.tensor_data.size), str(i.tensor_data.properties.dtype)))
            for i in plan.items]


# ------------------------------------------------------------------------------ the steps
def step_local_plan(method: Method, state: dict, rank: int, folder: str, repeat: int, key: str):
    """The chosen rank's planning: set_up_planner and create_local_plan (timed apart)."""
    setup, plan_t = [], []
    for _ in range(repeat):
        drop_cached_plans(key)
        planner = method.save_planner(key)
        t0 = time.perf_counter()
        planner.set_up_planner(state, StorageMeta(checkpoint_id=folder), is_coordinator=rank == 0)
        t1 = time.perf_counter()
        plan = planner.create_local_plan()
        plan_t.append(time.perf_counter() - t1)
        setup.append(t1 - t0)
    return round(statistics.median(setup), 4), round(statistics.median(plan_t), 4), planner, plan


def step_gather_plans(method: Method, case: dict, folder: str):
    """Every rank's local plan (SimShards, the method's planner and writer), pickled and unpickled
    as gather_object carries it, and the non-tensor values' serialized sizes. Only the unpickle
    is timed, with the cyclic GC off (on, it triples the time: each unpickled plan adds ~15,000
    container objects that the collector traverses again and again)."""
    n, plans, nbytes, value_sizes, values = case["n"], [], 0, {}, plain_values(case["model"])
    unpickle_s = 0.0
    gc.disable()
    for r in range(n):
        planner = method.save_planner("sim-all-ranks")
        planner.set_up_planner(build_state(case["model"], case["layout"], sim_leaf(case["layout"], n, r), *values),
                               StorageMeta(checkpoint_id=folder), is_coordinator=r == 0)
        plan = method.prepare_local_plan(planner.create_local_plan(), r, planner.state_dict, folder)
        for fqn, v in planner.state_dict.items() if r == 0 else ():
            if not isinstance(v, (torch.Tensor, SimShard)):
                buf = io.BytesIO()
                torch.save(v, buf)
                value_sizes[fqn] = buf.tell()
        if r == case["rank"]:
            chosen = plan
        raw = pickle.dumps(plan)
        nbytes += len(raw)
        t0 = time.perf_counter()
        plans.append(pickle.loads(raw))
        unpickle_s += time.perf_counter() - t0
    gc.enable()
    return plans, nbytes, round(unpickle_s, 4), value_sizes, chosen


def step_global_plan(method: Method, plans: list, repeat: int):
    """Rank 0's create_global_plan of a first save; the plan caches of the last run stay."""
    keys: list[str] = []

    def once():
        if keys:
            drop_cached_plans(keys[-1])
        keys.append(f"coordinator-{len(keys)}")
        return method.save_planner(keys[-1]).create_global_plan(plans)
    seconds, (deltas, md), gc_s = timed(once, repeat)
    return seconds, gc_s, deltas, md, keys[-1]


def step_steady(method: Method, planner, key: str, state: dict, delta: SavePlan, case: dict, folder: str, coord: str):
    """The next save with plan caching: the chosen rank's plan must come back empty and unusable;
    rank 0 plans with every rank's such plan. Returns (seconds, bytes up, bytes down, verified)."""
    planner.finish_plan(delta)  # promotes the chosen rank's plan to the cache, as DCP's write step does
    again = method.save_planner(key)
    again.set_up_planner(state, StorageMeta(checkpoint_id=folder), is_coordinator=case["rank"] == 0)
    second = again.create_local_plan()
    plans = [method.prepare_local_plan(SavePlan([], usable=False), r, {}, folder) for r in range(case["n"])]
    seconds, (deltas, _), _ = timed(lambda: method.save_planner(coord).create_global_plan(plans), case["repeat"])
    down = sum(len(pickle.dumps(p)) for p in method.prepare_global_plan(folder, deltas))
    return seconds, sum(len(pickle.dumps(p)) for p in plans), down, not second.usable and not second.items


def step_write_results(method: Method, final_plans: list, value_sizes: dict, data_start: int):
    """Every rank's write results for its final plan, as its writer returns them, pickled, and
    unpickled as DCP gathers them at rank 0 (only the unpickle is timed; the cyclic GC is off)."""
    gathered, nbytes, unpickle_s = [], 0, 0.0
    gc.disable()
    for r, plan in enumerate(final_plans):
        sizes = [item_nbytes(item, value_sizes) for item in plan.items]
        file, offset, file_size, out = method.file_name(r), data_start, data_start + sum(sizes), []
        for item, nb in zip(plan.items, sizes):
            td = item.tensor_data
            dtype, shape = ("uint8", (nb,)) if td is None else (ds_layout.dtype_to_name(td.properties.dtype),
                                                                 tuple(td.chunk.sizes))
            out.append(WriteResult(index=item.index, size_in_bytes=nb,
                                   storage_data=method.location(file, offset, nb, dtype, shape, data_start, file_size)))
            offset += nb
        raw = pickle.dumps(method.send_results(out))
        nbytes += len(raw)
        t0 = time.perf_counter()
        gathered.append(pickle.loads(raw))
        unpickle_s += time.perf_counter() - t0
    gc.enable()
    return gathered, nbytes, round(unpickle_s, 4)


def step_commit(method: Method, md, results: list, folder: str, repeat: int, prof=None):
    """Rank 0's commit and marker write. Ours takes again what a steady state repeats from the
    commit before it: its first commit is timed alone (returned last), the steady ones after it."""
    first = None
    if method.caching:
        t0 = time.perf_counter()
        method.commit(md, results, folder)
        first = round(time.perf_counter() - t0, 4)
    commit_s, payload, gc_s = timed(lambda: method.commit(md, results, folder), repeat, prof)
    write_s = None if method.write is None else timed(lambda: method.write(payload, folder), repeat, prof)[0]
    return commit_s, gc_s, write_s, first


def step_read_load(method: Method, folder: str, state: dict, repeat: int, prof=None):
    """The chosen rank's load with each load planner: the metadata read and decoded (afresh for
    each planner: a decode may be lazy), then ``set_up_planner`` + ``create_local_plan``; with
    ``prof``, one more load with the method's own planner, profiled and not timed."""
    reads, plans, items, g0 = [], {k: [] for k in method.load_planners}, {}, GCClock.total
    sent: dict = {}

    def load(cls):
        md, end_load = method.read_metadata(folder)
        t1 = time.perf_counter()
        planner = cls()
        planner.set_up_planner(state, md, is_coordinator=False)
        plan = planner.create_local_plan()
        t2 = time.perf_counter()
        end_load()
        sent[cls] = pickle.dumps(method.prepare_load_plan(folder, plan))
        return t1, t2, len(plan.items)
    for _ in range(repeat):
        for name, cls in method.load_planners.items():
            t0 = time.perf_counter()
            t1, t2, items[name] = load(cls)
            reads.append(t1 - t0)
            plans[name].append(t2 - t1)
        if sum(reads) + sum(map(sum, plans.values())) > STEP_BUDGET_S:
            break
    gc_s = round((GCClock.total - g0) / len(reads), 4)  # a load's mean (a DataStatesReader load pauses it)
    if prof is not None:
        prof.runcall(load, list(method.load_planners.values())[-1])
    own = sent.get(list(method.load_planners.values())[-1])
    return round(statistics.median(reads), 4), {k: round(statistics.median(v), 4) for k, v in plans.items()}, items, gc_s, own


def step_load_coordinator(method: Method, folder: str, sent: bytes, n: int) -> float:
    """Rank 0 at a load: every rank's load plan unpickled as DCP's gather does (N copies of the
    chosen rank's), the method's global load plan (its planner's, then its reader's), each plan
    pickled as DCP's scatter does; GC off, as the gathers here."""
    with gc_paused():
        t0 = time.perf_counter()
        plans = [pickle.loads(sent) for _ in range(n)]
        out = [pickle.dumps(p) for p in method.load_global_plan(folder, plans)]
        seconds = time.perf_counter() - t0
    del plans, out
    return round(seconds, 4)


# ------------------------------------------------------------------------------ one case
def run_case(case: dict) -> dict:
    """One (layout, model, N, method): steps 1-4 here, step 5 in a fresh process."""
    method, out = METHODS[case["method"]], dict(case)
    n, rank, repeat = case["n"], case["rank"], case["repeat"]
    folder = tempfile.mkdtemp(prefix="scale_sim_")
    prof = cProfile.Profile() if case.get("profile") else None
    try:
        dstate = chosen_state(case)
        out["tensors"] = 4 * len(param_shapes(case["model"]))
        out["rss_base_mib"] = round(_proc("/proc/self/status", "VmRSS") / 2**20, 1)
        # 1. the chosen rank's local plan, on real DTensors
        ckey = f"rank-{rank}"
        out["local_setup_s"], out["local_plan_s"], cplanner, cplan = step_local_plan(method, dstate, rank, folder, repeat, ckey)
        # 2. every rank's plan, gathered at rank 0; its global plan
        t0 = time.perf_counter()
        plans, out["gather_plans_first"], out["gather_plans_s"], value_sizes, chosen_sim = step_gather_plans(method, case, folder)
        out["build_plans_s"] = round(time.perf_counter() - t0, 1)
        out["plan_items"] = sum(len(p.items) for p in plans)
        prepared = method.prepare_local_plan(cplan, rank, cplanner.state_dict, folder)
        out["dtensor_matches_sim"] = plan_signature(prepared) == plan_signature(chosen_sim)
        settle()
        peak = Peak()
        peak.reset()
        out["global_plan_first_s"], out["global_plan_first_gc_s"], deltas, md, coord = step_global_plan(method, plans, repeat)
        out["chunks"] = sum(len(getattr(v, "chunks", [None])) for v in md.state_dict_metadata.values())
        scattered = method.prepare_global_plan(folder, deltas)
        out["scatter_plans_first"] = sum(len(pickle.dumps(p)) for p in scattered)
        # 3. the steady state: the next save, with cached plans
        if method.caching:
            (out["global_plan_steady_s"], out["gather_plans_steady"], out["scatter_plans_steady"],
             out["steady_plan_unusable"]) = step_steady(method, cplanner, ckey, dstate, deltas[rank], case, folder, coord)
        else:
            out["global_plan_steady_s"] = out["global_plan_first_s"]  # no plan caching: every save is a first
            out["gather_plans_steady"], out["scatter_plans_steady"] = out["gather_plans_first"], out["scatter_plans_first"]
        # 4. write results, gathered at rank 0; the commit
        entries = [ds_layout.FileEntry(i.index.fqn, "bytes", "uint8", (item_nbytes(i, value_sizes),), item_nbytes(i, value_sizes))
                   if i.tensor_data is None else
                   ds_layout.FileEntry(i.index.fqn, "tensor", ds_layout.dtype_to_name(DTYPE), tuple(i.tensor_data.chunk.sizes),
                                       item_nbytes(i, value_sizes)) for i in scattered[rank].items]
        before, t0 = _proc("/proc/self/status", "VmRSS"), time.perf_counter()
        results, out["gather_results"], out["gather_results_s"] = step_write_results(
            method, scattered, value_sizes, method.header_size(entries))
        out["build_results_s"] = round(time.perf_counter() - t0, 1)
        out["results_mib"] = round((_proc("/proc/self/status", "VmRSS") - before) / 2**20, 1)
        del plans, scattered, entries
        (out["commit_s"], out["commit_gc_s"], out["metadata_write_s"],
         out["commit_first_s"]) = step_commit(method, md, results, folder, repeat, prof)
        out["peak_extra_mib"] = peak.extra_mib()
        out["commit_total_s"] = round(out["gather_results_s"] + out["commit_s"] + (out["metadata_write_s"] or 0), 4)
        out["metadata_bytes"] = os.path.getsize(os.path.join(folder, ".metadata"))
        out["broadcast_metadata"] = len(pickle.dumps(method.broadcast(md)))
        for phase in ("first", "steady"):
            out[f"gather_bytes_{phase}"] = (out[f"gather_plans_{phase}"] + out[f"scatter_plans_{phase}"]
                                            + out["gather_results"] + out["broadcast_metadata"])
        if prof is not None:
            prof.dump_stats(os.path.join(case["profile"], f"{case['method']}_{case['layout']}_{case['model']}_{n}_commit.prof"))
        # 5. the chosen rank's load, in a fresh process (memory freed here would hide its peak)
        del results, md, deltas
        res = subprocess.run([sys.executable, __file__, "--load", json.dumps(dict(case, folder=folder))],
                             capture_output=True, text=True)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise RuntimeError(f"load step failed: {res.stderr.strip()[-2000:]}")
        out.update(json.loads(line[-1][7:]))
        out["rss_peak_mib"] = round(Peak.overall / 2**20, 1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def run_load(case: dict) -> dict:
    """Step 5 alone: the chosen rank reads the metadata committed in ``case["folder"]`` and plans."""
    method, out = METHODS[case["method"]], {}
    dstate = chosen_state(case)
    prof = cProfile.Profile() if case.get("profile") else None
    settle()
    peak = Peak()
    peak.reset()
    (out["md_read_s"], load_s, out["load_read_items"], out["load_gc_s"],
     sent) = step_read_load(method, case["folder"], dstate, case["repeat"], prof)
    out["load_plan_bytes"] = len(sent)
    out["load_peak_extra_mib"] = peak.extra_mib()
    out["load_coordinator_s"] = step_load_coordinator(method, case["folder"], sent, case["n"])
    out["load_plan_default_s"], out["load_plan_ours_s"] = load_s["default"], load_s.get("ours")
    out["load_total_s"] = round(out["md_read_s"] + load_s.get("ours", load_s["default"]), 4)
    if prof is not None:
        prof.dump_stats(os.path.join(case["profile"], f"{case['method']}_{case['layout']}_{case['model']}_{case['n']}_load.prof"))
    return out


# ------------------------------------------------------------------------------ checks
class _RecordingPlanner(DataStatesSavePlanner):
    """The real save's local plan, recorded for --check."""

    record = ""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        with open(self.record, "wb") as f:
            pickle.dump(plan_signature(plan), f)
        return plan


def _tiny_model(model: str) -> torch.nn.Module:
    layers, dim, heads, kv, ffn, vocab = MODELS[model]
    nn, kvd = torch.nn, kv * (dim // heads)

    def block():
        b = nn.Module()
        b.attention, b.feed_forward = nn.Module(), nn.Module()
        for name, out_dim in (("wq", dim), ("wk", kvd), ("wv", kvd), ("wo", dim)):
            setattr(b.attention, name, nn.Linear(dim, out_dim, bias=False))
        for name, i, o in (("w1", dim, ffn), ("w2", ffn, dim), ("w3", dim, ffn)):
            setattr(b.feed_forward, name, nn.Linear(i, o, bias=False))
        b.attention_norm, b.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        return b
    m = nn.Module()
    m.tok_embeddings = nn.Embedding(vocab, dim)
    m.layers = nn.ModuleList(block() for _ in range(layers))
    m.norm, m.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
    return m


def _real_save_worker(rank: int, n: int, folder: str, port: int, model: str) -> None:
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        mesh = init_device_mesh("cpu", (n,))
        m = _tiny_model(model)
        assert {k: tuple(p.shape) for k, p in m.named_parameters()} == param_shapes(model), "config != module"
        for block in m.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        msd, osd = get_state_dict(m, torch.optim.AdamW(m.parameters()))
        planner = _RecordingPlanner()
        planner.record = os.path.join(folder + ".plans", f"{rank}.pkl")
        save({"model": msd, "optim": osd}, storage_writer=DataStatesWriter(folder), planner=planner)
    finally:
        dist.destroy_process_group()


def _metadata_signature(md) -> dict:
    return {fqn: ("bytes",) if getattr(v, "chunks", None) is None else
            (tuple(v.size), str(v.properties.dtype), [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
            for fqn, v in md.state_dict_metadata.items()}


def check_real_saves(model: str = "tiny") -> list[str]:
    """Real gloo FSDP2 saves against the simulator: every rank's local plan and the metadata."""
    import torch.multiprocessing as mp
    problems, method = [], METHODS["datastates"]
    for n in (2, 4):
        folder = tempfile.mkdtemp(prefix="scale_sim_check_")
        os.makedirs(folder + ".plans")
        try:
            mp.spawn(_real_save_worker, args=(n, folder, random.randint(20000, 40000), model), nprocs=n)
            real_md = _metadata_signature(DataStatesReader(folder).read_metadata())
            found, sim_plans = len(problems), []
            for r in range(n):  # the simulator's plans, before the writer's part (as recorded)
                planner = method.save_planner(f"check-{n}-{r}")
                planner.set_up_planner(build_state(model, "fsdp", sim_leaf("fsdp", n, r), *plain_values(model)),
                                       StorageMeta(), is_coordinator=r == 0)
                sim_plans.append(planner.create_local_plan())
                with open(os.path.join(folder + ".plans", f"{r}.pkl"), "rb") as f:
                    real = pickle.load(f)
                sim = plan_signature(sim_plans[-1])
                if real != sim:
                    bad = [(a, b) for a, b in zip(real, sim) if a != b][:3]
                    problems.append(f"n={n} rank {r}: local plans differ ({len(real)} vs {len(sim)} items): {bad}")
            prepared = [method.prepare_local_plan(p, r, {}, folder) for r, p in enumerate(sim_plans)]
            sim_md = _metadata_signature(method.save_planner(f"check-{n}-rank0").create_global_plan(prepared)[1])
            if sim_md != real_md:
                diff = [(k, real_md.get(k), sim_md.get(k)) for k in set(sim_md) | set(real_md) if sim_md.get(k) != real_md.get(k)]
                problems.append(f"n={n}: metadata differs in {len(diff)} items (real, sim): {diff[:3]}")
            chunks = sum(len(v[-1]) if v[0] != "bytes" else 1 for v in real_md.values())
            print(f"check real gloo FSDP2 save, n={n}: {len(real_md)} items, {chunks} chunks, "
                  f"{sum(1 for v in real_md.values() for c in v[-1] if v[0] != 'bytes' and 0 in c[1])} empty: "
                  f"{'ok' if len(problems) == found else 'MISMATCH'}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(folder + ".plans", ignore_errors=True)
    return problems


def check_dtensors(model: str, n: int, rank: int) -> list[str]:
    """Real DTensors on a fake process group (this process is ``rank`` of n) against SimShards:
    every layout's whole local plan."""
    problems = []
    for layout in LAYOUTS:
        sigs = []
        for state in (chosen_state({"layout": layout, "model": model, "n": n, "rank": rank}),
                      build_state(model, layout, sim_leaf(layout, n, rank), *plain_values(model))):
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, is_coordinator=False)
            sigs.append(plan_signature(planner.create_local_plan()))
        if sigs[0] != sigs[1]:
            problems.append(f"{layout} n={n} rank {rank}: {[(a, b) for a, b in zip(*sigs) if a != b][:2]}")
        empty = sum(1 for s in sigs[1] if s[3] is not None and 0 in s[3][1])
        print(f"check DTensors on a fake PG, {layout:8s} n={n:6d} rank {rank:6d}: {len(sigs[1])} items, "
              f"{empty} empty shards: {'ok' if sigs[0] == sigs[1] else 'MISMATCH'}")
    return problems


def run_check() -> int:
    problems = check_real_saves()
    for n, rank in ((1024, 0), (1024, 517), (16384, 8191), (16384, 16383)):
        res = subprocess.run([sys.executable, __file__, "--xcheck", json.dumps({"model": "8b", "n": n, "rank": rank})],
                             capture_output=True, text=True)
        print(res.stdout.strip())
        if res.returncode != 0:
            problems.append(f"n={n} rank {rank}: {res.stdout.strip()[-1500:]} {res.stderr.strip()[-1500:]}")
    for p in problems:
        print("MISMATCH:", p)
    print("check:", "FAILED" if problems else "the simulator's plans and metadata equal the real ones")
    return 1 if problems else 0


# ------------------------------------------------------------------------------ the driver
def machine_info() -> dict:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_total_gib": round(_proc("/proc/meminfo", "MemTotal") / 2**30, 1),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def run_child(case: dict, timeout: float) -> dict:
    try:
        res = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(case, skipped=f"timed out after {timeout:.0f} s (--case-timeout)")
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if line:
        return json.loads(line[-1][7:])
    return dict(case, skipped=f"failed (exit {res.returncode}): {(res.stderr.strip().splitlines() or ['?'])[-1]}")


COLUMNS = [("local_plan_s", "lplan_s", 1), ("gather_plans_s", "unpk1_s", 1), ("global_plan_first_s", "gplan1_s", 1), ("global_plan_first_gc_s", "(gc)", 1),
           ("global_plan_steady_s", "gplanN_s", 1), ("gather_results_s", "unpickle_s", 1), ("commit_s", "commit_s", 1), ("commit_gc_s", "(gc)", 1),
           ("metadata_write_s", "mdwrite_s", 1),
           ("metadata_bytes", "md_MB", 1e-6), ("md_read_s", "mdread_s", 1), ("load_plan_default_s", "ldplanD_s", 1),
           ("load_plan_ours_s", "ldplanO_s", 1), ("load_total_s", "load_s", 1), ("gather_bytes_first", "gath1_MB", 1e-6),
           ("gather_bytes_steady", "gathN_MB", 1e-6), ("peak_extra_mib", "peak_MiB", 1),
           ("load_peak_extra_mib", "ldpeak_MiB", 1), ("load_plan_bytes", "ldplan_KB", 1e-3),
           ("load_coordinator_s", "ldcoord_s", 1)]


def print_table(rows: list[dict]) -> None:
    head = f"{'layout':8s} {'model':5s} {'N':>6s} {'method':10s} {'chunks':>9s} " + " ".join(f"{c[1]:>10s}" for c in COLUMNS)
    print(head + "\n" + "-" * len(head))
    fmt = lambda v: f"{v:10.4g}" if isinstance(v, (int, float)) else f"{'-':>10s}"  # noqa: E731
    pairs: dict = {}
    for r in rows:
        pair = pairs.setdefault((r["layout"], r["model"], r["n"]), {})
        pair[r["method"]] = r
        lead = f"{r['layout']:8s} {r['model']:5s} {r['n']:6d} {r['method']:10s}"
        if "skipped" in r:
            print(f"{lead} skipped: {r['skipped']}")
            continue
        print(f"{lead} {r['chunks']:9d} " + " ".join(fmt(None if r.get(c) is None else r[c] * s) for c, _, s in COLUMNS))
        if len(pair) == 2 and all("skipped" not in v for v in pair.values()):
            d, o = pair["dcp"], pair["datastates"]
            ratio = [d[c] / o[c] if isinstance(d.get(c), (int, float)) and o.get(c) else None for c, _, _ in COLUMNS]
            print(f"{'':21s} {'dcp/ours':10s} {'':9s} " + " ".join(fmt(v) for v in ratio))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS)
    p.add_argument("--models", nargs="+", choices=list(MODELS))
    p.add_argument("--ranks", nargs="+", type=int)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rank", type=int, help="the chosen rank (default N // 2 + 1)")
    p.add_argument("--case-timeout", type=float, default=600.0)
    p.add_argument("--json", help="write the cases, the command and the machine here")
    p.add_argument("--profile", help="a folder for cProfile stats of the commit and load steps")
    p.add_argument("--check", action="store_true", help="the simulator against real saves and DTensors")
    for hidden in ("--case", "--load", "--xcheck"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    gc.callbacks.append(GCClock.tick)
    if args.case or args.load:  # a child: one JSON line; no teardown of millions of objects
        print("RESULT " + json.dumps(run_case(json.loads(args.case)) if args.case else run_load(json.loads(args.load))),
              flush=True)
        os._exit(0)
    if args.xcheck:
        x = json.loads(args.xcheck)
        return 1 if check_dtensors(x["model"], x["n"], x["rank"]) else 0
    if args.check:
        return run_check()
    combos = DEFAULT_CASES
    if args.layouts or args.models or args.ranks:
        combos = [(lay, m, n) for lay in args.layouts or ["fsdp"] for m in args.models or ["70b"]
                  for n in args.ranks or [8, 64, 256]]
    item_bytes: dict = {}
    rows = []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    for lay, m, n in sorted(combos, key=lambda c: (c[2], c[0], c[1])):
        for meth in args.methods:
            rank = min(n - 1, n // 2 + 1) if args.rank is None else args.rank
            case = {"layout": lay, "model": m, "n": n, "method": meth, "rank": rank, "repeat": args.repeat,
                    "profile": os.path.abspath(args.profile) if args.profile else None}
            per_item = item_bytes.get(meth, DEFAULT_ITEM_BYTES)
            est = n * (4 * len(param_shapes(m)) + len(adamw_group([]))) * per_item / 2**20 + 600
            avail = _proc("/proc/meminfo", "MemAvailable") / 2**20
            t0 = time.perf_counter()
            if est > 0.7 * avail:
                row = dict(case, skipped=f"estimated {est:.0f} MiB ({per_item} B a plan item) > 70% of MemAvailable "
                                         f"({avail:.0f} MiB)")
            else:
                row = run_child(case, args.case_timeout)
            row["case_wall_s"] = round(time.perf_counter() - t0, 1)
            if row.get("plan_items", 0) >= 100_000:  # learn rank 0's memory per item from a large case
                measured = int((row["rss_peak_mib"] - row["rss_base_mib"]) * 2**20 / row["plan_items"])
                item_bytes[meth] = max(item_bytes.get(meth, 0), measured)
            print(f"[{row['case_wall_s']:7.1f} s] {lay} {m} N={n} {meth}: "
                  + (row.get("skipped") or f"{row['chunks']} chunks, peak RSS {row['rss_peak_mib']} MiB"),
                  file=sys.stderr, flush=True)
            rows.append(row)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv), "machine": machine_info(), "cases": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
