"""Compile the block-FP8 GEMM launches for sm_90a WITHOUT a GPU: errors, registers, spills, asynchronous copies.

    PYTHONPATH=$PWD python benchmarks/offline_compile_fp8.py [--ttgir-dir DIR]

The host code (``fp8_linear.fp8_gemm`` with TMA operands, as on the H200, and ``moe.fp8_grouped_gemm``) runs on CPU
tensors with the kernels replaced by recorders, for the Llama-8B shapes of ``benchmarks/sweep_gpu_gemm.py`` and
Qwen3-30B-A3B's expert projections, each with and without the flat split walk (``FLAT``) and the experts' weights
through a TMA descriptor (``W_TMA``); each distinct launch is
compiled by :mod:`offline_compile`.  Shows whether the flat walk's loop is software-pipelined (its asynchronous copies)
and what it costs in registers; says nothing about bits or speed.  Exit 1 on a compile error or a launch over the
shared memory of a block.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offline_compile import capture, compile_report, distinct_launches  # noqa: E402

from megatron_consistent.kernels.triton import fp8_linear as tf8  # noqa: E402
from megatron_consistent.kernels.triton import moe as tmoe  # noqa: E402

DENSE = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]  # (N, K)
EXPERTS = [(128, 1536, 2048), (128, 2048, 768)]  # (E, N, K): Qwen3-30B-A3B's gate/up and down


def _zeros(shape, dtype=torch.float8_e4m3fn):
    return torch.zeros(shape, dtype=torch.float32).to(dtype)


def record_dense():
    def run():
        for n, k in DENSE:
            g = -(-k // tf8.GROUP)
            w, ws = _zeros((n, k)), torch.ones(n, g)
            for flat in (False, True):
                cfg = {**tf8.fp8_config(n, k), "FLAT": flat}
                x, xs = _zeros((4096, k)), torch.ones(4096, g)
                tf8.fp8_gemm(x, xs, w, ws, None, torch.bfloat16, path="serial", use_tma=True, cfg=cfg, w_block_rows=128)

    return distinct_launches(capture(tf8, ("_fp8_gemm_kernel",), run), {"_fp8_gemm_kernel": tf8._fp8_gemm_kernel})


def record_grouped():
    def run():
        for e, n, k in EXPERTS:
            g = -(-k // tf8.GROUP)
            w, ws = _zeros((e, n, k)), torch.ones(e, n, g)
            for rows in (8, 16 * 8, 4096 * 8):  # decode (one row per expert), mid, prefill
                bm = tmoe.fp8_grouped_tiles(tf8.fp8_config(n, k), rows, e)[0]
                max_tiles = -(-rows // bm) + e  # tile_table's length (its contents do not enter the compile)
                tiles = (bm, *(torch.zeros(max_tiles, dtype=torch.int32) for _ in range(3)), max_tiles)
                x, xs = _zeros((rows, k)), torch.ones(rows, g)
                pairs = torch.arange(rows, dtype=torch.int32)
                for flat in (False, True):
                    for w_tma in (False, True):
                        tmoe.FP8_GROUPED_FLAT, tmoe.FP8_GROUPED_W_TMA = flat, w_tma
                        tmoe.fp8_grouped_gemm(x, xs, w, ws, tiles, pairs, torch.bfloat16, w_block_rows=128)

    saved = tmoe.FP8_GROUPED_FLAT, tmoe.FP8_GROUPED_W_TMA
    try:
        launches = capture(tmoe, ("_fp8_grouped_gemm_kernel",), run)
    finally:
        tmoe.FP8_GROUPED_FLAT, tmoe.FP8_GROUPED_W_TMA = saved
    return distinct_launches(launches, {"_fp8_grouped_gemm_kernel": tmoe._fp8_grouped_gemm_kernel})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttgir-dir", help="write each launch's normalized TTGIR here (diff -r against another tree's)")
    args = ap.parse_args()
    jobs = []
    for name, kernel, launches in (("dense", tf8._fp8_gemm_kernel, record_dense()),
                                   ("grouped", tmoe._fp8_grouped_gemm_kernel, record_grouped())):
        for _, sig, attrs, const, warps, stages in launches:
            desc = (f"{name} {const['BM']}x{const['BN']} SPLIT_GROUPS {const['SPLIT_GROUPS']} SPLITS {const['SPLITS']} "
                    f"FLAT {const.get('FLAT', False)} W_TMA {const.get('W_TMA', False)} W{warps} S{stages}")
            jobs.append((desc, kernel, sig, attrs, const, warps, stages))
    sys.exit(compile_report(jobs, args.ttgir_dir))


if __name__ == "__main__":
    main()
