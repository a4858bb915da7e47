"""Per-rank code of the multi-rank fault matrix (tests/test_fault_matrix.py): one rank fails in
one phase of a save; every rank must raise CheckpointException within seconds, the process goes
on, and the next save into the same folder loads back bitwise."""

from __future__ import annotations

import json
import os
import resource
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, start_engine
from dcp_datastates.runtime import current_engine
from dcp_datastates.storage import local as local_storage

CACHE, CHUNK = 8 << 20, 256 << 10


class Unpicklable:
    """A value whose serialization fails (the user's object that cannot be saved)."""

    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


def state_for(rank: int, value: float, bad: bool = False) -> dict:
    g = torch.Generator().manual_seed(int(value * 100) + rank)
    state = {
        f"stage{rank}": torch.randn(96 * 1024, generator=g) + value,  # rank-unique (pipeline-like)
        "shared": torch.arange(4096, dtype=torch.float32) + value,  # replicated plain tensor
        "step": int(value),
    }
    if bad:
        state["extra"] = Unpicklable()
    return state


def _save(api: str, state: dict, path: str, pg) -> None:
    writer = DataStatesWriter(path, process_group=pg, host_cache_size=CACHE, chunk_size=CHUNK)
    if api == "sync":
        dcp.save(state, storage_writer=writer, process_group=pg)
    else:
        dcp.async_save(state, storage_writer=writer, process_group=pg).upload_completion.result(timeout=120)


class _Fault:
    """Arms one fault on this rank for the duration of a save."""

    def __init__(self, kind: str, path: str) -> None:
        self.kind, self.path = kind, path

    def __enter__(self):
        if self.kind == "efbig":
            self._limits = resource.getrlimit(resource.RLIMIT_FSIZE)
            self._handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, self._limits[1]))
        elif self.kind in ("eio", "fsync_eio"):
            current_engine().set_fault(self.kind, 0, self.path)
        elif self.kind == "commit":
            self._replace = local_storage.os.replace

            def failing(src, dst, *a, **k):
                if ".metadata.tmp" in str(src):
                    raise OSError(5, "Input/output error", str(src))
                return self._replace(src, dst, *a, **k)

            local_storage.os.replace = failing
        return self

    def __exit__(self, *exc):
        if self.kind == "efbig":
            resource.setrlimit(resource.RLIMIT_FSIZE, self._limits)
            signal.signal(signal.SIGXFSZ, self._handler)
        elif self.kind in ("eio", "fsync_eio"):
            current_engine().set_fault("none", 0, "")
        elif self.kind == "commit":
            local_storage.os.replace = self._replace
        return False


# fault kind -> text that the error every rank sees must contain
FAULTS = {
    "unpicklable": "this object refuses to be pickled",
    "efbig": "File too large",
    "eio": "Input/output error",
    "fsync_eio": "fsync",
    "commit": "committing checkpoint",
}


def _not_committed(path: str) -> list[str]:
    """The entries of checkpoint folder ``path`` that its commit (if any) does not list."""
    from dcp_datastates import commit

    keep = {".metadata"}
    if os.path.exists(os.path.join(path, ".metadata")):
        keep |= set(commit.read_commit(path)[1])
    return sorted(set(os.listdir(path)) - keep)


def run_matrix(rank: int, world: int, root: str, per_node: int, apis: list[str]) -> None:
    os.environ["DCP_DATASTATES_RANKS_PER_NODE"] = str(per_node)  # 2 simulated nodes
    start_engine(host_cache_size=CACHE, chunk_size=CHUNK)
    pg = dist.new_group(backend="gloo")  # the checkpoint's own group, as trainers pass it
    # the coordinator, the other node's leader, a plain member (when nodes have one)
    failing = sorted({0, per_node, world - 1})
    records = []
    for api in apis:
        for fr in failing:
            for kind in FAULTS:
                if kind == "commit" and fr != 0:
                    continue  # only the coordinator commits
                path = f"{root}/w{world}-{api}-{kind}-r{fr}"
                _save(api, state_for(rank, 1.0), path, pg)  # a good checkpoint first
                dist.barrier()
                bad = rank == fr
                t0 = time.monotonic()
                error = None
                try:
                    if bad:
                        with _Fault(kind, path):
                            _save(api, state_for(rank, 2.0, bad=kind == "unpicklable"), path, pg)
                    else:
                        _save(api, state_for(rank, 2.0), path, pg)
                except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
                    error = exc
                seconds = time.monotonic() - t0
                dist.barrier()
                leftover = _not_committed(path)  # every rank's files of the failed save are gone
                # the previous checkpoint is intact, then the next save works and loads bitwise
                back = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state_for(rank, 0).items()}
                dcp.load(back, storage_reader=DataStatesReader(path), process_group=pg)
                old_ok = all(torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v
                             for k, v in state_for(rank, 1.0).items())
                _save(api, state_for(rank, 3.0), path, pg)
                dcp.load(back, storage_reader=DataStatesReader(path), process_group=pg)
                new_ok = all(torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v
                             for k, v in state_for(rank, 3.0).items())
                records.append({
                    "api": api, "kind": kind, "failing_rank": fr, "rank": rank, "seconds": round(seconds, 3),
                    "type": type(error).__name__ if error is not None else None,
                    "cause_in_message": error is not None and FAULTS[kind] in str(error),
                    "old_checkpoint_intact": old_ok, "next_save_loads": new_ok, "leftover": leftover,
                })
                dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(f"{root}/matrix-w{world}.json", "w") as f:
            json.dump([r for per_rank in gathered for r in per_rank], f, indent=1)


# ------------------------------------------------------------- protocol cases on 2 ranks
def run_protocol(rank: int, world: int, root: str) -> None:
    """Rank-local saves, ranks naming different paths, a tensor torn on one rank."""
    from dcp_datastates import wait_staged

    start_engine(host_cache_size=CACHE, chunk_size=CHUNK)
    out = {}
    # 1. Rank-local (use_collectives=False): a same-named plain tensor holds different values
    # per rank; each rank must load its own, sync and async.
    for api in ("sync", "async"):
        path = f"{root}/local-{api}"
        state = {"w": torch.full((1000,), float(rank + 1)), f"own{rank}": torch.arange(10.0) * (rank + 1), "note": f"rank{rank}"}
        writer = DataStatesWriter(path)
        if api == "sync":
            dcp.save(state, storage_writer=writer, use_collectives=False)
        else:
            dcp.async_save(state, storage_writer=writer, use_collectives=False).upload_completion.result(timeout=60)
        dist.barrier()
        back = {"w": torch.zeros(1000), f"own{rank}": torch.zeros(10), "note": None}
        dcp.load(back, storage_reader=DataStatesReader(path))
        out[f"local_{api}"] = bool(torch.equal(back["w"], state["w"]) and torch.equal(back[f"own{rank}"], state[f"own{rank}"])
                                   and back["note"] == f"rank{rank}")
    # a rank-local save into a folder holding a global commit is refused on every rank
    glob = f"{root}/global"
    dcp.save({"w": torch.ones(4)}, storage_writer=DataStatesWriter(glob))
    try:
        dcp.save({"w": torch.zeros(4)}, storage_writer=DataStatesWriter(glob), use_collectives=False)
        out["local_over_global"] = "no error"
    except BaseException as exc:  # noqa: BLE001
        out["local_over_global"] = "shadowed" in str(exc)
    dist.barrier()
    # 2. Ranks naming different folders for one save: every rank raises, nothing commits.
    path = f"{root}/mismatch-{rank}"
    t0 = time.monotonic()
    try:
        dcp.async_save({"x": torch.ones(8)}, storage_writer=DataStatesWriter(path)).upload_completion.result(timeout=60)
        out["paths"] = "no error"
    except BaseException as exc:  # noqa: BLE001
        out["paths"] = type(exc).__name__ == "CheckpointException" and "different checkpoint paths" in str(exc)
    out["paths_s"] = time.monotonic() - t0
    out["paths_committed"] = os.path.exists(f"{path}/.metadata")
    dist.barrier()
    # the same with plan caching: the second save's local plans are cached (empty), the paths
    # still reach the coordinator
    from dcp_datastates import DataStatesSavePlanner

    planner = dict(planner=DataStatesSavePlanner(cache_key="paths"))
    dcp.save({"x": torch.ones(8)}, storage_writer=DataStatesWriter(f"{root}/same"), **planner)
    try:
        dcp.save({"x": torch.ones(8)}, storage_writer=DataStatesWriter(f"{root}/cached-{rank}"),
                 planner=DataStatesSavePlanner(cache_key="paths"))
        out["paths_cached"] = "no error"
    except BaseException as exc:  # noqa: BLE001
        out["paths_cached"] = "different checkpoint paths" in str(exc)
    dist.barrier()
    # 3. Rank 1 changes a tensor in place right after async_save (no protect_optimizer): every
    # rank raises CheckpointException naming it; the previous checkpoint stays.
    path = f"{root}/torn"
    state = {f"t{i}": torch.full((512, 512), float(i)) for i in range(16)}  # 16 MiB through an 8 MiB cache
    dcp.save(state, storage_writer=DataStatesWriter(path))
    tiny = DataStatesWriter(path, host_cache_size=CACHE, chunk_size=CHUNK)
    current_engine().set_fault("stall", 0, "/torn/")  # flushes held: copies cannot all finish yet
    resp = dcp.async_save(state, storage_writer=tiny)
    if rank == 1:
        for t in state.values():
            t.add_(100.0)
    current_engine().set_fault("none", 0, "")
    try:
        resp.upload_completion.result(timeout=60)
        out["torn"] = "no error"
    except BaseException as exc:  # noqa: BLE001
        out["torn"] = type(exc).__name__ == "CheckpointException" and "changed in place" in str(exc)
    wait_staged()
    dist.barrier()
    back = {f"t{i}": torch.zeros(512, 512) for i in range(16)}
    dcp.load(back, storage_reader=DataStatesReader(path))
    out["torn_kept_old"] = all(torch.equal(back[f"t{i}"], torch.full((512, 512), float(i))) for i in range(16))
    dist.barrier()
    # 4. Rank 1 frees the storage of a tensor the save still copies (no version bump): every rank
    # raises CheckpointException (the seal's memory check, or the copy's fault guard when the
    # memory was unmapped), within the timeout; the previous checkpoint stays.
    state = {f"t{i}": torch.full((512, 512), float(i)) for i in range(16)}
    current_engine().set_fault("stall", 0, "/torn/")
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, host_cache_size=CACHE, chunk_size=CHUNK))
    if rank == 1:
        state["t12"].untyped_storage().resize_(0)
    current_engine().set_fault("none", 0, "")
    t0 = time.monotonic()
    try:
        resp.upload_completion.result(timeout=60)
        out["freed"] = "no error"
    except BaseException as exc:  # noqa: BLE001
        text = str(exc)
        out["freed"] = type(exc).__name__ == "CheckpointException" and (
            "was freed or reallocated" in text or "was unmapped while it was copied" in text)
    out["freed_s"] = time.monotonic() - t0
    wait_staged()
    dist.barrier()
    back = {f"t{i}": torch.zeros(512, 512) for i in range(16)}
    dcp.load(back, storage_reader=DataStatesReader(path))
    out["freed_kept_old"] = all(torch.equal(back[f"t{i}"], torch.full((512, 512), float(i))) for i in range(16))
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(f"{root}/protocol.json", "w") as f:
            json.dump(gathered, f, indent=1)
