"""Loaded by every interpreter that ``run.py`` starts (it is first on PYTHONPATH), the ranks that
PyTorch's multi-process tests spawn included: installs the substitution there too."""

import os

if os.environ.get("UPSTREAM_DCP_FORCE_GPU_TESTS") == "1":
    # Run the tests gated by skip_if_lt_x_gpu(n) on CPU and gloo (stock and substituted alike):
    # most of DCP's storage tests are gated so, though what they check of storage needs no GPU.
    def _keep(n):
        return lambda fn: fn

    import torch.testing._internal.common_distributed as _common
    import torch.testing._internal.distributed._tensor.common_dtensor as _dtensor

    _common.skip_if_lt_x_gpu = _dtensor.skip_if_lt_x_gpu = _keep

if os.environ.get("UPSTREAM_DCP_STORAGE") == "datastates":
    import dcp_subst

    dcp_subst.install()
