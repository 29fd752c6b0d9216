"""A decode step's new boundary states formed in place in the state cache on the GPU (``ssd_step_end_states``: the
CUDA registration, ``kernels/triton/ssd_scan.py``) vs the torch reference on the same GPU (``kernels/ssd.py``'s
``_ssd_step_end_states_cpu``: the rows' chunks and states gathered, ``ssd_chunk_end_state``, a masked write), bitwise
over the whole state cache, at Nemotron-H 8B's widths (128 heads x 64, 8 groups, state 128, chunk 128) with 64
sequences: closing, fresh, both and neither rows; the caches hold NaN wherever no state may read, and the slots left
alone must keep their exact bits.  Also captured in a CUDA graph and replayed (no host synchronisation).

Skipped without CUDA.  Inputs are drawn on the CPU (seeded generators) and copied to the GPU.
"""

from __future__ import annotations

import pytest
import torch

from _ssd_caches import NAN, nan_filled_chunks
from megatron_consistent.kernels import dispatch, ssd, ssd_step_end_states

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the CUDA registration of ssd_step_end_states (kernels/triton/ssd_scan.py)")]

# Nemotron-H 8B: (L, H, P, G, N)
NEMOTRON_H_8B = (128, 128, 64, 8, 128)


def _case(seed, bsz, n_slots, L, nh, hp, ng, ns, dtype, device):
    """Caches of ``n_slots`` slots; row ``i`` closing where ``i % 4 in (0, 1)``, fresh where ``i % 4 in (1, 2)``
    (so closing, both, fresh, neither); a closing row's slot holds its whole chunk, the others rows ``< p`` (random
    ``p < L - 1``; NaN after); fresh and non-closing non-fresh rows' states NaN (read by no state, kept)."""
    g = torch.Generator().manual_seed(seed)
    conv = nh * hp + 2 * ng * ns
    closing = torch.arange(bsz) % 4 < 2
    fresh = (torch.arange(bsz) % 4 == 1) | (torch.arange(bsz) % 4 == 2)
    pending = torch.where(closing, L, torch.randint(0, L - 1, (bsz,), generator=g))
    slots = torch.randperm(n_slots, generator=g)[:bsz]
    xbc_cache, dt_cache = nan_filled_chunks(g, n_slots, slots, pending, L, conv, nh, dtype, 0.1, 0.001)
    state_cache = torch.full((n_slots, nh, hp, ns), NAN)
    state_cache[slots] = torch.where((closing & ~fresh)[:, None, None, None], torch.randn(bsz, nh, hp, ns, generator=g),
                                     NAN)
    case = dict(xbc_cache=xbc_cache, dt_cache=dt_cache, state_cache=state_cache, slots=slots, closing=closing,
                fresh=fresh, A=-torch.rand(nh, generator=g) * 2 - 0.1)
    case = {k: v.to(device) for k, v in case.items()}
    return dict(case, chunk_size=L, n_groups=ng, state_size=ns)


def _run(fn, case, **over):
    c = dict(case, **over)
    c["state_cache"] = c["state_cache"].clone()
    fn(**c)
    return c["state_cache"]


def _assert_same(out, ref, case):
    touched = case["slots"][case["closing"] | (case["fresh"] if case["fresh"] is not None else False)]
    assert not torch.isnan(ref[touched]).any()
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), \
        f"{(out.view(torch.int32) != ref.view(torch.int32)).sum().item()} of {out.numel()} differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_end_states_equal_the_torch_reference_at_nemotron_h_8b_widths(dtype):
    case = _case(1, 64, 80, *NEMOTRON_H_8B, dtype, "cuda")
    assert dispatch.implementation("ssd_step_end_states", torch.device("cuda")) is not ssd._ssd_step_end_states_cpu
    out = _run(ssd_step_end_states, case)  # the CUDA registration
    ref = _run(ssd._ssd_step_end_states_cpu, case)
    _assert_same(out, ref, case)
    untouched = torch.ones(80, dtype=torch.bool, device="cuda")
    untouched[case["slots"][case["closing"] | case["fresh"]]] = False
    assert torch.equal(out[untouched].view(torch.int32), case["state_cache"][untouched].view(torch.int32))
    no_fresh = dict(case, fresh=None, state_cache=case["state_cache"].nan_to_num())
    _assert_same(_run(ssd_step_end_states, no_fresh), _run(ssd._ssd_step_end_states_cpu, no_fresh), no_fresh)


def test_end_states_equal_the_torch_evaluation_of_the_contract(monkeypatch):
    """The reference with the scan's torch steps (``MC_SSD_SCAN=torch``'s evaluation, not the Triton contributions
    kernel) on the GPU: the same bits."""
    case = _case(2, 8, 12, *NEMOTRON_H_8B, torch.bfloat16, "cuda")
    out = _run(ssd_step_end_states, case)
    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("ssd_steps", "cuda"), ssd.TORCH_STEPS)
    _assert_same(out, _run(ssd._ssd_step_end_states_cpu, case), case)


def test_end_states_small_widths_and_strided_slots():
    """Widths that are not powers of two and caches whose slots lie apart (vLLM's pages); the padding between
    slots keeps its bits."""
    case = _case(3, 8, 11, 6, 6, 5, 2, 7, torch.bfloat16, "cuda")
    ref = _run(ssd._ssd_step_end_states_cpu, case)
    padded = {}
    for name in ("xbc_cache", "dt_cache", "state_cache"):
        v = case[name]
        padded[name] = torch.full((v.shape[0], 2, *v.shape[1:]), NAN, dtype=v.dtype, device=v.device)
        padded[name][:, 0] = v
        case[name] = padded[name][:, 0]
    ssd_step_end_states(**case)
    _assert_same(padded["state_cache"][:, 0], ref, case)
    assert torch.isnan(padded["state_cache"][:, 1]).all()


def test_end_states_replay_as_a_cuda_graph():
    """Captured once, replayed on new closing / fresh flags, chunks and states written into the captured inputs:
    the eager bits."""
    case = _case(4, 64, 80, *NEMOTRON_H_8B, torch.bfloat16, "cuda")
    ssd_step_end_states(**_dict_copy(case))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ssd_step_end_states(**case)
    nxt = _case(5, 64, 80, *NEMOTRON_H_8B, torch.bfloat16, "cuda")
    for k in ("xbc_cache", "dt_cache", "state_cache", "slots", "closing", "fresh", "A"):
        case[k].copy_(nxt[k])
    ref = _run(ssd._ssd_step_end_states_cpu, nxt)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(case["state_cache"], ref, nxt)


def _dict_copy(case):
    return dict(case, state_cache=case["state_cache"].clone())
