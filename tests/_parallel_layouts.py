"""What the CPU (gloo) and GPU (NCCL) trainer-layout tests share: the single-process TP = PP = 1 reference on a
device, and the spawned layouts compared with it bit for bit (``torch.equal``)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_consistent import kernels


def reference(config, tmp_path: Path, dtype=torch.bfloat16, batch=2, seq=12, device="cpu", prepare=None):
    """The single-process (TP=1, PP=1) model on ``device``: its weights as an HF checkpoint, tokens, logits and
    log-probs (the tensors on the CPU).  ``prepare``: called on the seeded model before anything else (e.g. to give
    weights initialized to constants other values)."""
    from megatron_consistent.conversion import export_hf
    from megatron_consistent.layers import build_consistent_model, compute_token_logprobs

    model = build_consistent_model(config, seed=5, dtype=dtype)
    if prepare is not None:
        prepare(model)
    arch = model.arch_config
    export_hf(model, arch, tmp_path / "weights")
    ids = torch.randint(0, arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7))
    model.to(device)
    with torch.no_grad():
        on_device = ids.to(device)
        logits = model(on_device, kernels.causal_positions(batch, seq, device=device), None)
        lp = compute_token_logprobs(model, on_device)
    return tmp_path / "weights", ids, logits.cpu(), lp.cpu()


def check_layouts(config, layouts, tmp_path: Path, device="cpu", dtype=torch.bfloat16):
    """Each ``(tp, pp[, sequence_parallel])`` layout, spawned on ``device`` (gloo / NCCL ranks), gives the reference's
    logits and log-probs bit for bit (both models in ``dtype``)."""
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel

    weights, ids, logits, lp = reference(config, tmp_path, dtype=dtype, device=device)
    for tp, pp, *sp in layouts:
        sp = bool(sp and sp[0])
        got_lp, got_logits = recompute_logprobs_parallel(config, weights, ids, tp=tp, pp=pp, sequence_parallel=sp,
                                                         dtype=dtype, return_logits=True, device=device,
                                                         workdir=tmp_path / f"tp{tp}pp{pp}sp{int(sp)}")
        assert torch.equal(got_logits, logits), f"logits differ at TP={tp} PP={pp} SP={sp} on {device}"
        assert torch.equal(got_lp, lp), f"log-probs differ at TP={tp} PP={pp} SP={sp} on {device}"
