"""The node-local tier in front of an object store (an S3 API on a local moto server) reached
through a proxy that cuts every connection: the drain fails, the local copy stays committed and
loadable, and the next checkpoint drains it once the store is back."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_tiers import _durable_writes, drain_fails_local_copy_loads

from dcp_datastates import DataStatesReader, DataStatesWriter, commit
from dcp_datastates.tiers import local_tier as tiers

from conftest import assert_state_equal, clone_state, zeros_like_state
from s3_util import CutProxy as _CutProxy
from s3_util import s3_options as _options

MiB = 1 << 20


def make_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 512, generator=g), "b": torch.randn(1000, generator=g).to(torch.bfloat16),
            "step": seed}


def via(proxy):
    """Options reaching the store through ``proxy``, failing fast when it is cut."""
    return dict(_options(proxy.endpoint),
                config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5})


def load_from_store(url, like, options):
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(url, storage_options=options))
    return out


def test_store_cut_during_the_drain_then_the_next_checkpoint_drains_both(s3, tmp_path):
    bucket = s3.bucket()
    port = int(s3.endpoint.rsplit(":", 1)[1])
    nv = str(tmp_path / "nvme")
    first, second = f"s3://{bucket}/run/step-1", f"s3://{bucket}/run/step-2"
    state1, state2 = make_state(1), make_state(2)

    cut = _CutProxy(port)
    cut.arm(64 * 1024)  # the store goes away 64 KiB into the drain
    # Safe on the local tier all along: committed there, loadable, tied to the durable path.
    drain_fails_local_copy_loads(state1, first, nv, via(cut))
    assert not commit.is_committed(first, storage_options=s3.options)  # never a commit without its data
    # A restart now reads the local copy (the durable tier has no commit of it yet).
    out = zeros_like_state(state1)
    dcp.load(out, storage_reader=DataStatesReader(first, local_tier=nv, storage_options=s3.options))
    assert_state_equal(state1, out)

    healed = _CutProxy(port)  # the store is back
    w2 = DataStatesWriter(second, local_tier=nv, keep_local=1, storage_options=via(healed))
    dcp.async_save(clone_state(state2), storage_writer=w2).upload_completion.result(timeout=120)
    # The second checkpoint drained, and the first one too (retried by this save).
    for url, state in ((first, state1), (second, state2)):
        assert commit.is_committed(url, check_files=True, storage_options=s3.options)
        assert_state_equal(state, load_from_store(url, state, s3.options))
    # keep_local=1: the first copy, durable now, is gone; the second stays.
    assert os.listdir(nv) == [os.path.basename(tiers.local_copy(nv, second))]
    healed.kill()


def test_both_tiers_carry_one_checkpoint_id(s3, tmp_path):
    url = f"s3://{s3.bucket()}/ck/step-3"
    nv = str(tmp_path / "nvme")
    state = make_state(3)
    w = DataStatesWriter(url, local_tier=nv, storage_options=s3.options)
    dcp.save(clone_state(state), storage_writer=w)
    local = tiers.local_copy(nv, url)
    assert commit.checkpoint_id(local) == commit.checkpoint_id(url, s3.options) is not None
    assert_state_equal(state, load_from_store(url, state, s3.options))


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


def test_files_are_uploaded_while_the_engine_writes_them_locally(s3, tmp_path, monkeypatch):
    """With an object store as the durable tier too, each data file is streamed to the store as
    the engine writes its local copy (file_copy.Follower), and the drain uploads nothing again."""
    uploads = _durable_writes(monkeypatch)
    url = f"s3://{s3.bucket()}/run/step-1"
    state = make_state(3)
    w = DataStatesWriter(url, local_tier=str(tmp_path / "nvme"), storage_options=s3.options)
    dcp.async_save(clone_state(state), storage_writer=w).upload_completion.result(timeout=120)
    assert uploads and all(while_written for _, while_written in uploads), uploads
    assert_state_equal(state, load_from_store(url, state, s3.options))
