"""Ranks of the incremental-save tests (importable by spawned processes): a Hugging Face Llama
built from a config, 96 % of its parameters frozen, trained under FSDP2 and saved incrementally."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, protect_optimizer

TRAINABLE = ("model.norm.weight", "model.layers.1.self_attn.o_proj.weight")  # 4,160 of 106,816 parameters
SAVES = 20


def _llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for name, p in model.named_parameters():
        p.requires_grad_(name in TRAINABLE)
    return model


def _sharded():
    from torch.distributed.fsdp import fully_shard

    model = _llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    return model, opt


def _full(state):
    """Every DTensor of a state dict as its full tensor (collective: every rank calls it)."""
    if hasattr(state, "full_tensor"):
        return state.full_tensor().detach().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _full(v) for k, v in state.items()}
    return state


def save_frozen_llama(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _sharded()
    protect_optimizer(opt)
    ckpt_group = dist.new_group(backend="gloo")  # the save's collectives run beside training's (DCP's advice)
    written, response = {}, None
    for step in range(1, SAVES + 1):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (4, 16), generator=g)[rank * 2:(rank + 1) * 2]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()  # waits for the previous save's copies (protect_optimizer)
        opt.zero_grad()
        if response is not None:
            response.upload_completion.result(timeout=120)
        msd, osd = get_state_dict(model, opt)
        # Collectives of the test's own, before the save's start on DCP's thread (same group).
        full = _full({"model": msd, "optim": osd})
        if rank == 0 and step in (1, SAVES // 2, SAVES):
            torch.save(full, os.path.join(root, f"expected-{step}.pt"))
        state = {"model": msd, "optim": osd, "step": step}
        path = os.path.join(root, f"step-{step}")
        response = dcp.async_save(state, storage_writer=DataStatesWriter(path, incremental=True, process_group=ckpt_group),
                                  process_group=ckpt_group)
    response.upload_completion.result(timeout=120)
    dist.barrier()
    if rank == 0:
        for step in range(1, SAVES + 1):
            path = os.path.join(root, f"step-{step}")
            written[step] = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                                if n.endswith(".safetensors"))
        with open(os.path.join(root, "written.json"), "w") as f:
            json.dump(written, f)


def load_and_compare(rank: int, world: int, root: str, step: int) -> None:
    """Load step ``step`` strictly at this world size and compare with what was saved."""
    expected = torch.load(os.path.join(root, f"expected-{step}.pt"), weights_only=True)
    path = os.path.join(root, f"step-{step}")
    if world == 1 and not dist.is_initialized():  # one process, no FSDP: full tensors
        model = _llama()
        state = {"model": model.state_dict(), "step": 0}
        dcp.load(state, storage_reader=DataStatesReader(path), no_dist=True)
        got = state["model"]
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, opt = _sharded()
        g = torch.Generator().manual_seed(99)
        ids = torch.randint(0, 256, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()  # the optimizer's state exists, as when resuming
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, storage_reader=DataStatesReader(path))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        msd, osd = get_state_dict(model, opt)
        full = _full({"model": msd, "optim": osd})
        got = full["model"]
        _same(expected["optim"], full["optim"], "optim")
    assert state["step"] == step, state["step"]
    _same(expected["model"], got, "model")


def _same(expected, got, where):
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected.view(-1).view(torch.uint8), got.detach().contiguous().view(-1).view(torch.uint8)), where
        return
    if isinstance(expected, dict):
        assert set(expected) == set(got), (where, set(expected) ^ set(got))
        for k in expected:
            _same(expected[k], got[k], f"{where}.{k}")
        return
    assert expected == got, (where, expected, got)
