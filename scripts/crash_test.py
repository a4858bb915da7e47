#!/usr/bin/env python
"""Crash consistency: kill a saving process with SIGKILL at random moments, then check that

- the previous checkpoint still loads, exactly;
- the killed checkpoint either loads exactly (the kill came after its commit) or is reported
  incomplete (IncompleteCheckpointError, only ever when it has no commit marker): never wrong
  values, never a checksum or format error;
- a killed re-save into a folder holding a committed checkpoint leaves that folder loading the
  old checkpoint or the new one exactly: never neither, never a mix;
- ``latest_checkpoint(root)`` names the newest complete checkpoint.

    python scripts/crash_test.py --kills 300                # hundreds of kills, a minute or two
    python scripts/crash_test.py --kills 12 --json out.json --root /tmp/x --keep

Each round forks a saver from this (torch-loaded, engine-free) process: it builds the state of
round i, signals "starting", and saves it with ``dcp.async_save`` or ``dcp.save``, alternately
into a new folder ``step-i`` or over one folder ``rolling`` (re-save into a committed
checkpoint). This process sleeps a random delay (uniform over the measured save time, and every
third kill aimed at the commit at its end) and SIGKILLs it. A forked verifier then loads the
folders with ``DataStatesReader`` and classifies each. Every ``--sync-every``-th save runs with
``sync_files=True``, the others with ``sync_files=False`` (quicker; SIGKILL loses no page cache,
so the ordering guarantees are what is tested either way).

Exit status 0 when there is no violation; the report (``--json``) lists outcomes and violations.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))  # a bare checkout's package, unless one is installed

warnings.filterwarnings("ignore")
# DCP logs a warning with a traceback (on the root logger) for every load of an incomplete
# checkpoint; this test makes many.
logging.getLogger().setLevel(logging.ERROR)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from dcp_datastates import DataStatesReader, DataStatesWriter, IncompleteCheckpointError, latest_checkpoint  # noqa: E402
from dcp_datastates.errors import checkpoint_error_cause  # noqa: E402

CACHE = 512 << 10  # small cache, many chunks: kills land between chunks, during backpressure ...
CHUNK = 64 << 10
SAVER_TIMEOUT_S = 60.0
VERIFY_TIMEOUT_S = 120.0


# ------------------------------------------------------------------------------------ state
def expected_state(tag: int) -> dict:
    """The state saved in round ``tag``: about 1.6 MiB in 20 tensors of several dtypes, plus
    non-tensor values. Every byte depends on ``tag`` so a mix of two rounds is detected."""
    g = torch.Generator().manual_seed(1000 + tag)
    layers = []
    for _ in range(6):
        layers.append(
            {
                "w": torch.randn(128, 256, generator=g),
                "b": torch.randn(256, generator=g).to(torch.bfloat16),
                "scale": torch.randint(-100, 100, (64,), dtype=torch.int32, generator=g),
            }
        )
    return {
        "model": {"layers": layers, "emb": torch.randn(64, 96, generator=g).to(torch.float16)},
        "step": tag,
        "meta": {"name": f"round-{tag}", "history": list(range(tag % 7))},
    }


def empty_like(obj):
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: empty_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [empty_like(v) for v in obj]
    return None


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def classify(folder: str, allowed: list[int]) -> dict:
    """Load ``folder`` and say what it holds: exact:TAG (one of ``allowed``), incomplete,
    absent, or a violation."""
    has_marker = os.path.isfile(os.path.join(folder, ".metadata"))
    if not os.path.exists(folder):
        return {"outcome": "absent"}
    dest = empty_like(expected_state(0))
    try:
        dcp.load(dest, storage_reader=DataStatesReader(folder, host_cache_size=CACHE, chunk_size=CHUNK))
    except BaseException as exc:  # noqa: BLE001 - classified below
        cause = checkpoint_error_cause(exc)
        if isinstance(cause, IncompleteCheckpointError) and not has_marker:
            return {"outcome": "incomplete"}
        return {"outcome": "violation", "why": f"load failed with marker={has_marker}: {type(cause).__name__}: {cause}"}
    for tag in allowed:
        if tag is not None and same(expected_state(tag), dest):
            return {"outcome": f"exact:{tag}"}
    return {"outcome": "violation", "why": f"loaded values match none of the rounds {allowed}"}


# ------------------------------------------------------------------------------------ children
def _child_save(folder: str, tag: int, sync: bool, use_async: bool, wfd: int) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        state = expected_state(tag)
        writer = DataStatesWriter(folder, host_cache_size=CACHE, chunk_size=CHUNK, sync_files=sync)
        os.write(wfd, b"r")
        if use_async:
            resp = dcp.async_save(state, storage_writer=writer)
            resp.upload_completion.result()
        else:
            dcp.save(state, storage_writer=writer)
        os.write(wfd, b"d")
    except BaseException:  # noqa: BLE001 - report, the parent counts it
        os.write(wfd, b"e" + traceback.format_exc().encode()[-2000:])
        code = 3
    os._exit(code)


def _child_verify(checks: list[tuple[str, list]], wfd: int) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        out = {folder: classify(folder, allowed) for folder, allowed in checks}
        out["__latest__"] = latest_checkpoint(os.path.dirname(checks[0][0]))
        data = json.dumps(out).encode()
    except BaseException:  # noqa: BLE001
        data = json.dumps({"__error__": traceback.format_exc()}).encode()
        code = 3
    view = memoryview(data)
    while view:
        view = view[os.write(wfd, view) :]
    os._exit(code)


def _read_all(fd: int, timeout: float) -> tuple[bytes, bool]:
    """Read until EOF or timeout; returns (data, eof)."""
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        b = os.read(fd, 65536)
        if not b:
            return b"".join(chunks), True
        chunks.append(b)


def _fork(target, *args) -> tuple[int, int]:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(rfd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        target(*args, wfd)
    os.close(wfd)
    return pid, rfd


def _reap(pid: int) -> int:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return 0
    return os.waitstatus_to_exitcode(status)


def verify(checks: list[tuple[str, list]]) -> dict:
    pid, rfd = _fork(_child_verify, checks)
    data, eof = _read_all(rfd, VERIFY_TIMEOUT_S)
    os.close(rfd)
    if not eof:
        os.kill(pid, signal.SIGKILL)
        _reap(pid)
        return {"__error__": f"verifier hung for {VERIFY_TIMEOUT_S} s"}
    _reap(pid)
    try:
        return json.loads(data)
    except ValueError:
        return {"__error__": f"verifier output unreadable: {data[:500]!r}"}


def save(folder: str, tag: int, sync: bool, use_async: bool, kill_after: float | None) -> dict:
    """Run one saver; kill it ``kill_after`` seconds after it starts saving (None: let it finish).
    Returns {"killed", "finished", "duration", "error"}."""
    pid, rfd = _fork(_child_save, folder, tag, sync, use_async)
    info = {"killed": False, "finished": False, "duration": None, "error": None}
    try:
        got, _ = b"", None
        deadline = time.monotonic() + SAVER_TIMEOUT_S
        while b"r" not in got and time.monotonic() < deadline:  # wait for "starting"
            r, _, _ = select.select([rfd], [], [], 0.5)
            if r:
                b = os.read(rfd, 4096)
                if not b:
                    break
                got += b
        if b"r" not in got:
            info["error"] = "saver never started: " + got.decode(errors="replace")
            os.kill(pid, signal.SIGKILL)
            return info
        t0 = time.monotonic()
        if kill_after is None:
            while b"d" not in got and b"e" not in got:  # the time to "done", not to the exit
                r, _, _ = select.select([rfd], [], [], SAVER_TIMEOUT_S)
                b = os.read(rfd, 4096) if r else b""
                if not b:
                    break
                got += b
            info["duration"] = time.monotonic() - t0
            rest, _ = _read_all(rfd, SAVER_TIMEOUT_S)
            got += rest
        else:
            time.sleep(kill_after)
            os.kill(pid, signal.SIGKILL)
            info["killed"] = True
            rest, _ = _read_all(rfd, SAVER_TIMEOUT_S)
            got += rest
        info["finished"] = b"d" in got
        if b"e" in got:
            info["error"] = got[got.index(b"e") + 1 :].decode(errors="replace")
        elif kill_after is None and not info["finished"]:
            info["error"] = f"saver did not finish in {SAVER_TIMEOUT_S} s"
    finally:
        os.close(rfd)
        code = _reap(pid)
        if kill_after is None and code != 0 and not info["error"]:
            info["error"] = f"saver exited with {code}"
    return info


# ------------------------------------------------------------------------------------ driver
def run(root: str, kills: int, sync_every: int, rng: random.Random, log) -> dict:
    os.makedirs(root, exist_ok=True)
    rolling = os.path.join(root, "rolling")
    report = {
        "kills": 0,
        "sync_kills": 0,
        "outcomes": {"exact": 0, "incomplete": 0, "absent": 0, "finished_before_kill": 0, "overwrite_kept_old": 0},
        "violations": [],
        "folders": {},  # folder -> tag it must hold when complete
    }

    def violation(what: str) -> None:
        report["violations"].append(what)
        log(f"VIOLATION: {what}")

    # Calibration: complete saves in each sync mode (also the first committed checkpoints).
    durations = {False: [], True: []}
    tag = 0
    for sync in (False, True):
        for use_async in (True, False, True):
            info = save(os.path.join(root, f"step-{tag}"), tag, sync, use_async, None)
            if info["error"]:
                violation(f"calibration save step-{tag} failed: {info['error']}")
                return report
            durations[sync].append(info["duration"])
            report["folders"][os.path.join(root, f"step-{tag}")] = tag
            tag += 1
    info = save(rolling, tag, False, True, None)
    if info["error"]:
        violation(f"calibration save of rolling failed: {info['error']}")
        return report
    rolling_tag: int | None = tag
    last_new, last_new_tag = os.path.join(root, f"step-{tag - 1}"), tag - 1
    tag += 1
    est = {s: sorted(durations[s])[len(durations[s]) // 2] for s in durations}  # median
    log(f"save time: {est[False] * 1e3:.1f} ms without sync, {est[True] * 1e3:.1f} ms with sync")

    for i in range(kills):
        sync = sync_every > 0 and i % sync_every == 0
        use_async = i % 2 == 0
        overwrite = i % 3 == 2
        folder = rolling if overwrite else os.path.join(root, f"step-{tag}")
        d = est[sync]
        delay = rng.uniform(0.85 * d, 1.05 * d) if i % 3 == 1 else rng.uniform(0.0, 1.05 * d)
        info = save(folder, tag, sync, use_async, delay)
        report["kills"] += 1
        report["sync_kills"] += int(sync)
        if info["error"]:
            violation(f"round {tag}: saver failed before the kill: {info['error']}")
        if info["finished"]:
            report["outcomes"]["finished_before_kill"] += 1
        if overwrite:
            allowed = [t for t in (rolling_tag, tag) if t is not None]
            checks = [(folder, allowed), (last_new, [last_new_tag])]
        else:
            checks = [(folder, [tag]), (last_new, [last_new_tag])]
        res = verify(checks)
        if "__error__" in res:
            violation(f"round {tag}: verifier failed: {res['__error__']}")
            break
        killed, prev = res[folder], res[last_new]
        if prev["outcome"] != f"exact:{last_new_tag}":
            violation(f"round {tag}: previous checkpoint {last_new} is {prev}")
        out = killed["outcome"]
        if out == "violation":
            violation(f"round {tag}: killed save of {folder} (sync={sync}, async={use_async}, "
                      f"kill at {delay * 1e3:.1f} ms): {killed['why']}")
        elif out.startswith("exact:"):
            report["outcomes"]["exact"] += 1
            got = int(out.split(":")[1])
            if overwrite:
                report["outcomes"]["overwrite_kept_old"] += int(got != tag)
                rolling_tag = got
                report["folders"][folder] = got
            elif got == tag:
                last_new, last_new_tag = folder, tag
                report["folders"][folder] = tag
        else:
            report["outcomes"][out] += 1
            if overwrite and rolling_tag is not None:
                violation(f"round {tag}: killed re-save of {folder} (sync={sync}, async={use_async}, kill at "
                          f"{delay * 1e3:.1f} ms) lost the previous checkpoint (round {rolling_tag}): {out}")
            if overwrite:
                rolling_tag = None
                report["folders"].pop(folder, None)
        if info["finished"] and out != f"exact:{tag}":
            violation(f"round {tag}: the save finished before the kill but {folder} is {killed}")
        if res["__latest__"] != last_new:
            violation(f"round {tag}: latest_checkpoint is {res['__latest__']}, expected {last_new}")
        tag += 1
        if (i + 1) % 25 == 0:
            log(f"{i + 1} kills: {report['outcomes']}, {len(report['violations'])} violations")

    # Final sweep: every folder holds its round exactly, or is incomplete (no marker).
    checks = [(os.path.join(root, n), [int(n.split("-")[1])]) for n in sorted(os.listdir(root)) if n.startswith("step-")]
    checks.append((rolling, [rolling_tag] if rolling_tag is not None else []))
    res = verify(checks)
    if "__error__" in res:
        violation(f"final sweep: verifier failed: {res['__error__']}")
    else:
        for folder, _ in checks:
            if res[folder]["outcome"] == "violation":
                violation(f"final sweep: {folder}: {res[folder]['why']}")
            elif folder in report["folders"] and res[folder]["outcome"] != f"exact:{report['folders'][folder]}":
                violation(f"final sweep: {folder} held round {report['folders'][folder]}, now {res[folder]}")
    report["latest"] = last_new
    report["rolling_tag"] = rolling_tag
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=4, help="every N-th killed save syncs its files (0: never)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--root", default=None, help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if os.name != "posix" or not hasattr(os, "fork"):
        print("crash_test needs fork and SIGKILL (Linux/macOS)", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    root = args.root or tempfile.mkdtemp(prefix="dcpds_crash_")
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    log(f"crash test: {args.kills} kills, seed {seed}, root {root}")
    t0 = time.monotonic()
    try:
        report = run(root, args.kills, args.sync_every, rng, log)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report["seed"] = seed
    report["seconds"] = round(time.monotonic() - t0, 2)
    report["root"] = root
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    log(
        f"done in {report['seconds']} s: {report['kills']} kills ({report['sync_kills']} with sync), "
        f"outcomes {report['outcomes']}, {len(report['violations'])} violations"
    )
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
