"""dcp.async_save call time with DataStatesWriter vs dcp.save with FileSystemWriter, 512 MiB in
2,048 tensors on /tmp (issue 2: the call must take under 5% of dcp.save).

    python benchmarks/async_call_vs_save.py
"""
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import DataStatesWriter

warnings.filterwarnings("ignore")
g = torch.Generator().manual_seed(0)
big = 48
state = {"model": {f"big{i}": torch.randn((512 << 20) // 4 // big, generator=g) for i in range(big)}}
state["model"].update({f"tiny{i}": torch.randn(16, generator=g) for i in range(2000)})
n = sum(t.numel() * t.element_size() for t in state["model"].values())
print(f"state: {n / 2**20:.0f} MiB in {len(state['model'])} tensors")
save, call, durable = [], [], []
for k in range(4):
    p = f"/tmp/issue2probe/ds{k}"
    t = time.perf_counter()
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(p))
    call.append(time.perf_counter() - t)
    resp.upload_completion.result()
    durable.append(time.perf_counter() - t)
    p = f"/tmp/issue2probe/fs{k}"
    t = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(p))
    save.append(time.perf_counter() - t)
c, s, d = statistics.median(call[1:]), statistics.median(save[1:]), statistics.median(durable[1:])
print(f"async_save call {c*1e3:.1f} ms (all: {[round(x*1e3,1) for x in call]}), dcp.save {s*1e3:.0f} ms, ratio {c/s:.2%}; DataStates request->durable {d*1e3:.0f} ms")
shutil.rmtree("/tmp/issue2probe", ignore_errors=True)
