"""Hybrid Mamba-2 family (``NemotronHForCausalLM``: layers ``M * - E``; ``Mamba2ForCausalLM``: every layer ``M``): its weight table.

The published checkpoint layout (what vLLM's ``nemotron_h.py`` / ``mamba2.py`` ``load_weights``
read; transformers 5 maps ``backbone.`` -> ``model.`` on load).  ``P`` = ``backbone.layers.{i}.``,
vLLM plugin names relative to ``layers.{i}.``:

=====================================================  ===================================================  =====================
Megatron                                               HF                                                   vLLM plugin
=====================================================  ===================================================  =====================
embedding.word_embeddings.weight                       backbone.embeddings.weight                           embed_tokens
M  decoder.layers.i.norm.weight                        P norm.weight                                        norm
M  decoder.layers.i.mixer.{in_proj,out_proj}.weight    P mixer.{in_proj,out_proj}.weight                    mixer.{in_proj,out_proj}
M  decoder.layers.i.mixer.conv1d.{weight,bias}         P mixer.conv1d.{weight [C, 1, K], bias}              mixer.conv_{weight,bias}
M  decoder.layers.i.mixer.{dt_bias,A_log,D}            P mixer.{dt_bias,A_log,D}                            mixer.{dt_bias,A_log,D}
M  decoder.layers.i.mixer.norm.weight                  P mixer.norm.weight                                  mixer.norm_weight
*  decoder.layers.i.input_layernorm.weight             P norm.weight                                        norm
*  decoder.layers.i.self_attention.linear_qkv.weight   P mixer.{q,k,v}_proj.weight  (grouped per KV head)   mixer.qkv_proj
*  decoder.layers.i.self_attention.linear_proj.weight  P mixer.o_proj.weight                                mixer.o_proj
-  decoder.layers.i.pre_mlp_layernorm.weight           P norm.weight                                        norm
-  decoder.layers.i.mlp.linear_fc{1,2}.weight          P mixer.{up,down}_proj.weight  (non-gated)           mixer.{up,down}_proj
E  decoder.layers.i.pre_mlp_layernorm.weight           P norm.weight                                        norm
E  decoder.layers.i.mlp.router.weight                  P mixer.gate.weight                                  mixer.gate
E  decoder.layers.i.mlp.router.expert_bias [E] fp32    P mixer.gate.e_score_correction_bias                 mixer.score_bias
E  decoder.layers.i.mlp.experts.linear_fc1 [E, I, H]   P mixer.experts.{e}.up_proj.weight                   mixer.experts_up
E  decoder.layers.i.mlp.experts.linear_fc2 [E, H, I]   P mixer.experts.{e}.down_proj.weight                 mixer.experts_down
E  decoder.layers.i.mlp.shared_experts.linear_fc{1,2}  P mixer.shared_experts.{up,down}_proj.weight         mixer.shared_{up,down}
decoder.final_norm.weight                              backbone.norm_f.weight                               norm
output_layer.weight                                    lm_head.weight  (absent when embeddings are tied)    lm_head
=====================================================  ===================================================  =====================

The plugin holds the Mamba mixers' small parameters (conv, ``dt_bias``, ``A_log``, ``D``, gated norm)
in float32; checkpoints and updates carry them in the model dtype (the copy widens them exactly).
"""

from __future__ import annotations

from ..config import ArchConfig, UnsupportedConfigError
from .weights import WeightEntry

__all__ = ["canonical_hf_name", "hybrid_entries"]

_HF_ALIASES = (("model.", "backbone."), ("backbone.embed_tokens.", "backbone.embeddings."))


def canonical_hf_name(name: str) -> str:
    """The table's name for an HF tensor name written with the ``model.*`` / ``embed_tokens`` aliases."""
    for alias, canonical in _HF_ALIASES:
        if name.startswith(alias):
            name = canonical + name[len(alias):]
    return name


def _copy(megatron: str, hf: str, shape: tuple[int, ...], dtype: str, engine: str, shard: str = "replicated",
          blocks: tuple[int, ...] = ()) -> WeightEntry:
    return WeightEntry(megatron, (hf,), shape, (shape,), dtype, "copy", engine, shard, blocks)


def _mamba(arch: ArchConfig, m: str, h: str, e: str) -> list[WeightEntry]:
    """A Mamba layer's entries; at TP > 1 a rank holds whole heads and the groups they read: ``in_proj`` / ``conv1d``
    cut per block (z | x | B | C | dt, x | B | C), ``dt_bias`` / ``A_log`` / ``D`` its heads, the gated-norm weight its
    groups' channels, ``out_proj`` row-parallel."""
    s, H, dt = arch.ssm, arch.hidden_size, arch.dtype
    rows = [("in_proj.weight", "in_proj", (s.in_proj_size, H), "blocks", s.in_proj_blocks),
            ("conv1d.weight", "conv_weight", (s.conv_dim, 1, s.conv_kernel), "blocks", s.conv_blocks),
            ("conv1d.bias", "conv_bias", (s.conv_dim,), "blocks", s.conv_blocks),
            ("dt_bias", "dt_bias", (s.num_heads,), "column", ()), ("A_log", "A_log", (s.num_heads,), "column", ()),
            ("D", "D", (s.num_heads,), "column", ()), ("norm.weight", "norm_weight", (s.d_inner,), "column", ()),
            ("out_proj.weight", "out_proj", (H, s.d_inner), "row", ())]
    out = [_copy(m + "norm.weight", h + "norm.weight", (H,), dt, e + "norm")]
    return out + [_copy(m + "mixer." + n, h + "mixer." + n, shape, dt, e + "mixer." + held, shard, blocks)
                  for n, held, shape, shard, blocks in rows if n != "conv1d.bias" or s.use_conv_bias]


def _attention(arch: ArchConfig, m: str, h: str, e: str) -> list[WeightEntry]:
    H, dt = arch.hidden_size, arch.dtype
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return [_copy(m + "input_layernorm.weight", h + "norm.weight", (H,), dt, e + "norm"),
            WeightEntry(m + "self_attention.linear_qkv.weight", tuple(h + f"mixer.{p}_proj.weight" for p in "qkv"), (q + 2 * kv, H),
                        ((q, H), (kv, H), (kv, H)), dt, "qkv", e + "mixer.qkv_proj", "column"),
            _copy(m + "self_attention.linear_proj.weight", h + "mixer.o_proj.weight", (H, q), dt, e + "mixer.o_proj", "row")]


def _mlp(arch: ArchConfig, m: str, h: str, e: str) -> list[WeightEntry]:
    H, inter, dt = arch.hidden_size, arch.intermediate_size, arch.dtype
    return [_copy(m + "pre_mlp_layernorm.weight", h + "norm.weight", (H,), dt, e + "norm"),
            _copy(m + "mlp.linear_fc1.weight", h + "mixer.up_proj.weight", (inter, H), dt, e + "mixer.up_proj", "column"),
            _copy(m + "mlp.linear_fc2.weight", h + "mixer.down_proj.weight", (H, inter), dt, e + "mixer.down_proj", "row")]


def _moe(arch: ArchConfig, m: str, h: str, e: str) -> list[WeightEntry]:
    E, H, inter, si, dt = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size, arch.shared_expert_intermediate_size, arch.dtype
    return [_copy(m + "pre_mlp_layernorm.weight", h + "norm.weight", (H,), dt, e + "norm"),
            _copy(m + "mlp.router.weight", h + "mixer.gate.weight", (E, H), dt, e + "mixer.gate"),
            _copy(m + "mlp.router.expert_bias", h + "mixer.gate.e_score_correction_bias", (E,), "float32", e + "mixer.score_bias"),
            WeightEntry(m + "mlp.experts.linear_fc1.weight", tuple(h + f"mixer.experts.{x}.up_proj.weight" for x in range(E)),
                        (E, inter, H), ((inter, H),) * E, dt, "experts_fc2", e + "mixer.experts_up", "experts"),
            WeightEntry(m + "mlp.experts.linear_fc2.weight", tuple(h + f"mixer.experts.{x}.down_proj.weight" for x in range(E)),
                        (E, H, inter), ((H, inter),) * E, dt, "experts_fc2", e + "mixer.experts_down", "experts"),
            _copy(m + "mlp.shared_experts.linear_fc1.weight", h + "mixer.shared_experts.up_proj.weight", (si, H), dt,
                  e + "mixer.shared_up"),
            _copy(m + "mlp.shared_experts.linear_fc2.weight", h + "mixer.shared_experts.down_proj.weight", (H, si), dt,
                  e + "mixer.shared_down")]


_LAYER_ENTRIES = {"mamba": _mamba, "attention": _attention, "mlp": _mlp, "moe": _moe}


def hybrid_entries(arch: ArchConfig) -> list[WeightEntry]:
    """The hybrid family's table for ``arch``, in checkpoint order."""
    if not arch.is_hybrid:
        raise UnsupportedConfigError(f"{arch.architecture} is not a hybrid architecture")
    H, V, dt = arch.hidden_size, arch.vocab_size, arch.dtype
    out = [_copy("embedding.word_embeddings.weight", "backbone.embeddings.weight", (V, H), dt, "embed_tokens", "vocab")]
    for i, kind in enumerate(arch.layer_types):
        out += _LAYER_ENTRIES[kind](arch, f"decoder.layers.{i}.", f"backbone.layers.{i}.", f"layers.{i}.")
    out.append(_copy("decoder.final_norm.weight", "backbone.norm_f.weight", (H,), dt, "norm"))
    if not arch.tie_word_embeddings:
        out.append(_copy("output_layer.weight", "lm_head.weight", (V, H), dt, "lm_head", "vocab"))
    return out
