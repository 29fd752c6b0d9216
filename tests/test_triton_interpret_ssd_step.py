"""The decode step's outputs read in place from the state cache (``kernels/triton/ssd_scan.py``'s
``ssd_step_outputs``: the outputs kernel with ``FROM_CACHE``) in Triton's interpreter (CPU tensors): the bits of the
torch reference (``kernels/ssd.py``'s ``_ssd_step_outputs_cpu``: the mixer's replay, then ``ssd_outputs_at``).

Runs only with ``TRITON_INTERPRET=1`` and Triton importable, like the other ``test_triton_interpret_*`` files.  The
caches hold NaN in every row at or past a sequence's pending count and in every slot no sequence uses, so an output
that let any of them in would be NaN.  The interpreter rounds float32 to bfloat16 by truncation where torch rounds to
nearest, so the bf16 cases compare the float32 outputs (``out_dtype=float32``) of bf16 caches; float32 caches compare
both.  Bitwise: ``torch.equal`` on int32 views.
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
from megatron_consistent.kernels import ssd, ssd_step_outputs
from megatron_consistent.kernels.triton import ssd_scan as tssd

NAN = float("nan")


def _case(seed, bsz, n_slots, L, nh, hp, ng, ns, dtype, pending, fresh=None):
    """Caches of ``n_slots`` slots (NaN everywhere no output may read), ``bsz`` distinct slots, the new tokens."""
    g = torch.Generator().manual_seed(seed)
    conv = nh * hp + 2 * ng * ns
    xbc_cache = torch.full((n_slots, L, conv), NAN, dtype=dtype)
    dt_cache = torch.full((n_slots, L, nh), NAN)
    state_cache = torch.full((n_slots, nh, hp, ns), NAN)
    slots = torch.randperm(n_slots, generator=g)[:bsz]
    pending = torch.tensor(pending, dtype=torch.int64)
    for i, (slot, p) in enumerate(zip(slots.tolist(), pending.tolist())):
        xbc_cache[slot, :p] = torch.randn(p, conv, generator=g).to(dtype)
        dt_cache[slot, :p] = torch.rand(p, nh, generator=g) * 0.5 + 0.01
        if fresh is None or not fresh[i]:
            state_cache[slot] = torch.randn(nh, hp, ns, generator=g) * 0.5
    new_xbc = torch.randn(bsz, conv, generator=g).to(dtype)
    new_dt = torch.rand(bsz, nh, generator=g) * 0.5 + 0.01
    A = -torch.rand(nh, generator=g) * 2 - 0.1
    D = torch.randn(nh, generator=g)
    fresh_t = None if fresh is None else torch.tensor(fresh)
    return dict(xbc_cache=xbc_cache, dt_cache=dt_cache, state_cache=state_cache, slots=slots, pending=pending,
                new_xbc=new_xbc, new_dt=new_dt, A=A, D=D, chunk_size=L, n_groups=ng, state_size=ns, fresh=fresh_t)


def _bits(y):
    return y.to(torch.float32).view(torch.int32)


def _check_equal(case, out_dtype):
    ref = ssd._ssd_step_outputs_cpu(**case, out_dtype=out_dtype)
    out = tssd.ssd_step_outputs(**case, out_dtype=out_dtype)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(ref).any()
    assert torch.equal(_bits(out), _bits(ref)), f"{(out != ref).sum().item()} of {out.numel()} outputs differ"


# (L, H, P, G, N): non-powers of two in every width, one group and several, a chunk of one row
SHAPES = [(8, 4, 4, 2, 8), (4, 4, 4, 1, 4), (6, 6, 5, 2, 7), (16, 8, 16, 2, 16), (5, 6, 12, 3, 10), (1, 4, 4, 2, 4)]


@pytest.mark.parametrize("width", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,nh,hp,ng,ns", SHAPES)
def test_step_outputs_equal_the_torch_replay(monkeypatch, L, nh, hp, ng, ns, dtype, width):
    """p = 0, 1, L - 1 and random, in one batch; a fresh row and a row reading a stored state; the kernel's trees whole
    or in slices of two rows / columns (``MC_SSD_TREE_WIDTH``)."""
    monkeypatch.setattr(tssd, "OUTPUTS_TREE_WIDTH", width)
    g = torch.Generator().manual_seed(L * 100 + ns)
    pending = sorted({0, min(1, L - 1), L - 1}) + torch.randint(0, L, (3,), generator=g).tolist()
    fresh = [i % 3 == 1 for i in range(len(pending))]
    case = _case(L + nh + hp, len(pending), len(pending) + 3, L, nh, hp, ng, ns, dtype, pending, fresh)
    _check_equal(case, torch.float32)
    if dtype == torch.float32:
        _check_equal(case, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_fresh_rows_and_the_public_function(dtype):
    """``fresh=None``: every state read from its slot; the public function (validation, then the cpu registration)
    gives the reference's bits, and the kernel the same."""
    case = _case(7, 5, 9, 8, 4, 4, 2, 8, dtype, [0, 3, 7, 1, 5])
    _check_equal(case, torch.float32)
    ref = ssd._ssd_step_outputs_cpu(**case)
    assert torch.equal(_bits(ssd_step_outputs(**case)), _bits(ref))
    assert ref.dtype == dtype


def test_is_the_scan_output_at_the_new_token():
    """The reference itself: the whole-sequence ``ssd_scan`` output of the chunk's row ``p`` (the cache holds the
    sequence's pending rows, the state cache its boundary state)."""
    L, nh, hp, ng, ns = 8, 4, 4, 2, 8
    case = _case(3, 3, 4, 8, nh, hp, ng, ns, torch.float32, [0, 4, 7], [False, False, False])
    x, dt, B, C, state = ssd.ssd_step_replay(**{k: v for k, v in case.items() if k not in ("A", "D")})
    y_scan, _ = ssd.ssd_scan(x, dt, case["A"], B, C, case["D"], L, state)
    out = tssd.ssd_step_outputs(**case)
    assert torch.equal(_bits(out), _bits(y_scan[torch.arange(3), case["pending"]]))


def test_strided_slots():
    """Caches whose slots lie apart (vLLM's pages: a slot stride past the slot's own size), read in place."""
    case = _case(11, 3, 5, 8, 4, 4, 2, 8, torch.bfloat16, [2, 7, 0], [False, True, False])
    for name in ("xbc_cache", "dt_cache", "state_cache"):
        v = case[name]
        padded = torch.full((v.shape[0], 2, *v.shape[1:]), NAN, dtype=v.dtype)
        padded[:, 0] = v
        case[name] = padded[:, 0]
        assert not case[name].is_contiguous()
    _check_equal(case, torch.float32)


def test_slots_past_32_bit_element_offsets():
    """A state cache that fills a large GPU puts late slots past 2**31 elements: the same sequences at slot ids whose
    element offsets pass 2**32 give the same outputs (checked by hand: slot ids kept 32-bit in the kernel -- int32
    slots, no 64-bit cast -- fail it)."""
    case = _case(13, 4, 6, 8, 4, 4, 2, 8, torch.bfloat16, [0, 3, 7, 5], [False, True, False, False])
    want = tssd.ssd_step_outputs(**case, out_dtype=torch.float32)
    got = tssd.ssd_step_outputs(**at_slots_past_32_bits(case), out_dtype=torch.float32)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("broken", ["row p from the cache", "state of the wrong slot", "fresh ignored"])
def test_a_broken_reader_is_caught(broken):
    """Plausible bugs of an in-place reader, each evaluated as the correct kernel on the values the buggy one would
    read: the outputs differ from the reference's (so the comparisons above can fail)."""
    case = _case(5, 4, 6, 8, 4, 4, 2, 8, torch.float32, [3, 6, 1, 5], [False, True, False, False])
    g = torch.Generator().manual_seed(9)
    xbc = case["xbc_cache"].clone()  # row p of each slot: last chunk's stale token (finite), which must not be read
    xbc[case["slots"], case["pending"]] = torch.randn(4, xbc.shape[2], generator=g)
    case["xbc_cache"] = xbc
    ref = ssd._ssd_step_outputs_cpu(**case)
    assert torch.equal(_bits(tssd.ssd_step_outputs(**case)), _bits(ref))
    if broken == "row p from the cache":
        out = tssd.ssd_step_outputs(**{**case, "new_xbc": xbc[case["slots"], case["pending"]]})
    elif broken == "state of the wrong slot":
        state = case["state_cache"].clone()
        state[case["slots"]] = case["state_cache"][case["slots"].roll(1)].nan_to_num()
        out = tssd.ssd_step_outputs(**{**case, "state_cache": state})
    else:
        state = case["state_cache"].clone()
        state[case["slots"][1]] = torch.randn(state.shape[1:], generator=g)
        assert torch.equal(_bits(tssd.ssd_step_outputs(**{**case, "state_cache": state})), _bits(ref))
        out = tssd.ssd_step_outputs(**{**case, "state_cache": state, "fresh": None})
    assert not torch.isnan(out).any()
    assert not torch.equal(_bits(out), _bits(ref)), broken


def test_validation_names_the_argument():
    case = _case(1, 2, 3, 4, 4, 4, 2, 4, torch.float32, [0, 3])
    with pytest.raises(ValueError, match="pending"):
        ssd_step_outputs(**{**case, "pending": case["pending"].to(torch.int32)})
    with pytest.raises(ValueError, match="state_cache"):
        ssd_step_outputs(**{**case, "state_cache": case["state_cache"][:, :, :2]})
    with pytest.raises(ValueError, match="new_xbc"):
        ssd_step_outputs(**{**case, "new_xbc": case["new_xbc"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="conv_dim"):
        ssd_step_outputs(**{**case, "n_groups": 3})
    with pytest.raises(ValueError, match="out_dtype"):
        ssd_step_outputs(**case, out_dtype=torch.bfloat16)
    strided = case["state_cache"].transpose(2, 3).contiguous().transpose(2, 3)  # a slot's [P, N] not dense
    with pytest.raises(ValueError, match="state_cache strides .* not contiguous within a slot"):
        tssd.ssd_step_outputs(**{**case, "state_cache": strided})


@pytest.mark.parametrize("graphed", [False, True])
def test_the_mixer_on_the_kernel_equals_the_whole_sequence(monkeypatch, graphed):
    """The vLLM mixer's decode steps on this kernel (registered for the CPU here, as it is for CUDA: the mixer then
    calls ``ssd_step_outputs`` instead of its torch replay), with ``MC_HYBRID_DECODE_GRAPHS`` off and on: closing, open
    and first tokens, NaN in every unwritten cache row -- bitwise the one-pass forward (a float32 model: see the docstring)."""
    from test_vllm_hybrid import _arch, _forward, _mixer, _run_schedule

    from megatron_consistent.kernels import dispatch
    from megatron_consistent.vllm_plugin import mamba as mod

    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("ssd_step_outputs", "cpu"), tssd.ssd_step_outputs)
    monkeypatch.setattr(mod, "DECODE_GRAPHS", graphed)
    calls = []
    real = tssd.ssd_step_outputs
    monkeypatch.setattr(mod, "ssd_step_outputs", lambda *a, **k: calls.append(1) or ssd_step_outputs(*a, **k))
    arch = dataclasses.replace(_arch(chunk=4), dtype="float32")
    assert arch.torch_dtype == torch.float32
    mixer = _mixer(arch, slots=5, seed=5)
    g = torch.Generator().manual_seed(6)
    hidden = [torch.randn(n, arch.hidden_size, generator=g) for n in (9, 7, 3)]
    whole = [_forward(monkeypatch, mixer, None, h) for h in hidden]
    steps = [[(0, 0, 3), (1, 0, 2)],
             [(0, 3, 1), (1, 2, 1), (2, 0, 1)],  # closes its chunk, leaves it open, a first token
             [(0, 4, 1), (1, 3, 1), (2, 1, 1)],  # after the closure; the second closes now
             [(0, 5, 1), (1, 4, 1), (2, 2, 1)],
             [(0, 6, 1), (1, 5, 1)], [(0, 7, 1), (1, 6, 1)], [(0, 8, 1)]]
    got = _run_schedule(monkeypatch, mixer, hidden, steps, [3, 0, 4])
    assert len(calls) == len(steps) - 1 and real is tssd.ssd_step_outputs
    for w, o in zip(whole, got):
        assert torch.equal(w.view(torch.int32), o.view(torch.int32))
