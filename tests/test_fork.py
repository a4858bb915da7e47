"""A process forked while a save is in flight (``os.fork``, ``multiprocessing``'s fork context,
DataLoader workers): the child has none of the parent's engine threads. Its optimizer steps and
``wait_staged`` must not wait for the parent's save, its own saves must work, its exit must not
hang (nor wait on the library's thread pools, whose threads it does not have, nor on its locks,
which the parent's threads may hold at the fork), and it must not share the parent's host cache (copy-on-write would duplicate every page
the parent's copies write while the child lives). The parent's save still commits exactly.

Each scenario is a script in a subprocess, so that the forks happen outside pytest's process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys, time, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesReader, DataStatesWriter, wait_staged
    from dcp_datastates.runtime import current_engine, engine_stats, start_engine
    from dcp_datastates.runtime import inflight

    root = sys.argv[1]
    CHILD_OPTIONS = dict(host_cache_size=8 << 20, chunk_size=1 << 20)

    def state(seed, n=8, numel=1 << 18):
        g = torch.Generator().manual_seed(seed)
        return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}, "step": seed}

    def load_equal(path, expected):
        out = {"model": {k: torch.empty_like(v) for k, v in expected["model"].items()}, "step": -1}
        dcp.load(out, storage_reader=DataStatesReader(path))
        return out["step"] == expected["step"] and all(torch.equal(out["model"][k], v) for k, v in expected["model"].items())

    def mapped(address):
        for line in open("/proc/self/maps"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
        return False

    def child(tag, cache_address):
        t0 = time.monotonic()
        assert not mapped(cache_address), f"{tag}: the parent's host cache is mapped in the child"
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([p], lr=0.1)
        p.grad = torch.ones(4)
        opt.step()  # the step hook must not wait for the parent's save
        wait_staged()
        assert time.monotonic() - t0 < 10, f"{tag}: waited {time.monotonic() - t0:.1f} s for the parent's save"
        mine = state(int(tag[-1]) + 10)
        path = os.path.join(root, "child")
        # Its own engine and the library's thread pools (staging watchers, folder preparation,
        # freed files, uploads), whose threads in the parent were idle at the fork.
        resp = dcp.async_save(mine, storage_writer=DataStatesWriter(path, **CHILD_OPTIONS))  # replaces the one there
        resp.upload_completion.result(timeout=30)
        assert load_equal(path, mine), f"{tag}: its checkpoint loads back different"
        url = f"memory://forked/{tag}"
        dcp.async_save(mine, storage_writer=DataStatesWriter(url)).upload_completion.result(timeout=30)
        assert load_equal(url, mine), f"{tag}: its object-store checkpoint loads back different"
        print(f"{tag} ok", flush=True)

    if __name__ == "__main__":
        start_engine(host_cache_size=1 << 20, chunk_size=256 << 10)  # a cache far smaller than the save
        dcp.save(state(99), storage_writer=DataStatesWriter(os.path.join(root, "child")))  # the children replace it
        dcp.async_save(state(98), storage_writer=DataStatesWriter("memory://parent/a")).upload_completion.result()
        current_engine().set_fault("stall", 0, os.sep + "parent")  # its flushes wait: it stays staging
        saved = state(1)
        resp = dcp.async_save(saved, storage_writer=DataStatesWriter(os.path.join(root, "parent")))
        assert inflight.staging(), "the parent's save is not staging at the fork"
        cache_address = engine_stats()["cache_address"]

        # Locks of the library that a parent's thread may hold at the fork (a commit, a request),
        # held here by this thread instead: the child's save takes each of them.
        from dcp_datastates.commit import reading
        from dcp_datastates.save import checkpoint_stats, plan_cache
        held = [plan_cache._plans_lock, checkpoint_stats._lock, reading._summaries_lock]
        for lock in held:
            lock.acquire()
        pid = os.fork()
        if pid == 0:  # the child ends the way a script does: atexit hooks, then finalization
            try:
                child("fork1", cache_address)
            except BaseException as exc:
                print(f"fork1 failed: {exc!r}", flush=True)
                sys.exit(1)
            sys.exit(0)
        for lock in held:
            lock.release()
        deadline = time.monotonic() + 60
        done, status = os.waitpid(pid, os.WNOHANG)
        while done == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
            done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        print(f"fork1 exit {os.waitstatus_to_exitcode(status)}" if done else "fork1 hung", flush=True)

        p = multiprocessing.get_context("fork").Process(target=child, args=("mp2", cache_address))
        p.start()
        p.join(60)
        print(f"mp2 exit {p.exitcode}" if not p.is_alive() else "mp2 hung", flush=True)
        if p.is_alive():
            p.kill()

        assert inflight.staging(), "the parent's save finished while its flushes were held"
        current_engine().set_fault("none", 0, "")
        resp.upload_completion.result(timeout=60)
        print("parent equal", load_equal(os.path.join(root, "parent"), saved), flush=True)
    """
)


@pytest.mark.parametrize("packed", [False, True], ids=["json-metadata", "packed-metadata"])
def test_a_child_forked_during_a_save_neither_waits_for_it_nor_shares_the_cache(tmp_path, packed):
    """With the packed metadata (torch ops on the tables) the child's load and commit run torch
    after the fork: without forking.py's one torch thread in the child, its load hangs."""
    script = tmp_path / "fork_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, DCP_DATASTATES_PACK_FROM_CHUNKS="1" if packed else "")
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240,
                       env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    lines = r.stdout.splitlines()
    assert "fork1 ok" in lines and "fork1 exit 0" in lines, out  # os.fork, then sys.exit: the exit runs atexit hooks
    assert "mp2 ok" in lines and "mp2 exit 0" in lines, out  # multiprocessing's fork context
    assert "parent equal True" in lines, out
