"""The hybrid (Mamba-2 / Nemotron-H) trainer at tensor parallelism TP = 2 on gloo CPU ranks: the bits of TP = 1.

* logits and token log-probs ``torch.equal`` to the one-process model at TP 2, PP 2, TP 2 x PP 2, TP 2 + SP and
  TP 2 x PP 2 + SP (``tiny-nemotronh``: Mamba mixers with n_groups 2 and 8 heads, attention, relu2 MLP) and at TP 2,
  TP 2 x PP 2, TP 2 + SP (``tiny-nemotronh-moe``: its experts over the TP ranks);
* the seeded init at TP = 2 is the TP = 1 init's shard; the mixer's parameters are the rank's heads / groups;
* TP=2 gradients, without and with sequence parallelism, vs the float64 reference (``tests/test_hybrid_megatron.py``)
  within ``GRAD_REL_TOL``;
* a TP=2 ``dist_checkpointing`` save loads into the TP=1 model bit for bit (Megatron's mixer layout: ``in_proj``
  blocks ``z x B C dt``, ``conv1d`` blocks ``x B C``, each split over the ranks);
* broken variants are caught: each rank's gated norm with the other rank's group slice of ``norm.weight``, and
  the ``out_proj`` rank partials summed by an all-reduce instead of the 8-segment tree;
* refusals by name: TP not dividing the Mamba groups / heads, layers not dividing PP, EP for hybrids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _parallel_layouts import check_layouts, reference
from safetensors.torch import load_file, save_file
from test_hybrid_megatron import gradient_errors_vs_f64, hf_gradients
from test_parallel_trainer import MODELS_DIR

from megatron_consistent.config import ArchConfig, UnsupportedConfigError, load_hf_config

NEMOTRONH = MODELS_DIR / "tiny-nemotronh"
RANDOMIZED = ("mixer.norm.weight", "mixer.D")  # initialized to ones: random values make a wrong slice visible


def _randomize_mixers(model) -> None:
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(RANDOMIZED):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


@pytest.mark.slow
def test_hybrid_logits_and_logprobs_equal_at_tp2(tmp_path):
    check_layouts(NEMOTRONH, [(2, 1), (1, 2), (2, 2), (2, 1, True), (2, 2, True)], tmp_path / "nemotronh")
    check_layouts(MODELS_DIR / "tiny-nemotronh-moe", [(2, 1), (2, 2), (2, 1, True)], tmp_path / "moe")


def _hybrid_tp2_worker(rank: int, workdir: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_consistent import kernels
    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.cpu_shims import cuda_stubs_for_checkpoint
    from megatron_consistent.layers.distributed import build_parallel_model, gather_vocab, stage_forward, stage_logprobs

    work = Path(workdir)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    cfg, weights = work / "weights" / "config.json", work / "weights"
    model = build_parallel_model(cfg, weights, tp=2, dtype=torch.bfloat16)
    mixers = [layer.mixer for layer in model.decoder.layers if hasattr(layer, "mixer")]
    m, s, hidden = mixers[0], mixers[0].ssm, model.config.hidden_size  # the rank's heads and groups
    assert m.in_proj.weight.shape == (s.in_proj_size // 2, hidden) and m.out_proj.weight.shape == (hidden, s.d_inner // 2)
    assert m.conv1d.weight.shape[0] == s.conv_dim // 2 and m.norm.weight.shape == (s.d_inner // 2,)
    assert m.A_log.shape == m.D.shape == m.dt_bias.shape == (s.num_heads // 2,)
    seeded = dict(build_parallel_model(cfg, None, tp=2, dtype=torch.bfloat16, seed=5).named_parameters())
    for name, p in model.named_parameters():  # the seeded TP=2 init is the rank's piece of the TP=1 init
        assert name.endswith(RANDOMIZED) or torch.equal(seeded[name], p), name
    out = {}
    with torch.no_grad():
        out["logits"] = gather_vocab(stage_forward(model, ids)).contiguous()

    (work / "dist").mkdir(exist_ok=True)
    dist.barrier()
    with cuda_stubs_for_checkpoint():
        dist_checkpointing.save(model.sharded_state_dict(), str(work / "dist"))

    grads = {}
    for sp in (False, True):  # float32 gradients without and with sequence parallelism
        model32 = build_parallel_model(cfg, weights, tp=2, dtype=torch.float32, sequence_parallel=sp)
        (-stage_logprobs(model32, ids).mean()).backward()
        for p in model32.parameters():  # what Megatron's finalize_model_grads does for sequence-parallel parameters
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=tpar.tp_group())
        grads[sp] = {name: tpar.unshard_like(p.grad, p).contiguous() for name, p in model32.named_parameters()}

    with torch.no_grad():  # broken: each rank normalizes its groups with the other rank's norm.weight slice
        kept = [m.norm.weight.clone() for m in mixers]
        for m in mixers:
            w = m.norm.weight
            w.copy_(tpar.shard_like(tpar.unshard_like(w.detach(), w), w, 1 - rank, 2))
        out["broken_norm_logits"] = gather_vocab(stage_forward(model, ids)).contiguous()
        for m, w in zip(mixers, kept):
            m.norm.weight.copy_(w)

    def all_reduced(layer):  # broken: out_proj's rank partials (rounded) summed by an all-reduce
        def forward(x):
            y = kernels.linear(x, layer.weight, None).contiguous()
            dist.all_reduce(y, group=layer.tp_group)
            return y, None
        return forward

    for m in mixers:
        m.out_proj.forward = all_reduced(m.out_proj)
    with torch.no_grad():
        out["broken_out_proj_logits"] = gather_vocab(stage_forward(model, ids)).contiguous()
    if rank == 0:
        save_file(out, str(work / "out.safetensors"))
        for sp, g in grads.items():
            save_file(g, str(work / f"grads.sp{int(sp)}.safetensors"))


@pytest.mark.slow
def test_hybrid_tp2_bits_gradients_checkpoint_and_broken_variants(tmp_path):
    from megatron_consistent.checkpoint import _load_dist_staged
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import megatron_state_from_hf, read_hf_tensors, spawn_ranks
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    weights, ids, logits, _ = reference(NEMOTRONH, tmp_path, prepare=_randomize_mixers)
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_hybrid_tp2_worker, 2, tmp_path)
    out = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(out["logits"], logits)
    assert not torch.equal(out["broken_norm_logits"], logits), "a gated norm over the wrong group slice was not caught"
    assert not torch.equal(out["broken_out_proj_logits"], logits), "out_proj summed by an all-reduce was not caught"

    arch = ArchConfig.from_hf(load_hf_config(NEMOTRONH))
    hf = read_hf_tensors(weights)
    for sp in (0, 1):
        got = hf_gradients(NEMOTRONH, arch, load_file(str(tmp_path / f"grads.sp{sp}.safetensors")))
        _, errs = gradient_errors_vs_f64(arch, hf, got, ids, {})
        print(f"hybrid TP=2 SP={sp} gradients: max relative error vs float64 {max(errs.values()):.3g} "
              f"({max(errs, key=errs.get)})")
        assert max(errs.values()) < GRAD_REL_TOL, (sp, errs)

    loaded = _load_dist_staged(build_consistent_model(NEMOTRONH, seed=1), tmp_path / "dist")
    for name, tensor in megatron_state_from_hf(arch, hf).items():
        assert torch.equal(loaded[name], tensor), name


def test_hybrid_tp_refusals_are_named():
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel

    ids = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(UnsupportedConfigError, match="n_groups=2 is not divisible by TP=4"):
        recompute_logprobs_parallel(NEMOTRONH, {}, ids, tp=4)
    with pytest.raises(UnsupportedConfigError, match="n_groups=1 is not divisible by TP=2"):
        recompute_logprobs_parallel(MODELS_DIR / "tiny-mamba2", {}, ids, tp=2)
    with pytest.raises(UnsupportedConfigError, match="num_hidden_layers=3 is not divisible by PP=2"):
        recompute_logprobs_parallel(MODELS_DIR / "tiny-mamba2", {}, ids, pp=2)
    with pytest.raises(UnsupportedConfigError, match=r"hybrid \(Mamba\) model with expert parallelism"):
        recompute_logprobs_parallel(MODELS_DIR / "tiny-nemotronh-moe", {}, ids, dp=2, ep=2)
