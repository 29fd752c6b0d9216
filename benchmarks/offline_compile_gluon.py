"""Compile the Gluon kernels (``kernels/triton/gluon_segment_tree.py``, ``gluon_fp8_gemm.py``, ``gluon_attention.py``)
for sm_90a WITHOUT a GPU: errors, registers, spills, shared memory, at the launches the benchmarks make.

    PYTHONPATH=/tmp/tritonsite:$PWD python benchmarks/offline_compile_gluon.py [--only tree|fp8|attention]

(Triton 3.6, the H200's, in ``/tmp/tritonsite``: ``pip install --target /tmp/tritonsite --no-deps triton==3.6.0``.)
Bits and speed on the H200: ``python benchmarks/bench_gpu_row_parallel.py --gluon`` (tree) and ``python
benchmarks/sweep_gpu_gemm.py --only-fp8 --gluon`` (FP8), ``python benchmarks/bench_gpu_attention.py --gluon``
(attention), each against the committed kernel with ``torch.equal``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline_compile import compile_report  # noqa: E402


def tree_jobs():
    """``(description, kernel, signature, constexprs)`` of the launches the row-parallel benchmark's shapes make
    (o_proj and down of the 1B and 8B Llama) by each schedule: bf16 out at TP = 1 (8 segments), the float32 subtrees
    of TP = 2, 4, 8 (4, 2, 1 segments)."""
    from triton.runtime.jit import mangle_type

    from megatron_consistent.kernels.triton.gluon_segment_tree import SCHEDULES, TILE, WARPS, _ws_tree_kernel, descriptors

    jobs = []
    for schedule, (stages, extra) in SCHEDULES.items():
        for n, k in ((4096, 4096), (4096, 14336), (2048, 2048), (2048, 8192)):
            for segments, out_dtype in ((8, torch.bfloat16), (4, torch.float32), (2, torch.float32), (1, torch.float32)):
                k_local = k * segments // 8
                x = torch.zeros(4096, k_local, dtype=torch.bfloat16)
                w = torch.zeros(n, k_local, dtype=torch.bfloat16)
                out = torch.zeros(4096, n, dtype=out_dtype)
                a_desc, b_desc, out_desc = descriptors(x, w, out)
                sig = {"a_desc": mangle_type(a_desc), "b_desc": mangle_type(b_desc), "out_desc": mangle_type(out_desc),
                       "bias_ptr": mangle_type(out), "top_ptr": "*fp32" if extra["TOP_IN_GLOBAL"] else mangle_type(out),
                       "M": "i32", "N": "i32"}
                const = {"SEGMENTS": segments, "SEG_STEPS": k_local // segments // TILE[2], "STAGES": stages,
                         "HAS_BIAS": segments == 8 and n == 2048, "num_warps": WARPS, **extra}  # a bias: the 1B shapes
                sig.update({name: "constexpr" for name in const})
                jobs.append((f"tree {schedule} N={n} K={k} segments={segments} out={str(out_dtype).split('.')[-1]}"
                             + (" bias" if const["HAS_BIAS"] else ""), _ws_tree_kernel, sig, const))
    return jobs


def fp8_jobs():
    """``(description, kernel, signature, constexprs)`` for the Llama-8B FP8 shapes and Qwen3-30B-A3B's attention
    projections (qkv: three uneven splits of 6, 6, 4 groups; o_proj: eight) at M = 4096, bf16 out, the (N, K) table's
    splits, with one weight scale per tile and without."""
    from triton.runtime.jit import mangle_type

    from megatron_consistent.kernels.triton.fp8_linear import fp8_config
    from megatron_consistent.kernels.triton.gluon_fp8_gemm import GROUP, _fp8_ws_kernel, launch_args

    jobs = []
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (5120, 2048), (2048, 4096)):
        g = k // GROUP
        xq = torch.zeros(4096, k, dtype=torch.float32).to(torch.float8_e4m3fn)
        wq = torch.zeros(n, k, dtype=torch.float32).to(torch.float8_e4m3fn)
        out = torch.zeros(4096, n, dtype=torch.bfloat16)
        for schedule, sws in (("ws", True), ("ws", False), ("ws grouped", True), ("ws regs", True), ("ws smem sums", True)):
            args, const = launch_args(xq, torch.ones(4096, g), wq, torch.ones(n, g), None, out,
                                      fp8_config(n, k)["SPLIT_GROUPS"], sws, schedule)
            sig = {name: mangle_type(a, True) if not isinstance(a, int) else "i32"
                   for name, a in zip(_fp8_ws_kernel.arg_names, args)}
            sig.update({name: "constexpr" for name in const})
            jobs.append((f"fp8 {schedule} N={n} K={k} splits={const['SPLITS']} sws={sws}", _fp8_ws_kernel, sig, const))
    return jobs


def attention_jobs():
    """``(description, kernel, signature, constexprs)`` of the dense prefill launches ``bench_gpu_attention.py --gluon``
    makes (GQA 32/8 and MHA, head dims 64 and 128, bf16) and of the paged kernel at pages of 16 and 64 keys, with and
    without the step's K / V (the engine's layouts)."""
    from triton.runtime.jit import mangle_type

    from megatron_consistent.kernels.triton.attention import KV_BLOCK_GPU, PART_BLOCKS
    from megatron_consistent.kernels.triton.gluon_attention import SCHEDULES, STAGES, WARPS, _gluon_attn_kernel, kv_descriptor

    jobs = []
    for hq, hkv in ((32, 8), (32, 32)):
        for d in (128, 64):
            k = torch.zeros(1, 4096, hkv, d, dtype=torch.bfloat16)
            q = torch.zeros(1, 4096, hq, d, dtype=torch.bfloat16)
            qpos = torch.zeros(1, 4096, dtype=torch.int64)
            lse = torch.zeros(1, hq, 4096)
            args = (kv_descriptor(k, KV_BLOCK_GPU), kv_descriptor(k, KV_BLOCK_GPU), q, qpos, qpos[0, :1], q, lse, 1.0, 4096, 4096, hq, hkv,
                    *q.stride()[:3], *qpos.stride(), *q.stride()[:3])
            sig = {name: "fp32" if isinstance(a, float) else "i32" if isinstance(a, int) else mangle_type(a, True)
                   for name, a in zip(_gluon_attn_kernel.arg_names, args)}
            for schedule, knobs in SCHEDULES.items():
                const = {"G": hq // hkv, "PART_BLOCKS": PART_BLOCKS, "STAGES": STAGES, "STORE_LSE": True, **knobs,
                         "num_warps": WARPS}
                jobs.append((f"attention {schedule} Hq={hq} Hkv={hkv} D={d}", _gluon_attn_kernel,
                             {**sig, **{name: "constexpr" for name in const}}, const))
    from megatron_consistent.kernels.triton.gluon_attention import (_gluon_paged_attn_kernel, paged_cache_descriptor,
                                                                    step_kv_descriptor)

    hq, hkv, d, t = 32, 8, 128, 4096
    q = torch.zeros(t, hq, d, dtype=torch.bfloat16)
    qkv = torch.zeros(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    k_new = qkv[:, hq * d: (hq + hkv) * d].unflatten(-1, (hkv, d))  # as the engine's projection gives it
    tab = torch.zeros(4, 256, dtype=torch.int32)
    for page in (16, 64):
        kv = torch.zeros(1024, hkv, page, 2 * d, dtype=torch.bfloat16).transpose(1, 2)  # vLLM's Triton-backend layout
        k_cache = kv[..., :d]
        for new_kv in (True, False):
            kd = paged_cache_descriptor(k_cache, KV_BLOCK_GPU)
            knd = step_kv_descriptor(k_new, KV_BLOCK_GPU) if new_kv else kd
            args = (kd, kd, knd, knd, q, tab, tab[0], tab[0], q, 1.0, 4, hq, *q.stride()[:2], *q.stride()[:2],
                    tab.stride(0))
            sig = {name: "fp32" if isinstance(a, float) else "i32" if isinstance(a, int) else mangle_type(a, True)
                   for name, a in zip(_gluon_paged_attn_kernel.arg_names, args)}
            for schedule, knobs in SCHEDULES.items():
                const = {"G": hq // hkv, "PART_BLOCKS": PART_BLOCKS, "STAGES": STAGES, "KV_BLOCK": KV_BLOCK_GPU,
                         "PAGE": page, "NEW_KV": new_kv, **knobs, "num_warps": WARPS}
                jobs.append((f"paged attention {schedule} page={page} new_kv={new_kv} Hq={hq} Hkv={hkv} D={d}",
                             _gluon_paged_attn_kernel, {**sig, **{name: "constexpr" for name in const}}, const))
    return jobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("tree", "fp8", "attention"), help="one kernel's launches")
    args = ap.parse_args()
    from triton.experimental.gluon._runtime import GluonASTSource

    pick = {"tree": tree_jobs, "fp8": fp8_jobs, "attention": attention_jobs}
    jobs = [job for name, make in pick.items() if args.only in (None, name) for job in make()]
    return compile_report([(desc, kernel, sig, {}, const, const["num_warps"], 1) for desc, kernel, sig, const in jobs],
                          source=GluonASTSource)


if __name__ == "__main__":
    sys.exit(main())
