"""Which of the package's modules a steady-state save and a load go through, in call order.

Issue 25 asks that a save and a load read top to bottom; this measures it. ``sys.setprofile`` /
``threading.setprofile`` record every call that enters a ``dcp_datastates`` module from another
module (calls inside one module are not entries). Per thread it prints the modules entered in
order, the number of entries, and the re-entries (an entry into a module the thread had entered
before and left). The training thread is the caller of ``dcp.async_save`` / ``dcp.load``.

    python scripts/trace_save.py [--tensors 1612] [--json out.json]
    python scripts/trace_save.py --per-item 100 200 [--json out.json]

``--per-item A B`` traces a save and a load of A and of B tensors and reports, per thread, the
cross-module entries per item: (entries at B - entries at A) / (B - A), the cost that grows with
the state, apart from the fixed cost of a save. ``tests/test_trace.py`` holds them to the
ceilings in ``scripts/trace_ceilings.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import warnings
from collections import defaultdict

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter

PREFIX = "dcp_datastates"


class ModuleTrace:
    def __init__(self) -> None:
        self.entries: dict[str, list[str]] = defaultdict(list)
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith(PREFIX):
            return
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if caller == mod:
            return
        name = threading.current_thread().name
        with self._lock:
            self.entries[name].append(mod)

    def __enter__(self):
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)

    def summary(self) -> dict:
        out = {}
        for thread, seq in self.entries.items():
            seen, order, reentries = set(), [], 0
            left_behind = set()
            previous = None
            for mod in seq:
                if mod in left_behind and mod != previous:
                    reentries += 1
                if mod not in seen:
                    order.append(mod)
                    seen.add(mod)
                if previous is not None and previous != mod:
                    left_behind.add(previous)
                previous = mod
            out[thread] = {"modules": len(order), "entries": len(seq), "reentries": reentries,
                           "order": [m[len(PREFIX) + 1:] or PREFIX for m in order]}
        return out


def state_of(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i // 8}.w{i % 8}": torch.randn(64, 64, generator=g) for i in range(n)}
    return {"model": model, "step": 3}


def thread_role(what: str, thread: str) -> str:
    """The role of a traced thread: the caller of dcp.async_save / dcp.load, or DCP's own."""
    if thread == threading.main_thread().name:
        return "training_thread" if what == "save" else "caller_thread"
    return "dcp_thread" if thread.startswith("AsyncCheckpointExecutor") else thread


def per_item(small: int, large: int) -> dict:
    """Cross-module entries per item, per thread role, for a save and a load."""
    a, b = trace(small), trace(large)
    out: dict = {"tensors": [small, large]}
    for what in ("save", "load"):
        roles: dict = {}
        for thread in set(a[what]) | set(b[what]):
            ea = a[what].get(thread, {}).get("entries", 0)
            eb = b[what].get(thread, {}).get("entries", 0)
            role = thread_role(what, thread)
            roles[role] = round(roles.get(role, 0.0) + (eb - ea) / (large - small), 2)
        out[what] = roles
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=1612)
    p.add_argument("--per-item", type=int, nargs=2, metavar=("A", "B"), default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.per_item:
        report = per_item(*args.per_item)
        print(json.dumps(report))
    else:
        report = trace(args.tensors)
        for what in ("construct", "save", "load"):
            for thread, s in report[what].items():
                print(f"{what} [{thread}]: {s['modules']} modules, {s['entries']} entries, {s['reentries']} re-entries"
                      + (f"; packages: {', '.join(s['packages'])}" if "packages" in s else ""))
                print("    " + " -> ".join(s["order"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def trace(tensors: int) -> dict:
    """One traced writer construction, steady-state save and load of ``tensors`` tensors."""
    state = state_of(tensors)
    root = tempfile.mkdtemp(prefix="trace_save_")
    for k in range(3):  # warm: engine started, plan cached
        dcp.async_save(state, storage_writer=DataStatesWriter(f"{root}/warm-{k}")).upload_completion.result()
    with ModuleTrace() as construct_trace:  # one writer per checkpoint, as the docs show
        writer = DataStatesWriter(f"{root}/traced")
    with ModuleTrace() as save_trace:
        resp = dcp.async_save(state, storage_writer=writer)
        resp.upload_completion.result()
    dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": None}
    dcp.load(dest, storage_reader=DataStatesReader(f"{root}/warm-0"))  # warm
    with ModuleTrace() as load_trace:
        dcp.load(dest, storage_reader=DataStatesReader(f"{root}/traced"))
    report = {"tensors": tensors, "construct": construct_trace.summary(), "save": save_trace.summary(),
              "load": load_trace.summary()}
    for s in report["save"].values():
        s["packages"] = sorted({m.split(".")[0] for m in s["order"]})
    return report


if __name__ == "__main__":
    main()
