"""Compile the CUDA log-softmax kernels (8-segment vocabulary tree) for sm_90a WITHOUT a GPU: errors, registers, spills.

    PYTHONPATH=$PWD python benchmarks/offline_compile_log_softmax.py

The host code of ``kernels/triton/log_softmax.py`` runs on CPU tensors with the two kernels replaced by recorders, for
the vocabularies of the tests and the benchmark (Llama-3's 128256 at TP = 1, 2, 4, 8: shard ``128256 / t`` in
``8 / t`` segments; 32000; 1001, not a multiple of 8) and a few row counts; each distinct launch is compiled by
:mod:`offline_compile`.  Says nothing about bits or speed.  Exit 1 on a compile error or a launch over the shared memory of a block.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offline_compile import capture, compile_report, distinct_launches  # noqa: E402

from megatron_consistent.kernels.logprobs import VOCAB_SEGMENTS  # noqa: E402
from megatron_consistent.kernels.triton import log_softmax as tls  # noqa: E402

KERNELS = ("_segment_sums_kernel", "_normalise_kernel")
SHAPES = [(rows, 128256 // t, VOCAB_SEGMENTS // t) for t in (1, 2, 4, 8) for rows in (1, 9, 1024)]
SHAPES += [(9, 32000, VOCAB_SEGMENTS), (3, 1001, VOCAB_SEGMENTS)]


def record_launches():
    """The distinct ``(kernel name, signature, attrs, constexprs, warps, stages)`` launches of the host code."""
    def run():
        for rows, n, segments in SHAPES:
            z = torch.zeros(rows, n)
            m = torch.zeros(rows, 1)
            tls.log_softmax_normalise(z, m, tls.sum_exp_subtree(z, m, segments))

    kernels = {name: getattr(tls, name) for name in KERNELS}
    return distinct_launches(capture(tls, KERNELS, run), kernels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttgir-dir", help="write each launch's normalized TTGIR here (diff -r against another tree's)")
    args = ap.parse_args()
    jobs = [(f"{name} {const} W{warps} aligned {sorted(int(i) for i in attrs)}", getattr(tls, name), sig, attrs, const,
             warps, stages) for name, sig, attrs, const, warps, stages in record_launches()]
    sys.exit(compile_report(jobs, args.ttgir_dir))


if __name__ == "__main__":
    main()
