"""GPU kernel events of a torch-profiler chrome trace (plain or gzipped JSON), for the benchmarks that attribute time
to kernels (``bench_rollout_gpu.py --profile``, the split-decode phases of ``bench_gpu_attention.py``, the MoE layer's
``bench_gpu_moe.py --kernel-times``)."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path


def kernel_events(trace: Path) -> list[tuple[str, float, float]]:
    """``(kernel name, start us, duration us)`` of every GPU kernel in ``trace``, in start order."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [(e["name"], float(e.get("ts", 0.0)), float(e["dur"])) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    return sorted(kernels, key=lambda k: k[1])


def profiled_kernels(fn, iters: int = 20) -> list[tuple[str, float, float]]:
    """:func:`kernel_events` of ``iters`` eager calls of ``fn`` (after one unprofiled call), under the torch profiler."""
    import torch

    fn()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return kernel_events(trace)
