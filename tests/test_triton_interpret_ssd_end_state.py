"""A decode step's new boundary states formed in place in the state cache (``kernels/triton/ssd_scan.py``'s
``ssd_step_end_states``: the contributions kernel with ``FROM_CACHE``) in Triton's interpreter (CPU tensors): the bits
of the torch reference (``kernels/ssd.py``'s ``_ssd_step_end_states_cpu``: the rows' chunks and states gathered,
``ssd_chunk_end_state``, a masked write), over the WHOLE state cache.

Runs only with ``TRITON_INTERPRET=1`` and Triton importable, like the other ``test_triton_interpret_*`` files.  The
caches hold NaN wherever no state may read: the chunks of non-closing rows past their pending count, the states of
fresh rows, every slot no row uses (and the states of non-closing, non-fresh rows, which must keep their exact bits).
Bitwise: ``torch.equal`` on int32 views (NaN payloads included).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = [pytest.mark.slow,  # Triton's interpreter on the CPU
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")]
pytest.importorskip("triton")

from _ssd_caches import at_slots_past_32_bits
from megatron_consistent.kernels import numerics, ssd, ssd_chunk_end_state, ssd_step_end_states
from megatron_consistent.kernels.triton import ssd_scan as tssd

NAN = float("nan")


def _case(seed, n_slots, L, nh, hp, ng, ns, dtype, rows, nan_kept=True):
    """``rows`` = [(closing, fresh)] each: caches of ``n_slots`` slots, NaN everywhere no state may read; a closing
    row's slot holds its whole chunk, a non-closing row's rows ``< p`` (``p`` random ``< L - 1``); the state of a
    non-fresh row is finite (``nan_kept``: a non-closing, non-fresh row's state is NaN, which must stay)."""
    g = torch.Generator().manual_seed(seed)
    conv = nh * hp + 2 * ng * ns
    bsz = len(rows)
    xbc_cache = torch.full((n_slots, L, conv), NAN, dtype=dtype)
    dt_cache = torch.full((n_slots, L, nh), NAN)
    state_cache = torch.full((n_slots, nh, hp, ns), NAN)
    slots = torch.randperm(n_slots, generator=g)[:bsz]
    for slot, (closing, fresh) in zip(slots.tolist(), rows):
        p = L if closing else int(torch.randint(0, max(L - 1, 1), (1,), generator=g))
        xbc_cache[slot, :p] = torch.randn(p, conv, generator=g).to(dtype)
        dt_cache[slot, :p] = torch.rand(p, nh, generator=g) * 0.5 + 0.01
        if not fresh and (closing or not nan_kept):
            state_cache[slot] = torch.randn(nh, hp, ns, generator=g) * 0.5
    A = -torch.rand(nh, generator=g) * 2 - 0.1
    return dict(xbc_cache=xbc_cache, dt_cache=dt_cache, state_cache=state_cache, slots=slots,
                closing=torch.tensor([c for c, _ in rows], dtype=torch.bool),
                fresh=torch.tensor([f for _, f in rows], dtype=torch.bool), A=A, chunk_size=L, n_groups=ng,
                state_size=ns)


def _bits(v):
    return v.view(torch.int32)


def _run(fn, case, **over):
    """``fn`` on a copy of the case's state cache; returns it."""
    c = dict(case, **over)
    c["state_cache"] = c["state_cache"].clone()
    fn(**c)
    return c["state_cache"]


def _check_equal(case):
    ref = _run(ssd._ssd_step_end_states_cpu, case)
    out = _run(tssd.ssd_step_end_states, case)
    touched = case["slots"][case["closing"] | (case["fresh"] if case["fresh"] is not None else False)]
    assert not torch.isnan(ref[touched]).any()
    others = torch.ones(ref.shape[0], dtype=torch.bool)
    others[touched] = False
    assert torch.equal(_bits(ref[others]), _bits(case["state_cache"][others]))  # the reference leaves them alone
    assert torch.equal(_bits(out), _bits(ref)), f"{(_bits(out) != _bits(ref)).sum().item()} of {out.numel()} differ"
    return ref


# (L, H, P, G, N): non-powers of two in every width, one group and several, a chunk of one row, P and N past one block
SHAPES = [(8, 4, 4, 2, 8), (4, 4, 4, 1, 4), (6, 6, 5, 2, 7), (16, 8, 16, 2, 16), (5, 6, 12, 3, 10), (1, 4, 4, 2, 4),
          (4, 2, 20, 1, 520)]
ROWS = [(True, False), (True, True), (False, True), (False, False), (True, False), (False, False), (False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,nh,hp,ng,ns", SHAPES)
def test_end_states_equal_the_torch_reference(L, nh, hp, ng, ns, dtype):
    """Closing, fresh, both and neither rows in one batch, the whole state cache compared (the chunk terms' tree over
    the chunk's rows leaf by leaf)."""
    rows = [(c or L == 1, f) for c, f in ROWS]  # a chunk of one row: every token closes it
    case = _case(L * 10 + ns, len(rows) + 3, L, nh, hp, ng, ns, dtype, rows)
    _check_equal(case)


@pytest.mark.parametrize("columns", [1, 4])
def test_end_states_in_other_tiles_keep_the_bits(monkeypatch, columns):
    """``MC_SSD_TERMS_BN``: a program's state columns change no new state (state size 7: 7 programs a row's head, or
    2, the last one past the state's columns)."""
    monkeypatch.setattr(tssd, "TERMS_BN", columns)
    case = _case(columns, len(ROWS) + 3, 6, 6, 5, 2, 7, torch.bfloat16, ROWS)
    _check_equal(case)


@pytest.mark.parametrize("chunk,leaves", [(6, 2), (16, 4), (32, 8)])
def test_end_states_with_the_tree_in_a_loop_keep_the_bits(monkeypatch, chunk, leaves):
    """``MC_SSD_TERMS_LEAVES``: the chunk-terms tree's runtime loop over residue classes (the leaves read in place
    from the xbc cache, the state updated in place) changes no new state."""
    monkeypatch.setattr(tssd, "TERMS_LEAVES", leaves)
    case = _case(chunk + leaves, len(ROWS) + 3, chunk, 6, 5, 2, 7, torch.bfloat16, ROWS)
    _check_equal(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_fresh_and_the_public_function(dtype):
    """``fresh=None``; the public function (validation, then the cpu registration) and the kernel agree."""
    case = _case(7, 9, 8, 4, 4, 2, 8, dtype, [(True, False), (False, False), (True, False), (False, False)])
    case["fresh"] = None
    ref = _check_equal(case)
    assert torch.equal(_bits(_run(ssd_step_end_states, case)), _bits(ref))


def test_no_closing_row_and_an_empty_batch():
    case = _case(8, 6, 8, 4, 4, 2, 8, torch.bfloat16, [(False, True), (False, False), (False, True)])
    _check_equal(case)
    empty = dict(case, slots=case["slots"][:0], closing=case["closing"][:0], fresh=case["fresh"][:0])
    assert torch.equal(_bits(_run(tssd.ssd_step_end_states, empty)), _bits(case["state_cache"]))


def test_is_the_chunk_end_state_of_the_cached_chunk():
    """The reference itself: a closing row's slot gets ``ssd_chunk_end_state`` (and so ``ssd_scan``'s boundary
    state) of its cached chunk from its state (zeros if fresh)."""
    L, nh, hp, ng, ns = 8, 4, 4, 2, 8
    case = _case(3, 5, L, nh, hp, ng, ns, torch.float32, [(True, False), (True, True)])
    out = _run(tssd.ssd_step_end_states, case)
    for i, slot in enumerate(case["slots"].tolist()):
        x, B, C = case["xbc_cache"][slot].split([nh * hp, ng * ns, ng * ns], dim=-1)
        state = torch.zeros(nh, hp, ns) if i == 1 else case["state_cache"][slot]
        args = (x.reshape(1, L, nh, hp), case["dt_cache"][slot][None], case["A"], B.reshape(1, L, ng, ns),
                C.reshape(1, L, ng, ns))
        want = ssd_chunk_end_state(*args, L, state[None])[0]
        assert torch.equal(_bits(out[slot]), _bits(want))
        _, scan_state = ssd.ssd_scan(*args, torch.zeros(nh), L, state[None])
        assert torch.equal(_bits(out[slot]), _bits(scan_state[0]))


def test_strided_slots():
    """Caches whose slots lie apart (vLLM's pages: a slot stride past the slot's own size), read and written in
    place; the padding between slots keeps its bits."""
    case = _case(11, 6, 8, 4, 4, 2, 8, torch.bfloat16, ROWS[:4])
    ref = _run(ssd._ssd_step_end_states_cpu, case)
    padded = {}
    for name in ("xbc_cache", "dt_cache", "state_cache"):
        v = case[name]
        padded[name] = torch.full((v.shape[0], 2, *v.shape[1:]), NAN, dtype=v.dtype)
        padded[name][:, 0] = v
        case[name] = padded[name][:, 0]
        assert not case[name].is_contiguous()
    before = padded["state_cache"].clone()
    tssd.ssd_step_end_states(**case)
    assert torch.equal(_bits(padded["state_cache"][:, 0]), _bits(ref))
    assert torch.equal(_bits(padded["state_cache"][:, 1]), _bits(before[:, 1]))


def test_slots_past_32_bit_element_offsets():
    """The closing rows' new states written in place at slot ids whose element offsets pass 2**32 (a state cache
    that fills a large GPU): the same states as at low ids (checked by hand: slot ids kept 32-bit in the kernel --
    int32 slots, no 64-bit cast -- fail it)."""
    case = _case(13, 6, 8, 4, 4, 2, 8, torch.bfloat16, ROWS[:4])
    want = _run(tssd.ssd_step_end_states, case)
    big = at_slots_past_32_bits(case)
    tssd.ssd_step_end_states(**big)
    assert torch.equal(_bits(big["state_cache"][big["slots"]]), _bits(want[case["slots"]]))


def test_padding_rows_on_the_null_block():
    """Rows vLLM pads a captured batch with share slot 0 (closing: ``p = (0 - 1) % L``): the real rows' slots get
    the bits they get without them."""
    case = _case(12, 7, 4, 4, 4, 2, 4, torch.float32, ROWS[:4])
    case["slots"] = case["slots"] % 6 + 1  # slot 0 free
    ref = _run(tssd.ssd_step_end_states, case)
    pads = 3
    padded = dict(case, slots=torch.cat([case["slots"], torch.zeros(pads, dtype=case["slots"].dtype)]),
                  closing=torch.cat([case["closing"], torch.ones(pads, dtype=torch.bool)]),
                  fresh=torch.cat([case["fresh"], torch.zeros(pads, dtype=torch.bool)]))
    out = _run(tssd.ssd_step_end_states, padded)
    assert torch.equal(_bits(out[1:]), _bits(ref[1:]))


@pytest.mark.parametrize("broken", ["decay after the add", "state of the wrong slot", "fresh ignored",
                                    "closing ignored", "a row of the chunk dropped"])
def test_a_broken_update_is_caught(broken):
    """Plausible bugs of an in-place update, each evaluated on the values the buggy one would read (or, for the
    order of the recurrence, from the kernel's own pieces): the states differ from the reference's (so the
    comparisons above can fail)."""
    rows = [(True, False), (True, False), (False, True), (False, False), (True, True)]
    case = _case(5, 7, 8, 4, 4, 2, 8, torch.float32, rows, nan_kept=False)
    g = torch.Generator().manual_seed(9)
    slots = case["slots"]
    state = case["state_cache"].clone()
    state[slots[[2, 4]]] = torch.randn(2, *state.shape[1:], generator=g)  # fresh rows' stale states (finite)
    xbc, dt = case["xbc_cache"].clone(), case["dt_cache"].clone()
    xbc[slots[2:4]] = torch.randn(2, *xbc.shape[1:], generator=g)  # non-closing rows' stale rows (finite)
    dt[slots[2:4]] = torch.rand(2, *dt.shape[1:], generator=g) * 0.5 + 0.01
    case.update(state_cache=state, xbc_cache=xbc, dt_cache=dt)
    ref = _check_equal(case)
    if broken == "decay after the add":  # decay * (S + contrib), from the kernel's contrib (its end state from zeros)
        contrib = _run(tssd.ssd_step_end_states, case, fresh=torch.ones_like(case["fresh"]))
        cum = ssd._chunk_prefix_sums(dt[slots][:, None], case["A"])[:, 0, -1]  # [b, H]
        decay = numerics.exp(cum)[:, :, None, None]
        out = ref.clone()
        start = torch.where(case["fresh"][:, None, None, None], 0.0, state[slots])
        out[slots] = torch.where(case["closing"][:, None, None, None], decay * (start + contrib[slots]), ref[slots])
    elif broken == "state of the wrong slot":
        wrong = state.clone()
        wrong[slots] = state[slots.roll(1)]
        out = _run(tssd.ssd_step_end_states, case, state_cache=wrong)
    elif broken == "fresh ignored":
        out = _run(tssd.ssd_step_end_states, case, fresh=None)
    elif broken == "closing ignored":
        out = _run(tssd.ssd_step_end_states, case, closing=torch.ones_like(case["closing"]))
    else:
        short = xbc.clone()
        short[slots, -1] = 0
        out = _run(tssd.ssd_step_end_states, case, xbc_cache=short)
    assert not torch.isnan(out[slots]).any()
    assert not torch.equal(_bits(out), _bits(ref)), broken


def test_validation_names_the_argument():
    case = _case(1, 4, 4, 4, 4, 2, 4, torch.float32, [(True, False), (False, True)])
    for name, bad in (("closing", case["closing"].to(torch.int64)), ("fresh", case["fresh"][:1]),
                      ("state_cache", case["state_cache"][:, :, :2]), ("dt_cache", case["dt_cache"].double()),
                      ("slots", case["slots"].float()), ("A", case["A"][:2])):
        with pytest.raises(ValueError, match=name):
            ssd_step_end_states(**{**case, name: bad})
    with pytest.raises(ValueError, match="conv_dim"):
        ssd_step_end_states(**{**case, "n_groups": 3})
    with pytest.raises(ValueError, match="xbc_cache"):
        ssd_step_end_states(**{**case, "chunk_size": 5})
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_step_end_states(**{**case, "chunk_size": 0})
    strided = case["xbc_cache"].transpose(1, 2).contiguous().transpose(1, 2)  # a slot's [L, conv_dim] not dense
    with pytest.raises(ValueError, match="xbc_cache strides .* not contiguous within a slot"):
        tssd.ssd_step_end_states(**{**case, "xbc_cache": strided})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_graphed_mixer_on_the_kernels_equals_the_whole_sequence(monkeypatch, dtype):
    """The vLLM mixer's decode steps (``MC_HYBRID_DECODE_GRAPHS=1``: as a full CUDA graph runs them) on both in-place
    kernels (registered for the CPU here, as they are for CUDA): closing, open and first tokens, NaN in every
    unwritten cache row -- bitwise the one-pass forward."""
    from test_vllm_hybrid import _arch, _forward, _mixer, _run_schedule

    from megatron_consistent.kernels import dispatch
    from megatron_consistent.vllm_plugin import mamba as mod

    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("ssd_step_end_states", "cpu"), tssd.ssd_step_end_states)
    monkeypatch.setattr(mod, "DECODE_GRAPHS", True)
    if dtype == "float32":  # the outputs kernel too (its bf16 rounding differs in the interpreter: see its test)
        monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("ssd_step_outputs", "cpu"), tssd.ssd_step_outputs)
    calls = []
    monkeypatch.setattr(mod, "ssd_step_end_states", lambda *a, **k: calls.append(1) or ssd_step_end_states(*a, **k))
    arch = dataclasses.replace(_arch(chunk=4), dtype=dtype)
    mixer = _mixer(arch, slots=5, seed=5)
    g = torch.Generator().manual_seed(6)
    hidden = [torch.randn(n, arch.hidden_size, generator=g).to(arch.torch_dtype) for n in (10, 7, 3)]
    whole = [_forward(monkeypatch, mixer, None, h) for h in hidden]
    steps = [[(0, 0, 3), (1, 0, 2)],
             [(0, 3, 1), (1, 2, 1), (2, 0, 1)],  # closes its chunk, leaves it open, a first token
             [(0, 4, 1), (1, 3, 1), (2, 1, 1)],  # after the closure; the second closes now
             [(0, 5, 1), (1, 4, 1), (2, 2, 1)],
             [(0, 6, 1), (1, 5, 1)], [(0, 7, 1), (1, 6, 1)], [(0, 8, 1)], [(0, 9, 1)]]
    got = _run_schedule(monkeypatch, mixer, hidden, steps, [3, 0, 4])
    assert len(calls) == sum(any(k == 1 and c > 0 for _, c, k in st) for st in steps) == 7  # the steps with decodes
    for w, o in zip(whole, got):
        assert torch.equal(w.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                           o.view(torch.int16 if dtype == "bfloat16" else torch.int32))
