"""Tolerance checks against independent references (float32 Megatron model):

* gradients vs a plain-torch float64 implementation of the same architecture;
* 'architecture mapping vs transformers': exported checkpoint loaded by
  ``transformers.AutoModelForCausalLM`` gives logits close to the Megatron forward.

These are numerical-accuracy checks of the mapping and the backward, with the
tolerances justified at each constant.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_consistent.conversion import export_hf
from megatron_consistent.layers import build_consistent_gpt_model as build_kernel_model
from megatron_consistent.layers import compute_token_logprobs as kernel_token_logprobs

MODELS_DIR = Path(__file__).resolve().parents[1] / "megatron_consistent" / "configs" / "models"
MODEL_NAMES = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())

# Relative Frobenius error of each float32 gradient tensor vs float64.  float32 has unit roundoff u = 6e-8; the
# forward and backward chain ~20 ops over 2 layers, each a float32 reduction of length <= 512 (tree / blocked sums,
# error ~ log2(K) * u ~ 6e-7 per op), so the expected error is ~1e-6 (measured: up to 8.3e-7 over all tensors of
# the five tiny models).  2e-5 leaves >20x headroom while any wrong formula gives errors of order 1e-2 .. 1.
GRAD_REL_TOL = 2e-5
# Logits of the float32 models: |logit| < ~1 at init; both sides accumulate in float32 in different orders, giving
# differences ~1e-6 (measured: up to 7.2e-7); a mapping error (head order, rope style, norm placement) gives >= 1e-2.
LOGIT_ABS_TOL = 1e-5


def _inv_freq(arch) -> torch.Tensor:
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

    def lin(x, name, bias=False):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if bias else y

    ang = torch.arange(s, dtype=torch.float64)[:, None] * _inv_freq(arch)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = w["model.embed_tokens.weight"][ids]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = lin(h, p + "self_attn.q_proj", arch.qkv_bias).reshape(b, s, nh, hd)
        k = lin(h, p + "self_attn.k_proj", arch.qkv_bias).reshape(b, s, nkv, hd)
        v = lin(h, p + "self_attn.v_proj", arch.qkv_bias).reshape(b, s, nkv, hd)
        if arch.qk_norm:
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(nh // nkv, dim=2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * hd**-0.5
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
        x = x + lin(o, p + "self_attn.o_proj")
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + lin(torch.nn.functional.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    h = norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if arch.tie_word_embeddings else w["lm_head.weight"]
    lp = torch.log_softmax(h @ head.T, dim=-1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _tokens(arch, b, s, seed):
    return torch.randint(0, arch.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_gradients_vs_float64_reference(name, tmp_path):
    model = build_kernel_model(MODELS_DIR / name, seed=11, dtype=torch.float32)
    arch = model.arch_config
    export_hf(model, arch, tmp_path / "w")
    ids = _tokens(arch, 2, 40, seed=12)
    loss = -kernel_token_logprobs(model, ids).mean()
    loss.backward()
    # gradients in HF layout: copy them into a twin model and export it
    twin = build_kernel_model(MODELS_DIR / name, seed=0, dtype=torch.float32)
    grads = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(grads[n].grad)
    export_hf(twin, arch, tmp_path / "g")
    got = load_file(str(tmp_path / "g" / "model.safetensors"))

    w64 = {k: v.double().requires_grad_(True) for k, v in load_file(str(tmp_path / "w" / "model.safetensors")).items()}
    ref_loss = -reference_logprobs_f64(w64, arch, ids).mean()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for k, t in w64.items():
        ref = t.grad
        err = (got[k].double() - ref).norm().item()
        scale = ref.norm().item()
        assert err <= GRAD_REL_TOL * scale, f"{k}: relative gradient error {err / scale:.2e}"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_architecture_mapping_vs_transformers(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = build_kernel_model(MODELS_DIR / name, seed=13, dtype=torch.float32)
    arch = model.arch_config
    export_hf(model, arch, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, local_files_only=True)
    hf.eval()
    ids = _tokens(arch, 2, 300 if arch.rope_scaling else 40, seed=14)  # past original_max_position_embeddings=256
    with torch.no_grad():
        ours = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        theirs = hf(input_ids=ids).logits.float()
    assert ours.shape == theirs.shape == (*ids.shape, arch.vocab_size)
    diff = (ours - theirs).abs().max().item()
    assert diff <= LOGIT_ABS_TOL, f"max |logit difference| {diff:.2e}"
