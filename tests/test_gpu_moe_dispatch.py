"""Megatron's MoELayer on the GPU: the all-to-all and all-gather token dispatchers give identical values.

Runs only where CUDA is present (the H200 via the device tool; megatron-core 0.19.2 there, 0.16.1 works
too).  Megatron's all-to-all dispatcher cannot be built on a CPU-only machine (it creates a
``torch.cuda.Stream``), so the CPU suite covers the all-gather dispatcher only
(tests/test_moe_megatron_layer.py).  Here, for the three built-in MoE configs, with the same weights:
Megatron MoELayer + all-to-all == Megatron MoELayer + all-gather == ConsistentMoELayer (torch.equal
logits, equal routes), and a row alone == the row in a batch with the all-to-all dispatcher.
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.config import builtin_model_dir
from megatron_consistent.layers import build_consistent_gpt_model
from megatron_consistent.layers.model import _positions
from megatron_consistent.layers.moe import collect_routes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: Megatron's all-to-all token dispatcher creates a torch.cuda.Stream "
                                       "(the CPU suite tests the all-gather dispatcher: tests/test_moe_megatron_layer.py)")]

CONFIGS = ["tiny-qwen3moe-top1", "tiny-mixtral-top2", "tiny-qwen2moe-top8-shared"]


@pytest.fixture(autouse=True)
def _route_on_cuda(monkeypatch):
    """kernels/moe.py registers its router for "cpu" only.  Its body is device-agnostic torch code (float64
    exp with one rounding, fixed pairwise tree sums, stable sort), so for this comparison — all three paths
    run the same route — it is registered for "cuda" for the duration of the test when nothing else is."""
    from megatron_consistent.kernels import dispatch
    from megatron_consistent.kernels import moe as kmoe

    try:
        dispatch.implementation("moe_route", torch.device("cuda"))
    except dispatch.NoConsistentKernelError:
        monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("moe_route", "cuda"), kmoe._route_cpu)


def _build(name, impl, dispatcher="allgather", state=None):
    kw = {"moe_token_dispatcher": dispatcher} if impl == "megatron" else {}
    m = build_consistent_gpt_model(builtin_model_dir(name), seed=0, moe_impl=impl, **kw)
    if state is not None:
        m.load_state_dict(state)
    return m.cuda()


def _logits(model, ids):
    return model(ids, _positions(ids), None)


@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_alltoall_equals_allgather_equals_module(name):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

    module = build_consistent_gpt_model(builtin_model_dir(name), seed=1, moe_impl="module")
    state = module.state_dict()
    module = module.cuda()
    ag, a2a = _build(name, "megatron", "allgather", state), _build(name, "megatron", "alltoall", state)
    for model, cls in ((ag, MoEAllGatherTokenDispatcher), (a2a, MoEAlltoAllTokenDispatcher)):
        moe = [layer.mlp for layer in model.decoder.layers if type(layer.mlp) is MoELayer]
        assert moe and all(type(m.token_dispatcher) is cls for m in moe)
    ids = torch.randint(3, module.arch_config.vocab_size, (4, 37), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        lm, rm = _logits(module, ids), collect_routes(module)
        lg, rg = _logits(ag, ids), collect_routes(ag)
        la, ra = _logits(a2a, ids), collect_routes(a2a)
    assert torch.equal(la, lg), f"all-to-all vs all-gather: max |diff| {(la - lg).abs().max().item():.3e}"
    assert torch.equal(lg, lm), f"all-gather vs ConsistentMoELayer: max |diff| {(lg - lm).abs().max().item():.3e}"
    assert sorted(ra) == sorted(rg) == sorted(rm)
    assert all(torch.equal(ra[i], rg[i]) and torch.equal(rg[i], rm[i]) for i in ra)


def test_gpu_alltoall_row_alone_equals_row_in_batch():
    a2a = _build("tiny-mixtral-top2", "megatron", "alltoall")
    ids = torch.randint(3, a2a.arch_config.vocab_size, (5, 41), generator=torch.Generator().manual_seed(8)).cuda()
    with torch.no_grad():
        batch = _logits(a2a, ids)
        for i, n in ((0, 41), (2, 17), (4, 1)):
            assert torch.equal(_logits(a2a, ids[i : i + 1, :n])[0], batch[i, :n])
