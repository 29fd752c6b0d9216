"""The CUDA SSD scan kernels (``kernels/triton/ssd_scan.py``: the outputs and the chunks' state terms) in Triton's
interpreter (CPU tensors): the bits of the contract's torch evaluation (``kernels/ssd.py``).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable, like the other ``test_triton_interpret_*`` files.  The
interpreter runs each Triton operation as one numpy operation, IEEE like torch's CPU elementwise ops, so the kernels
must give ``_ssd_cpu``'s bits exactly: their trees must pair as ``numerics.tree_sum`` does, their ``exp`` must be
``numerics.exp``'s arithmetic, their masks and zero padding (chunk rows past T, head dims and state sizes that are
not powers of two, chunk sizes that are not) must match.  The interpreter rounds float32 to bfloat16 by truncation
where torch rounds to nearest, so the bf16 cases compare the float32 outputs of bf16 operands; on the GPU the kernels
are launched without mul-add fusion (``enable_fp_fusion=False``) for the same reason torch's separate kernels have
none.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_consistent.kernels import ssd  # noqa: E402
from megatron_consistent.kernels.triton import numerics as tnum, ssd_scan as tssd  # noqa: E402

TRITON_SCAN = ssd.ssd_scan_by(tssd.TRITON_STEPS)


def _inputs(seed, bsz, t_len, nh, hp, ng, ns, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, t_len, nh, hp, generator=g).to(dtype)
    dt = torch.rand(bsz, t_len, nh, generator=g) * 0.5 + 0.01
    a = -torch.rand(nh, generator=g) * 2 - 0.1
    b = torch.randn(bsz, t_len, ng, ns, generator=g).to(dtype)
    c = torch.randn(bsz, t_len, ng, ns, generator=g).to(dtype)
    d = torch.randn(nh, generator=g)
    state = torch.randn(bsz, nh, hp, ns, generator=g) * 0.5
    return x, dt, a, b, c, d, state


# (T, chunk, H, P, G, N): partial last chunks, one position, non-power-of-two chunk / head dim / state size
SHAPES = [(13, 8, 4, 4, 2, 8), (16, 8, 2, 8, 1, 16), (1, 4, 2, 4, 2, 4), (11, 6, 3, 6, 3, 5), (20, 16, 4, 2, 2, 8)]


@pytest.mark.parametrize("t_len,chunk,nh,hp,ng,ns", SHAPES + [(40, 16, 4, 8, 2, 24), (70, 32, 2, 16, 1, 40)])
def test_scan_equals_the_torch_contract(t_len, chunk, nh, hp, ng, ns):
    """The whole scan (chunks of 16 and 32 rows too, partial last chunks)."""
    x, dt, a, b, c, d, state = _inputs(t_len * 7 + hp, 2, t_len, nh, hp, ng, ns, torch.float32)
    y_ref, s_ref = ssd._ssd_cpu(x, dt, a, b, c, d, chunk, state, 0)
    y, s = TRITON_SCAN(x, dt, a, b, c, d, chunk, state, 0)
    assert torch.equal(s, s_ref)
    assert torch.equal(y, y_ref), f"{(y != y_ref).sum().item()} of {y.numel()} outputs differ"


@pytest.mark.parametrize("first_out", [0, 5, 12])
def test_replayed_positions_and_bf16_operands(first_out):
    """``first_out``: a decode / chunked-prefill replay's positions only (the pending tokens of its chunk are
    recomputed, not output); bf16 operands, float32 outputs (see the module docstring)."""
    x, dt, a, b, c, d, state = _inputs(first_out, 3, 13, 4, 4, 2, 8, torch.bfloat16)
    ops = ssd._ssd_chunk_states(x, dt, a, b, c, 8, state)[:6]
    pos = ssd.output_positions(3, first_out, 13, "cpu")
    ref = ssd._ssd_outputs(*ops, d, pos, torch.float32)
    out = tssd.ssd_outputs(*ops, d, pos, torch.float32)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} outputs differ"


@pytest.mark.parametrize("t_len,chunk,nh,hp,ng,ns", [v for v in SHAPES if v[0] >= v[1]] + [(40, 8, 2, 12, 1, 24),
                                                                                          (33, 16, 2, 16, 2, 40),
                                                                                          (70, 32, 2, 80, 1, 72)])
def test_chunk_state_terms_equal_the_torch_contract(t_len, chunk, nh, hp, ng, ns):
    """Step 5's per-chunk terms alone (the state recurrence uses them in chunk order), bf16 operands; head dims and
    state sizes spanning several of the kernel's P x N blocks; the tree over the chunk's rows leaf by leaf."""
    x, dt, a, b, c, _, _ = _inputs(t_len + ns, 2, t_len, nh, hp, ng, ns, torch.bfloat16)
    xc, dtc, bc, _, cum = ssd._ssd_chunk_states(x, dt, a, b, c, chunk, torch.zeros(2, nh, hp, ns))[:5]
    n_complete = t_len // chunk
    ref = ssd._chunk_contributions(xc, dtc, bc, cum, n_complete)
    out = tssd.chunk_contributions(xc, dtc, bc, cum, n_complete)
    assert out.shape == ref.shape and torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"


@pytest.mark.parametrize("columns", [1, 4, 16, 64])
def test_chunk_state_terms_in_other_tiles_keep_the_bits(monkeypatch, columns):
    """``MC_SSD_TERMS_BN``: a program's state columns change no term (the in-place end states of a decode step:
    tests/test_triton_interpret_ssd_end_state.py); a count that is not a power of two is refused by name."""
    x, dt, a, b, c, _, _ = _inputs(columns, 2, 40, 2, 12, 1, 24, torch.bfloat16)
    xc, dtc, bc, _, cum = ssd._ssd_chunk_states(x, dt, a, b, c, 8, torch.zeros(2, 2, 12, 24))[:5]
    ref = ssd._chunk_contributions(xc, dtc, bc, cum, 5)
    monkeypatch.setattr(tssd, "TERMS_BN", columns)
    out = tssd.chunk_contributions(xc, dtc, bc, cum, 5)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"
    for bad in (12, 0):
        monkeypatch.setattr(tssd, "TERMS_BN", bad)
        with pytest.raises(ValueError, match=f"MC_SSD_TERMS_BN={bad}: expected a power of two"):
            tssd.chunk_contributions(xc, dtc, bc, cum, 5)


@pytest.mark.parametrize("chunk,leaves", [(8, 1), (16, 4), (24, 4), (32, 8), (64, 32), (64, 0), (256, 8)])
def test_chunk_state_terms_with_the_tree_in_a_loop_keep_the_bits(monkeypatch, chunk, leaves):
    """``MC_SSD_TERMS_LEAVES``: the leaves a step of the chunk-terms tree's runtime loop forms (the loop over ``BL /
    leaves`` residue classes, at most 16; 0: no loop) change no term, partial last chunks included; a count that is
    not a power of two is refused by name."""
    x, dt, a, b, c, _, _ = _inputs(chunk + leaves, 2, 2 * chunk + 5, 2, 12, 1, 24, torch.float32)
    xc, dtc, bc, _, cum = ssd._ssd_chunk_states(x, dt, a, b, c, chunk, torch.zeros(2, 2, 12, 24))[:5]
    ref = ssd._chunk_contributions(xc, dtc, bc, cum, 2)
    monkeypatch.setattr(tssd, "TERMS_LEAVES", leaves)
    out = tssd.chunk_contributions(xc, dtc, bc, cum, 2)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"
    monkeypatch.setattr(tssd, "TERMS_LEAVES", 12)
    with pytest.raises(ValueError, match="MC_SSD_TERMS_LEAVES=12: expected 0 or a power of two"):
        tssd.chunk_contributions(xc, dtc, bc, cum, 2)


def test_chunk_state_terms_of_the_active_rows_only():
    """A decode step's closing rows (``active``): their terms are the contract's, the others' programs return at
    once (the end state keeps those rows' states, ``ssd_chunk_end_state``)."""
    x, dt, a, b, c, _, state = _inputs(4, 4, 8, 4, 4, 2, 8, torch.float32)
    xc, dtc, bc, _, cum = ssd._ssd_chunk_states(x, dt, a, b, c, 8, state)[:5]
    active = torch.tensor([True, False, False, True])
    ref = ssd._chunk_contributions(xc, dtc, bc, cum, 1)
    out = tssd.chunk_contributions(xc, dtc, bc, cum, 1, active)
    assert torch.equal(out[active], ref[active])
    end = ssd._ssd_chunk_states(x, dt, a, b, c, 8, state, tssd.TRITON_STEPS, active=active)[6]
    assert torch.equal(torch.where(active[:, None, None, None], end, state),
                       torch.where(active[:, None, None, None], ssd._ssd_cpu(x, dt, a, b, c, torch.zeros(4), 8, state, 7)[1],
                                   state))


@pytest.mark.parametrize("chunk,nh", [(8, 4), (6, 3), (16, 40), (1, 2), (128, 5)])
def test_prefix_sums_equal_the_doubling_scan(chunk, nh):
    """Step 1 alone: chunk sizes that are and are not powers of two, more heads than a program's block."""
    g = torch.Generator().manual_seed(chunk + nh)
    dtc = torch.rand(3, 2, chunk, nh, generator=g) * 0.5
    a = -torch.rand(nh, generator=g) * 4
    ref = ssd._chunk_prefix_sums(dtc, a)
    out = tssd.chunk_prefix_sums(dtc, a)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("t_len,chunk,nh,hp,ng,ns", [(13, 8, 4, 4, 2, 8), (16, 8, 2, 8, 1, 16), (11, 6, 3, 6, 3, 5)])
def test_column_trees_in_slices_keep_the_bits(monkeypatch, width, t_len, chunk, nh, hp, ng, ns):
    """The outputs kernel's trees -- over the state (``C_t . B_s``, ``C_t . S``) and over the chunk's rows (the intra
    term) -- evaluated in slices of ``width`` columns / rows (``MC_SSD_TREE_WIDTH``; state sizes 16, 8 and 5, padded
    to 8; chunks of 8 and 6) give the torch contract's bits; a width that is not a power of two is refused by name."""
    x, dt, a, b, c, d, state = _inputs(width * 3 + ns, 2, t_len, nh, hp, ng, ns, torch.float32)
    y_ref, s_ref = ssd._ssd_cpu(x, dt, a, b, c, d, chunk, state, 0)
    monkeypatch.setattr(tssd, "OUTPUTS_TREE_WIDTH", width)
    y, s = TRITON_SCAN(x, dt, a, b, c, d, chunk, state, 0)
    assert torch.equal(s, s_ref) and torch.equal(y, y_ref), f"{(y != y_ref).sum().item()} of {y.numel()} outputs differ"
    monkeypatch.setattr(tssd, "OUTPUTS_TREE_WIDTH", 6)
    with pytest.raises(ValueError, match="MC_SSD_TREE_WIDTH=6: expected 0 or a power of two"):
        TRITON_SCAN(x, dt, a, b, c, d, chunk, state, 0)


@pytest.mark.parametrize("heads", ["all of the group", "two"])
def test_several_heads_a_program(monkeypatch, heads):
    """A program that takes several heads of a group (``heads_per_program``: at large position counts) forms
    ``C_t . B_s`` once for them; every head's outputs keep their bits."""
    x, dt, a, b, c, d, state = _inputs(11, 2, 13, 8, 4, 2, 8, torch.float32)
    ops = ssd._ssd_chunk_states(x, dt, a, b, c, 8, state)[:6]
    pos = ssd.output_positions(2, 0, 13, "cpu")
    ref = ssd._ssd_outputs(*ops, d, pos, torch.float32)
    monkeypatch.setattr(tssd, "heads_per_program", lambda positions, nh, ng: nh // ng if heads != "two" else 2)
    out = tssd.ssd_outputs(*ops, d, pos, torch.float32)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} outputs differ"


def test_one_position_a_sequence():
    """A decode step asks each sequence for one position of its own (``positions [b, 1]``, ragged): the outputs
    are the whole scan's at those positions, bitwise."""
    x, dt, a, b, c, d, state = _inputs(5, 4, 13, 4, 4, 2, 8, torch.float32)
    ops = ssd._ssd_chunk_states(x, dt, a, b, c, 8, state)[:6]
    whole = ssd._ssd_outputs(*ops, d, ssd.output_positions(4, 0, 13, "cpu"), torch.float32)
    pos = torch.tensor([[12], [0], [7], [8]])
    out = tssd.ssd_outputs(*ops, d, pos, torch.float32)
    assert torch.equal(out[:, 0], whole[torch.arange(4), pos[:, 0]])


def test_heads_per_program_divides_the_group_and_keeps_programs():
    assert tssd.heads_per_program(4096, 128, 8) == 16  # a prefill: a whole group a program
    assert tssd.heads_per_program(64, 128, 8) == 8  # a decode step of 64 sequences: 64 x 16 programs
    assert tssd.heads_per_program(1, 80, 1) == 1  # one position: every head a program of its own
    for positions, nh, ng in ((7, 24, 3), (300, 80, 1), (1, 4, 4)):
        hpp = tssd.heads_per_program(positions, nh, ng)
        assert (nh // ng) % hpp == 0


def test_a_row_alone_equals_the_row_in_a_batch():
    x, dt, a, b, c, d, state = _inputs(3, 4, 13, 4, 4, 2, 8, torch.float32)
    scan = TRITON_SCAN
    y, _ = scan(x, dt, a, b, c, d, 8, state, 0)
    for i in (0, 2):
        alone, _ = scan(x[i:i + 1], dt[i:i + 1], a, b[i:i + 1], c[i:i + 1], d, 8, state[i:i + 1], 0)
        assert torch.equal(alone, y[i:i + 1])


def test_exp_is_the_contract_exp():
    """The kernel's ``exp`` alone, over the range the SSD feeds it (``cum_t - cum_s <= 0``, ``cum_t``) and beyond
    (the clamps at -110 / 90, NaN)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(X, Y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(Y + i, tnum.exp_f32(tl.load(X + i, mask=i < n, other=0.0)), mask=i < n)

    from megatron_consistent.kernels import numerics

    v = torch.cat([torch.linspace(-120, 95, 997), torch.randn(500) * 3, torch.tensor([0.0, -0.0, float("nan")])])
    out = torch.empty_like(v)
    _probe[(1,)](v, out, v.numel(), BLOCK=2048)
    ref = numerics.exp(v)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@triton.jit
def _halves_leaves(LEAF: tl.constexpr, args, N: tl.constexpr, K: tl.constexpr, zero, I0: tl.constexpr = 0):
    """A wrong leaf tree (``tree_leaves``' arguments): the first half's tree plus the second half's (neighbours
    paired first)."""
    if N == 1:
        return LEAF(args, I0)
    else:
        return _halves_leaves(LEAF, args, N // 2, K, zero, I0) + _halves_leaves(LEAF, args, N // 2, K, zero,
                                                                                 I0 + N // 2)


def test_chunk_terms_with_a_neighbour_tree_are_caught(monkeypatch):
    """The chunk-terms kernel's tree over the chunk's rows (leaf by leaf) summed with neighbours paired first gives
    other bits: the comparisons above can fail."""
    x, dt, a, b, c, _, _ = _inputs(6, 2, 40, 2, 12, 1, 24, torch.float32)
    xc, dtc, bc, _, cum = ssd._ssd_chunk_states(x, dt, a, b, c, 16, torch.zeros(2, 2, 12, 24))[:5]
    ref = ssd._chunk_contributions(xc, dtc, bc, cum, 2)
    assert torch.equal(tssd.chunk_contributions(xc, dtc, bc, cum, 2), ref)
    monkeypatch.setattr(tssd, "tree_leaves", _halves_leaves)
    assert not torch.equal(tssd.chunk_contributions(xc, dtc, bc, cum, 2), ref)
