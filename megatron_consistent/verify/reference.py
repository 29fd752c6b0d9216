"""Independent float64 reference of the dense decoder and the gradient check against it.

:func:`reference_logprobs_f64` is plain torch in float64 (no package kernels):
embedding, RMSNorm, q/k/v (+bias), [q/k RMSNorm], NeoX RoPE (llama3 scaling),
causal softmax attention with GQA, SwiGLU, final norm, log-softmax.  It reads
HF-named weights (q, k, v and gate, up as separate tensors; names from the weight
table of :mod:`megatron_consistent.architectures`), so it is independent of the
Megatron layout as well.

:func:`gradient_check` differentiates the consistent Megatron model (float32)
and the reference (float64) on the same tokens and returns the relative
Frobenius error of every gradient tensor; :data:`GRAD_REL_TOL` is the bound the
test suite and the ``C6`` gate apply.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..architectures import hf_names

# Relative Frobenius error of each float32 gradient tensor vs float64.  float32 has unit roundoff u = 6e-8; the
# forward and backward chain ~20 ops over 2 layers, each a float32 reduction of length <= 512 (tree / blocked sums,
# error ~ log2(K) * u ~ 6e-7 per op), so the expected error is ~1e-6 (measured: up to 8.3e-7 over all tensors of
# the five tiny models).  2e-5 leaves >20x headroom while any wrong formula gives errors of order 1e-2 .. 1.
GRAD_REL_TOL = 2e-5
# Relative error of the loss itself (same reasoning, one scalar).
LOSS_REL_TOL = 1e-5


def inv_freq_f64(arch) -> torch.Tensor:
    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if arch.rope_scaling:
        s = dict(arch.rope_scaling)
        factor, lo, hi, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def reference_logprobs_f64(w: dict[str, torch.Tensor], arch, ids: torch.Tensor) -> torch.Tensor:
    """Plain float64 torch: embedding, RMSNorm, q/k/v, [q/k norm], NeoX RoPE, causal softmax attention, SwiGLU."""
    b, s = ids.shape
    nh, nkv, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + arch.rms_norm_eps) * weight

    def lin(x, name):
        return x @ w[name].T

    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq_f64(arch)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    names = hf_names(arch)  # Megatron name -> HF names (the family's weight table); only the HF tensors are read
    x = w[names["embedding.word_embeddings.weight"][0]][ids]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(arch.num_layers):
        m = f"decoder.layers.{i}."
        h = norm(x, w[names[m + "input_layernorm.weight"][0]])
        qkv = [lin(h, n) for n in names[m + "self_attention.linear_qkv.weight"]]
        if arch.qkv_bias:
            qkv = [y + w[n] for y, n in zip(qkv, names[m + "self_attention.linear_qkv.bias"])]
        q, k, v = qkv[0].reshape(b, s, nh, hd), qkv[1].reshape(b, s, nkv, hd), qkv[2].reshape(b, s, nkv, hd)
        if arch.qk_norm:
            q = norm(q, w[names[m + "self_attention.q_layernorm.weight"][0]])
            k = norm(k, w[names[m + "self_attention.k_layernorm.weight"][0]])
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(nh // nkv, dim=2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * hd**-0.5
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
        x = x + lin(o, names[m + "self_attention.linear_proj.weight"][0])
        h = norm(x, w[names[m + "pre_mlp_layernorm.weight"][0]])
        if arch.layer_is_moe(i):  # MoE block: verify/moe_reference.py
            from .moe_reference import moe_mlp_f64

            x = x + moe_mlp_f64(w, arch, i, h)
            continue
        (gate, up), (down,) = names[m + "mlp.linear_fc1.weight"], names[m + "mlp.linear_fc2.weight"]
        x = x + lin(torch.nn.functional.silu(lin(h, gate)) * lin(h, up), down)
    h = norm(x, w[names["decoder.final_layernorm.weight"][0]])
    head = w[names["output_layer.weight" if "output_layer.weight" in names else "embedding.word_embeddings.weight"][0]]
    lp = torch.log_softmax(h @ head.T, dim=-1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def gradient_check(hf_config, *, seed: int = 11, batch: int = 2, seq: int = 40, data_seed: int = 12,
                   dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    """Gradients of ``-mean(token log-probs)``: consistent Megatron model vs :func:`reference_logprobs_f64`.

    The model runs in ``dtype`` on ``device`` (the GPU kernels take bf16/fp16);
    the reference always runs in float64 on the CPU from the same weights.
    Returns ``{"loss", "ref_loss", "loss_rel_err", "rel_errors": {hf_name: err}, "max_rel_err", "worst"}``.
    """
    from ..conversion import export_hf
    from ..layers import build_consistent_model, compute_token_logprobs

    model = build_consistent_model(hf_config, seed=seed, dtype=dtype)
    arch = model.arch_config
    ids = torch.randint(0, arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(data_seed))
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, arch, Path(tmp) / "w")
        model.to(device)
        loss = -compute_token_logprobs(model, ids.to(device)).mean()
        loss.backward()
        twin = build_consistent_model(hf_config, seed=0, dtype=torch.float32)  # gradients in HF layout via export
        grads = dict(model.named_parameters())
        with torch.no_grad():
            for n, p in twin.named_parameters():
                p.copy_(grads[n].grad.cpu())
        export_hf(twin, arch, Path(tmp) / "g")
        got = load_file(str(Path(tmp) / "g" / "model.safetensors"))
        w64 = {k: v.double().requires_grad_(True) for k, v in load_file(str(Path(tmp) / "w" / "model.safetensors")).items()}
    ref_loss = -reference_logprobs_f64(w64, arch, ids).mean()
    ref_loss.backward()
    errs = {}
    for k, t in w64.items():
        err, scale = (got[k].double() - t.grad).norm().item(), t.grad.norm().item()
        errs[k] = err / scale if scale > 0 else err
    worst = max(errs, key=errs.get)
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "loss_rel_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "rel_errors": errs, "max_rel_err": errs[worst], "worst": worst}
