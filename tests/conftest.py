import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def small_engine():
    """A fresh process-wide engine for the test (the next writer creates it with its own config,
    e.g. a small cache), with fault injection cleared and the engine shut down afterwards.
    Yields a 1 MiB cache size for tests that want one."""
    from dcp_datastates import shutdown_engine
    from dcp_datastates.runtime import current_engine

    shutdown_engine()
    yield 1 << 20
    eng = current_engine()
    if eng is not None:
        eng.set_fault("none", 0, "")
    shutdown_engine()


def tensors_equal_bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ac, bc = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return bool(torch.equal(ac.view(-1).view(torch.uint8), bc.view(-1).view(torch.uint8)))


def assert_state_equal(expected, actual, path="state", *, strict=False):
    """Bitwise for tensors (dtype and shape included), equal elsewhere. ``strict``: non-tensor
    values also of the same type, floats equal with their sign (NaN equals NaN)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert tensors_equal_bitwise(expected, actual), f"{path}: tensors differ ({expected.dtype} {tuple(expected.shape)})"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) == set(actual), f"{path}: keys differ"
        for k in expected:
            assert_state_equal(expected[k], actual[k], f"{path}.{k}", strict=strict)
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), f"{path}: lengths differ"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_state_equal(e, a, f"{path}[{i}]", strict=strict)
    elif strict:
        assert type(expected) is type(actual), f"{path}: {type(expected).__name__} {expected!r} != {type(actual).__name__} {actual!r}"
        if isinstance(expected, float):
            same = (math.isnan(expected) and math.isnan(actual)) or (
                expected == actual and math.copysign(1, expected) == math.copysign(1, actual))
            assert same, f"{path}: {expected!r} != {actual!r}"
        else:
            assert expected == actual, f"{path}: {expected!r} != {actual!r}"
    else:
        assert expected == actual or (expected != expected and actual != actual), f"{path}: {expected!r} != {actual!r}"


def clone_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if type(obj) is tuple:
        return tuple(clone_state(v) for v in obj)
    return obj


def zeros_like_state(obj):
    """A destination for dcp.load: same structure, tensors zeroed (non-tensor values kept)."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj) if obj.dtype != torch.bool else torch.zeros_like(obj, dtype=torch.bool)
    if isinstance(obj, dict):
        return {k: zeros_like_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [zeros_like_state(v) for v in obj]
    return None


class raises_through_dcp:
    """Like pytest.raises for errors raised inside DCP, which wraps them in CheckpointException
    (a BaseException); asserts the message (cause included) matches ``pattern``."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.value = None

    def __enter__(self):
        return self

    def __exit__(self, typ, value, tb):
        import re

        from torch.distributed.checkpoint.api import CheckpointException

        assert value is not None, f"no exception raised (expected one matching {self.pattern!r})"
        assert isinstance(value, (Exception, CheckpointException)), f"unexpected {typ.__name__}: {value}"
        from dcp_datastates.errors import checkpoint_error_cause

        # DCP's message carries the cause's text, except for a failed metadata read on torch
        # 2.9-2.11 (a bare AssertionError): the cause, as the library recovers it, is matched too.
        cause = checkpoint_error_cause(value)
        texts = (str(value), f"{type(cause).__name__}: {cause}")
        assert any(re.search(self.pattern, t) for t in texts), f"{self.pattern!r} not in: {value}\ncause: {texts[1]}"
        self.value = value
        return True


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 for the module (skipped without moto/s3fs)."""
    from s3_util import S3, s3_options, start_moto, stop_moto

    server, endpoint = start_moto()
    try:
        yield S3(server, endpoint, s3_options(endpoint))
    finally:
        stop_moto(server)


# ------------------------------------------------------------------- the package under test
# The suite tests whichever dcp_datastates imports: this checkout's (pip install -e) or an installed
# wheel (pip install ".[test]", as the README and .ci/run do). Against an installed package the
# session runs from a temporary folder: a subprocess started with `python -c` or `-m` puts its
# working folder first on sys.path, and from the repository root it would import the checkout.
# DCP_DATASTATES_EXPECT_INSTALLED=1 (.ci/run) makes it an error for the checkout to be imported.
ROOT = Path(__file__).resolve().parent.parent
_session_dir = None


def _from_checkout(file) -> bool:
    return Path(file).resolve().is_relative_to(ROOT / "dcp_datastates")


def _package_file() -> str:
    """Where ``import dcp_datastates`` finds the package (found, not imported: the checkout's
    copy may not import at all without its compiled engine)."""
    import importlib.util

    spec = importlib.util.find_spec("dcp_datastates")
    return spec.origin if spec is not None and spec.origin else "(not found)"


# False against an installed wheel: `dcp-datastates bench` then has no checkout to run benchmarks/bench.py from
TESTING_THE_CHECKOUT = _from_checkout(_package_file())


def pytest_report_header(config):
    file = _package_file()
    return f"dcp_datastates: {Path(file).parent} ({'this checkout' if _from_checkout(file) else 'installed'})"


def pytest_sessionstart(session):
    global _session_dir
    file = _package_file()
    if os.environ.get("DCP_DATASTATES_EXPECT_INSTALLED") == "1":
        if _from_checkout(file):
            pytest.exit(f"DCP_DATASTATES_EXPECT_INSTALLED=1 but dcp_datastates comes from the checkout ({file}): "
                        f"install it (pip install .), and run `pytest`, not `python -m pytest`, which puts "
                        f"the working folder first on sys.path", returncode=4)
        from dcp_datastates import _engine

        if _from_checkout(_engine.__file__):
            pytest.exit(f"dcp_datastates._engine comes from the checkout ({_engine.__file__})", returncode=4)
    if not _from_checkout(file):
        _session_dir = tempfile.mkdtemp(prefix="dcp-datastates-tests-")
        os.chdir(_session_dir)


def pytest_sessionfinish(session, exitstatus):
    if _session_dir is not None:
        os.chdir(session.config.invocation_params.dir)
        shutil.rmtree(_session_dir, ignore_errors=True)
