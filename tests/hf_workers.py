"""Rank functions for tests/test_hf.py: a Hugging Face model, as users build and train it, under
FSDP2 on gloo ranks (run with dist_harness.run_ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

VOCAB = 128


def _tied_llama(seed: int):
    """A tiny Llama whose lm_head shares the embedding's weight, each layer and the whole model
    sharded with FSDP2, AdamW on torch's foreach path with a LambdaLR schedule."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train_step(model, opt, sched, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _full_values(state: dict) -> dict:
    """Every tensor of a (nested) state dict as a full local copy, by flat key."""
    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, DTensor):
            out[prefix] = value.full_tensor().clone()
        elif isinstance(value, torch.Tensor):
            out[prefix] = value.clone()
        else:
            out[prefix] = value

    walk("", state)
    return out


def tied_llama_saves_request_time_values(rank: int, world: int, root: str, saves: int) -> None:
    """``saves`` lazy async saves, each followed at once by a training step (no wait, no
    protect_optimizer: torch.optim's step waits by itself); each checkpoint loads back, into a
    differently initialized model, bitwise equal to the state at its request, optimizer and
    schedule included."""
    from dcp_datastates import DataStatesReader, DataStatesWriter

    from conftest import assert_state_equal

    ckpt_group = dist.new_group(backend="gloo")  # the training's collectives keep the default group
    model, opt, sched = _tied_llama(0)
    _train_step(model, opt, sched, 0)
    requested, responses = [], []
    for i in range(1, saves + 1):
        msd, osd = get_state_dict(model, opt)
        requested.append((_full_values({"model": msd, "optim": osd}), sched.state_dict()))
        responses.append(dcp.async_save(
            {"model": msd, "optim": osd, "sched": sched.state_dict()},
            storage_writer=DataStatesWriter(f"{root}/step-{i}", process_group=ckpt_group), process_group=ckpt_group))
        _train_step(model, opt, sched, i)
    for r in responses:
        r.upload_completion.result()
    for i, (values, sched_state) in enumerate(requested, start=1):
        model2, opt2, sched2 = _tied_llama(1)
        _train_step(model2, opt2, sched2, 0)  # creates the optimizer state to load into
        msd, osd = get_state_dict(model2, opt2)
        state = {"model": msd, "optim": osd, "sched": sched2.state_dict()}
        dcp.load(state, storage_reader=DataStatesReader(f"{root}/step-{i}"))
        set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert model2.lm_head.weight is model2.model.embed_tokens.weight, "the tie survives the load"
        msd, osd = get_state_dict(model2, opt2)
        loaded = _full_values({"model": msd, "optim": osd})
        assert_state_equal(values, loaded, f"rank {rank}: checkpoint step-{i}")
        assert_state_equal(sched_state, state["sched"], f"rank {rank}: checkpoint step-{i}: sched")
