"""The CUDA log-softmax's 8-segment vocabulary tree on CPU tensors in Triton's interpreter (issue #18).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable (e.g. ``PYTHONPATH=.:/tmp/tritonsite``), like
tests/test_triton_interpret_gemm.py.  The Triton ops ``sum_exp_subtree`` / ``log_softmax_normalise`` are installed
as the CPU implementations for the test, so :func:`kernels.log_softmax` (TP = 1) and a simulated vocab-parallel
layout (per-shard subtree, all-gather, top of the tree) run the kernels' segment / lane / tree logic: TP = 1, 2, 4, 8
give the same bits, a row's bits do not depend on its batch, V not divisible by 8 is the -inf padding.  The
interpreter's exp2 / log are numpy's, so this proves the structure, not the GPU's bits (tests/test_gpu_kernels.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from _vocab_parallel import left_to_right, same, tp1, vocab_parallel

from megatron_consistent import kernels
from megatron_consistent.kernels import dispatch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
pytest.importorskip("triton")

from megatron_consistent.kernels.triton import log_softmax as tls

V = 8 * 4101  # segments of 4101 entries: two 4096-lane blocks per segment, the second mostly masked
SEG = kernels.VOCAB_SEGMENTS


@pytest.fixture(autouse=True)
def triton_ops_on_cpu(monkeypatch):
    """Route the two dispatched ops of the log-softmax to the Triton kernels for CPU tensors (the interpreter)."""
    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("sum_exp_subtree", "cpu"), tls.sum_exp_subtree)
    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("log_softmax_normalise", "cpu"), tls.log_softmax_normalise)


def _logits(rows, v, seed, scale=4.0):
    z = torch.randn(rows, v, generator=torch.Generator().manual_seed(seed)) * scale
    z[0, : v // 3] = float("-inf")  # a whole segment (and more) of -inf: segment sums of +0
    return z


def test_tp_split_gives_the_tp1_bits():
    z = _logits(3, V, 0)
    full = tp1(z)
    whole = full[1]
    ref = torch.log_softmax(z.double(), -1)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(whole))
    assert (whole.double()[fin] - ref[fin]).abs().max().item() < 1e-5  # it is a log-softmax
    for t in (1, 2, 4, 8):
        assert same(vocab_parallel(z, t), full), f"TP={t}"


def test_row_bits_do_not_depend_on_the_batch():
    z = _logits(6, V, 1)
    whole = kernels.log_softmax(z)
    for sl in (slice(0, 1), slice(4, 5), slice(2, 6)):
        assert torch.equal(kernels.log_softmax(z[sl]), whole[sl]), sl
    perm = torch.tensor([5, 0, 3])
    assert torch.equal(kernels.log_softmax(z[perm]), whole[perm])
    assert torch.equal(kernels.log_softmax(z[3]), whole[3])  # a 1-D row
    assert torch.equal(kernels.log_softmax(z.reshape(2, 3, V)), whole.reshape(2, 3, V))


@pytest.mark.parametrize("v", [1, 9, 1001, V - 5])
def test_vocab_not_divisible_by_8_is_padded_with_minus_inf(v):
    """c = ceil(V / 8); entries past V (and, at V = 9, segments wholly past V) contribute +0."""
    z = torch.randn(2, v, generator=torch.Generator().manual_seed(v)) * 5
    c = -(-v // SEG)
    padded = torch.cat([z, torch.full((2, SEG * c - v), float("-inf"))], dim=-1)
    out = kernels.log_softmax(z)
    assert torch.equal(out, kernels.log_softmax(padded)[:, :v])
    assert (out.double() - torch.log_softmax(z.double(), -1)).abs().max().item() < 1e-5


def test_minus_inf_entries():
    z = _logits(3, 8 * 300, 2)
    z[1] = float("-inf")
    z[1, 2000] = 3.0  # one finite entry: log-prob 0 there, -inf elsewhere
    z[2, 1::2] = float("-inf")
    full = tp1(z)
    out = full[1]
    assert torch.equal(torch.isinf(out), torch.isinf(z))
    assert out[1, 2000].item() == 0.0
    for t in (2, 8):
        assert same(vocab_parallel(z, t), full), f"TP={t}"


def test_broken_layouts_are_caught():
    """The checks above can fail: an all-reduce-order top of the tree, a shard summed as one segment, or another
    in-segment order (1024 lanes: five sequential blocks per segment of 4101 entries instead of two) change the
    bits of ``s``, which the checks compare beside the log-probs (a last-bit change of ``s`` often vanishes in
    ``log``)."""
    z = torch.randn(8, V, generator=torch.Generator().manual_seed(3))
    full = tp1(z)
    for broken in (vocab_parallel(z, 8, top=left_to_right), vocab_parallel(z, 2, shard_segments=1)):
        assert not torch.equal(broken[0], full[0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tls, "MAX_BLOCK", 1024)
        assert not torch.equal(tp1(z)[0], full[0])
