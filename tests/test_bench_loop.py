"""``dcp-datastates bench --loop`` (benchmarks/bench_loop.py): a tiny training loop end to end,
every method, group and interval in its JSON, and the bitwise check that fails a run whose last
checkpoint does not load back as the state it was taken of."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench  # noqa: E402 - benchmarks/bench.py

sys.path.remove(str(BENCHMARKS))
bench_loop = bench._load_sibling("bench_loop")  # as `bench --loop` loads it

METHODS = ("datastates", "dcp-async-stager")
GROUPS = ("durable", "page-cache")
TINY = ["--layers", "2", "--width", "128", "--batch", "4", "--steps", "4", "--every", "1,4", "--runs", "1", "--quiet"]


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_loop_tiny_every_method_group_and_interval(tmp_path, capsys):
    out = tmp_path / "loop.json"
    threads = torch.get_num_threads()
    rc = bench.main(["--loop", *TINY, "--methods", ",".join(METHODS), "--dir", str(tmp_path / "ckpt"), "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert torch.get_num_threads() == threads  # the loop's pacing does not outlive it
    text = capsys.readouterr().out
    assert "no checkpoint" in text and all(m in text for m in METHODS) and "page-cache" in text
    report = json.loads(out.read_text())

    assert report["argv"][0] == "--loop" and "--json" in report["argv"]
    assert report["machine"]["cpus"] >= 1 and report["machine"]["torch"] == torch.__version__
    config = report["config"]
    assert config["every"] == [1, 4] and config["steps"] == 4 and config["torch_threads"] >= 1
    # 2 x Linear(128, 128): weights and biases, and AdamW's two moments and step counter of each
    assert config["tensors"] == 4 + 4 * 3 and config["state_bytes"] == 3 * 2 * (128 * 128 + 128) * 4 + 4 * 4
    base = report["baseline"]
    assert len(base["runs_s"]) == 1 and _positive(base["median_s"])
    assert set(report["results"]) == set(METHODS)
    for name in METHODS:
        assert set(report["results"][name]) == set(GROUPS), name
        for group in GROUPS:
            cells = report["results"][name][group]
            assert set(cells) == {"1", "4"}, (name, group)
            for every, cell in cells.items():
                n = 4 // int(every)
                assert cell["checkpoints"] == n and len(cell["runs_s"]) == 1
                assert all(_positive(s) for s in cell["runs_s"]) and _positive(cell["median_s"])
                assert cell["overhead"] == pytest.approx(cell["median_s"] / base["median_s"] - 1)
                assert cell["overhead_s_per_checkpoint"] == pytest.approx((cell["median_s"] - base["median_s"]) / n)
                (run,) = cell["runs"]
                assert len(run["call_s"]) == len(run["request_to_done_s"]) == n
                assert all(_positive(s) for s in run["request_to_done_s"] + run["call_s"])
                assert len(run["staged_wait_s"]) == 4 - int(every)  # before each step after the first request
                assert _positive(cell["median_request_to_done_s"])
                assert cell["last_checkpoint_equal"] is True
                # The extra seconds split into parts that add up to the run's time over the baseline.
                extra = cell["extra_s"]
                assert sum(extra.values()) == pytest.approx(run["seconds"] - base["median_s"])
                assert extra["calls"] == pytest.approx(sum(run["call_s"]))
                assert extra["waits_for_done"] == pytest.approx(sum(run["done_wait_s"]))
                if group == "durable":  # against the sustained bound: steps alone, or checkpoints back to back
                    bound = max(base["median_s"], n * report["sustained"]["best_s"])
                    assert cell["sustained_bound_s"] == pytest.approx(bound)
                    assert cell["vs_sustained_bound"] == pytest.approx(cell["median_s"] / bound)
                else:
                    assert "vs_sustained_bound" not in cell
    sustained = report["sustained"]
    # O_DIRECT: measured where the file system takes it (not tmpfs), else named as unsupported.
    assert set(sustained["patterns"]) | set(sustained["unsupported"]) == {"ours", "dcp", "direct"}
    assert {"ours", "dcp"} <= set(sustained["patterns"]) and sustained["best"] in sustained["patterns"]
    for pattern in sustained["patterns"].values():
        assert len(pattern["runs_s"]) == 5 and all(_positive(s) for s in pattern["runs_s"])
    assert sustained["best_s"] == min(p["median_s"] for p in sustained["patterns"].values())
    assert "sustained bound:" in text and "where the extra seconds go" in text
    assert "error" not in report
    assert not (tmp_path / "ckpt").exists()  # what the run wrote is gone


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_bitwise_check_names_what_differs(tmp_path):
    trainer = bench_loop.Trainer(2, 64, 4)
    state = trainer.state_dict()
    method = bench.make_method("datastates", 128 << 20, durable=False)
    method.setup(state, str(tmp_path))
    pending = method.save(state, str(tmp_path / "ckpt"))
    pending.wait_durable()
    targets = bench.empty_like_state(state)
    method.load(targets, str(tmp_path / "ckpt"))
    bench_loop.check_loaded(state, targets, "as saved")  # equal: no exception

    targets["optim"]["state"]["1.weight"]["exp_avg"].view(-1).view(torch.uint8)[7] ^= 1  # one bit of one moment
    with pytest.raises(AssertionError, match=r"differs .*optim\.state\.1\.weight\.exp_avg"):
        bench_loop.check_loaded(state, targets, "one bit flipped")
    method.load(targets, str(tmp_path / "ckpt"))
    targets["optim"]["param_groups"][0]["lr"] = 0.5  # a value, not a tensor
    with pytest.raises(AssertionError, match="param_groups"):
        bench_loop.check_loaded(state, targets, "another learning rate")


def test_a_checkpoint_that_loads_back_different_fails_the_run(tmp_path, capsys, monkeypatch):
    load = bench.DataStatesMethod.load

    def corrupting_load(self, targets, path):
        load(self, targets, path)
        targets["model"]["0.bias"].view(-1).view(torch.uint8)[0] ^= 0x80

    monkeypatch.setattr(bench.DataStatesMethod, "load", corrupting_load)
    out = tmp_path / "loop.json"
    rc = bench.main(["--loop", *TINY, "--every", "1", "--methods", "datastates", "--groups", "page-cache",
                     "--dir", str(tmp_path / "ckpt"), "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "datastates page-cache every 1, round 1" in err and "model.0.bias" in err
    report = json.loads(out.read_text())
    assert "differs" in report["error"] and report["results"] == {}


def test_usage_errors_and_the_table_again(tmp_path, capsys):
    assert bench.main(["--loop", "--steps", "6", "--every", "4"]) == 2
    assert "multiple of each --every" in capsys.readouterr().err
    assert bench.main(["--loop", "--methods", "dcp-save"]) == 2
    assert "unknown dcp-save" in capsys.readouterr().err
    assert bench.main(["--loop", "--from-json", str(tmp_path / "none.json")]) == 1
