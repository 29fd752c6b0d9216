"""Compile the CUDA attention kernel's launches for sm_90a WITHOUT a GPU: errors, registers, spills, async copies.

    PYTHONPATH=$PWD python benchmarks/offline_compile_attention.py [--quick] [--ttgir-dir DIR]

The host code (``paged_attention`` for page sizes 16-128, bf16 and FP8 caches, prefill / decode / chunk shapes on
both paths, with and without the step's new K/V for a bf16 cache; ``attention_fwd`` for the dense path) runs on CPU
tensors with the kernels replaced by recorders; each distinct launch is compiled by :mod:`offline_compile`.  The
``async`` column counts the key and value loads the software pipeliner made asynchronous (the dense path's prefill:
12): a paged launch with fewer waits on its loads.
``--pdl``: the split path's launches as on Hopper with ``MC_ATTN_PDL=1`` (the merge a programmatic dependent launch).
Says nothing about bits or speed.  Exit 1 on a compile error or a launch over the shared memory of a block.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offline_compile import capture, compile_report, distinct_launches  # noqa: E402

from megatron_consistent.kernels.triton import attention as tattn  # noqa: E402
from megatron_consistent.kernels.triton import paged_attention as tpa  # noqa: E402

HQ, HKV, D, KEYS = 32, 8, 128, 4096
# (sequences, new queries per sequence, split): a 4k prefill, a 64-sequence decode step, a decode row alone
# (split), 8 chunks of 32 over a 4k prefix, 4 chunks of 16 (split)
SHAPES = [(1, KEYS, False), (64, 1, False), (1, 1, True), (8, 32, False), (4, 16, True)]


def record_launches(quick: bool, pdl: bool = False):
    """The distinct ``(name, signature, attrs, constexprs, warps, stages)`` launches of the attention host code."""
    def run():
        for page in (16, 64) if quick else tpa.PAGE_SIZES:
            for cache_dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float8_e4m3fn):
                cache = torch.empty(KEYS * 2 // page, page, HKV, D, dtype=cache_dtype)
                for nseq, qlen, split in SHAPES:
                    q = torch.empty(nseq * qlen, HQ, D, dtype=torch.bfloat16)
                    table = torch.zeros(nseq, KEYS // page, dtype=torch.int32)
                    qsl = torch.arange(nseq + 1, dtype=torch.int32) * qlen
                    seq = torch.full((nseq,), KEYS, dtype=torch.int32)
                    tpa.paged_attention(q, cache, cache, table, qsl, seq, D ** -0.5, torch.empty_like(q), qlen, KEYS,
                                        kv_scale=1.0, split=split)
                    if cache_dtype != torch.float8_e4m3fn and qlen > 1:
                        kv_new = torch.empty(nseq * qlen, HKV, D, dtype=torch.bfloat16)
                        tpa.paged_attention(q, cache, cache, table, qsl, seq, D ** -0.5, torch.empty_like(q), qlen,
                                            KEYS, split=split, k_new=kv_new, v_new=kv_new)
        # the dense path (trainer): every query tile (1 / 16 / 4096 new tokens: BLOCK_M 16 / 64 / 128) on both paths,
        # head dims 128 and 256 (whose shared memory bounds the tile and the merge stages)
        for d in (D, 256):
            kv = torch.empty(1, KEYS, HKV, d, dtype=torch.bfloat16)
            for tq in (1, 16, KEYS):
                q = torch.empty(1, tq, HQ, d, dtype=torch.bfloat16)
                for split in (False, True):
                    tattn.attention_fwd(q, kv, kv, torch.arange(KEYS - tq, KEYS)[None], torch.tensor([KEYS]),
                                        d ** -0.5, split=split)

    launches: list = []  # the padding-row zeroing kernel is recorded too, and dropped
    saved = tattn.SPLIT_PDL, tattn.on_hopper
    if pdl:
        tattn.SPLIT_PDL, tattn.on_hopper = True, lambda t: True
    try:
        capture(tpa, ["_zero_rows_kernel"], lambda: launches.extend(capture(tattn, ["_attn_kernel"], run)))
    finally:
        tattn.SPLIT_PDL, tattn.on_hopper = saved
    return distinct_launches(launches, {"_attn_kernel": tattn._attn_kernel})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="pages 16 and 64, bf16 cache only")
    ap.add_argument("--ttgir-dir", help="write each launch's normalized TTGIR here (diff -r against another tree's)")
    ap.add_argument("--pdl", action="store_true", help="the split path's merge as a programmatic dependent launch")
    args = ap.parse_args()
    launches = record_launches(args.quick, args.pdl)
    print(f"{len(launches)} distinct launches", flush=True)
    jobs = [(f"D {const['D']} PAGE {const['PAGE']} FP8 {const['FP8']} BLOCK_M {const['BLOCK_M']} MODE {const['MODE']} "
             f"W{warps} S{stages}" + (" NEW_KV" if const["NEW_KV"] else "")
             + (f" MERGE_STAGES {const['MERGE_STAGES']} SLICES {const['MERGE_DSPLIT']}" if const["MODE"] == 2 else "")
             + (" PDL" if const.get("PDL") else ""),
             tattn._attn_kernel, sig, attrs, const, warps, stages)
            for _, sig, attrs, const, warps, stages in launches]
    sys.exit(compile_report(jobs, args.ttgir_dir))


if __name__ == "__main__":
    main()
