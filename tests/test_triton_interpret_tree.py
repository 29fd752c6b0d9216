"""The re-formulations of the contract's pairwise tree that ``benchmarks/offline_compile_tree.py`` compiles (pre-split
slices, bit-reversed loads, ``tl.sum`` over the pair axis, and :func:`numerics.tree_cols_split`) in Triton's
interpreter on CPU tensors: bitwise the kernels' :func:`tree_cols` / :func:`tree_rows` and the torch contract
(:func:`kernels.numerics.tree_sum`) on products of mixed magnitudes; a tree that pairs neighbours (``i`` with
``i + 1``) is caught.  Runs only with ``TRITON_INTERPRET=1`` (``make test-interpret``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
pytest.importorskip("triton")

from megatron_consistent.kernels import numerics


def _load_tree_module():
    """``benchmarks/offline_compile_tree.py`` (its kernels and variants)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offline_compile_tree.py"
    spec = importlib.util.spec_from_file_location("offline_compile_tree", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TREE = _load_tree_module()
SHAPES = TREE.SHAPES + [(16, 8, False), (8, 16, True), (4, 2, False)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _operands(r: int, c: int, rows: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [r, c]`` and the vector: float32 of mixed magnitudes (``2**-30`` .. ``2**30``, signed zeros, cancelling
    pairs), so that any other order of the additions rounds differently."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.exp2(torch.randint(-30, 31, (r, c), generator=g).float())
    x[torch.rand(r, c, generator=g) < 0.05] = 0.0
    x[torch.rand(r, c, generator=g) < 0.05] = -0.0
    x[:, -1] = -x[:, 0]
    x[-1, :] = -x[0, :]
    n = r if rows else c
    y = torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 9, (n,), generator=g).float())
    return x, y


def _run(fn, x: torch.Tensor, y: torch.Tensor, k: int, rows: bool) -> torch.Tensor:
    r, c = x.shape
    out = torch.full((c if rows else r,), 7.0)
    TREE.tree_kernel[(1,)](x, y, out, R=r, C=c, K=k, REDUCE=fn, ROWS=rows)
    return out


def _contract(x: torch.Tensor, y: torch.Tensor, rows: bool) -> torch.Tensor:
    return numerics.tree_sum(y[:, None] * x, dim=0) if rows else numerics.tree_sum(y[None, :] * x, dim=1)


def _variants(r: int, c: int, rows: bool) -> list[tuple[str, object, int]]:
    """Every variant that fits the shape (``K`` at most ``log2`` of the reduced length)."""
    n = (r if rows else c).bit_length() - 1
    return [v for v in TREE.variants(rows, r, c) if v[2] <= n]


@pytest.mark.parametrize("r,c,rows", SHAPES)
def test_variants_are_the_kernels_tree(r, c, rows):
    x, y = _operands(r, c, rows)
    want = _contract(x, y, rows)
    current = _run(TREE.rows_tree if rows else TREE.cols_tree, x, y, 0, rows)
    assert torch.equal(_bits(current), _bits(want))
    for name, fn, k in _variants(r, c, rows):
        assert torch.equal(_bits(_run(fn, x, y, k, rows)), _bits(current)), name


@pytest.mark.parametrize("r,c", [(r, c) for r, c, rows in SHAPES if not rows and c > 2])
def test_neighbour_pairing_is_caught(r, c):
    x, y = _operands(r, c, False)
    assert not torch.equal(_bits(_run(TREE.cols_adjacent, x, y, 0, False)), _bits(_contract(x, y, False)))


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_consistent.kernels.triton.numerics import tree_leaves, tree_rows_split  # noqa: E402


@triton.jit
def _row_leaf(args, i):
    """Row ``i`` of ``X [R, C]`` times ``Y[i]`` (rows past ``R``: ``+0``, the tree's padding)."""
    X, Y, R, C, BC = args
    c = tl.arange(0, BC)
    in_row = c < C
    return tl.load(Y + i, mask=tl.full((), i, tl.int32) < R, other=0.0) * tl.load(
        X + i * C + c, mask=in_row & (tl.zeros_like(c) + i < R), other=0.0)


@triton.jit
def _halves_leaves(LEAF: tl.constexpr, args, N: tl.constexpr, I0: tl.constexpr):
    """A wrong tree for the test: the first half's tree plus the second half's (neighbours paired first)."""
    if N == 1:
        return LEAF(args, I0)
    else:
        return _halves_leaves(LEAF, args, N // 2, I0) + _halves_leaves(LEAF, args, N // 2, I0 + N // 2)


@triton.jit
def _leaves_kernel(X, Y, OUT, R, C, N: tl.constexpr, BC: tl.constexpr, K: tl.constexpr, HALVES: tl.constexpr):
    if HALVES:
        v = _halves_leaves(_row_leaf, (X, Y, R, C, BC), N, 0)
    else:
        v = tree_leaves(_row_leaf, (X, Y, R, C, BC), N, K, tl.zeros((BC,), dtype=tl.float32))
    c = tl.arange(0, BC)
    tl.store(OUT + c, v, mask=c < C)


@pytest.mark.parametrize("r,c", [(1, 3), (2, 8), (5, 7), (16, 16), (13, 4), (32, 5), (100, 6)])
def test_tree_of_leaves_is_the_contract_tree(r, c):
    """:func:`numerics.tree_leaves` (the rows formed one at a time, summed in the tree's order; its top levels in a
    runtime loop over 2 .. 16 residue classes): the bits of ``tree_sum`` over the rows, rows padded with zeros to a
    power of two, at every class count; pairing neighbours first is caught."""
    x, y = _operands(r, c, True, seed=r * 100 + c)
    want = _contract(x, y, True)
    n = triton.next_power_of_2(r)
    for k in (1, 2, 4, 8, 16):
        if k <= n:
            out = torch.full((c,), 7.0)
            _leaves_kernel[(1,)](x, y, out, r, c, N=n, BC=triton.next_power_of_2(c), K=k, HALVES=False)
            assert torch.equal(_bits(out), _bits(want)), f"{k} classes"
    if r > 2:
        _leaves_kernel[(1,)](x, y, out, r, c, N=n, BC=triton.next_power_of_2(c), K=1, HALVES=True)
        assert not torch.equal(_bits(out), _bits(want))


@triton.jit
def _row_slice(args, r):
    """Rows ``r`` of ``X [R, C]`` times ``Y[r]`` (rows past ``R``: zeros)."""
    X, Y, R, C, BC = args
    c = tl.arange(0, BC)
    return tl.load(Y + r, mask=r < R, other=0.0)[:, None] * tl.load(X + r[:, None] * C + c[None, :],
                                                                   mask=(r < R)[:, None] & (c < C)[None, :], other=0.0)


@triton.jit
def _row_slices_kernel(X, Y, OUT, R, C, N: tl.constexpr, BC: tl.constexpr, W: tl.constexpr):
    v = tree_rows_split(_row_slice, (X, Y, R, C, BC), N, BC, W)
    c = tl.arange(0, BC)
    tl.store(OUT + c, v, mask=c < C)


@pytest.mark.parametrize("r,c", [(16, 8), (13, 4), (32, 5), (8, 16)])
def test_row_slices_are_the_contract_tree(r, c):
    """:func:`numerics.tree_rows_split` (the intra tree of the SSD outputs kernel): every slice width gives
    ``tree_sum``'s bits over the rows."""
    x, y = _operands(r, c, True, seed=r + c)
    want = _contract(x, y, True)
    n = triton.next_power_of_2(r)
    for w in (1, 2, 4, n):
        out = torch.full((c,), 7.0)
        _row_slices_kernel[(1,)](x, y, out, r, c, N=n, BC=triton.next_power_of_2(c), W=w)
        assert torch.equal(_bits(out), _bits(want)), w
