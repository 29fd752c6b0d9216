"""Trainer context parallelism (CP = c ∈ {2, 4}; ``layers/context_parallel.py``, docs/parallel.md "Context
parallelism"): bits equal to CP = 1, gradients within the float64 bound.

* kernel level (no processes): a CP rank's query rows (Megatron's load-balanced layout: chunks r and 2c - 1 - r of
  2c) attended over the whole sequence's keys at their absolute positions are the rows of the one-call attention,
  ``torch.equal``; attending the rank's own keys only is not;
* refusals by name (CP 3, CP x EP, Megatron's MoELayer, hybrids, the framework entry points, a length 2c does not
  divide);
* model level (gloo ranks, slow): logits and token log-probs at CP 2, CP 4, TP 2 x CP 2, TP 2 + SP x CP 2,
  DP 2 x CP 2, PP 2 x CP 2 (dense), CP 2 and TP 2 (+ SP) x CP 2 (MoE, with the routes) ``torch.equal`` to one
  process; CP 2 float32 gradients (summed over the CP ranks, as Megatron's DDP does over its
  data-parallel-with-context-parallel group) vs float64 within ``GRAD_REL_TOL``, at TP 1, TP 2 + SP and PP 2 (dense)
  and at TP 1 (MoE, whose load-balancing loss is the one-process value, bit for bit); broken variants caught: rotary /
  mask at the rank's local positions, a rank attending its own chunks' keys only (logits differ), dk / dv without the
  other ranks' contributions (gradients off).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _parallel_layouts import reference
from safetensors.torch import load_file, save_file

from megatron_consistent import kernels
from megatron_consistent.config import ArchConfig, UnsupportedConfigError, load_hf_config

MODELS_DIR = Path(__file__).resolve().parents[1] / "megatron_consistent" / "configs" / "models"
LLAMA = MODELS_DIR / "tiny-llama"
QWEN3MOE = MODELS_DIR / "tiny-qwen3moe-top1"  # 8 experts, top-1
QWEN2MOE = MODELS_DIR / "tiny-qwen2moe-top8-shared"  # 64 experts, top-8, a gated shared expert
SEQ = 16  # 2 x CP = 8 divides it at CP 4; at TP 2 + SP, CP 2: each rank's 8 tokens split over TP 2


# ---------------------------------------------------------------------------------------------- kernel level
def _share_rows(s: int, c: int, r: int) -> torch.Tensor:
    """The positions CP rank r holds (chunks r and 2c - 1 - r of 2c), as the layers lay them out."""
    m = s // (2 * c)
    return torch.cat([torch.arange(r * m, (r + 1) * m), torch.arange((2 * c - 1 - r) * m, (2 * c - r) * m)])


@pytest.mark.parametrize("c, s, dtype", [(2, 64, torch.bfloat16), (4, 96, torch.float32), (2, 200, torch.float32)])
def test_cp_rows_over_the_whole_keys_equal_the_one_call_rows(c, s, dtype):
    """The contract CP rests on: a query row attended at its absolute position over all the keys is its one-call row,
    whichever other rows are in the call (several 32-key blocks, GQA); attending the rank's own keys only differs."""
    g = torch.Generator().manual_seed(c * s)
    q = torch.randn(2, s, 4, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, s, 2, 16, generator=g).to(dtype) for _ in range(2))
    whole = kernels.attention(q, k, v, kernels.causal_positions(2, s))
    for r in range(c):
        rows = _share_rows(s, c, r)
        pos = rows.expand(2, -1)
        got = kernels.attention(q[:, rows], k, v, pos)
        assert torch.equal(got, whole[:, rows]), f"CP={c} rank {r}"
        own = kernels.attention(q[:, rows], k[:, rows], v[:, rows], kernels.causal_positions(2, rows.numel()))
        assert not torch.equal(own, whole[:, rows]), f"CP={c} rank {r}: own keys only not caught"


# ---------------------------------------------------------------------------------------------- refusals
def test_context_parallel_refusals_are_named(tmp_path):
    from megatron_consistent.layers import build_consistent_model, check_parallel_sizes
    from megatron_consistent.layers.builder import make_transformer_config
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel
    from megatron_consistent.layers.entry_points import consistent_layer_spec_provider

    ids = torch.zeros(1, SEQ, dtype=torch.int64)
    with pytest.raises(UnsupportedConfigError, match=re.escape("context parallelism of size 3 (context_parallel_size must "
                                                               "be 1, 2 or 4)")):
        recompute_logprobs_parallel(LLAMA, {}, ids, cp=3)
    with pytest.raises(UnsupportedConfigError, match="context parallelism of size 8"):
        build_consistent_model(LLAMA, context_parallel_size=8)
    with pytest.raises(UnsupportedConfigError, match="context parallelism with expert parallelism"):
        check_parallel_sizes(1, 1, 2, expert_model_parallel_size=2)
    with pytest.raises(UnsupportedConfigError, match=re.escape("moe_impl='megatron' with TP/PP/EP/CP > 1 is not supported")):
        build_consistent_model(QWEN3MOE, context_parallel_size=2, moe_impl="megatron")
    with pytest.raises(UnsupportedConfigError, match=re.escape("hybrid (Mamba) model with context parallelism "
                                                               "(context_parallel_size=2)")):
        recompute_logprobs_parallel(MODELS_DIR / "tiny-nemotronh", {}, ids, cp=2)
    with pytest.raises(UnsupportedConfigError, match=re.escape("hybrid (Mamba) model with context parallelism")):
        build_consistent_model(MODELS_DIR / "tiny-nemotronh", context_parallel_size=2)
    with pytest.raises(UnsupportedConfigError, match=re.escape("CP=4: sequence length 12 is not divisible by 8 (2 x CP "
                                                               "chunks)")):
        recompute_logprobs_parallel(LLAMA, {}, torch.zeros(1, 12, dtype=torch.int64), cp=4)
    with pytest.raises(UnsupportedConfigError, match=re.escape("CP=2: sequence length 10 is not divisible by 4 (2 x CP "
                                                               "chunks, each CP rank's tokens over TP=2)")):
        recompute_logprobs_parallel(LLAMA, {}, torch.zeros(1, 10, dtype=torch.int64), cp=2, tp=2, sequence_parallel=True)
    framework_config = make_transformer_config(ArchConfig.from_hf(load_hf_config(LLAMA)), torch.float32, consistent=False)
    framework_config.context_parallel_size = 2
    with pytest.raises(UnsupportedConfigError, match=re.escape("context parallelism (context_parallel_size=2) through the "
                                                               "framework entry points is not supported")):
        consistent_layer_spec_provider(framework_config)
    # one process: CP 2 needs ranks (before torch.distributed is up, or at world size 1 after an earlier test)
    with pytest.raises(UnsupportedConfigError, match=r"TP=1 x CP=2 x PP=1 (needs torch.distributed initialized by the "
                       r"caller|needs a world size that TP x CP x PP divides)"):
        build_consistent_model(LLAMA, context_parallel_size=2)


# ---------------------------------------------------------------------------------------------- model level
@pytest.mark.slow
@pytest.mark.parametrize("config, layouts", [
    (LLAMA, [(1, 2, False, 1), (1, 4, False, 1), (2, 2, False, 1), (2, 2, True, 1), (1, 2, False, 2), (1, 2, False, 1, 2)]),
    (QWEN3MOE, [(1, 2, False, 1)]),
    (QWEN2MOE, [(2, 2, False, 1), (2, 2, True, 1)]),
], ids=["tiny-llama", "tiny-qwen3moe-top1", "tiny-qwen2moe-top8-shared"])
def test_logits_and_logprobs_equal_across_cp_layouts(tmp_path, config, layouts):
    """(TP, CP, SP, DP[, PP]) layouts (bf16, 2 sequences of 16 tokens): the one-process logits and log-probs, and for
    MoE every layer's routes, ``torch.equal``."""
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel
    from megatron_consistent.layers.moe import collect_routes

    weights, ids, logits, lp = reference(config, tmp_path, seq=SEQ)
    one = build_consistent_model(config, seed=5, dtype=torch.bfloat16)  # reference()'s model: its routes
    with torch.no_grad():
        one(ids, kernels.causal_positions(*ids.shape), None)
    routes = collect_routes(one)
    for tp, cp, sp, dp, *pp in layouts:
        pp = pp[0] if pp else 1
        where = f"TP={tp} CP={cp} SP={sp} DP={dp} PP={pp}"
        got_lp, got_logits, got_routes = recompute_logprobs_parallel(
            config, weights, ids, tp=tp, cp=cp, dp=dp, pp=pp, sequence_parallel=sp, return_logits=True, return_routes=True,
            workdir=tmp_path / where.replace(" ", "_"))
        assert torch.equal(got_logits, logits), f"logits differ at {where}"
        assert torch.equal(got_lp, lp), f"log-probs differ at {where}"
        if dp == 1:
            assert got_routes.keys() == ({0} if routes else set())
            assert got_routes.get(0, {}).keys() == routes.keys()
            for layer, r in routes.items():
                assert torch.equal(got_routes[0][layer], r), f"layer {layer} routes differ at {where}"


def _local_positions(batch, length, device=None):  # broken: rotary and mask at the rank's local positions
    return kernels.causal_positions(batch, length, device=device)


def _own_keys_only(q, k, v, positions, scale):  # broken: the rank attends its own chunks' keys only
    return kernels.attention(q, k, v, kernels.causal_positions(*q.shape[:2], device=q.device), scale=scale)


def _own_contribution_only(ctx, g):  # broken backward: dk / dv without the other CP ranks' queries' contributions
    from megatron_consistent.layers import context_parallel as cpar

    return cpar.cp_share(g, ctx.dim), None, None


def _cp_worker(rank: int, workdir: str, tp: int, sp: bool, pp: int) -> None:
    """CP 2 (x TP ``tp`` x PP ``pp``): the logits (gathered over the vocabulary and the CP ranks, last stage), the same
    with the two broken forwards, and the float32 gradients (summed over the CP ranks as Megatron's DDP does: the
    helper's data-parallel-with-context-parallel group) with the right and the broken backward, by stage; MoE: the
    load-balancing loss of the training forward."""
    from megatron.core import parallel_state as ps
    from test_parallel_trainer import _data_parallel_gradients
    from test_pipeline_trainer import _save_stage

    from megatron_consistent.layers import context_parallel as cpar
    from megatron_consistent.layers.distributed import build_parallel_model, gather_vocab, stage_forward
    from megatron_consistent.layers.moe import moe_aux_loss

    work = Path(workdir)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    cfg = work / "weights" / "config.json"
    model = build_parallel_model(cfg, work / "weights", tp=tp, pp=pp, cp=2, dtype=torch.bfloat16, sequence_parallel=sp)

    def logits():
        with torch.no_grad():
            shard = stage_forward(model, ids)
        return None if shard is None else cpar.gather_cp_sequence(gather_vocab(shard)).contiguous()

    out = {"logits": logits()}
    for name, attr, broken in (("local_positions", "cp_positions", _local_positions),
                               ("own_keys", "cp_attention", _own_keys_only)):
        right = getattr(cpar, attr)
        setattr(cpar, attr, broken)
        try:
            out[name] = logits()
        finally:
            setattr(cpar, attr, right)
    model32 = build_parallel_model(cfg, work / "weights", tp=tp, pp=pp, cp=2, dtype=torch.float32, sequence_parallel=sp)
    tokens = ids[:, 1:].numel()
    _save_stage(_data_parallel_gradients(model32, ids, tokens), work, "grads")
    aux = moe_aux_loss(model32)
    if aux is not None:
        out["aux_loss"] = aux.detach().reshape(1)
    model32.zero_grad(set_to_none=True)
    right = cpar._GatherKeysValues.backward
    cpar._GatherKeysValues.backward = staticmethod(_own_contribution_only)
    try:
        _save_stage(_data_parallel_gradients(model32, ids, tokens), work, "broken_grads")
    finally:
        cpar._GatherKeysValues.backward = right
    if out["logits"] is not None and ps.get_tensor_model_parallel_rank() == 0 and cpar.cp_rank() == 0:
        save_file(out, str(work / "out.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("config, tp, sp, pp", [(LLAMA, 1, False, 1), (LLAMA, 2, True, 1), (LLAMA, 1, False, 2),
                                                (QWEN2MOE, 1, False, 1)],
                         ids=["tiny-llama-cp2", "tiny-llama-tp2-sp-cp2", "tiny-llama-pp2-cp2", "tiny-qwen2moe-top8-shared-cp2"])
def test_cp2_bits_gradients_and_broken_variants(tmp_path, config, tp, sp, pp):
    """CP 2 (and TP 2 + SP x CP 2, PP 2 x CP 2) in one gloo job: logits ``torch.equal`` to one process; float32
    gradients, summed over the CP ranks (at PP 2 backpropagated stage by stage), within ``GRAD_REL_TOL`` of float64;
    MoE: the load-balancing loss is the one-process value;
    rotary at local positions and own-keys-only attention change the logits; a backward without the other ranks'
    dk / dv contributions is far off."""
    from test_parallel_trainer import _gradient_errors
    from test_pipeline_trainer import _stage_files

    from megatron_consistent.layers import build_consistent_model, compute_token_logprobs
    from megatron_consistent.layers.distributed import (load_full_megatron_state, megatron_state_from_hf, read_hf_tensors,
                                                        spawn_ranks)
    from megatron_consistent.layers.moe import moe_aux_loss
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    weights, ids, logits, _ = reference(config, tmp_path, seq=SEQ)
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_cp_worker, 2 * tp * pp, tmp_path, tp, sp, pp)
    out = load_file(str(tmp_path / "out.safetensors"))
    for stem in ("grads", "broken_grads"):
        save_file(_stage_files(tmp_path, stem), str(tmp_path / f"{stem}.safetensors"))
    assert torch.equal(out["logits"], logits)
    one = build_consistent_model(config, dtype=torch.float32, moe_impl="module")  # the ranks' MoE layer; training mode
    load_full_megatron_state(one, megatron_state_from_hf(one.arch_config, read_hf_tensors(weights)))
    compute_token_logprobs(one, ids)
    aux = moe_aux_loss(one)
    assert (aux is None) == ("aux_loss" not in out)
    if aux is not None:
        assert aux.item() > 0 and torch.equal(out["aux_loss"], aux.detach().reshape(1)), (out["aux_loss"], aux)
    assert not torch.equal(out["local_positions"], logits), "rotary / mask at local positions not caught"
    assert not torch.equal(out["own_keys"], logits), "attention over the rank's own keys only not caught"
    errs = _gradient_errors(tmp_path / "grads.safetensors", weights, ids)
    print(f"{config.name} TP={tp} SP={sp} PP={pp} CP=2 gradients: max relative error vs float64 {max(errs.values()):.3g} "
          f"({max(errs, key=errs.get)})")
    assert max(errs.values()) < GRAD_REL_TOL, errs
    broken = _gradient_errors(tmp_path / "broken_grads.safetensors", weights, ids)
    print(f"broken dk / dv sum: max relative error {max(broken.values()):.3g} ({max(broken, key=broken.get)})")
    assert max(broken.values()) > 1e3 * GRAD_REL_TOL, "dk / dv without the other CP ranks' contributions not caught"


def test_layouts_state_the_context_parallel_trainer(tmp_path):
    from megatron_consistent.verify.check import check_layouts, load_check_config

    arch = ArchConfig.from_hf(load_hf_config(LLAMA))
    lay = check_layouts(load_check_config(trainer_tp=2, trainer_cp=2, trainer_sp=True, device="cpu",
                                          out_dir=str(tmp_path)), arch)["trainer"]
    assert lay["context_parallel_size"] == 2 and lay["ranks"].startswith("4 gloo processes")
    assert "right-padded to a multiple of 4" in lay["context"] and "chunks r and 3-r" in lay["context"]
    for overrides, words in [({"trainer_cp": 3}, "--trainer-tp 1 --trainer-cp 3: the consistent Megatron layers do not "
                              "support: context parallelism of size 3"),
                             ({"trainer_cp": 2, "trainer_dp": 2, "trainer_ep": 2}, "--trainer-tp 1 --trainer-dp 2 "
                              "--trainer-ep 2 --trainer-cp 2: the consistent Megatron layers do not support: context "
                              "parallelism with expert parallelism")]:
        with pytest.raises(UnsupportedConfigError, match=re.escape(words)):
            check_layouts(load_check_config(device="cpu", out_dir=str(tmp_path), **overrides), arch)
