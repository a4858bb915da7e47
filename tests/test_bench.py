"""Smoke tests of ``dcp-datastates bench`` (benchmarks/bench.py): a tiny run end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench  # noqa: E402 - benchmarks/bench.py

sys.path.remove(str(BENCHMARKS))
from dcp_datastates.cli import main as cli_main  # noqa: E402 - after the benchmarks' path

from conftest import TESTING_THE_CHECKOUT  # noqa: E402

TIMES = ("stall_s", "call_s", "durable_s", "durable_in_loop_s", "load_warm_s", "compute_s")
RATIOS = ("stall_vs_dcp_save", "durable_vs_dcp_save", "load_warm_vs_dcp_save", "durable_vs_raw", "load_warm_vs_raw")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(
        [
            "--size", "8MiB", "--tensors", "50", "--reps", "1", "--json", str(out),
            "--dir", str(tmp_path / "ckpt"), "--stage-tensors", "2000", "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "datastates" in text and "dcp-save" in text and "raw bound" in text and "train ms" in text

    (run,) = report["runs"]
    assert run["state_bytes"] > 7 << 20 and run["tensors"] == 50
    for key in ("write_s", "read_warm_s", "write_gbps", "read_warm_gbps"):
        assert _positive(run["raw"][key]), key
    assert set(run["methods"]) == set(bench.METHODS)
    for name, m in run["methods"].items():
        if name in bench.PEERS and not m["available"]:
            assert name.replace("-", "_") in m["reason"] and "pip install" in m["reason"]  # said so, not failed
            continue
        assert m["available"], (name, m.get("reason"))
        for key in TIMES:
            assert _positive(m[key]), (name, key, m[key])
        for key in RATIOS:
            assert _positive(m[key]), (name, key, m[key])
        assert m["load_verified"] is True and m["load_checks"] >= 1 and m["load_checks_failed"] == 0, name
        assert m["step_wait_s"] >= 0 and m["upload_wait_s"] >= 0
        # the training thread's time per checkpoint: the call, then the waits before the next step
        assert m["call_s"] <= m["stall_s"] <= m["stall_with_upload_wait_s"], name
        if name in bench.PEERS:  # neither fsyncs: the bench's own pass is part of durable
            assert _positive(m["fsync_pass_s"]) and "fsync" in m["description"], name
        mem = m["memory"]
        assert mem["model_bytes"] == run["state_bytes"]
        assert _positive(mem["rss_baseline"]) and mem["rss_peak"] >= mem["rss_baseline"]
        assert len(mem["per_checkpoint_peak"]) == m["loop_checkpoints"] >= 10
        assert isinstance(mem["flat_from_second"], bool)
        if run["cold_loads"].startswith("yes"):
            assert _positive(m["load_cold_s"]), name
    ds = run["methods"]["datastates"]
    assert ds["memory"]["host_cache_bytes"] > 0
    assert _positive(ds["load_warm_gc_paused_s"])
    names = [t["target"] for t in run["targets"]]
    assert any("1% of dcp.save" in n for n in names) and any("raw write bound" in n for n in names)
    assert all(t["met"] in (True, False, None) for t in run["targets"])
    assert run["methods"]["dcp-save"]["stall_vs_dcp_save"] == pytest.approx(1.0)

    sc = report["stage_cost"]
    assert sc["tensors"] == 2000
    for key in ("stage_s", "stage_cpu_s", "stage_gc_paused_s", "async_save_call_s", "async_save_durable_s", "stage_us_per_tensor"):
        assert _positive(sc[key]), key
    assert report["page_cache"]
    assert bench.main(["--from-json", str(out)]) == 0  # re-prints the table of a saved run
    assert "datastates" in capsys.readouterr().out


def _bench_methods(tmp_path, capsys, *args: str) -> tuple[str, dict]:
    """A one-repetition run of the given methods (no raw bound, no stage cost): what it printed,
    and its JSON's methods."""
    out = tmp_path / "bench.json"
    rc = bench.main([*args, "--reps", "1", "--stage-tensors", "0", "--no-raw", "--dir", str(tmp_path / "ckpt"),
                     "--json", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    return capsys.readouterr().out, json.loads(out.read_text())["runs"][0]["methods"]


def test_bench_torchsnapshot(tmp_path, capsys, monkeypatch):
    """torchsnapshot as a method: measured, fsync'ed by the bench, every load bitwise equal. Its
    slab threshold lowered to 256 KiB, the 4 large tensors are ones it writes from the live
    tensors after async_take returns: the step then waits for .wait()."""
    pytest.importorskip("torchsnapshot")
    monkeypatch.setenv("TORCHSNAPSHOT_SLAB_SIZE_THRESHOLD_BYTES_OVERRIDE", str(256 << 10))
    text, methods = _bench_methods(tmp_path, capsys, "--size", "8MiB", "--tensors", "8", "--mem-ckpts", "3",
                                   "--methods", "torchsnapshot")
    assert "torchsnapshot" in text and "n/a: " not in text
    m = methods["torchsnapshot"]
    assert m["available"] and m["load_verified"] is True and m["load_checks"] >= 1, m
    for key in TIMES:
        assert _positive(m[key]), (key, m[key])
    assert _positive(m["fsync_pass_s"]) and "fsync" in m["description"]
    assert m["tensors_written_live"] == 4 and "wait()" in m["step_guard"]
    assert m["call_s"] <= m["stall_s"] <= m["stall_with_upload_wait_s"]


def test_bench_skips_missing_peers(tmp_path, capsys, monkeypatch):
    """A peer that does not import is reported as not available, with the reason and how to add
    it, and the run still succeeds."""
    monkeypatch.setitem(sys.modules, "torchsnapshot", None)  # import torchsnapshot -> ImportError
    monkeypatch.setitem(sys.modules, "torch_checkpointing", None)
    text, methods = _bench_methods(tmp_path, capsys, "--size", "1MiB", "--tensors", "4", "--mem-ckpts", "1",
                                   "--methods", "torch-checkpointing,torchsnapshot")
    for name in bench.PEERS:
        assert methods[name]["available"] is False
        reason = methods[name]["reason"]
        assert reason.startswith(f"{name.replace('-', '_')} is not installed") and "pip install" in reason, reason
        assert f"n/a: {reason}" in text


def test_an_interrupted_bench_writes_the_methods_it_measured(tmp_path, capsys, monkeypatch):
    """Stopped by SIGINT (gpu_session.sh's time limit) during the second method: --json still
    holds the run, marked interrupted, with the first method's results; the exit status is 130."""

    def interrupted(self, state, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.DcpSaveMethod, "save", interrupted)
    out = tmp_path / "bench.json"
    rc = bench.main(["--size", "1MiB", "--tensors", "4", "--reps", "1", "--mem-ckpts", "1", "--cold", "no",
                     "--methods", "datastates,dcp-save", "--stage-tensors", "0", "--dir", str(tmp_path / "ckpt"),
                     "--json", str(out), "--quiet"])
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err
    (run,) = json.loads(out.read_text())["runs"]
    assert run["interrupted"] is True
    assert run["methods"]["datastates"]["available"] and _positive(run["methods"]["datastates"]["durable_s"])
    assert "dcp-save" not in run["methods"] or not run["methods"]["dcp-save"].get("available")


def test_bench_via_cli_and_bad_arguments(capsys):
    assert cli_main(["bench", "--size", "lots"]) == 2
    assert ("--size" if TESTING_THE_CHECKOUT else "bench is not available in this build") in capsys.readouterr().err
    assert bench.main(["--methods", "nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err
    assert bench.main(["--help"]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no CUDA")
def test_bench_cuda_without_cuda_fails_clearly(capsys):
    assert bench.main(["--device", "cuda", "--size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err


def test_bench_png(tmp_path, capsys):
    png = tmp_path / "chart.png"
    rc = bench.main(
        [
            "--size", "2MiB", "--tensors", "8", "--reps", "1", "--mem-ckpts", "3", "--methods", "datastates,dcp-save",
            "--stage-tensors", "0", "--dir", str(tmp_path / "ckpt"), "--cold", "no", "--png", str(png), "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib" in capsys.readouterr().err and not png.exists()
    else:
        assert png.stat().st_size > 1000


def test_end_to_end_loop_smoke(tmp_path):
    """benchmarks/end_to_end.py: every loop ends with a checkpoint equal to the final state, and
    a method's overhead is measured against the loop without checkpoints."""
    spec = importlib.util.spec_from_file_location("end_to_end", BENCHMARKS / "end_to_end.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    out = tmp_path / "e2e.json"
    report = e2e.main(["--size", "2MiB", "--tensors", "40", "--steps", "4", "--every", "1,2", "--runs", "1",
                       "--step-ms", "5", "--methods", "datastates,dcp-save", "--dir", str(tmp_path / "ck"),
                       "--json", str(out)])
    loops = report["loops"]
    assert set(loops) == {"none", "datastates every 1", "datastates every 2", "dcp-save every 1", "dcp-save every 2"}
    for name, loop in loops.items():
        assert loop["median_s"] > 0
        if name != "none":
            assert loop["last_checkpoint_equal"] is True, name
            assert loop["overhead"] == pytest.approx(loop["median_s"] / loops["none"]["median_s"] - 1)
    assert json.loads(out.read_text())["loops"].keys() == loops.keys()


def test_the_raw_bound_is_the_best_configuration_and_reads_back_what_it_wrote(tmp_path):
    """Every write configuration (1-N threads, shared or own files, with and without early
    writeback) is measured and leaves no file behind; the bound is the lowest median; merging
    more samples recomputes it."""
    raw_bound = bench.raw_bound
    raw = raw_bound.measure_raw(str(tmp_path), 3 * (1 << 20) + 5, 1, None)
    names = set(raw["medians"]["write"])
    assert len(names) == len(raw_bound.write_configs()) >= 1
    assert raw["write_s"] == min(raw["medians"]["write"].values()) > 0
    assert raw["write_how"] in names and raw["read_warm_how"].startswith("read, ")
    assert raw["read_cold_s"] is None  # no cold reads asked for
    assert list(tmp_path.iterdir()) == []
    fake = raw_bound.summarize({"bytes": 10, "configs": {"a": {"write": [3.0, 1.0, 2.0], "read_warm": [], "read_cold": []},
                                                      "b": {"write": [1.5], "read_warm": [4.0], "read_cold": []}}})
    assert (fake["write_s"], fake["write_how"], fake["read_warm_how"]) == (1.5, "b", "b")
    merged = raw_bound.merge_raw(fake, {"bytes": 10, "configs": {"b": {"write": [9.0, 9.0]}}})
    assert (merged["write_s"], merged["write_how"], merged["write_samples"]) == (2.0, "a", [3.0, 1.0, 2.0])
    assert fake["configs"]["b"]["write"] == [1.5]  # merging copies, it does not change its input


def test_a_striped_write_covers_every_byte_once(tmp_path):
    raw_bound = bench.raw_bound
    for nbytes, parts in ((1, 2), (3 * (64 << 20) + 7, 2), (64 << 20, 4), (5 << 20, 1)):
        stripes = raw_bound._stripes(nbytes, parts)
        assert sum(n for _, n in stripes) == nbytes and stripes[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(stripes, stripes[1:]))


def test_load_profile_splits_a_load_into_its_steps(tmp_path):
    """benchmarks/load_profile.py: the load's steps add up to at most its total, every load
    restores the saved bytes exactly, and the baselines of the same bytes are measured."""
    spec = importlib.util.spec_from_file_location("load_profile", BENCHMARKS / "load_profile.py")
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    out = tmp_path / "lp.json"
    report = lp.main(["--size", "4MiB", "--tensors", "40", "--loads", "2", "--dir", str(tmp_path), "--json", str(out)])
    m = report["medians_s"]
    assert m["bitwise_equal"] == 1.0
    assert all(m[step] >= 0 for step in lp.STEPS)
    assert m["read"] > 0 and m["metadata"] > 0 and m["torch_load"] > 0
    assert sum(m[step] for step in lp.STEPS) <= m["total"] * 1.05
    assert report["raw"]["read_warm_s"] > 0 and report["data_file_bytes"] >= report["bytes"] > 3 << 20
    assert json.loads(out.read_text())["tensors"] == 40
    assert list(tmp_path.iterdir()) == [out]  # its checkpoint folder is removed


def test_load_profile_cold_evicts_before_each_load(tmp_path, monkeypatch):
    """--cold: the checkpoint, the raw bound's file and torch.save's file are evicted before
    each of their loads (a cold raw read is measured), and the loads still restore every byte."""
    spec = importlib.util.spec_from_file_location("load_profile", BENCHMARKS / "load_profile.py")
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    evicted = []
    real = bench._evict
    monkeypatch.setattr(bench, "_evict", lambda path: (evicted.append(os.path.basename(path)), real(path)))
    report = lp.main(["--size", "2MiB", "--tensors", "10", "--loads", "2", "--dir", str(tmp_path), "--cold"])
    assert report["cold"] is True and report["medians_s"]["bitwise_equal"] == 1.0
    assert evicted.count("ckpt") == 2 and evicted.count("state.pt") == 2, evicted
    assert report["raw"]["read_cold_s"] > 0


def test_planner_variants_run_and_share_the_loads_of_the_same_files(tmp_path, capsys):
    """The opt-in plan-caching methods save through their planners, check their own files with a
    load, and report the loads of the method that writes the same files."""
    out = tmp_path / "bench.json"
    rc = bench.main(["--size", "2MiB", "--tensors", "20", "--reps", "2", "--mem-ckpts", "3", "--load-reps", "1",
                     "--cold", "no", "--no-raw", "--stage-tensors", "0", "--quiet", "--json", str(out),
                     "--dir", str(tmp_path / "ckpt"),
                     "--methods", "datastates,datastates-planner,dcp-save,dcp-async,dcp-async-cached"])
    assert rc == 0, capsys.readouterr().err
    methods = json.loads(out.read_text())["runs"][0]["methods"]
    for name, like in (("datastates-planner", "datastates"), ("dcp-async", "dcp-save"), ("dcp-async-cached", "dcp-save")):
        m = methods[name]
        assert m["available"], (name, m.get("reason"))
        assert m["load_shared_with"] == like and m["load_warm_s"] == methods[like]["load_warm_s"], name
        assert m["load_verified"] is True and m["load_checks_failed"] == 0, name
        assert _positive(m["durable_s"]), name
    assert "load_shared_with" not in methods["datastates"] and "load_shared_with" not in methods["dcp-save"]


def test_durable_saves_run_with_no_checkpoint_of_the_loop_left(tmp_path, capsys, monkeypatch):
    """The durable measurement writes where the loop's checkpoints were: they are removed before
    it (on /dev/shm a kept checkpoint is memory, and the next one then lands in pages nothing
    touched yet, which cost this VM ~1.4 s per GiB in one sample of five)."""
    seen: list[list[str]] = []
    save = bench.DcpAsyncMethod.save

    def listing_save(self, state, path):
        seen.append(sorted(os.listdir(os.path.dirname(path))))
        return save(self, state, path)

    monkeypatch.setattr(bench.DcpAsyncMethod, "save", listing_save)
    _bench_methods(tmp_path, capsys, "--size", "1MiB", "--tensors", "4", "--mem-ckpts", "4", "--load-reps", "1",
                   "--cold", "no", "--methods", "dcp-async")
    loop, durable = seen[:4], seen[4:]
    assert [len(names) for names in loop] == [0, 1, 1, 1], loop  # the loop keeps the last checkpoint only
    assert durable == [[]], seen

def test_rss_loop_reports_memory_per_checkpoint(small_engine, capsys):
    """scripts/rss_loop.py: one row per checkpoint (RSS at the request, live Python objects)."""
    spec = importlib.util.spec_from_file_location("rss_loop", BENCHMARKS.parent / "scripts" / "rss_loop.py")
    rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl)
    rows = rl.main(["--tensors", "40", "--checkpoints", "3", "--host-cache", "16MiB"])
    assert len(rows) == 3 and all(rss > 50 and objects > 1000 for rss, objects in rows)
    assert capsys.readouterr().out.count("Python objects") == 3


def test_overwrite_folder_times_replacing_and_fresh_saves(tmp_path):
    """benchmarks/overwrite_folder.py: both series run every save to its commit, and the folder
    is removed afterwards."""
    spec = importlib.util.spec_from_file_location("overwrite_folder", BENCHMARKS / "overwrite_folder.py")
    ow = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ow)
    report = ow.main(["--dir", str(tmp_path / "ow"), "--size", "2MiB", "--tensors", "10", "--saves", "2", "--pause", "0"])
    assert set(report["seconds"]) == {"one folder, replaced", "a new folder each"}
    assert all(len(v) == 2 and min(v) > 0 for v in report["seconds"].values())
    assert not (tmp_path / "ow").exists()


def test_staged_vs_durable_times_both_paths(tmp_path):
    """scripts/staged_vs_durable.py: a lazy save through the cache and with direct writes, each
    staged no later than durable, the checkpoints removed."""
    spec = importlib.util.spec_from_file_location("staged_vs_durable", BENCHMARKS.parent / "scripts" / "staged_vs_durable.py")
    svd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(svd)
    for mode in ("off", "on"):
        out = svd.main(["--dir", str(tmp_path / mode), "--direct-writes", mode, "--saves", "3", "--mib", "4"])
        assert out["direct_writes"] == mode and len(out["durable_samples"]) == 1
        assert 0 < out["staged_s"] <= out["durable_s"]
        assert not list((tmp_path / mode).iterdir())
