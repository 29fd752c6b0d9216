"""Compile every launch of the row-parallel segment-tree kernel for sm_90a WITHOUT a GPU: errors, registers, spills.

    PYTHONPATH=$PWD python benchmarks/offline_compile_segment_tree.py [--quick]

The host code (``segment_tree.segment_tree_gemm``) runs on CPU tensors with the kernel launch replaced by a recorder;
each distinct launch (signature + constexprs, as an H200 with 132 SMs would get) is compiled by Triton's NVIDIA
backend to a cubin (Triton's bundled ptxas; no driver needed) and ``cuobjdump -res-usage`` reports registers and
stack (spills).  Catches compile errors and register spills before device time is spent; it says nothing about
bits or speed.  Exit 1 on a compile error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_consistent.kernels.triton import linear as tlin  # noqa: E402
from megatron_consistent.kernels.triton import segment_tree as st  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (2048, 2048), (2048, 8192), (1000, 8192), (96, 64), (136, 200)]
SCHEDULES = [(None, None), ("serial", 1), ("serial", 2), ("serial", 4), ("parallel", 1), ("parallel", 2), ("flat", 1),
             ("flat", 2)]
_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32"}
SMEM_MAX = 232448  # H100 / H200 opt-in shared memory per block


def record_launches(calls):
    """The distinct launches ``(signature, constexprs, warps, stages)`` of ``segment_tree_gemm(**c)`` for each call."""
    kernel = st._segment_tree_kernel
    captured = []

    class _Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: captured.append((args, kw))

    st._segment_tree_kernel, sms = _Recorder(), st._INTERPRETER_SMS
    st._INTERPRETER_SMS = 132
    try:
        for c in calls:
            st.segment_tree_gemm(**c)
    finally:
        st._segment_tree_kernel, st._INTERPRETER_SMS = kernel, sms
    seen = {}
    for args, kw in captured:
        sig, const = {}, {}
        for name, a in zip(kernel.arg_names, args):
            if isinstance(a, TensorDescriptor):
                sig[name] = f"tensordesc<{_TY[a.base.dtype]}[{', '.join(map(str, a.block_shape))}]>"
            elif isinstance(a, torch.Tensor):
                sig[name] = "*" + _TY[a.dtype]
            else:
                sig[name] = "i32"
        for k, v in kw.items():
            if k not in ("num_warps", "num_stages"):
                sig[k], const[k] = "constexpr", v
        seen[json.dumps([sig, const, kw["num_warps"], kw["num_stages"]], sort_keys=True)] = None
    return [json.loads(k) for k in seen]


def compile_sm90(sig, const, warps, stages, kernel=st._segment_tree_kernel, attrs=None):
    """``(registers, stack bytes, shared memory bytes)`` of ``kernel`` compiled for sm_90a (signature, constexprs,
    optional argument attributes such as ``{(i,): [["tt.divisibility", 16]]}``)."""
    k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    return int(m.group(1)), int(m.group(2)), k.metadata.shared


def compile_report(jobs) -> int:
    """Compile every ``(description, compile_sm90 args, compile_sm90 kwargs)`` for sm_90a and print its registers,
    spills and shared memory; returns the exit status (1 on any compile error)."""
    errors = flagged = 0
    for desc, args, kwargs in jobs:
        try:
            regs, stack, smem = compile_sm90(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            errors += 1
            print(f"COMPILE ERROR {desc}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        flag = ("SPILL " if stack else "") + ("SMEM " if smem > SMEM_MAX else "")
        flagged += bool(flag)
        print(f"{flag:11s} regs {regs:3d} stack {stack:5d} smem {smem:6d}  {desc}", flush=True)
    print(f"{len(jobs)} launches: {errors} compile errors, {flagged} with spills or too much shared memory")
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="TMA shapes, M = 1 and 4096, bf16 out only")
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
                for path, reg in SCHEDULES:
                    for od, bias in outs:
                        calls.append(dict(x2d=x, weight=w, segments=segments, bias=bias, out_dtype=od, path=path,
                                          reg_segments=reg, use_tma=tma))
                calls.append(dict(x2d=x, weight=w, segments=segments, partials=True, use_tma=tma))
    launches = record_launches(calls)
    print(f"{len(launches)} distinct launches", flush=True)
    jobs = [(f"MODE {const['MODE']} SEG {const['SEGMENTS']} REG {const['REG']} LANES {const['LANES']} "
             f"{const['BM']}x{const['BN']}x{const['BK']} SPLITS {const['SPLITS']} TMA {const['USE_TMA']} "
             f"SWAP {const['SWAP']} W{warps} S{stages} out {sig['out_ptr']} bias {const['HAS_BIAS']}",
             (sig, const, warps, stages), {}) for sig, const, warps, stages in launches]
    sys.exit(compile_report(jobs))

if __name__ == "__main__":
    main()
