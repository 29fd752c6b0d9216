"""Compile Triton kernels for sm_90a WITHOUT a GPU: the launches a host function makes, as Triton's launcher would
specialise them, and for each: compile errors, registers, spills, shared memory, asynchronous (cp.async or TMA) copies.

Used by ``offline_compile_segment_tree.py``, ``offline_compile_log_softmax.py`` and ``offline_compile_attention.py``:
the host code runs on CPU tensors with the kernels replaced by recorders (:func:`capture`); each distinct launch
(:func:`launch_key`: signature, 16-byte divisibility of pointers and integers, constexprs, warps, stages) is compiled
by Triton's NVIDIA backend to a cubin (Triton's bundled ptxas; no driver needed) and ``cuobjdump -res-usage``
reports registers and stack (spills).  Catches compile errors, spills and loads the software pipeliner left
synchronous before device time is spent; it says nothing about bits or speed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

SMEM_MAX = 232448  # H100 / H200 opt-in shared memory per block
_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64",
       torch.float8_e4m3fn: "fp8e4nv"}


def capture(module, names, run) -> list[tuple[str, tuple, dict]]:
    """``(kernel name, args, kwargs)`` of every launch of ``module``'s kernels ``names`` while ``run()`` runs (the
    kernels are replaced by recorders meanwhile)."""
    captured, saved = [], {name: getattr(module, name) for name in names}

    def recorder(name):
        class _Recorder:
            def __getitem__(self, grid):
                return lambda *args, **kw: captured.append((name, args, kw))
        return _Recorder()

    for name in names:
        setattr(module, name, recorder(name))
    try:
        run()
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)
    return captured


def launch_key(kernel, args, kw) -> tuple[dict, dict, dict, int, int]:
    """``(signature, attrs, constexprs, warps, stages)`` of one launch, specialised as Triton's launcher does: a
    tensor whose data pointer and an integer whose value is a multiple of 16 (unless ``do_not_specialize``) get
    ``tt.divisibility`` 16 -- what lets the pipeliner turn a load into an async copy."""
    sig, attrs, const = {}, {}, {}
    for i, (name, a) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(a, TensorDescriptor):
            sig[name] = f"tensordesc<{_TY[a.base.dtype]}[{', '.join(map(str, a.block_shape))}]>"
            continue
        if isinstance(a, torch.Tensor):
            sig[name], aligned = "*" + _TY[a.dtype], a.data_ptr() % 16 == 0
        elif isinstance(a, float):
            sig[name], aligned = "fp32", False
        else:
            sig[name], aligned = "i32", a % 16 == 0
        if aligned and name not in kernel.do_not_specialize:
            attrs[str(i)] = [["tt.divisibility", 16]]
    for k, v in kw.items():
        if k in ("enable_fp_fusion", "launch_pdl"):  # options, not constexprs: compile_sm90 takes them out
            const[k] = v
        elif k not in ("num_warps", "num_stages"):
            sig[k], const[k] = "constexpr", v
    for param in kernel.params:  # constexprs the launch leaves to their defaults (Triton 3.9's ASTSource needs them)
        if param.is_constexpr and param.has_default and param.name not in sig:
            sig[param.name], const[param.name] = "constexpr", param.default
    return sig, attrs, const, kw["num_warps"], kw.get("num_stages", 1)


def distinct_launches(captured, kernels) -> list[tuple[str, dict, dict, dict, int, int]]:
    """The distinct ``(kernel name, signature, attrs, constexprs, warps, stages)`` of :func:`capture`'s launches
    (``kernels``: name -> the real kernel)."""
    seen = {}
    for name, args, kw in captured:
        seen[json.dumps([name, *launch_key(kernels[name], args, kw)], sort_keys=True)] = None
    return [tuple(json.loads(k)) for k in seen]


def compile_sm90(kernel, sig, const, warps, stages, attrs=None, source=ASTSource) -> tuple[int, int, int, int, str, bytes]:
    """``(registers, stack bytes, shared memory bytes, asynchronous global-to-shared copies, TTGIR, cubin)`` of ``kernel``
    compiled for sm_90a (attrs as :func:`launch_key` gives them, keys as strings; ``source``: Triton's ``ASTSource``,
    or Gluon's ``GluonASTSource`` for a ``gluon.jit`` kernel)."""
    attrs = {(int(i),): v for i, v in (attrs or {}).items()}
    const = dict(const)
    options = {"num_warps": warps, "num_stages": stages}
    for option in ("enable_fp_fusion", "launch_pdl"):  # the launch's own choices (the contract kernels turn mul-add
        if option in const:                            # fusion off; a programmatic dependent launch)
            options[option] = const.pop(option)
    k = triton.compile(source(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=options)
    ttgir = k.asm["ttgir"]
    return (*resource_usage(k.asm["cubin"]), k.metadata.shared, ttgir.count("copy_global_to_local"), ttgir,
            k.asm["cubin"])


SASS_CLASSES = ("FADD", "FMUL", "FFMA", "DADD", "DMUL", "DFMA", "LDG", "STG", "LDS", "STS", "BAR", "SHFL", "LDL", "STL")


def sass_mix(cubin: bytes) -> dict:
    """Static SASS instruction counts of a cubin (``cuobjdump -sass``, Triton's bundled one): ``total`` and each of
    :data:`SASS_CLASSES` by opcode (float32 / float64 adds, multiplies and fused multiply-adds, global / shared /
    local loads and stores, barriers, shuffles).  For a kernel without loops, a thread's instructions."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
    return {"total": len(ops), **{c: ops.count(c) for c in SASS_CLASSES}}


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack bytes)`` of a compiled kernel's cubin, as ``cuobjdump -res-usage`` (Triton's bundled one)
    reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    return int(m.group(1)), int(m.group(2))


def normalized_ttgir(ttgir: str) -> str:
    """TTGIR without what differs between two compiles of the same program: source locations, SSA value names, and
    the order of the hoisted constants (sorted, first).  Equal text = the same ops in the same order."""
    lines = []
    for line in ttgir.splitlines():
        if line.startswith("#loc"):
            continue
        line = re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", line)
        lines.append(re.sub(r"%[\w#]+", "%v", line).rstrip())
    consts = sorted(x for x in lines if "arith.constant" in x)
    return "\n".join(consts + [x for x in lines if "arith.constant" not in x]) + "\n"


def compile_report(jobs, ttgir_dir: str | None = None, source=ASTSource, sass: bool = False) -> int:
    """Compile every ``(description, kernel, signature, attrs, constexprs, warps, stages)`` for sm_90a and print its
    registers, spills, shared memory and async copies; returns the exit status (1 on any compile error or launch over
    the shared memory a block may have).  With ``ttgir_dir``, each launch's :func:`normalized_ttgir` is written there
    (``diff -r`` two such folders, e.g. of the tree before and after a change, to see which launches compile to other
    ops).  ``source``: as :func:`compile_sm90`; ``sass``: each launch's :func:`sass_mix` too.  The compile seconds
    are this CPU's, a launch's first JIT compile on a machine (Triton caches it after)."""
    errors = flagged = over_smem = 0
    if ttgir_dir:
        os.makedirs(ttgir_dir, exist_ok=True)
    for desc, kernel, sig, attrs, const, warps, stages in jobs:
        start = time.perf_counter()
        try:
            regs, stack, smem, copies, ttgir, cubin = compile_sm90(kernel, sig, const, warps, stages, attrs, source)
        except Exception as e:  # noqa: BLE001
            errors += 1
            cause = e
            while cause.__cause__ is not None:  # the compiler's own message, not only the source line it points at
                cause = cause.__cause__
            print(f"COMPILE ERROR {desc}: {type(e).__name__}: {str(e)[:300]}"
                  + (f" -- {type(cause).__name__}: {str(cause)[-600:]}" if cause is not e else ""), flush=True)
            continue
        if ttgir_dir:
            with open(os.path.join(ttgir_dir, re.sub(r"[^\w.-]+", "_", desc) + ".ttgir"), "w") as f:
                f.write(normalized_ttgir(ttgir))
        flag = ("SPILL " if stack else "") + ("SMEM " if smem > SMEM_MAX else "")
        flagged += bool(flag)
        over_smem += smem > SMEM_MAX
        print(f"{flag:11s} regs {regs:3d} stack {stack:5d} smem {smem:6d} async {copies:2d} "
              f"compile {time.perf_counter() - start:5.1f} s  {desc}", flush=True)
        if sass:
            print("            SASS " + " ".join(f"{k} {v}" for k, v in sass_mix(cubin).items() if v), flush=True)
    print(f"{len(jobs)} launches: {errors} compile errors, {flagged} with spills or too much shared memory "
          f"({over_smem} over the {SMEM_MAX} bytes a block may have: such a launch fails on the GPU)")
    return 1 if errors or over_smem else 0
