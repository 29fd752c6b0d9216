"""Compile every launch of the row-parallel segment-tree kernel for sm_90a WITHOUT a GPU: errors, registers, spills.

    PYTHONPATH=$PWD python benchmarks/offline_compile_segment_tree.py [--quick]

The host code (``segment_tree.segment_tree_gemm``) runs on CPU tensors with the kernel launch replaced by a recorder;
each distinct launch (as an H200 with 132 SMs would get) is compiled by :mod:`offline_compile`.  Catches compile
errors and register spills before device time is spent; it says nothing about bits or speed.  Exit 1 on a compile
error or a launch over the shared memory of a block.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offline_compile import capture, compile_report, distinct_launches  # noqa: E402

from megatron_consistent.kernels.triton import linear as tlin  # noqa: E402
from megatron_consistent.kernels.triton import segment_tree as st  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (2048, 2048), (2048, 8192), (1000, 8192), (96, 64), (136, 200)]
# (path, segments per register group, chains per K loop): None = the planner's
SCHEDULES = [(None, None, None), ("serial", 1, None), ("serial", 2, None), ("serial", 4, None), ("parallel", 1, None),
             ("parallel", 2, None), ("flat", 1, None), ("flat", 2, None), ("serial", 4, 4), ("serial", 8, 4),
             ("parallel", 4, 4)]


def record_launches(calls):
    """The distinct launches ``(name, signature, attrs, constexprs, warps, stages)`` of ``segment_tree_gemm(**c)``."""
    def run():
        for c in calls:
            st.segment_tree_gemm(**c)

    sms, st._INTERPRETER_SMS = st._INTERPRETER_SMS, 132
    try:
        captured = capture(st, ["_segment_tree_kernel"], run)
    finally:
        st._INTERPRETER_SMS = sms
    return distinct_launches(captured, {"_segment_tree_kernel": st._segment_tree_kernel})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="TMA shapes, M = 1 and 4096, bf16 out only")
    ap.add_argument("--ttgir-dir", help="write each launch's normalized TTGIR here (diff -r against another tree's)")
    args = ap.parse_args()
    calls = []
    for n, k in (SHAPES[:4] if args.quick else SHAPES):
        for segments in (1, 2, 4, 8):
            kl = k * segments // 8
            w = torch.empty(n, kl, dtype=torch.bfloat16)
            tma = tlin.tma_ok(w) and (kl * 2) % 16 == 0
            for m in ((1, 4096) if args.quick else (1, 300, 4096)):
                x = torch.empty(m, kl, dtype=torch.bfloat16)
                outs = [(torch.bfloat16, torch.empty(n, dtype=torch.bfloat16))]
                if not args.quick:
                    outs.append((torch.float32, None))
                for path, reg, lanes in SCHEDULES:
                    for od, bias in outs:
                        calls.append(dict(x2d=x, weight=w, segments=segments, bias=bias, out_dtype=od, path=path,
                                          reg_segments=reg, lanes=lanes, use_tma=tma))
                calls.append(dict(x2d=x, weight=w, segments=segments, partials=True, use_tma=tma))
    launches = record_launches(calls)
    print(f"{len(launches)} distinct launches", flush=True)
    jobs = [(f"MODE {const['MODE']} SEG {const['SEGMENTS']} REG {const['REG']} LANES {const['LANES']} "
             f"{const['BM']}x{const['BN']}x{const['BK']} SPLITS {const['SPLITS']} TMA {const['USE_TMA']} "
             f"SWAP {const['SWAP']} W{warps} S{stages} out {sig['out_ptr']} bias {const['HAS_BIAS']}",
             st._segment_tree_kernel, sig, attrs, const, warps, stages)
            for _, sig, attrs, const, warps, stages in launches]
    sys.exit(compile_report(jobs, args.ttgir_dir))


if __name__ == "__main__":
    main()
