"""Megatron-core integration (dcp_datastates.integrations.megatron) on 2 gloo ranks (CPU).

One launch of 2 ranks runs every save and load (tests/megatron_workers.py): the ranks compare
each loaded tensor bitwise with the saved values and write what they checked; the tests here
read that and the checkpoint folders. Skipped when megatron-core cannot be imported (an
optional extra: ``pip install -e ".[megatron]"``); the test that the integration module imports
without it always runs.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest

from dist_harness import run_ranks


def test_module_imports_without_megatron():
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "import dcp_datastates\n"
        "from dcp_datastates.integrations import megatron as mg\n"
        "assert mg.MEGATRON_AVAILABLE is False\n"
        "for make in (mg.DataStatesSaveShardedStrategy, mg.DataStatesLoadShardedStrategy, mg.register_strategies):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as exc:\n"
        "        assert 'megatron-core' in str(exc) and 'pip install' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "assert 'megatron' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    # like pytest.importorskip("megatron.core"), and also when an installed megatron-core fails
    # to import (importorskip lets an ImportError other than ModuleNotFoundError through)
    with warnings.catch_warnings():  # importing megatron.core warns about TE, Apex, torch.jit
        warnings.simplefilter("ignore")
        from dcp_datastates.integrations import megatron as integration

    if not integration.MEGATRON_AVAILABLE:
        pytest.skip(f"megatron-core cannot be imported: {integration._IMPORT_ERROR!r}")
    import megatron_workers as W

    root = tmp_path_factory.mktemp("megatron")
    run_ranks(2, W.round_trips, str(root), timeout=120)
    return root


@pytest.fixture(scope="module")
def summaries(root):
    return [json.loads((root / f"summary_{rank}.json").read_text()) for rank in range(2)]


def test_sync_save_round_trips_bitwise(summaries):
    # sharded fp32 rows, bf16 columns, replicated, uneven int64, layer-stacked bf16; per-rank
    # objects, RNG state and the common state (checked in the ranks)
    assert [s["sync"] for s in summaries] == [5, 5]


def test_async_save_keeps_request_time_values_and_reshards(summaries):
    for s in summaries:
        # the ranks changed every source tensor in place after staging; the load matched the
        # values at the request, with rows and columns swapped, and each rank read the
        # ShardedObjects the other one saved
        assert s["async_resharded"] == 5
        assert s["async_full"] == 5  # load_plain_tensors: every tensor whole
        assert s["metadata_json_before_finalize"] is False  # Megatron commits it in finalize


def test_megatron_async_calls_queue_runs_the_request(summaries):
    for s in summaries:
        assert s["queue_finalized"] == [0]
        assert s["queue"] == 5
    # the non-blocking polls of all ranks agree (all-reduced), so they stop at the same poll
    assert summaries[0]["queue_polls"] == summaries[1]["queue_polls"]
    # wait_in_async_fn=False: nothing for the queue to run; its first poll finalizes (waiting)
    for s in summaries:
        assert s["no_helper_async_fn"] is True and s["no_helper_finalized"] == [1]
        assert s["queue_no_helper"] == 5


def test_failed_async_save_raises_on_every_rank_and_keeps_the_old_checkpoint(summaries):
    for s in summaries:
        raised = s["failed_save_raised"]
        assert raised.startswith("CheckpointException") and "overwrite" in raised, raised
        assert s["sync_after_failure"] == 5
        assert s["flags_left"] == []


def test_fully_parallel_wrapper_and_refusals(summaries):
    for s in summaries:
        assert s["wrapped"] == 5
        assert s["default_group_refused"] is True
        assert s["other_backend_refused"] is True


def test_checkpoint_folders_hold_datastates_and_megatron_files(root):
    for name in ("sync", "async", "queue", "queue_no_helper", "wrapped"):
        folder = root / name
        config = json.loads((folder / "metadata.json").read_text())
        assert config["sharded_backend"] == "datastates" and config["sharded_backend_version"] == 1, config
        names = set(os.listdir(folder))
        assert {"common.pt", ".metadata", "__0_0.safetensors", "__1_0.safetensors"} <= names, names
        assert not any(n.endswith(".distcp") for n in names), names
        doc = json.loads((folder / ".metadata").read_bytes())  # DataStates' JSON metadata, not a pickle
        items = doc["items"]
        assert {"decoder.weight", "decoder.proj", "decoder.bias", "embedding.word", "decoder.layers.w"} <= set(items)
        assert items["decoder.proj"]["dtype"] == "bfloat16" and items["embedding.word"]["dtype"] == "int64"
        # one object per rank, under Megatron's unique keys
        assert {"rank_state/shard_0_2", "rank_state/shard_1_2", "rng_state/shard_0_2", "rng_state/shard_1_2"} <= set(items)
