"""Compile the CUDA log-softmax kernels (8-segment vocabulary tree) for sm_90a WITHOUT a GPU: errors, registers, spills.

    PYTHONPATH=$PWD python benchmarks/offline_compile_log_softmax.py

The host code of ``kernels/triton/log_softmax.py`` runs on CPU tensors with the two kernels replaced by recorders, for
the vocabularies of the tests and the benchmark (Llama-3's 128256 at TP = 1, 2, 4, 8: shard ``128256 / t`` in
``8 / t`` segments; 32000; 1001, not a multiple of 8) and a few row counts; each distinct launch (signature,
16-byte divisibility of the pointers and integers as Triton's launcher specialises them, constexprs, warps) is
compiled by :func:`offline_compile_segment_tree.compile_report`.  Says nothing about bits or speed.  Exit 1 on a
compile error.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offline_compile_segment_tree import compile_report  # noqa: E402

from megatron_consistent.kernels.logprobs import VOCAB_SEGMENTS  # noqa: E402
from megatron_consistent.kernels.triton import log_softmax as tls  # noqa: E402

KERNELS = ("_segment_sums_kernel", "_normalise_kernel")
SHAPES = [(rows, 128256 // t, VOCAB_SEGMENTS // t) for t in (1, 2, 4, 8) for rows in (1, 9, 1024)]
SHAPES += [(9, 32000, VOCAB_SEGMENTS), (3, 1001, VOCAB_SEGMENTS)]


def record_launches():
    """The distinct ``(kernel name, signature, attrs, constexprs, warps)`` launches of the host code over SHAPES."""
    captured, saved = [], {name: getattr(tls, name) for name in KERNELS}

    def recorder(name):
        class _Recorder:
            def __getitem__(self, grid):
                return lambda *args, **kw: captured.append((name, args, kw))
        return _Recorder()

    for name in KERNELS:
        setattr(tls, name, recorder(name))
    try:
        for rows, n, segments in SHAPES:
            z = torch.zeros(rows, n)
            m = torch.zeros(rows, 1)
            tls.log_softmax_normalise(z, m, tls.sum_exp_subtree(z, m, segments))
    finally:
        for name, kernel in saved.items():
            setattr(tls, name, kernel)
    seen = {}
    for name, args, kw in captured:
        kernel = saved[name]
        sig, attrs, const = {}, {}, {}
        for i, (arg, a) in enumerate(zip(kernel.arg_names, args)):
            aligned = a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else a % 16 == 0
            sig[arg] = "*fp32" if isinstance(a, torch.Tensor) else "i32"
            if aligned and arg not in kernel.do_not_specialize:
                attrs[str(i)] = [["tt.divisibility", 16]]
        for k, v in kw.items():
            if k != "num_warps":
                sig[k], const[k] = "constexpr", v
        seen[json.dumps([name, sig, attrs, const, kw["num_warps"]], sort_keys=True)] = None
    return [json.loads(k) for k in seen]


def main():
    jobs = [(f"{name} {const} W{warps} aligned {sorted(int(i) for i in attrs)}", (sig, const, warps, 1),
             {"kernel": getattr(tls, name), "attrs": {(int(i),): v for i, v in attrs.items()}})
            for name, sig, attrs, const, warps in record_launches()]
    sys.exit(compile_report(jobs))


if __name__ == "__main__":
    main()
