"""Compile the CUDA SSD scan kernels (``kernels/triton/ssd_scan.py``: the prefix sums, the outputs, the chunks' state
terms) for sm_90a WITHOUT a GPU: errors, registers, spills, shared memory; with ``--sass`` each launch's static SASS
instruction mix (:func:`offline_compile.sass_mix`).

    PYTHONPATH=$PWD python benchmarks/offline_compile_ssd.py [--sass]
    MC_SSD_TREE_WIDTH=8 PYTHONPATH=$PWD python benchmarks/offline_compile_ssd.py --sass   # the outputs' tree slices

The host code runs on CPU tensors with the kernels replaced by recorders, for the Mamba-2 shapes of the tests and of
real models (Nemotron-H 8B: 128 heads x 64, 8 groups, state 128, chunk 128; Mamba-2 2.7B: 80 heads x 64, state 128,
chunk 256), at prefill and at a decode replay, and the decode step's in-place kernels (64 rows); each distinct launch
is compiled by :mod:`offline_compile`.  Says nothing about bits or speed.  Exit 1 on a compile error or a launch over
the shared memory of a block.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offline_compile import capture, compile_report, distinct_launches  # noqa: E402

from megatron_consistent.kernels import ssd  # noqa: E402
from megatron_consistent.kernels.triton import ssd_scan as tssd  # noqa: E402

KERNELS = ("_chunk_prefix_sums_kernel", "_ssd_outputs_kernel", "_chunk_contributions_kernel")
# (name, H, P, G, N, chunk, T, first_out)
SHAPES = [("tests", 4, 4, 2, 8, 8, 13, 0), ("Nemotron-H 8B prefill", 128, 64, 8, 128, 128, 300, 0),
          ("Nemotron-H 8B decode", 128, 64, 8, 128, 128, 77, 76), ("Mamba-2 2.7B prefill", 80, 64, 1, 128, 256, 300, 0)]


def record_launches():
    """The distinct ``(kernel name, signature, attrs, constexprs, warps, stages)`` launches of the host code."""
    def run():
        for _, nh, hp, ng, ns, chunk, t_len, first_out in SHAPES:
            x = torch.zeros(1, t_len, nh, hp, dtype=torch.bfloat16)
            b = torch.zeros(1, t_len, ng, ns, dtype=torch.bfloat16)
            ssd.ssd_scan_by(tssd.TRITON_STEPS)(
                x, torch.zeros(1, t_len, nh), torch.zeros(nh), b, b, torch.zeros(nh), chunk, torch.zeros(1, nh, hp, ns),
                first_out)
            if t_len >= chunk:  # a decode step's chunk closures (the state terms of the active rows only)
                ssd._ssd_chunk_states(x[:, :chunk], torch.zeros(1, chunk, nh), torch.zeros(nh), b[:, :chunk], b[:, :chunk],
                                      chunk, torch.zeros(1, nh, hp, ns), tssd.TRITON_STEPS, active=torch.ones(1, dtype=torch.bool))
        # the decode step's in-place kernels (FROM_CACHE: what the full decode graphs replay), Nemotron-H 8B, 64 rows
        nh, hp, ng, ns, chunk, rows = 128, 64, 8, 128, 128, 64
        conv = nh * hp + 2 * ng * ns
        caches = (torch.zeros(rows + 1, chunk, conv, dtype=torch.bfloat16), torch.zeros(rows + 1, chunk, nh),
                  torch.zeros(rows + 1, nh, hp, ns))
        slots, fresh = torch.arange(rows), torch.zeros(rows, dtype=torch.bool)
        tssd.ssd_step_outputs(*caches, slots, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, conv, dtype=torch.bfloat16),
                              torch.zeros(rows, nh), torch.zeros(nh), torch.zeros(nh), chunk, ng, ns, fresh)
        tssd.ssd_step_end_states(*caches, slots, torch.ones(rows, dtype=torch.bool), fresh, torch.zeros(nh), chunk, ng, ns)

    return distinct_launches(capture(tssd, KERNELS, run), {name: getattr(tssd, name) for name in KERNELS})


def main():
    jobs = [(f"{name} {const} W{warps}", getattr(tssd, name), sig, attrs, const, warps, stages)
            for name, sig, attrs, const, warps, stages in record_launches()]
    sys.exit(compile_report(jobs, sass="--sass" in sys.argv[1:]))


if __name__ == "__main__":
    main()
