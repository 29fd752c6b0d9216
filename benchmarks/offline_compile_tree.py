"""Compile re-formulations of the contract's pairwise tree (``numerics.tree_sum``: element ``i`` + element ``i + n/2``,
level by level) over one axis of a float32 register tile for sm_90a WITHOUT a GPU, and count what each costs.

    PYTHONPATH=/tmp/tritonsite:$PWD python benchmarks/offline_compile_tree.py   # Triton 3.6, the GPU machine's

Every variant is a small kernel: load a ``[R, C]`` float32 tile and a vector, multiply (``y[None, :] * x`` for a
column tree, as the SSD outputs kernel's ``c_t[None, :] * b_sn``; ``y[:, None] * x`` for a row tree, as its
``w[:, None] * x_sp``), reduce one axis, store.  The variants make the same additions of the same pairs (the same bits
by construction; ``tests/test_triton_interpret_tree.py`` checks them bitwise in Triton's interpreter):

* ``tree``: :func:`tree_cols` / :func:`tree_rows` as the kernels use them (per level a reshape to ``2 x n/2``, a
  permute that puts the pair axis last, a ``tl.split``).
* ``sum2``: per level the same reshape, then ``tl.sum`` over the axis of length 2 (one add of the pair).
* ``slices k``: the top ``k`` levels as adds of ``2**k`` separately loaded contiguous slices of width ``n / 2**k``
  (slice ``m`` + slice ``m + 2**(k-1)``, ...), then ``tree`` over the last slice width (for columns:
  :func:`numerics.tree_cols_split`).
* ``bitrev k``: the tile loaded with the low ``k`` bits of its tree index bit-reversed and moved last, so that each of
  the top ``k`` levels pairs neighbours of the last axis (a ``tl.split`` with no permute); then ``tree`` over the
  rest (``k = log2 n``: every level).

For each: registers, spills (stack bytes), shared memory, and from the PTX (:func:`ptx_counts`) the global loads,
the shared-memory stores and loads (``stmatrix`` / ``ldmatrix`` included) and the bytes they move per thread, the
barriers, shuffles and all instructions; compiled on 4 warps with ``enable_fp_fusion=False``, as the SSD outputs
kernel is launched at a 128 x 128 tile.  Says nothing about speed on the device.
"""

from __future__ import annotations

import os
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # offline_compile, also when loaded by a test

from offline_compile import resource_usage  # noqa: E402

from megatron_consistent.kernels.triton.numerics import _MAX_LEVELS, tree_cols, tree_cols_split, tree_rows  # noqa: E402


@triton.jit
def _bitrev(i, BITS: tl.constexpr):
    """``i``'s low ``BITS`` bits in reverse order."""
    r = i * 0
    for b in tl.static_range(BITS):
        r = r | (((i >> b) & 1) << (BITS - 1 - b))
    return r


@triton.jit
def _cols_product(X, Y, r, j, C: tl.constexpr):
    """``Y[j][None, :] * X[r, j]``: tile columns ``j`` of the column-tree operand."""
    return tl.load(Y + j)[None, :] * tl.load(X + r[:, None] * C + j[None, :])


@triton.jit
def _rows_product(X, Y, i, c, C: tl.constexpr):
    """``Y[i][:, None] * X[i, c]``: tile rows ``i`` of the row-tree operand."""
    return tl.load(Y + i)[:, None] * tl.load(X + i[:, None] * C + c[None, :])


@triton.jit
def cols_tree(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """The kernels' form: :func:`tree_cols`."""
    return tree_cols(_cols_product(X, Y, tl.arange(0, R), tl.arange(0, C), C), R, C)


@triton.jit
def cols_sum2(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """Per level ``tl.sum`` over the pair axis of ``reshape(v, (R, 2, n/2))``."""
    v = _cols_product(X, Y, tl.arange(0, R), tl.arange(0, C), C)
    for level in tl.static_range(_MAX_LEVELS):
        if (C >> level) > 1:
            v = tl.sum(tl.reshape(v, (R, 2, C >> (level + 1))), axis=1)
    return tl.reshape(v, (R,))


@triton.jit
def _cols_product_of(args, j):
    """:func:`_cols_product` of ``args = (X, Y, r, C)``: the product tile as :func:`tree_cols_split` forms it."""
    X, Y, r, C = args
    return _cols_product(X, Y, r, j, C)


@triton.jit
def cols_slices(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """:func:`tree_cols_split` with slices of width ``C >> K``: the top ``K`` levels as adds of ``2**K`` column slices
    formed on their own, then :func:`tree_cols` over ``C >> K``."""
    return tree_cols_split(_cols_product_of, (X, Y, tl.arange(0, R), C), R, C, C >> K)


@triton.jit
def cols_bitrev(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """Tile column ``q = w 2**K + t`` holds column ``bitrev_K(t) (C >> K) + w``: the top ``K`` levels pair neighbours
    (split of the last axis, no permute); then :func:`tree_cols` over ``C >> K``."""
    q = tl.arange(0, C)
    v = _cols_product(X, Y, tl.arange(0, R), _bitrev(q & ((1 << K) - 1), K) * (C >> K) + (q >> K), C)
    for level in tl.static_range(K):
        lo, hi = tl.split(tl.reshape(v, (R, C >> (level + 1), 2)))
        v = lo + hi
    return tree_cols(v, R, C >> K)


@triton.jit
def cols_adjacent(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """NOT the contract's tree: neighbours paired (``i`` with ``i + 1``) -- the tests' check that a wrong pairing is
    caught."""
    v = _cols_product(X, Y, tl.arange(0, R), tl.arange(0, C), C)
    for level in tl.static_range(_MAX_LEVELS):
        if (C >> level) > 1:
            lo, hi = tl.split(tl.reshape(v, (R, C >> (level + 1), 2)))
            v = lo + hi
    return tl.reshape(v, (R,))


@triton.jit
def rows_tree(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """The kernels' form: :func:`tree_rows`."""
    return tree_rows(_rows_product(X, Y, tl.arange(0, R), tl.arange(0, C), C), R, C)


@triton.jit
def rows_sum2(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """Per level ``tl.sum`` over the pair axis of ``reshape(v, (2, n/2, C))``."""
    v = _rows_product(X, Y, tl.arange(0, R), tl.arange(0, C), C)
    for level in tl.static_range(_MAX_LEVELS):
        if (R >> level) > 1:
            v = tl.sum(tl.reshape(v, (2, R >> (level + 1), C)), axis=0)
    return tl.reshape(v, (C,))


@triton.jit
def _rows_slice_partial(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                        LEVEL: tl.constexpr):
    """Row slice ``M`` (height ``R >> K``) after ``LEVEL`` of the top ``K`` levels (:func:`_cols_slice_partial`)."""
    if LEVEL == 0:
        h: tl.constexpr = R >> K
        return _rows_product(X, Y, M * h + tl.arange(0, h), tl.arange(0, C), C)
    else:
        lo = _rows_slice_partial(X, Y, R, C, K, M, LEVEL - 1)
        hi = _rows_slice_partial(X, Y, R, C, K, M + (1 << (K - LEVEL)), LEVEL - 1)
        return lo + hi


@triton.jit
def rows_slices(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """The top ``K`` levels as adds of ``2**K`` loaded row slices, then :func:`tree_rows` over ``R >> K``."""
    return tree_rows(_rows_slice_partial(X, Y, R, C, K, 0, K), R >> K, C)


@triton.jit
def rows_bitrev(X, Y, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    """The row tree as a column tree of the transposed tile: tile ``[C, R]``, column ``q = w 2**K + t`` holds row
    ``bitrev_K(t) (R >> K) + w``; the top ``K`` levels pair neighbours, then :func:`tree_cols` over ``R >> K``."""
    q = tl.arange(0, R)
    i = _bitrev(q & ((1 << K) - 1), K) * (R >> K) + (q >> K)
    c = tl.arange(0, C)
    v = tl.load(Y + i)[None, :] * tl.load(X + i[None, :] * C + c[:, None])
    for level in tl.static_range(K):
        lo, hi = tl.split(tl.reshape(v, (C, R >> (level + 1), 2)))
        v = lo + hi
    return tree_cols(v, C, R >> K)


@triton.jit
def tree_kernel(X, Y, OUT, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr, REDUCE: tl.constexpr,
                ROWS: tl.constexpr):
    """``OUT = REDUCE(X [R, C], Y)``: ``[C]`` (``ROWS``, a row tree) or ``[R]``."""
    out = REDUCE(X, Y, R, C, K)
    if ROWS:
        tl.store(OUT + tl.arange(0, C), out)
    else:
        tl.store(OUT + tl.arange(0, R), out)


COLS = {"tree": (cols_tree, [0]), "sum2": (cols_sum2, [0]), "slices": (cols_slices, [1, 2, 3, 4, 5]),
        "bitrev": (cols_bitrev, [2, None])}
ROWS = {"tree": (rows_tree, [0]), "sum2": (rows_sum2, [0]), "slices": (rows_slices, [1, 2, 3]),
        "bitrev": (rows_bitrev, [None])}
# (R, C, a row tree): the outputs kernel's C_t . B_s ([L, N]), C_t . S ([P, N]) and intra ([L, P] over L)
SHAPES = [(128, 128, False), (128, 64, False), (64, 128, False), (128, 64, True)]
WARPS = 4  # the SSD outputs kernel's at a 128 x 128 tile (ssd_scan.launch_warps)


def variants(rows: bool, r: int, c: int) -> list[tuple[str, object, int]]:
    """``(name, reduce function, K)`` of every variant of a row or column tree over ``[r, c]`` (``K`` None in the
    tables: every level, ``log2`` of the reduced length)."""
    n = (r if rows else c).bit_length() - 1
    return [(f"{name} {k}" if name in ("slices", "bitrev") else name, fn, n if k is None else k)
            for name, (fn, ks) in (ROWS if rows else COLS).items() for k in ks]


def ptx_counts(ptx: str) -> dict[str, int]:
    """Instruction counts of a PTX listing (no loops in these kernels: each runs once per thread): global loads
    (vectorised or not), shared-memory stores (``st.shared*`` and ``stmatrix``) and loads (``ld.shared*`` and
    ``ldmatrix``), the bytes they move per thread, barriers, shuffles, all instructions (lines ending in ``;`` that
    are not directives)."""
    ins = [re.sub(r"^@!?%p\d+\s+", "", x.strip()) for x in ptx.splitlines()]
    ins = [x for x in ins if x.endswith(";") and not x.startswith((".", "//"))]
    st = [x for x in ins if x.startswith(("st.shared", "stmatrix"))]
    ld = [x for x in ins if x.startswith(("ld.shared", "ldmatrix"))]
    return {"ld.global": sum(x.startswith("ld.global") for x in ins),
            "st.shared": len(st), "ld.shared": len(ld), "shared bytes": sum(map(_shared_bytes, st + ld)),
            "bar.sync": sum(x.startswith(("bar.sync", "barrier.sync")) for x in ins),
            "shfl": sum(x.startswith("shfl.") for x in ins), "instructions": len(ins)}


def _shared_bytes(ins: str) -> int:
    """Bytes one thread stores or loads by a shared-memory instruction (``.vN`` x ``.bBITS``; ``stmatrix`` /
    ``ldmatrix .xN``: ``N`` 32-bit registers)."""
    op = ins.split()[0]
    if op.startswith(("stmatrix", "ldmatrix")):
        return 4 * int(re.search(r"\.x(\d)", op).group(1))
    vec = re.search(r"\.v(\d)", op)
    return (int(vec.group(1)) if vec else 1) * int(re.search(r"\.[bfsu](\d+)$", op).group(1)) // 8


def compile_variant(fn, r: int, c: int, k: int, rows: bool):
    """The sm_90a compile of :func:`tree_kernel` with ``fn`` over ``[r, c]`` (Triton's compiled kernel)."""
    sig = {"X": "*fp32", "Y": "*fp32", "OUT": "*fp32", "R": "constexpr", "C": "constexpr", "K": "constexpr",
           "REDUCE": "constexpr", "ROWS": "constexpr"}
    const = {"R": r, "C": c, "K": k, "REDUCE": fn, "ROWS": rows}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    return triton.compile(ASTSource(tree_kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": WARPS, "num_stages": 1, "enable_fp_fusion": False})


def main():
    """Print the table: one line per tile shape and variant."""
    print(f"{'tile':14s} {'variant':10s} {'regs':>4s} {'stack':>5s} {'smem':>6s} {'ld.gl':>5s} {'st.sh':>5s} "
          f"{'ld.sh':>5s} {'bytes':>5s} {'bar':>4s} {'shfl':>4s} {'instr':>6s}")
    for r, c, rows in SHAPES:
        for name, fn, k in variants(rows, r, c):
            tile = f"{r}x{c} {'rows' if rows else 'cols'}"
            try:
                kern = compile_variant(fn, r, c, k, rows)
            except Exception as e:  # noqa: BLE001
                print(f"{tile:14s} {name:10s} COMPILE ERROR {type(e).__name__}: {str(e)[:200]}")
                continue
            regs, stack = resource_usage(kern.asm["cubin"])
            n = ptx_counts(kern.asm["ptx"])
            print(f"{tile:14s} {name:10s} {regs:4d} {stack:5d} {kern.metadata.shared:6d} {n['ld.global']:5d} "
                  f"{n['st.shared']:5d} {n['ld.shared']:5d} {n['shared bytes']:5d} {n['bar.sync']:4d} {n['shfl']:4d} "
                  f"{n['instructions']:6d}", flush=True)


if __name__ == "__main__":
    main()
