"""Hugging Face export: ``convert.to_hf(..., hf_config=...)`` / ``convert --to hf --hf-config``
writes ``config.json`` (and ``generation_config.json``) so that ``from_pretrained(folder)`` loads
the output alone; a missing or invalid config is refused naming the file, before anything is
written. examples/hf_fsdp2_train.py runs end to end (FSDP2 training, crash, resume, export)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from dcp_datastates import DataStatesWriter
from dcp_datastates.convert import read_hf_config, to_hf

from conftest import tensors_equal_bitwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(5)
    state = {"model": {"embed.weight": torch.randn(16, 8, generator=g), "norm.weight": torch.ones(8)}, "step": 3}
    dcp.save(state, storage_writer=DataStatesWriter(path), no_dist=True)
    return str(path), state


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_config_file_is_written_as_config_json_byte_for_byte(saved, tmp_path):
    path, state = saved
    text = json.dumps(CONFIG, indent=3) + "\n"  # its own layout: copied as it is, not re-dumped
    source = _write(tmp_path / "cfg" / "my-llama.json", text)
    out = tmp_path / "hf"
    done = to_hf(path, str(out), prefix="model.", hf_config=str(source))
    assert done.config_files == ["config.json"]
    assert (out / "config.json").read_text() == text
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "model.safetensors.index.json"]
    loaded = load_file(out / "model.safetensors")
    assert tensors_equal_bitwise(loaded["embed.weight"], state["model"]["embed.weight"])


def test_a_model_folder_gives_config_and_generation_config_only(saved, tmp_path):
    path, _ = saved
    folder = tmp_path / "model"
    _write(folder / "config.json", json.dumps(CONFIG))
    _write(folder / "generation_config.json", '{"max_length": 20}')
    _write(folder / "tokenizer.json", "{}")
    _write(folder / "model.safetensors", "not copied")
    out = tmp_path / "hf"
    done = to_hf(path, str(out), prefix="model.", hf_config=folder)  # a PathLike works too
    assert done.config_files == ["config.json", "generation_config.json"]
    assert json.loads((out / "config.json").read_text()) == CONFIG
    assert json.loads((out / "generation_config.json").read_text()) == {"max_length": 20}
    assert not (out / "tokenizer.json").exists()
    assert set(load_file(out / "model.safetensors")) == {"embed.weight", "norm.weight"}
    # a folder without generation_config.json: config.json alone
    (folder / "generation_config.json").unlink()
    assert list(read_hf_config(folder)) == ["config.json"]


def test_force_replaces_an_earlier_config(saved, tmp_path):
    path, _ = saved
    out = tmp_path / "hf"
    to_hf(path, str(out), hf_config=_write(tmp_path / "a.json", '{"model_type": "a"}'))
    to_hf(path, str(out), hf_config=_write(tmp_path / "b.json", '{"model_type": "b"}'), force=True)
    assert json.loads((out / "config.json").read_text()) == {"model_type": "b"}
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


@pytest.mark.parametrize(
    "content, error, message",
    [
        (None, FileNotFoundError, "Hugging Face config not found"),
        ("{not json", ValueError, "is not valid JSON"),
        ('["a", "list"]', ValueError, "is not a JSON object \\(found a list\\)"),
        (b"\xff\xfe{}", ValueError, "is not valid JSON"),
    ],
    ids=["missing", "invalid", "not-an-object", "not-utf8"],
)
def test_a_bad_config_file_is_refused_by_name_and_nothing_is_written(saved, tmp_path, content, error, message):
    path, _ = saved
    source = tmp_path / "cfg" / "config.json"
    source.parent.mkdir()
    if isinstance(content, bytes):
        source.write_bytes(content)
    elif content is not None:
        source.write_text(content)
    out = tmp_path / "hf"
    with pytest.raises(error, match=message) as info:
        to_hf(path, str(out), hf_config=str(source))
    assert str(source) in str(info.value)
    assert not out.exists()  # checked before the checkpoint is read or the output made


def test_a_bad_folder_is_refused_naming_the_file(saved, tmp_path):
    path, _ = saved
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json in the Hugging Face config folder") as info:
        to_hf(path, str(tmp_path / "hf"), hf_config=str(folder))
    assert info.value.filename == str(folder / "config.json")
    _write(folder / "config.json", json.dumps(CONFIG))
    _write(folder / "generation_config.json", "1")
    with pytest.raises(ValueError, match=f"{folder / 'generation_config.json'} is not a JSON object"):
        to_hf(path, str(tmp_path / "hf"), hf_config=str(folder))
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").mkdir()
    with pytest.raises(ValueError, match="generation_config.json is a folder, not a JSON file"):
        to_hf(path, str(tmp_path / "hf"), hf_config=str(folder))
    assert not (tmp_path / "hf").exists()


def _cli(*args):
    # the package that the tests test (installed, or the checkout with pip install -e): no PYTHONPATH
    return subprocess.run([sys.executable, "-m", "dcp_datastates", *args], capture_output=True, text=True, timeout=120)


def test_the_command_line_writes_the_config_and_names_a_bad_one(saved, tmp_path):
    path, _ = saved
    folder = tmp_path / "model"
    _write(folder / "config.json", json.dumps(CONFIG))
    _write(folder / "generation_config.json", "{}")
    r = _cli("convert", path, str(tmp_path / "hf"), "--to", "hf", "--prefix", "model.", "--hf-config", str(folder))
    assert r.returncode == 0, r.stderr
    assert "+ model.safetensors.index.json + config.json + generation_config.json" in r.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == CONFIG
    bad = _write(tmp_path / "bad.json", "[]")
    r = _cli("convert", path, str(tmp_path / "hf2"), "--to", "hf", "--hf-config", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip() == f"dcp-datastates convert: error: Hugging Face config {bad} is not a JSON object (found a list)"
    r = _cli("convert", path, str(tmp_path / "hf2"), "--to", "hf", "--hf-config", str(tmp_path / "nope.json"))
    assert r.returncode == 1
    assert r.stderr.strip() == f"dcp-datastates convert: error: Hugging Face config not found: {tmp_path / 'nope.json'}"
    r = _cli("convert", path, str(tmp_path / "o.pt"), "--to", "torch", "--hf-config", str(folder))
    assert r.returncode == 1 and "--hf-config applies to --to hf only" in r.stderr
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "o.pt").exists()


def test_from_pretrained_loads_the_output_folder_alone(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    model.config.save_pretrained(tmp_path / "model")
    model.generation_config.save_pretrained(tmp_path / "model")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict(), "step": 1}, storage_writer=DataStatesWriter(tmp_path / "ckpt"), no_dist=True)
    out = tmp_path / "hf"
    to_hf(str(tmp_path / "ckpt"), str(out), prefix="model.", hf_config=tmp_path / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert tensors_equal_bitwise(got[k], v), k


def test_the_example_trains_crashes_resumes_and_exports_bitwise(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "hf_fsdp2_train.py"), "--steps", "6", "--ckpt-every", "2",
         "--kill-at-step", "5", "--out", str(tmp_path / "run"), "--export", str(tmp_path / "export")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "step 5: SIGKILL (simulated crash)" in r.stdout
    # step-4 was maybe still in flight at the crash; step-2 is complete (waited for before step-4's save)
    resumed = re.search(rf"resumed from {re.escape(str(tmp_path / 'run'))}/step-(\d) at step (\d)\n", r.stdout)
    assert resumed and resumed[1] == resumed[2] and resumed[1] in ("2", "4"), r.stdout
    assert f"resumed losses equal the reference's ({6 - int(resumed[1])} steps): True" in r.stdout
    assert "last checkpoint (model, optimizer, step) bitwise equal to the reference's: True" in r.stdout
    assert "is a LlamaForCausalLM, weights bitwise equal to the checkpoint: True" in r.stdout
    assert sorted(os.listdir(tmp_path / "export")) == [
        "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"]


def test_tied_llama_under_fsdp2_saves_its_request_time_values(tmp_path):
    """A Hugging Face Llama with tied embeddings, FSDP2 on 2 gloo ranks, AdamW (foreach) with a
    LambdaLR schedule: every lazy save, with a training step right after its request, loads back
    bitwise equal to the model, optimizer and schedule at the request."""
    pytest.importorskip("transformers")
    import hf_workers

    from dist_harness import run_ranks

    run_ranks(2, hf_workers.tied_llama_saves_request_time_values, str(tmp_path), 3)
