"""DeepSpeed integration (dcp_datastates.integrations.deepspeed) on 2 gloo ranks (CPU).

The ranks run DeepSpeed (tests/deepspeed_workers.py) and write what they checked; the tests here
read that and the checkpoint folders. Skipped when DeepSpeed is not installed (the `deepspeed`
extra); the tests that need no DeepSpeed always run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_ranks

WORLD = 2


def test_module_imports_without_deepspeed():
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from dcp_datastates.integrations import deepspeed as ds\n"
        "assert ds.DEEPSPEED_AVAILABLE is False\n"
        "for make in (ds.initialize, ds.DataStatesCheckpointEngine):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as exc:\n"
        "        assert 'DeepSpeed' in str(exc) and 'pip install' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.fixture(scope="module")
def integration():
    pytest.importorskip("deepspeed")
    from dcp_datastates.integrations import deepspeed as integration

    if not integration.DEEPSPEED_AVAILABLE:  # installed, but fails to import with this torch
        pytest.fail(f"DeepSpeed is installed but does not import: {integration.engine._IMPORT_ERROR!r}")
    return integration


def _summaries(root, name):
    return [json.loads((root / f"{name}_{rank}.json").read_text()) for rank in range(WORLD)]


def _launched(tmp_path_factory, worker: str, summary: str):
    """(folder, each rank's summary) of one launch of ``deepspeed_workers.<worker>`` on 2 ranks."""
    import deepspeed_workers as W

    root = tmp_path_factory.mktemp(worker)
    run_ranks(WORLD, getattr(W, worker), str(root), timeout=300)
    return root, _summaries(root, summary)


# ------------------------------------------------------------------------------ configuration
def test_the_seed_section_configures_the_engine(integration):
    config = integration.engine_config({"host_cache_size": 16, "parser_threads": 3, "pin_host_cache": False})
    assert config.host_cache_size == 16 << 30  # a bare number is GiB, as in the tutorial
    assert config.copy_threads == 3 and config.pin_host_cache is False
    assert config.dedup_replicated is False  # every DeepSpeed file is one rank's


def test_a_misspelled_option_is_refused_naming_it(integration):
    with pytest.raises(ValueError, match=r"datastates_ckpt.*'host_cache_sise'.*did you mean 'host_cache_size'"):
        integration.engine_config({"host_cache_sise": 16})
    with pytest.raises(ValueError, match="'datastates_ckpt' must be a section of options"):
        integration.engine_config(16)


def test_datastates_engine_refuses_an_engine_of_deepspeed(integration):
    class Engine:
        checkpoint_engine = object()

    with pytest.raises(TypeError, match="does not checkpoint through DataStates.*'datastates_ckpt'"):
        integration.datastates_engine(Engine())


def test_state_packing_keeps_containers_and_shared_tensors(integration):
    from collections import OrderedDict

    import deepspeed_workers as W

    from dcp_datastates.integrations.deepspeed.state import pack, unpack

    w = torch.nn.Parameter(torch.randn(3, 2))
    state = {"module": OrderedDict([("a.weight", w), ("b.weight", w)]), "shapes": [OrderedDict(a=torch.Size([3, 2]))],
             "groups": [torch.arange(4.0)], "betas": (0.9, 0.99), "state": {0: {"step": torch.tensor(3.0)}}, "n": 7}
    tensors, skeleton = pack("f.pt", state)
    assert sorted(tensors) == ["f.pt/groups/0", "f.pt/module/a.weight", "f.pt/state/0/step"]  # w once
    back = unpack(skeleton, {k: v.clone() for k, v in tensors.items()})
    assert W.differences(state, back) == []
    assert back["module"]["a.weight"] is back["module"]["b.weight"]  # still one tensor
    assert isinstance(back["module"]["a.weight"], torch.nn.Parameter)


# ------------------------------------------------------------------------------ resume matrix
@pytest.fixture(scope="module")
def matrix(integration, tmp_path_factory):
    return _launched(tmp_path_factory, "resume_matrix", "summary")


def test_resume_is_bitwise_for_zero_1_2_3_fp32_bf16_with_and_without_scheduler(matrix):
    import deepspeed_workers as W

    _, summaries = matrix
    for summary in summaries:
        assert sorted(summary) == sorted(W.name_of(*c) for c in W.CONFIGS)
        for name, s in summary.items():
            assert s["tag"] == "t1" and s["load_path"] == os.path.join(name, "t1"), (name, s["load_path"])
            assert len(s["resumed"]) == W.STEPS_AFTER
            assert s["resumed"] == s["continued"], name  # exactly the uninterrupted losses
            assert len(set(s["before"] + s["continued"])) == len(s["before"] + s["continued"]), name  # training moves


def test_checkpoint_holds_the_request_values_though_the_step_followed_at_once(matrix):
    _, summaries = matrix
    for rank, summary in enumerate(summaries):
        for name, s in summary.items():
            files = s["request_diffs"]
            expected = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"}
            if "bf16" in name:
                expected = {"bf16_" + f for f in expected}
            assert expected <= set(files), (name, files)
            assert all(d == [] for d in files.values()), (name, files)
            assert s["live_moved_after_request"] is True, name  # the live state changed meanwhile
            # every optimizer step ran with no copy left in flight
            assert s["staging_seen_by_steps"] == [0] * (2 + 3), (name, s["staging_seen_by_steps"])


def test_the_tag_folder_holds_datastates_files_and_deepspeed_pointers(matrix):
    root, summaries = matrix
    for name, s in summaries[0].items():
        stage = int(name[4])
        prefix = "bf16_" if "bf16" in name else ""
        model = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(WORLD)] if stage == 3 \
            else ["mp_rank_00_model_states.pt"]
        optim = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)]
        assert s["files"] == sorted([".metadata", "__0_0.safetensors", "__1_0.safetensors", *model, *optim]), s["files"]
        for pointer in model + optim:
            doc = json.loads((root / name / "t1" / pointer).read_text())
            assert doc["format"] == "dcp_datastates.deepspeed/pointer" and doc["item"] == pointer
        assert (root / name / "latest").read_text() == "t1"


def test_data_files_are_safetensors_readable(matrix, integration):
    from safetensors import safe_open

    root, _ = matrix
    folder = root / "zero2-fp32-sched" / "t1"
    for rank in range(WORLD):
        file = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        state = integration.load_file(str(folder), file)["optimizer_state_dict"]
        with safe_open(str(folder / f"__{rank}_0.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            fp32 = f.get_tensor(f"{file}/optimizer_state_dict/single_partition_of_fp32_groups/0")
            exp_avg = f.get_tensor(f"{file}/optimizer_state_dict/base_optimizer_state/state/0/exp_avg")
        assert torch.equal(fp32, state["single_partition_of_fp32_groups"][0])
        assert torch.equal(exp_avg, state["base_optimizer_state"]["state"][0]["exp_avg"])
        # this rank's files only: their tensors, and each file's skeleton value under the file's name
        model = "mp_rank_00_model_states.pt"
        assert all(k.startswith((f"{model}/", f"{file}/")) or k in (model, file) for k in keys), keys
        assert file in keys and (model in keys) == (rank == 0)


# ------------------------------------------------------------------------------ DeepSpeed's own files
@pytest.fixture(scope="module")
def against(integration, tmp_path_factory):
    return _launched(tmp_path_factory, "against_deepspeed", "against")


def test_ours_resumes_from_deepspeed_default_engine_files_as_from_its_own(against):
    _, summaries = against
    for summary in summaries:
        for name, s in summary.items():
            assert s["from_ref"] == s["from_ours"], name  # DeepSpeed's torch.save files load in ours


@pytest.mark.parametrize("name", ["zero1-fp32-sched", "zero3-bf16-sched"])
def test_convert_writes_deepspeed_own_files_and_zero_to_fp32_reads_them(against, integration, name, tmp_path):
    import deepspeed_workers as W
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, _ = against
    out = tmp_path / "converted" / "t1"
    done = integration.to_deepspeed(root / "ours" / name / "t1", out)
    ref = root / "ref" / name / "t1"
    assert sorted(done.files) == sorted(os.listdir(ref))
    for file in done.files:
        mine = torch.load(out / file, weights_only=False)
        theirs = torch.load(ref / file, weights_only=False)
        # the same state DeepSpeed's own engine wrote (the configs differ by datastates_ckpt only)
        assert W.differences(theirs, mine, skip=("ds_config",)) == [], file
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "converted"), tag="t1")
    expected = get_fp32_state_dict_from_zero_checkpoint(str(root / "ref" / name), tag="t1")
    assert sorted(fp32) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert W.differences(expected, fp32) == []
    with pytest.raises(ValueError, match="is not empty"):
        integration.to_deepspeed(root / "ours" / name / "t1", out)


def test_universal_checkpoint_converter_reads_the_converted_files(against, integration, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, _ = against
    integration.to_deepspeed(root / "ours" / "zero1-fp32-sched" / "t1", tmp_path / "in" / "t1")
    # --inject_missing_state: this test's client state has no universal_checkpoint_info (a
    # Megatron-DeepSpeed client writes it); DeepSpeed's converter then adds its default
    run = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                          str(tmp_path / "in" / "t1"), "--output_folder", str(tmp_path / "universal"),
                          "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "in"), tag="t1")
    for name, value in fp32.items():
        stored = torch.load(tmp_path / "universal" / "zero" / name / "fp32.pt", weights_only=False)
        stored = stored["param"] if isinstance(stored, dict) else stored
        assert torch.equal(stored.reshape(value.shape), value), name


def test_convert_refuses_a_checkpoint_without_deepspeed_files(integration, tmp_path):
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    dcp.save({"w": torch.zeros(2)}, storage_writer=DataStatesWriter(tmp_path / "plain"), no_dist=True)
    with pytest.raises(ValueError, match="holds no DeepSpeed file"):
        integration.to_deepspeed(tmp_path / "plain", tmp_path / "out")


def test_command_line_converts_to_deepspeed(against, tmp_path, capsys):
    from dcp_datastates.cli import main

    root, _ = against
    out = tmp_path / "t1"
    assert main(["convert", str(root / "ours" / "zero1-fp32-sched" / "t1"), str(out), "--to", "deepspeed", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "3 DeepSpeed file(s)" in printed and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in printed
    assert sorted(os.listdir(out)) == sorted(os.listdir(root / "ref" / "zero1-fp32-sched" / "t1"))
    assert main(["convert", str(root / "ours" / "zero1-fp32-sched" / "t1"), str(out), "--to", "deepspeed"]) == 1
    assert "is not empty (pass --force" in capsys.readouterr().err


# ------------------------------------------------------------------------------ latest and faults
def test_latest_names_a_tag_only_once_it_is_committed(integration, tmp_path):
    import deepspeed_workers as W

    run_ranks(WORLD, W.latest_after_commit, str(tmp_path), timeout=240)
    for s in _summaries(tmp_path, "held"):
        # save_checkpoint returned and two optimizer steps ran while rank 0's commit was held back
        assert s["steps_while_held"] == 2
        assert s["latest_while_held"] == "first" and s["marker_while_held"] is False
        assert s["wait"] == "second" and s["latest_after"] == "second" and s["marker_after"] is True
        # a commit that fails: `latest` stays, the next save raises naming the failed tag
        raised = s["next_save_raised"]
        assert raised.startswith("CheckpointWriteError: DeepSpeed checkpoint 'third'"), raised
        assert "No space left on device" in raised and "`latest` still names the previous tag" in raised
        assert s["latest_after_failure"] == "second" and s["fourth_started"] is False
        assert s["fifth"] == "fifth" and s["latest_end"] == "fifth"


def test_sigkill_mid_save_leaves_the_previous_tag_loadable(integration, tmp_path):
    import deepspeed_workers as W

    with pytest.raises(AssertionError, match=r"ranks exited abnormally: \[\(0, -9\), \(1, -9\)\]"):
        run_ranks(WORLD, W.killed_mid_save, str(tmp_path), timeout=240)
    save_dir = tmp_path / "ckpt"
    assert (save_dir / "latest").read_text() == "good"
    assert not (save_dir / "killed" / ".metadata").exists()
    os.unlink(tmp_path / "held")
    run_ranks(WORLD, W.resume_after_kill, str(tmp_path), timeout=240)
    for rank, s in enumerate(_summaries(tmp_path, "resumed")):
        assert s["latest"] == "good" and s["load_path"] == "good"
        assert s["losses"] == json.loads((tmp_path / f"after_good_{rank}.json").read_text())
        assert s["killed_tag"].startswith("IncompleteCheckpointError"), s["killed_tag"]
