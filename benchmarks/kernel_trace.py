"""GPU kernel events of a torch-profiler chrome trace (plain or gzipped JSON), for the benchmarks that attribute time
to kernels (``bench_rollout_gpu.py --profile``, the split-decode phases of ``bench_gpu_attention.py``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def kernel_events(trace: Path) -> list[tuple[str, float, float]]:
    """``(kernel name, start us, duration us)`` of every GPU kernel in ``trace``, in start order."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [(e["name"], float(e.get("ts", 0.0)), float(e["dur"])) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    return sorted(kernels, key=lambda k: k[1])
