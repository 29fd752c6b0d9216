"""Dense decoder family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``): its weight table.

==============================================  ============================================  ==================
Megatron                                        HF                                            vLLM plugin
==============================================  ============================================  ==================
embedding.word_embeddings.weight                model.embed_tokens.weight                     embed_tokens
decoder.layers.i.input_layernorm.weight         model.layers.i.input_layernorm.weight         input_layernorm
decoder.layers.i.self_attention.linear_qkv.*    model.layers.i.self_attn.{q,k,v}_proj.*       qkv_proj / qkv_bias
decoder.layers.i.self_attention.q_layernorm     model.layers.i.self_attn.q_norm.weight        q_norm  (Qwen3)
decoder.layers.i.self_attention.k_layernorm     model.layers.i.self_attn.k_norm.weight        k_norm  (Qwen3)
decoder.layers.i.self_attention.linear_proj     model.layers.i.self_attn.o_proj.weight        o_proj
decoder.layers.i.pre_mlp_layernorm.weight       model.layers.i.post_attention_layernorm.weight  post_attention_layernorm
decoder.layers.i.mlp.linear_fc1.weight          model.layers.i.mlp.{gate,up}_proj.weight      gate_up_proj
decoder.layers.i.mlp.linear_fc2.weight          model.layers.i.mlp.down_proj.weight           down_proj
decoder.final_layernorm.weight                  model.norm.weight                             norm
output_layer.weight                             lm_head.weight  (absent when embeddings are tied)  lm_head
==============================================  ============================================  ==================

The MoE family (:mod:`.moe`) shares everything but the MLP of its MoE layers.
"""

from __future__ import annotations

from ..config import ArchConfig
from .weights import WeightEntry

__all__ = ["attention_entries", "dense_entries", "dense_mlp_entries", "embedding_entries", "final_entries", "layer_prefixes"]


def layer_prefixes(i: int) -> tuple[str, str, str]:
    """(Megatron, HF, vLLM plugin) name prefixes of decoder layer ``i``."""
    return f"decoder.layers.{i}.", f"model.layers.{i}.", f"layers.{i}."


def embedding_entries(arch: ArchConfig) -> list[WeightEntry]:
    vh = (arch.vocab_size, arch.hidden_size)
    return [WeightEntry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vh, (vh,), arch.dtype, "copy",
                        "embed_tokens", "vocab")]


def attention_entries(arch: ArchConfig, i: int) -> list[WeightEntry]:
    """Input norm, q|k|v (+ bias, + Qwen3 q/k norms), o_proj and the post-attention norm of layer ``i``."""
    a, dt = arch, arch.dtype
    m, h, e = layer_prefixes(i)
    hidden, hd = a.hidden_size, a.head_dim
    q, kv = a.num_heads * hd, a.num_kv_heads * hd
    out = [WeightEntry(m + "input_layernorm.weight", (h + "input_layernorm.weight",), (hidden,), ((hidden,),), dt, "copy",
                       e + "input_layernorm"),
           WeightEntry(m + "self_attention.linear_qkv.weight", tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
                       (q + 2 * kv, hidden), ((q, hidden), (kv, hidden), (kv, hidden)), dt, "qkv", e + "qkv_proj", "column")]
    if a.qkv_bias:
        out.append(WeightEntry(m + "self_attention.linear_qkv.bias", tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"),
                               (q + 2 * kv,), ((q,), (kv,), (kv,)), dt, "qkv", e + "qkv_bias", "column"))
    if a.qk_norm:
        out += [WeightEntry(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), (hd,), ((hd,),), dt, "copy",
                            e + "q_norm"),
                WeightEntry(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), (hd,), ((hd,),), dt, "copy",
                            e + "k_norm")]
    out += [WeightEntry(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), (hidden, q), ((hidden, q),), dt,
                        "copy", e + "o_proj", "row"),
            WeightEntry(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), (hidden,), ((hidden,),), dt, "copy",
                        e + "post_attention_layernorm")]
    return out


def dense_mlp_entries(arch: ArchConfig, i: int) -> list[WeightEntry]:
    """The SwiGLU MLP of layer ``i``: gate|up rows fused in ``linear_fc1``, then ``linear_fc2``."""
    m, h, e = layer_prefixes(i)
    hidden, inter, dt = arch.hidden_size, arch.intermediate_size, arch.dtype
    return [WeightEntry(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), (2 * inter, hidden),
                        ((inter, hidden),) * 2, dt, "fc1", e + "gate_up_proj", "column"),
            WeightEntry(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), (hidden, inter), ((hidden, inter),), dt, "copy",
                        e + "down_proj", "row")]


def final_entries(arch: ArchConfig) -> list[WeightEntry]:
    """Final norm and (untied) output layer."""
    hidden, dt = arch.hidden_size, arch.dtype
    vh = (arch.vocab_size, hidden)
    out = [WeightEntry("decoder.final_layernorm.weight", ("model.norm.weight",), (hidden,), ((hidden,),), dt, "copy", "norm")]
    if not arch.tie_word_embeddings:
        out.append(WeightEntry("output_layer.weight", ("lm_head.weight",), vh, (vh,), dt, "copy", "lm_head", "vocab"))
    return out


def dense_entries(arch: ArchConfig) -> list[WeightEntry]:
    """The dense family's table for ``arch``, in checkpoint order."""
    out = embedding_entries(arch)
    for i in range(arch.num_layers):
        out += attention_entries(arch, i) + dense_mlp_entries(arch, i)
    return out + final_entries(arch)
