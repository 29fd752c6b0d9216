"""Paged varlen attention (kernels/triton/paged_attention.py: paged_attention, write_kv_cache) and the
fixed-partition split-KV contract of the Triton attention.

"Bitwise" means ``torch.equal`` on the raw bits.  Every paged row (token, query head) must equal
:func:`attention_fwd` on the same q/K/V laid out densely at the same absolute positions, whatever
the batch composition (decode, chunked prefill over a cached prefix, whole prefill, mixed), the
page size, and the path (in-program partitions vs split partitions + merge kernel).

Devices: CUDA when available (bf16 and fp16).  Without CUDA, with ``TRITON_INTERPRET=1`` and an
importable Triton, the same tests run in Triton's interpreter on CPU tensors (small shapes, fp16
only: the interpreter's ``tl.dot`` mishandles bf16).  The interpreter proves the logic (indices,
masks, paging, partition merge, the batch-dependent variant being caught), not GPU bits.
Otherwise the module is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch
from _bits import bits_equal
from hypothesis import given, settings
from hypothesis import strategies as st

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover
    _HAVE_TRITON = False

if torch.cuda.is_available() and _HAVE_TRITON and not _INTERPRET:
    DEV = torch.device("cuda")
elif _INTERPRET and _HAVE_TRITON:
    DEV = torch.device("cpu")
else:
    DEV = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    DEV is None, reason="needs a CUDA GPU, or TRITON_INTERPRET=1 with triton importable (Triton interpreter on CPU)")]

if DEV is not None:
    from megatron_consistent.kernels.fp8 import KV_SCALE, kv_dequantize, kv_quantize
    from megatron_consistent.kernels.triton import attention as ta
    from megatron_consistent.kernels.triton import paged_attention as tpa

ON_GPU = DEV is not None and DEV.type == "cuda"
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
HQ, HKV, D = (8, 2, 64) if ON_GPU else (4, 2, 32)
PART = 512
EXAMPLES = 25 if ON_GPU else 4




def _e4m3_exact(x):
    """Interpreter only: values exactly representable in e4m3 (the interpreter's float32 -> fp8 cast
    rounds half-up without carry, unlike the GPU's round-to-nearest-even; exact values make it moot)."""
    return kv_dequantize(kv_quantize(x), x.dtype)


def _randn(shape, gen, dtype):
    return torch.randn(shape, generator=gen).to(DEV, dtype)


def _unwritten(shape, dtype):
    """A cache's unwritten slots: NaN converted from float32 (on CUDA a bfloat16 NaN from the device's conversion is
    0x7fff, one from ``fill_(nan)`` the host's 0x7fc0: a cache compared bitwise with another must take its NaN
    the same way -- session 31's H100 run)."""
    return torch.full(shape, float("nan"), dtype=torch.float32).to(DEV, dtype)


class Batch:
    """Sequences ``(cached, q_len)`` with dense K/V, a shuffled paged cache and varlen q."""

    def __init__(self, seqs, page, dtype, seed, fp8=False, pad_tokens=0, dense_kv=None):
        gen = torch.Generator().manual_seed(seed)
        self.seqs, self.page, self.dtype, self.fp8 = list(seqs), page, dtype, fp8
        self.lens = [c + n for c, n in self.seqs]
        self.qlens = [n for _, n in self.seqs]
        self.kv = dense_kv or [(_randn((L, HKV, D), gen, dtype), _randn((L, HKV, D), gen, dtype)) for L in self.lens]
        if fp8 and not ON_GPU:
            self.kv = [(_e4m3_exact(k_), _e4m3_exact(v_)) for k_, v_ in self.kv]
        self.q = [_randn((n, HQ, D), gen, dtype) for n in self.qlens]
        npages = [-(-L // page) for L in self.lens]
        total = sum(npages) + 2
        perm = torch.randperm(total, generator=gen).tolist()
        self.poison = perm[-1]  # a page of NaN: unused table entries point at it
        max_pages = max(npages + [1]) + 1
        table = torch.full((len(self.seqs), max_pages), self.poison, dtype=torch.int32)
        k = 0
        for s, n in enumerate(npages):
            table[s, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
            k += n
        self.table = table.to(DEV)
        cache_dtype = torch.float8_e4m3fn if fp8 else dtype
        kv = _unwritten((2, total, page, HKV, D), cache_dtype)
        self.k_cache, self.v_cache = kv[0], kv[1]
        slots = []
        for s, L in enumerate(self.lens):
            pos = torch.arange(L)
            slots.append(table[s, pos // page].to(torch.int64) * page + pos % page)
        keys = torch.cat([k_ for k_, _ in self.kv]) if self.kv else torch.empty(0, HKV, D, dtype=dtype, device=DEV)
        vals = torch.cat([v_ for _, v_ in self.kv]) if self.kv else torch.empty(0, HKV, D, dtype=dtype, device=DEV)
        self.written = (keys, vals, torch.cat(slots).to(DEV) if slots else torch.empty(0, dtype=torch.int64, device=DEV))
        tpa.write_kv_cache(*self.written[:2], self.k_cache, self.v_cache, self.written[2],
                           kv_scale=KV_SCALE if fp8 else None)
        self.qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(self.qlens, dtype=torch.int64), 0)),
                                dtype=torch.int32).to(DEV)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32).to(DEV)
        self.t = sum(self.qlens)
        self.q_all = torch.cat(self.q + [_randn((pad_tokens, HQ, D), gen, dtype)])
        # the step's new keys / values, token-major as q (what the engine writes to the cache before attention),
        # padding tokens random
        pad_kv = [_randn((pad_tokens, HKV, D), gen, dtype) for _ in range(2)]
        self.k_new, self.v_new = (torch.cat([x[c:] for x, (c, _) in zip(side, self.seqs)] + [pad])
                                  for side, pad in zip(zip(*self.kv) if self.kv else ([], []), pad_kv))

    def paged(self, split=None, block_m=0, max_seq_len=None, max_query_len=None, new_kv=False):
        out = torch.full_like(self.q_all, float("nan"))
        tpa.paged_attention(self.q_all, self.k_cache, self.v_cache, self.table, self.qsl, self.seq_lens, D ** -0.5, out,
                           max_query_len=max_query_len or max(self.qlens + [1]),
                           max_seq_len=max_seq_len or max(self.lens + [1]),
                           kv_scale=KV_SCALE if self.fp8 else None, split=split, block_m=block_m,
                           k_new=self.k_new if new_kv else None, v_new=self.v_new if new_kv else None)
        return out

    def dense(self, s, split=None):
        """attention_fwd of sequence ``s`` alone (K/V dequantized when the cache is FP8)."""
        k, v = self.kv[s]
        if self.fp8:
            k, v = kv_dequantize(kv_quantize(k), self.dtype), kv_dequantize(kv_quantize(v), self.dtype)
        L, n = self.lens[s], self.qlens[s]
        pos = torch.arange(L - n, L, device=DEV)[None]
        out, _ = ta.attention_fwd(self.q[s][None], k[None], v[None], pos, torch.tensor([L], device=DEV), D ** -0.5,
                                  split=split)
        return out[0]

    def rows(self, out, s):
        a = int(self.qsl[s])
        return out[a:a + self.qlens[s]]


def _check_against_dense(batch: Batch, out: torch.Tensor, split=None) -> list[int]:
    """Indices of the sequences whose paged rows differ from dense attention_fwd (empty = all equal)."""
    return [s for s in range(len(batch.seqs)) if not bits_equal(batch.rows(out, s), batch.dense(s, split))]


# ------------------------------------------------------------------ dense attention_fwd: partition contract


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_fwd_split_equals_in_program_and_row_alone(dtype):
    """Rows at positions either side of partition (512, 1024) and block (64) boundaries: split path ==
    in-program path == the row alone (own Tk) == the row inside a longer, padded batch."""
    gen = torch.Generator().manual_seed(1)
    T = 1100
    q = _randn((2, T, HQ, D), gen, dtype)
    k = _randn((2, T + 30, HKV, D), gen, dtype)
    v = _randn((2, T + 30, HKV, D), gen, dtype)
    picks = torch.tensor([0, 63, 64, 65, 510, 511, 512, 513, 1023, 1024, 1025, T - 1])
    pos = picks[None].repeat(2, 1).to(DEV)
    klen = torch.tensor([T + 30, 1024], device=DEV)
    a, la = ta.attention_fwd(q[:, picks], k, v, pos, klen, D ** -0.5, split=False)
    b, lb = ta.attention_fwd(q[:, picks], k, v, pos, klen, D ** -0.5, split=True)
    assert bits_equal(a, b) and bits_equal(la, lb), "split != in-program"
    for i, p in enumerate(picks.tolist()):
        L = min(p + 1, 1024)
        one, lone = ta.attention_fwd(q[1:, p:p + 1], k[1:, :L], v[1:, :L], pos[1:, i:i + 1],
                                     torch.tensor([L], device=DEV), D ** -0.5)
        assert bits_equal(one[0, 0], a[1, i]), f"position {p}: alone != in batch"
        assert bits_equal(lone[0, :, 0], la[1, :, i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_fwd_prefill_chunk_decode_across_partitions(dtype):
    """Whole prefill == prefill in chunks over the cached prefix == decode steps, across 512-key partitions."""
    gen = torch.Generator().manual_seed(2)
    T = 1090
    q, k, v = _randn((1, T, HQ, D), gen, dtype), _randn((1, T, HKV, D), gen, dtype), _randn((1, T, HKV, D), gen, dtype)
    pos = torch.arange(T, device=DEV)[None]
    full, lfull = ta.attention_fwd(q, k, v, pos, torch.tensor([T], device=DEV), D ** -0.5)
    for a, b in [(0, 500), (500, 530), (530, 1030), (1030, T)]:
        ch, lch = ta.attention_fwd(q[:, a:b], k[:, :b], v[:, :b], pos[:, a:b], torch.tensor([b], device=DEV), D ** -0.5)
        assert bits_equal(ch, full[:, a:b]), f"chunk [{a},{b})"
        assert bits_equal(lch, lfull[:, :, a:b])
    for p in [511, 512, 1024, T - 1]:
        for split in (False, True):
            dec, _ = ta.attention_fwd(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], pos[:, p:p + 1],
                                      torch.tensor([p + 1], device=DEV), D ** -0.5, split=split)
            assert bits_equal(dec[0, 0], full[0, p]), f"decode at {p}, split={split}"


# ------------------------------------------------------------------ paged == dense


_seq = st.one_of(
    st.tuples(st.integers(0, 1100), st.just(1)),  # decode over a cache
    st.tuples(st.integers(1, 1100), st.integers(2, 40)),  # chunked prefill over a cached prefix
    st.tuples(st.just(0), st.integers(1, 600)),  # whole prefill
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(seqs=st.lists(_seq, min_size=1, max_size=4), page=st.sampled_from([16, 32, 64]),
       split=st.sampled_from([None, False, True]), seed=st.integers(0, 2 ** 16), pad=st.integers(0, 3))
def test_paged_equals_dense_random_batches(seqs, page, split, seed, pad):
    dtype = DTYPES[seed % len(DTYPES)]
    batch = Batch(seqs, page, dtype, seed, pad_tokens=pad)
    out = batch.paged(split=split)
    assert _check_against_dense(batch, out) == []
    assert bool((out[batch.t:] == 0).all()), "padding rows must be 0"
    # each row alone (its own max lengths, the other path) gives the same bits
    s = seed % len(seqs)
    alone = Batch([seqs[s]], page, dtype, seed, dense_kv=[batch.kv[s]])
    alone.q = [batch.q[s]]
    alone.q_all = batch.q[s]
    other = None if split is None else (not split)
    assert bits_equal(alone.paged(split=other), batch.rows(out, s)), "row alone != row in the batch"


_BOUNDARY_CASES = ([(p, s) for p in (16, 32, 64, 128) for s in (False, True)] if ON_GPU
                   else [(16, True), (128, False)])  # the interpreter is slow


@pytest.mark.parametrize("page,split", _BOUNDARY_CASES)
def test_paged_boundaries_mixed_batch(page, split):
    """Decode and chunks ending either side of block (64) and partition (512, 1024) boundaries, in one batch."""
    seqs = [(62, 1), (63, 1), (64, 1), (510, 1), (511, 1), (512, 1), (1023, 1), (1024, 1),
            (500, 20), (1000, 30), (0, 70)]
    for dtype in DTYPES:
        batch = Batch(seqs, page, dtype, seed=page + split, pad_tokens=5)
        out = batch.paged(split=split, max_seq_len=4096)  # a loose bound (max_model_len) never changes bits
        assert _check_against_dense(batch, out) == []
        assert bits_equal(out, batch.paged(split=not split)), "split != in-program"
        assert bits_equal(out, batch.paged(split=split, block_m=128)), "tile size changed bits"
        # max_seq_len / max_query_len are hints: below the real lengths the rows are still complete
        assert bits_equal(out, batch.paged(split=True, max_seq_len=513, max_query_len=1)), "short max_seq_len hint"
        assert bool((out[batch.t:] == 0).all())


@pytest.mark.parametrize("split", [False, True])
def test_launch_shape_table_is_numerics_neutral(monkeypatch, split):
    """Every (warps, stages) the tile table may hold gives the same bits on both paths (benchmarks/bench_gpu_attention.py
    --tiles picks among them by speed only)."""
    shapes = {16: [(2, 2), (4, 4), (4, 2)], 64: [(4, 2), (4, 3), (4, 4)], 128: [(8, 2), (8, 3), (4, 2)]}  # all compile
    for seqs in ([(600, 1), (30, 1), (513, 1)], [(600, 1), (30, 9), (513, 1)], [(600, 1), (30, 9), (0, 70)]):
        batch = Batch(seqs, 16, DTYPES[0], seed=11, pad_tokens=3)  # query tiles of 16, 64 and 128 rows
        ref = batch.paged(split=split)
        for i in range(3):
            tiles = {key: shapes[key[0]][i] for key in ta.ATTN_TILES}
            monkeypatch.setattr(ta, "ATTN_TILES", tiles)
            assert bits_equal(ref, batch.paged(split=split)), f"{tiles} changed bits"


# (merge stages, slices; 0 = the slices ``_merge_slices`` picks from the merge grid)
_MERGE_SCHEDULES = ([(st, 1) for st in (1, 2, 3, 4)] + [(st, ds) for st in (1, 4) for ds in (0, 2, 4, 8)] if ON_GPU
                    else [(1, 1), (2, 1), (4, 2), (4, 0)])  # the interpreter's head dim 32 allows 2 slices of 16


def _split_path_cases(seed: int):
    """(paged batches, a function running every split-path case): rows over 1-3 partitions, a ``max_seq_len`` hint
    shorter than the rows (the merge walks the tail), pages of 16 and 64 keys, and the dense path (its ``lse``) with a
    row that has no key."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, h, D, generator=gen).to(device=DEV, dtype=DTYPES[0])
               for n, h in ((3, HQ), (1100, HKV), (1100, HKV)))
    pos = torch.tensor([[1097, 1098, 1099], [0, 1, 2]], device=DEV)
    lens = torch.tensor([1100, 0], device=DEV)
    batches = [Batch([(600, 1), (30, 9), (1500, 1), (513, 1)], page, DTYPES[0], seed=seed + 8, pad_tokens=2)
               for page in (16, 64)]

    def run():
        return ([b.paged(split=True, max_seq_len=hint) for b in batches for hint in (None, 513)]
                + list(ta.attention_fwd(q, k, v, pos, lens, D ** -0.5, split=True)))

    return batches, run


def test_merge_schedules_are_numerics_neutral(monkeypatch):
    """The split path's merge launch pipelined over 1-4 stages (``attention.MERGE_STAGES``: loads issued ahead) and cut
    into 1-8 head-dimension slices (``attention.MERGE_DSPLIT``; 0: by the merge grid) gives the same bits, for rows spanning 1-3 partitions,
    a ``max_seq_len`` hint shorter than the rows (slice 0 walks the tail), pages of 16 and 64 keys, and the dense
    path's ``lse`` (stored by slice 0 only) with a row that has no key."""
    batches, run = _split_path_cases(5)
    monkeypatch.setattr(ta, "MERGE_STAGES", 1)
    monkeypatch.setattr(ta, "MERGE_DSPLIT", 1)
    ref = run()
    assert all(_check_against_dense(b, b.paged(split=True)) == [] for b in batches)
    for stages, dsplit in _MERGE_SCHEDULES:
        monkeypatch.setattr(ta, "MERGE_STAGES", stages)
        monkeypatch.setattr(ta, "MERGE_DSPLIT", dsplit)
        got = run()
        assert all(bits_equal(a, b) for a, b in zip(ref, got)), f"merge stages {stages}, slices {dsplit}"


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch: Hopper (sm_90)")
def test_dependent_merge_launch_is_numerics_neutral(monkeypatch):
    """The split path's merge as a programmatic dependent launch (``attention.SPLIT_PDL``: the merge grid starts early
    and waits in-kernel for the split grid) gives the bits of the plain launch order: rows over 1-3 partitions, a
    ``max_seq_len`` hint shorter than the rows, pages of 16 and 64, the dense path with its ``lse``."""
    _, run = _split_path_cases(6)
    ref = run()
    monkeypatch.setattr(ta, "SPLIT_PDL", True)
    for _ in range(3):
        assert all(bits_equal(a, b) for a, b in zip(ref, run()))


@pytest.mark.skipif(not ON_GPU, reason="Triton compiles binaries on the GPU only (the interpreter compiles none)")
@pytest.mark.parametrize("prebuilt", [True, False])
def test_decode_step_with_another_merge_slice_count_compiles_nothing(monkeypatch, prebuilt):
    """A decode step whose batch picks another merge slice count than the step before compiles no new binary: the first
    split launch of a configuration compiles the merge for every slice count (``attention._build_merge_binaries``),
    as a rollout's warm-up pass then does.  With that switched off (the deliberately broken variant) the second step
    compiles one -- so the test can fail.  Each case takes merge constexprs no other test launches (fp16 with 3 / 2
    merge stages), so its binaries are new to the process."""
    import triton

    from megatron_consistent.kernels.triton import compile_log

    monkeypatch.setattr(ta, "MERGE_STAGES", 3 if prebuilt else 2)
    monkeypatch.setattr(ta, "MERGE_DSPLIT", 0)
    monkeypatch.setattr(ta, "_merge_binaries_built", set())
    if not prebuilt:
        monkeypatch.setattr(ta, "_build_merge_binaries", lambda *args, **kwargs: None)
    built = []

    def hook(**kwargs):
        named = compile_log.specialization_constexprs(**kwargs)
        if named is not None and kwargs["fn"].name == "_attn_kernel" and named.get("MODE") == 2:
            built.append(named["MERGE_DSPLIT"])

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    # both block tables 36 pages wide: the same argument specialisation (Triton compiles a binary per divisibility
    # class of an integer argument such as the table's stride -- not foreseen, and an engine's table width is fixed)
    one = Batch([(1100, 1)], 32, torch.float16, seed=3)  # 2 merge programs: 4 slices of the 64-wide head
    many = Batch([(600 + 13 * i, 1) for i in range(40)], 32, torch.float16, seed=4)  # 80 programs: 1 slice
    assert one.table.shape[1] == many.table.shape[1] == 36
    one.paged(split=True)
    first = sorted(built)
    built.clear()
    got = many.paged(split=True)
    second = list(built)
    assert bits_equal(got, many.paged(split=False))  # the in-program path (MODE 0): no merge binary
    if prebuilt:
        assert first == [1, 2, 4] and second == [], (first, second)
    else:
        assert first == [4] and second == [1], (first, second)


def _nan_workspace(rows, block_d, dev):
    """A stand-in for ``attention._workspace`` filled with NaN: a merge that reads a slot no partition program wrote
    shows in its output."""
    return tuple(torch.full(shape, float("nan"), device=dev) for shape in ((rows,), (rows,), (rows, block_d)))


def test_split_path_reads_only_written_workspace_slots(monkeypatch):
    """The split path's workspace starts as NaN: every slot the merge launch reads must have been written by the split
    launch, so split == in-program on rows over 1-3 partitions, chunked rows, a ``max_seq_len`` hint shorter than the
    rows (the tail walked by the merging program), pages of 16 and 64 keys, and a dense row with no key."""
    monkeypatch.setattr(ta, "_workspace", _nan_workspace)
    monkeypatch.setattr(ta, "MERGE_DSPLIT", 2)  # slices: a program reading a slot of another's columns shows too
    for page in (16, 64):
        batch = Batch([(600, 1), (30, 9), (1500, 1), (513, 1)], page, DTYPES[0], seed=17, pad_tokens=2)
        for hint in (None, 513):
            assert bits_equal(batch.paged(split=True, max_seq_len=hint), batch.paged(split=False, max_seq_len=hint))
        assert _check_against_dense(batch, batch.paged(split=True)) == []
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, h, D, generator=gen).to(device=DEV, dtype=DTYPES[0])
               for n, h in ((3, HQ), (1100, HKV), (1100, HKV)))
    pos = torch.tensor([[1097, 1098, 1099], [0, 1, 2]], device=DEV)
    lens = torch.tensor([1100, 0], device=DEV)  # the second row has no key: out 0, lse -inf
    out, lse = ta.attention_fwd(q, k, v, pos, lens, D ** -0.5, split=True)
    ref, lref = ta.attention_fwd(q, k, v, pos, lens, D ** -0.5, split=False)
    assert bits_equal(out, ref) and bits_equal(lse, lref)
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())


_NEW_KV_CASES = ([(p, s) for p in (16, 32, 64, 128) for s in (None, False, True)] if ON_GPU
                 else [(16, None), (32, True), (64, True)])


@pytest.mark.parametrize("page,split", _NEW_KV_CASES)
def test_paged_new_kv_from_step_tensors(page, split):
    """Key blocks of new tokens read from the step's K/V (``k_new``) give the bits of the cache path and of dense
    attention: whole prefills, chunks over cached prefixes ending either side of a block boundary, decodes, padding
    tokens; pages 16-128; both paths.  A perturbed ``k_new`` must change the prefill rows where it is read (pages
    shorter than a key block), and pages of 64+ keys and the FP8 cache ignore it."""
    seqs = [(0, 150), (37, 90), (64, 70), (500, 40), (600, 1), (0, 1), (130, 2)]
    for dtype in DTYPES:
        batch = Batch(seqs, page, dtype, seed=page + 3, pad_tokens=3)
        ref = batch.paged(split=split)
        got = batch.paged(split=split, new_kv=True)
        assert bits_equal(got, ref), "new K/V from the step's tensors changed bits"
        assert _check_against_dense(batch, got) == []
        assert bits_equal(got, batch.paged(split=split, new_kv=True, block_m=128)), "tile size changed bits"
        assert bits_equal(got, batch.paged(split=split, new_kv=True, max_seq_len=513, max_query_len=2)), "short hints"
    batch.k_new = batch.k_new * 2
    read = not bits_equal(batch.rows(batch.paged(split=split, new_kv=True), 0), batch.rows(ref, 0))
    assert read == (page < ta.KV_BLOCK_GPU), f"page {page}: k_new {'read' if read else 'not read'}"
    fp8 = Batch(seqs[:3], page, DTYPES[0], seed=9, fp8=True)
    ref8 = fp8.paged(split=split)
    fp8.k_new = fp8.k_new * 2
    assert bits_equal(fp8.paged(split=split, new_kv=True), ref8), "an FP8 cache must ignore k_new"


def test_paged_new_kv_refuses_bad_shapes():
    batch = Batch([(5, 3)], 16, DTYPES[0], seed=1)
    for bad in (batch.k_new[:2], batch.k_new.to(torch.float32), batch.k_new[:, :1]):
        with pytest.raises(ValueError, match="k_new / v_new must be"):
            tpa.paged_attention(batch.q_all, batch.k_cache, batch.v_cache, batch.table, batch.qsl, batch.seq_lens,
                                1.0, torch.empty_like(batch.q_all), 3, 8, k_new=bad, v_new=batch.v_new)
    with pytest.raises(ValueError, match="both k_new and v_new"):
        tpa.paged_attention(batch.q_all, batch.k_cache, batch.v_cache, batch.table, batch.qsl, batch.seq_lens,
                            1.0, torch.empty_like(batch.q_all), 3, 8, k_new=batch.k_new)


def test_paged_fp8_kv_equals_dense_dequantized():
    for page, split in [(16, True), (64, False)]:
        batch = Batch([(600, 1), (30, 9), (0, 33), (513, 1)], page, DTYPES[0], seed=7, fp8=True, pad_tokens=2)
        out = batch.paged(split=split)
        assert _check_against_dense(batch, out) == []
        assert bool((out[batch.t:] == 0).all())


def test_paged_padding_rows_and_empty_sequences_zero():
    """T beyond query_start_loc[-1] and sequences with q_len 0 (CUDA-graph padding): rows are written 0."""
    batch = Batch([(40, 1), (0, 5), (300, 1)], 16, DTYPES[0], seed=3, pad_tokens=9)
    qsl = batch.qsl.tolist()
    batch.qsl = torch.tensor(qsl + [qsl[-1], qsl[-1]], dtype=torch.int32, device=DEV)  # two empty sequences
    batch.seq_lens = torch.cat([batch.seq_lens, torch.tensor([0, 7], dtype=torch.int32, device=DEV)])
    batch.table = torch.cat([batch.table, batch.table[:2]])
    out = batch.paged(split=True, max_seq_len=512)
    for s in range(3):
        assert bits_equal(batch.rows(out, s), batch.dense(s))
    assert not bool(out.isnan().any()), "every row of out must be written"
    assert bool((out[batch.t:] == 0).all())
    empty = Batch([(0, 1)], 16, DTYPES[0], seed=4, pad_tokens=6)
    empty.qsl = torch.zeros(2, dtype=torch.int32, device=DEV)  # no real token at all
    assert bool((empty.paged() == 0).all())


def test_paged_refuses_unsupported_page_size():
    q = torch.zeros(1, HQ, D, dtype=DTYPES[0], device=DEV)
    cache = torch.zeros(2, 24, HKV, D, dtype=DTYPES[0], device=DEV)
    with pytest.raises(ValueError, match="page_size 24"):
        tpa.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                           torch.tensor([0, 1], dtype=torch.int32, device=DEV),
                           torch.tensor([1], dtype=torch.int32, device=DEV), 1.0, torch.empty_like(q), 1, 1)


# ------------------------------------------------------------------ write_kv_cache


@pytest.mark.parametrize("fp8", [False, True])
def test_write_kv_cache_round_trip(fp8):
    gen = torch.Generator().manual_seed(5)
    dtype, page, blocks = DTYPES[0], 16, 6
    kv = torch.zeros((2, blocks, page, HKV, D), dtype=torch.float32).to(DEV, torch.float8_e4m3fn if fp8 else dtype)
    kc, vc = kv[0], kv[1]
    before = kv.clone()
    n_tok = 12
    key = (_randn((n_tok + 3, HKV, D), gen, dtype) * 40)  # 3 extra rows beyond the slots: never written
    val = (_randn((n_tok + 3, HKV, D), gen, dtype) * 40)
    key[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -3000.0], dtype=dtype)  # saturation
    if fp8 and not ON_GPU:
        key, val = _e4m3_exact(key), _e4m3_exact(val)
    slots = torch.randperm(blocks * page, generator=gen)[:n_tok]
    slots[[2, 7]] = -1
    tpa.write_kv_cache(key, val, kc, vc, slots.to(DEV), kv_scale=KV_SCALE if fp8 else None)
    exp = before.clone()
    keep = slots >= 0
    pg, off = slots[keep] // page, slots[keep] % page
    enc = (lambda x: kv_quantize(x)) if fp8 else (lambda x: x)
    exp[0][pg.to(DEV), off.to(DEV)] = enc(key[:n_tok][keep.to(DEV)])
    exp[1][pg.to(DEV), off.to(DEV)] = enc(val[:n_tok][keep.to(DEV)])
    assert torch.equal(kv.view(torch.uint8), exp.view(torch.uint8))


CACHE_ELEMENTS_PAST_32_BITS = 1 << 32


@pytest.mark.parametrize("page", [16, 64])
def test_pages_past_32_bit_element_offsets(page):
    """A KV cache that fills a large GPU holds more than 2**31 elements a layer (a 1B Llama shape on an H200 at
    ``gpu_memory_utilization`` 0.9: about 3.7e9), so the pages a busy engine hands out late have element offsets that
    do not fit 32 bits.  The same sequences written (``write_kv_cache``) to the top block ids of caches of more than
    2**32 elements each must land on the same bytes as at low ids, and ``paged_attention`` over them (both paths,
    pages read per key and per block) must give the same rows.  On the CPU the caches are virtual memory: only their
    top pages are touched.  (Checked by hand in the interpreter: with the page ids left 32-bit in ``_load_kv`` /
    ``_walk`` every row differs -- the offsets wrap into the unwritten low part; a cache between 2**31 and 2**32
    elements wraps them negative and the process faults.)"""
    dtype = DTYPES[0]
    batch = Batch([(70, 5), (0, 30), (PART + 90, 1)], page, dtype, seed=11)
    low = {split: batch.paged(split) for split in (False, True)}
    blocks = batch.k_cache.shape[0]
    top = CACHE_ELEMENTS_PAST_32_BITS // batch.k_cache[0].numel() + 1  # the first block id past 2**32 elements
    k_big, v_big = (torch.empty((top + blocks, page, HKV, D), dtype=dtype, device=DEV) for _ in range(2))
    for big in (k_big, v_big):
        big[top:].copy_(_unwritten(big[top:].shape, dtype))  # as the small cache's unwritten slots
    keys, vals, slots = batch.written
    tpa.write_kv_cache(keys, vals, k_big, v_big, slots + top * page)
    assert bits_equal(k_big[top:], batch.k_cache) and bits_equal(v_big[top:], batch.v_cache), "write_kv_cache"
    batch.k_cache, batch.v_cache, batch.table = k_big, v_big, batch.table + top
    for split, rows in low.items():
        assert bits_equal(batch.paged(split), rows), f"split={split}: rows from pages past 2**32 elements differ"


# ------------------------------------------------------------------ the tests can fail


def test_batch_dependent_partition_is_caught(monkeypatch):
    """A deliberately broken kernel (partition size from the batch's longest sequence) must fail the checks above."""
    monkeypatch.setattr(ta, "_TEST_BATCH_DEPENDENT_PARTITION", True)
    dtype = DTYPES[0]
    batch = Batch([(600, 1), (0, 4), (1300, 1)], 16, dtype, seed=11)
    alone = Batch([(600, 1)], 16, dtype, seed=11, dense_kv=[batch.kv[0]])
    alone.q, alone.q_all = [batch.q[0]], batch.q[0]
    caught = not bits_equal(alone.paged(split=True), batch.rows(batch.paged(split=True), 0))
    caught_dense = _check_against_dense(batch, batch.paged(split=False)) != []
    assert caught and caught_dense, "a batch-dependent partition went unnoticed"
    monkeypatch.setattr(ta, "_TEST_BATCH_DEPENDENT_PARTITION", False)
    assert bits_equal(alone.paged(split=True), batch.rows(batch.paged(split=True), 0))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("split,pdl", [(False, False), (True, False), (True, True)])
def test_paged_cuda_graph_capture_and_replay(split, pdl, monkeypatch):
    """write_kv_cache + paged_attention captured in a CUDA graph (no host sync) and replayed with new
    query_start_loc / seq_lens / slot contents equal the eager calls bit for bit; ``pdl``: the split path's merge a
    programmatic dependent launch (``MC_ATTN_PDL``, Hopper) in the graph, checked against eager calls without it."""
    if pdl and not HOPPER:
        pytest.skip("programmatic dependent launch: Hopper (sm_90)")
    batch = Batch([(100, 1), (0, 8), (600, 3)], 16, DTYPES[0], seed=21, pad_tokens=4)
    t = batch.q_all.shape[0]
    gen = torch.Generator().manual_seed(22)
    key, val = _randn((t, HKV, D), gen, DTYPES[0]), _randn((t, HKV, D), gen, DTYPES[0])
    slots = torch.full((t,), -1, dtype=torch.int64, device=DEV)
    out = torch.empty_like(batch.q_all)

    def step():
        tpa.write_kv_cache(key, val, batch.k_cache, batch.v_cache, slots)
        tpa.paged_attention(batch.q_all, batch.k_cache, batch.v_cache, batch.table, batch.qsl, batch.seq_lens,
                           D ** -0.5, out, max_query_len=t, max_seq_len=2048, split=split)

    monkeypatch.setattr(ta, "SPLIT_PDL", pdl)
    step()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    monkeypatch.setattr(ta, "SPLIT_PDL", False)
    for qsl, lens in [([0, 1, 9, 12], [101, 8, 603]), ([0, 4, 5, 12], [60, 5, 603]), ([0, 0, 2, 3], [1, 8, 1])]:
        batch.qsl.copy_(torch.tensor(qsl, dtype=torch.int32))
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        got = out.clone()
        step()
        assert bits_equal(got, out), f"replay != eager for {qsl}, {lens}"
        assert bool((out[qsl[-1]:] == 0).all()) and not bool(out.isnan().any())
