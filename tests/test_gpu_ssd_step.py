"""The decode step's outputs read in place from the state cache on the GPU (``ssd_step_outputs``: the CUDA
registration, ``kernels/triton/ssd_scan.py``) vs the torch reference on the same GPU (``kernels/ssd.py``'s
``_ssd_step_outputs_cpu``: the mixer's replay built with torch, then ``ssd_outputs_at``), bitwise, at Nemotron-H 8B's
widths (128 heads x 64, 8 groups, state 128, chunk 128) with 64 sequences at ragged pending counts; the caches hold NaN
in every row no output may read.  Also captured in a CUDA graph and replayed (no host synchronisation).

Skipped without CUDA.  Inputs are drawn on the CPU (seeded generators) and copied to the GPU.
"""

from __future__ import annotations

import pytest
import torch

from _ssd_caches import NAN, nan_filled_chunks
from megatron_consistent.kernels import dispatch, ssd, ssd_step_outputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the CUDA registration of ssd_step_outputs (kernels/triton/ssd_scan.py)")]

# Nemotron-H 8B: (L, H, P, G, N)
NEMOTRON_H_8B = (128, 128, 64, 8, 128)


def _case(seed, bsz, n_slots, L, nh, hp, ng, ns, dtype, device, fresh_every=5):
    """Caches of ``n_slots`` slots (NaN wherever no output may read), ``bsz`` distinct slots at ragged pending counts
    (0, 1, L - 1 and random), every ``fresh_every``-th row fresh."""
    g = torch.Generator().manual_seed(seed)
    conv = nh * hp + 2 * ng * ns
    pending = torch.randint(0, L, (bsz,), generator=g)
    pending[:3] = torch.tensor([0, 1, L - 1])
    fresh = torch.arange(bsz) % fresh_every == 2
    slots = torch.randperm(n_slots, generator=g)[:bsz]
    xbc_cache, dt_cache = nan_filled_chunks(g, n_slots, slots, pending, L, conv, nh, dtype, 0.5, 0.01)
    state_cache = torch.full((n_slots, nh, hp, ns), NAN)
    state_cache[slots] = torch.where(fresh[:, None, None, None], NAN, torch.randn(bsz, nh, hp, ns, generator=g) * 0.5)
    case = dict(xbc_cache=xbc_cache, dt_cache=dt_cache, state_cache=state_cache, slots=slots, pending=pending,
                new_xbc=torch.randn(bsz, conv, generator=g).to(dtype), new_dt=torch.rand(bsz, nh, generator=g) * 0.5 + 0.01,
                A=-torch.rand(nh, generator=g) * 2 - 0.1, D=torch.randn(nh, generator=g), fresh=fresh)
    case = {k: v.to(device) for k, v in case.items()}
    return dict(case, chunk_size=L, n_groups=ng, state_size=ns)


def _bits(y):
    return y.to(torch.float32).view(torch.int32)


def _assert_same(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(ref).any()
    assert torch.equal(_bits(out), _bits(ref)), f"{(_bits(out) != _bits(ref)).sum().item()} of {out.numel()} differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_step_outputs_equal_the_torch_replay_at_nemotron_h_8b_widths(dtype):
    case = _case(1, 64, 80, *NEMOTRON_H_8B, dtype, "cuda")
    out = ssd_step_outputs(**case)  # the CUDA registration
    assert dispatch.implementation("ssd_step_outputs", torch.device("cuda")) is not ssd._ssd_step_outputs_cpu
    _assert_same(out, ssd._ssd_step_outputs_cpu(**case))
    _assert_same(ssd_step_outputs(**case, out_dtype=torch.float32),
                 ssd._ssd_step_outputs_cpu(**case, out_dtype=torch.float32))
    no_fresh = dict(case, fresh=None, state_cache=case["state_cache"].nan_to_num())
    _assert_same(ssd_step_outputs(**no_fresh), ssd._ssd_step_outputs_cpu(**no_fresh))


def test_step_outputs_equal_the_torch_evaluation_of_the_contract(monkeypatch):
    """The reference with the scan's torch steps (``MC_SSD_SCAN=torch``'s evaluation, not the Triton outputs
    kernel) on the GPU: the same bits."""
    case = _case(2, 64, 70, *NEMOTRON_H_8B, torch.bfloat16, "cuda")
    out = ssd_step_outputs(**case)
    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("ssd_steps", "cuda"), ssd.TORCH_STEPS)
    _assert_same(out, ssd._ssd_step_outputs_cpu(**case))


def test_step_outputs_small_widths_and_strided_slots():
    """Widths that are not powers of two and caches whose slots lie apart (vLLM's pages)."""
    case = _case(3, 6, 9, 6, 6, 5, 2, 7, torch.bfloat16, "cuda", fresh_every=3)
    for name in ("xbc_cache", "dt_cache", "state_cache"):
        v = case[name]
        padded = torch.full((v.shape[0], 2, *v.shape[1:]), NAN, dtype=v.dtype, device=v.device)
        padded[:, 0] = v
        case[name] = padded[:, 0]
    _assert_same(ssd_step_outputs(**case), ssd._ssd_step_outputs_cpu(**case))


def test_step_outputs_replay_as_a_cuda_graph():
    """Captured once, replayed on new tokens and pending counts written into the captured inputs: the eager bits."""
    case = _case(4, 64, 80, *NEMOTRON_H_8B, torch.bfloat16, "cuda")
    ssd_step_outputs(**case)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ssd_step_outputs(**case)
    nxt = _case(5, 64, 80, *NEMOTRON_H_8B, torch.bfloat16, "cpu")
    pending = torch.minimum(nxt["pending"], case["pending"].cpu())  # rows the caches hold
    for k, v in (("new_xbc", nxt["new_xbc"]), ("new_dt", nxt["new_dt"]), ("pending", pending)):
        case[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(y, ssd._ssd_step_outputs_cpu(**case))
