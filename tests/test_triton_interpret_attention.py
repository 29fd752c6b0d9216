"""The paged attention kernel's page walk, partitions and paths on CPU tensors in Triton's interpreter (issue #15).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable (e.g. ``PYTHONPATH=.:/tmp/tritonsite``), like
tests/test_triton_interpret_gemm.py: the interpreter evaluates ``tl.dot`` with numpy, so this proves the index logic
(page lookup per key or per block, chunked queries over a cached prefix, decode rows, partitions and their merge,
both paths) -- not the GPU's bits, which tests/test_gpu_paged_attention.py checks on the device.  float16: the
interpreter (Triton 3.6) does not emulate this kernel's bfloat16 arithmetic (its outputs are garbage there), nor its
``tl.fma`` in the log-sum-exp, which is therefore not compared.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
triton = pytest.importorskip("triton")

from megatron_consistent.kernels.triton import attention as tattn
from megatron_consistent.kernels.triton import paged_attention as tpa

HQ, HKV, D = 4, 2, 16
# (keys, new queries) per sequence: a chunk over a cached prefix, a whole prompt, a decode row over three partitions
SEQS = [(70, 5), (130, 130), (1100, 1)]
PAD = 3  # padding tokens after the last sequence's queries (out must be 0 there)


def _batch(page: int, seqs=SEQS, seed: int = 0):
    """Random K/V for ``seqs`` in a shuffled page-``page`` cache, queries, and the per-sequence dense K/V."""
    g = torch.Generator().manual_seed(seed)
    npg = [triton.cdiv(keys, page) for keys, _ in seqs]
    total = sum(npg) + 2
    kc = torch.randn(total, page, HKV, D, generator=g).to(torch.float16)
    vc = torch.randn(total, page, HKV, D, generator=g).to(torch.float16)
    perm = torch.randperm(total, generator=g).to(torch.int32)
    tab = torch.zeros(len(seqs), max(npg), dtype=torch.int32)
    o = 0
    for s, n in enumerate(npg):
        tab[s, :n] = perm[o:o + n]
        o += n
    qlens = [ql for _, ql in seqs]
    q = torch.randn(sum(qlens) + PAD, HQ, D, generator=g).to(torch.float16)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor([keys for keys, _ in seqs], dtype=torch.int32)
    dense = [(kc[tab[s, :n].long()].reshape(-1, HKV, D)[:keys], vc[tab[s, :n].long()].reshape(-1, HKV, D)[:keys])
             for s, (n, (keys, _)) in enumerate(zip(npg, seqs))]
    return q, kc, vc, tab, qsl, seq, dense


def _paged(q, kc, vc, tab, qsl, seq, max_seq_len, split=None):
    out = torch.full_like(q, 7.0)
    qlens = (qsl[1:] - qsl[:-1]).tolist()
    return tpa.paged_attention(q, kc, vc, tab, qsl, seq, D ** -0.5, out, max(qlens), max_seq_len, split=split)


@pytest.mark.parametrize("page", tpa.PAGE_SIZES)
@pytest.mark.parametrize("split", [None, True, False])
def test_paged_equals_dense_on_the_gathered_keys(page, split):
    """Each sequence's rows from the paged cache (shuffled pages) = the dense kernel on its gathered K/V, bit for
    bit, on both paths; padding rows are 0."""
    q, kc, vc, tab, qsl, seq, dense = _batch(page)
    out = _paged(q, kc, vc, tab, qsl, seq, int(seq.max()), split)
    for s, ((keys, ql), (k, v)) in enumerate(zip(SEQS, dense)):
        rows = q[qsl[s]:qsl[s + 1]]
        pos = torch.arange(keys - ql, keys)[None]
        ref, _ = tattn.attention_fwd(rows[None], k[None].contiguous(), v[None].contiguous(), pos,
                                     torch.tensor([keys]), D ** -0.5)
        assert torch.equal(out[qsl[s]:qsl[s + 1]], ref[0]), (page, split, s)
    assert torch.equal(out[-PAD:], torch.zeros_like(out[-PAD:]))


@pytest.mark.parametrize("page", [16, 64])
def test_row_alone_equals_row_in_the_batch(page):
    """The decode row alone (its own length as the launch hint) = the same row in the mixed batch under a larger
    hint: the partitions are cut at absolute key positions, not by the batch."""
    q, kc, vc, tab, qsl, seq, _ = _batch(page)
    batch = _paged(q, kc, vc, tab, qsl, seq, 4096)
    last = len(SEQS) - 1
    alone = _paged(q[qsl[last]:qsl[last + 1]], kc, vc, tab[last:], torch.tensor([0, 1], dtype=torch.int32),
                   seq[last:], int(seq[last]))
    assert torch.equal(alone, batch[qsl[last]:qsl[last + 1]])


def _rows_alone_and_padded(keys: int = 1100, longer: int = 4000, rows: int = 16):
    """The last ``rows`` query rows of a ``keys``-long sequence, (out, lse) alone and in a dense batch padded to a
    longer neighbour's keys."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, rows, HQ, D, generator=g).to(torch.float16)
    k = torch.randn(2, longer, HKV, D, generator=g).to(torch.float16)
    v = torch.randn(2, longer, HKV, D, generator=g).to(torch.float16)
    pos = torch.stack([torch.arange(keys - rows, keys), torch.arange(longer - rows, longer)])
    lens = torch.tensor([keys, longer])
    alone = tattn.attention_fwd(q[:1], k[:1, :keys].contiguous(), v[:1, :keys].contiguous(), pos[:1], lens[:1],
                                D ** -0.5)
    batch = tattn.attention_fwd(q, k, v, pos, lens, D ** -0.5)
    return alone, batch


def test_padded_batch_rows_equal_rows_alone_and_a_batch_dependent_partition_is_caught(monkeypatch):
    """A sequence's rows do not depend on a longer neighbour (the launch's key count, which sets the split
    grid); a partition size taken from that key count (a batch property) breaks the contract and this check sees
    it."""
    (out1, _), (out2, _) = _rows_alone_and_padded()
    assert torch.equal(out1[0], out2[0])
    monkeypatch.setattr(tattn, "_TEST_BATCH_DEPENDENT_PARTITION", True)
    (out1, _), (out2, _) = _rows_alone_and_padded()
    assert not torch.equal(out1[0], out2[0])


@pytest.mark.parametrize("page", [16, 128])
def test_a_wrong_page_walk_is_caught(page):
    """The comparison with the gathered keys can fail: the long sequence's first page replaced by another
    sequence's in the table the kernel reads (the gather keeps the right one) gives other rows.  (Swapping two of
    its own pages would not do: attention does not depend on the order of the keys, up to rounding.)"""
    q, kc, vc, tab, qsl, seq, dense = _batch(page)
    last = len(SEQS) - 1
    wrong = tab.clone()
    wrong[last, 0] = tab[0, 0]
    out = _paged(q, kc, vc, wrong, qsl, seq, int(seq.max()))
    keys, ql = SEQS[last]
    k, v = dense[last]
    ref, _ = tattn.attention_fwd(q[qsl[last]:qsl[last + 1]][None], k[None].contiguous(), v[None].contiguous(),
                                 torch.arange(keys - ql, keys)[None], torch.tensor([keys]), D ** -0.5)
    assert not torch.equal(out[qsl[last]:qsl[last + 1]], ref[0])
