"""Megatron-Core layers on the consistent kernels: build, train step, and op-for-op equality with a kernel-only model.

Equality claims here use ``torch.equal`` only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_consistent import kernels
from megatron_consistent.config import ArchConfig, UnsupportedConfigError, load_hf_config
from megatron_consistent.conversion import export_hf
from megatron_consistent.layers import (
    ConsistentSpecProvider,
    build_consistent_gpt_model,
    build_stock_gpt_model,
    compute_stock_token_logprobs,
    compute_token_logprobs,
    consistent_bias_dropout_add,
    consistent_core_attention,
    get_consistent_gpt_layer_spec,
    init_cpu_process_group,
)

MODELS_DIR = Path(__file__).resolve().parents[1] / "megatron_consistent" / "configs" / "models"
# dense / MoE decoders; the hybrid Mamba-2 configs are tested in tests/test_hybrid_megatron.py
MODEL_NAMES = sorted(p.name for p in MODELS_DIR.iterdir()
                     if (p / "config.json").is_file() and not ArchConfig.from_hf(load_hf_config(p)).is_hybrid)


def arch_of(name: str) -> ArchConfig:
    return ArchConfig.from_hf(load_hf_config(MODELS_DIR / name))


def token_batch(arch: ArchConfig, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, arch.vocab_size, (batch, length), generator=g)


@pytest.fixture(scope="module")
def bf16_models():
    """One bf16 consistent model per tiny config (seed 0), built once for the module."""
    return {name: build_consistent_gpt_model(MODELS_DIR / name, seed=0) for name in MODEL_NAMES}


# ------------------------------------------------------------------------------------------------ kernel-only model
def _kernel_only_moe(w: dict[str, torch.Tensor], arch: ArchConfig, p: str, h: torch.Tensor) -> torch.Tensor:
    from megatron_consistent.architectures import hf_names
    from megatron_consistent.kernels import moe as kmoe

    names, m = hf_names(arch), f"decoder.layers.{int(p.split('.')[2])}.mlp."
    E = arch.num_experts
    gate_up, down = names[m + "experts.linear_fc1.weight"], names[m + "experts.linear_fc2.weight"]
    fc1 = torch.stack([torch.cat([w[gate_up[2 * e]], w[gate_up[2 * e + 1]]]) for e in range(E)])
    fc2 = torch.stack([w[down[e]] for e in range(E)])
    shared = None
    if arch.shared_expert_intermediate_size:
        shared = (torch.cat([w[n] for n in names[m + "shared_experts.linear_fc1.weight"]]),
                  w[names[m + "shared_experts.linear_fc2.weight"][0]], w[names[m + "shared_experts.gate_weight"][0]])
    x = h.reshape(-1, h.shape[-1])
    wts, experts = kmoe.route(x, w[names[m + "router.weight"][0]], arch.num_experts_per_tok, norm_topk_prob=arch.norm_topk_prob)
    return kmoe.moe_experts(x, experts, wts, fc1, fc2, shared).reshape(h.shape)


def kernel_only_logprobs(w: dict[str, torch.Tensor], arch: ArchConfig, ids: torch.Tensor) -> torch.Tensor:
    """An independent forward from HF-layout weights that calls only the kernels, in the vLLM plugin's op order
    (separate q/k/v and gate/up projections, residual add fused into the next RMSNorm)."""
    b, s = ids.shape
    eps = arch.rms_norm_eps
    pos = kernels.causal_positions(b, s)
    x = torch.nn.functional.embedding(ids, w["model.embed_tokens.weight"])
    residual = None
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        if residual is None:
            residual = x
            h = kernels.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        else:
            h, residual = kernels.rms_norm(x, w[p + "input_layernorm.weight"], eps, residual)
        q = kernels.linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
        k = kernels.linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
        v = kernels.linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
        q = q.reshape(b, s, arch.num_heads, arch.head_dim)
        k = k.reshape(b, s, arch.num_kv_heads, arch.head_dim)
        v = v.reshape(b, s, arch.num_kv_heads, arch.head_dim)
        if arch.qk_norm:
            q = kernels.rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = kernels.rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = kernels.apply_rope(q, pos, arch.rope)
        k = kernels.apply_rope(k, pos, arch.rope)
        o = kernels.attention(q, k, v, pos, scale=arch.softmax_scale).reshape(b, s, arch.num_heads * arch.head_dim)
        o = kernels.row_parallel_linear(o, w[p + "self_attn.o_proj.weight"], arch.row_parallel_segments)
        h, residual = kernels.rms_norm(o, w[p + "post_attention_layernorm.weight"], eps, residual)
        if arch.layer_is_moe(i):  # MoE block from the HF per-expert tensors (kernels.moe)
            x = _kernel_only_moe(w, arch, p, h)
            continue
        gate = kernels.linear(h, w[p + "mlp.gate_proj.weight"])
        up = kernels.linear(h, w[p + "mlp.up_proj.weight"])
        act = kernels.silu_and_mul(torch.cat([gate, up], dim=-1))
        x = kernels.row_parallel_linear(act, w[p + "mlp.down_proj.weight"], arch.row_parallel_segments)
    h, _ = kernels.rms_norm(x, w["model.norm.weight"], eps, residual)
    lm_head = w["model.embed_tokens.weight"] if arch.tie_word_embeddings else w["lm_head.weight"]
    return kernels.gather_logprobs(kernels.compute_logits(h, lm_head)[:, :-1], ids[:, 1:], 1.0)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_backward_bf16(name, bf16_models):
    model = bf16_models[name]
    arch = model.arch_config
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.output_layer.vocab_size == arch.vocab_size  # no vocab padding
    model.zero_grad(set_to_none=True)
    ids = token_batch(arch, 2, 40, seed=1)
    lp = compute_token_logprobs(model, ids)
    assert lp.shape == (2, 39) and lp.dtype == torch.float32
    loss = -lp.mean()
    assert torch.isfinite(loss)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n
    # Megatron's own labels path (vocab-parallel CE on the float32 logits) also runs
    per_token = model(ids, kernels.causal_positions(2, 40), None, labels=ids)
    assert per_token.shape == (2, 40) and torch.isfinite(per_token).all()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_logprobs_equal_kernel_only_model(name, bf16_models, tmp_path):
    """Megatron model == kernel-only re-implementation on the exported HF weights (torch.equal)."""
    model = bf16_models[name]
    arch = model.arch_config
    export_hf(model, arch, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    ids = token_batch(arch, 2, 45, seed=2)  # 45 > KV_BLOCK: two key blocks
    with torch.no_grad():
        got = compute_token_logprobs(model, ids)
        want = kernel_only_logprobs(weights, arch, ids)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["tiny-qwen2-mqa", "tiny-qwen3-qknorm-tied"])
def test_row_alone_equals_row_in_batch(name, bf16_models):
    model = bf16_models[name]
    ids = token_batch(model.arch_config, 3, 37, seed=3)
    with torch.no_grad():
        batched = compute_token_logprobs(model, ids)
        for r in range(3):
            assert torch.equal(compute_token_logprobs(model, ids[r : r + 1])[0], batched[r])
        # a prefix of a sequence gives the same log-probs as the head of the longer one
        assert torch.equal(compute_token_logprobs(model, ids[:1, :20])[0], batched[0, :19])


def test_seeded_build_is_reproducible():
    path = MODELS_DIR / "tiny-llama"
    a = build_consistent_gpt_model(path, seed=7)
    b = build_consistent_gpt_model(path, seed=7)
    c = build_consistent_gpt_model(path, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    tensors = [k for k, v in sa.items() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(sa[k], sb[k]) for k in tensors)
    assert not torch.equal(sa["decoder.layers.0.self_attention.linear_qkv.weight"], sc["decoder.layers.0.self_attention.linear_qkv.weight"])


def test_stock_baseline_builds_with_same_weights_and_state_dict_keys():
    path = MODELS_DIR / "tiny-llama3-rope-oddvocab"
    ours = build_consistent_gpt_model(path, seed=3)
    stock = build_stock_gpt_model(path, seed=3)
    so, ss = ours.state_dict(), stock.state_dict()
    assert so.keys() == ss.keys()
    for k, v in so.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == ss[k].dtype and torch.equal(v, ss[k]), k
    ids = token_batch(ours.arch_config, 1, 16, seed=4)
    with torch.no_grad():
        lp = compute_stock_token_logprobs(stock, ids)
    assert lp.shape == (1, 15) and lp.dtype == torch.float32 and torch.isfinite(lp).all()
    with pytest.raises(ValueError, match="compute_stock_token_logprobs"):
        compute_token_logprobs(stock, ids)


def test_packed_sequences_equal_separate_sequences():
    """THD packing (cu_seqlens) through the core attention == each segment on its own (torch.equal)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_consistent.layers import make_transformer_config

    init_cpu_process_group()
    arch = arch_of("tiny-mistral-gqa")
    cfg = make_transformer_config(arch, torch.bfloat16, consistent=True)
    attn = consistent_core_attention(arch.rope)(config=cfg, layer_number=1, softmax_scale=None)
    g = torch.Generator().manual_seed(5)
    lens = [7, 33, 1, 12]
    t = sum(lens)
    q = torch.randn(t, 1, arch.num_heads, arch.head_dim, generator=g).bfloat16()
    k = torch.randn(t, 1, arch.num_kv_heads, arch.head_dim, generator=g).bfloat16()
    v = torch.randn(t, 1, arch.num_kv_heads, arch.head_dim, generator=g).bfloat16()
    cu = torch.tensor([0, 7, 40, 41, 53], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=33, max_seqlen_kv=33)
    packed = attn(q, k, v, None, packed_seq_params=psp)
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = attn(q[s0:s1], k[s0:s1], v[s0:s1], None)
        assert torch.equal(packed.reshape(t, -1)[s0:s1], alone[:, 0])


def test_spec_provider_protocol():
    from megatron.core.models.backends import BackendSpecProvider

    arch = arch_of("tiny-qwen3-qknorm-tied")
    provider = ConsistentSpecProvider(rope=arch.rope)
    for method in [m for m in dir(BackendSpecProvider) if not m.startswith("_")]:
        assert callable(getattr(provider, method)), method
    assert provider.fuse_layernorm_and_linear() is False
    assert provider.activation_func().__name__ == "ConsistentSiluAndMul"
    assert provider.core_attention().rope == arch.rope
    with pytest.raises(UnsupportedConfigError, match="megatron_moe_layer_spec"):  # where the consistent MoE layer comes from
        provider.grouped_mlp_modules(False, False)
    spec = get_consistent_gpt_layer_spec(qk_layernorm=True, rope=arch.rope)
    assert spec.submodules.self_attention.submodules.q_layernorm is not None
    assert spec.submodules.self_attn_bda is consistent_bias_dropout_add


def test_refusals_are_named():
    path = MODELS_DIR / "tiny-llama"
    with pytest.raises(UnsupportedConfigError, match="tensor parallelism of size 3"):
        build_consistent_gpt_model(path, tensor_model_parallel_size=3)
    with pytest.raises(UnsupportedConfigError, match="TP=2 x PP=1 needs"):
        build_consistent_gpt_model(path, tensor_model_parallel_size=2)
    with pytest.raises(UnsupportedConfigError, match="sequence parallelism"):
        build_consistent_gpt_model(path, sequence_parallel=True)
    with pytest.raises(UnsupportedConfigError, match="context parallelism of size 3"):
        build_consistent_gpt_model(path, context_parallel_size=3)
    with pytest.raises(UnsupportedConfigError, match="TP=1 x CP=2 x PP=1 needs"):  # CP 2 runs in ranks
        build_consistent_gpt_model(path, context_parallel_size=2)
    with pytest.raises(UnsupportedConfigError, match="TP=1 x PP=2 needs"):
        build_consistent_gpt_model(path, pipeline_model_parallel_size=2)
    hf = load_hf_config(path)
    with pytest.raises(UnsupportedConfigError, match="GPTNeoXForCausalLM"):
        build_consistent_gpt_model({**hf, "architectures": ["GPTNeoXForCausalLM"]})
    x = torch.zeros(3, 1, 4, dtype=torch.bfloat16)
    bda = consistent_bias_dropout_add(True, False)
    with pytest.raises(UnsupportedConfigError, match="bias"):
        bda((x, torch.zeros(4, dtype=torch.bfloat16)), x, 0.0)
    with pytest.raises(UnsupportedConfigError, match="dropout"):
        bda((x, None), x, 0.1)
    assert torch.equal(bda((x + 1, None), x, 0.0), kernels.add_residual(x + 1, x))


def test_non_causal_mask_refused(bf16_models):
    model = bf16_models["tiny-llama"]
    ids = token_batch(model.arch_config, 1, 8, seed=6)
    pos = kernels.causal_positions(1, 8)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        assert torch.equal(model(ids, pos, causal), model(ids, pos, None))
        with pytest.raises(UnsupportedConfigError, match="causal only"):
            model(ids, pos, torch.zeros(1, 1, 8, 8, dtype=torch.bool))
