"""Hybrid Mamba-2 / Nemotron-H: Megatron (layers/hybrid.py) <-> HF safetensors names, bitwise.

The published NemotronH / Mamba2 checkpoint layout (what vLLM's ``nemotron_h.py`` /
``mamba2.py`` ``load_weights`` read, and what transformers 5 maps ``backbone.`` ->
``model.`` and merges the per-expert tensors from on load).  ``P`` = ``backbone.layers.{i}.``:

=====================================================  ===================================================
Megatron                                               HF
=====================================================  ===================================================
embedding.word_embeddings.weight                       backbone.embeddings.weight
M  decoder.layers.i.norm.weight                        P norm.weight
M  decoder.layers.i.mixer.{in_proj,out_proj}.weight    P mixer.{in_proj,out_proj}.weight
M  decoder.layers.i.mixer.conv1d.{weight,bias}         P mixer.conv1d.{weight [C, 1, K], bias}
M  decoder.layers.i.mixer.{dt_bias,A_log,D}            P mixer.{dt_bias,A_log,D}
M  decoder.layers.i.mixer.norm.weight                  P mixer.norm.weight
*  decoder.layers.i.input_layernorm.weight             P norm.weight
*  decoder.layers.i.self_attention.linear_qkv.weight   P mixer.{q,k,v}_proj.weight   (grouped per KV head, as hf.py)
*  decoder.layers.i.self_attention.linear_proj.weight  P mixer.o_proj.weight
-  decoder.layers.i.pre_mlp_layernorm.weight           P norm.weight
-  decoder.layers.i.mlp.linear_fc{1,2}.weight          P mixer.{up,down}_proj.weight  (non-gated)
E  decoder.layers.i.pre_mlp_layernorm.weight           P norm.weight
E  decoder.layers.i.mlp.router.weight                  P mixer.gate.weight
E  decoder.layers.i.mlp.router.expert_bias [E] fp32    P mixer.gate.e_score_correction_bias
E  decoder.layers.i.mlp.experts.linear_fc1 [E, I, H]   P mixer.experts.{e}.up_proj.weight
E  decoder.layers.i.mlp.experts.linear_fc2 [E, H, I]   P mixer.experts.{e}.down_proj.weight
E  decoder.layers.i.mlp.shared_experts.linear_fc{1,2}  P mixer.shared_experts.{up,down}_proj.weight
decoder.final_norm.weight                              backbone.norm_f.weight
output_layer.weight                                    lm_head.weight  (absent when embeddings are tied)
=====================================================  ===================================================

Only slicing, stacking and copies — export -> import is bitwise.  Export / import are
:func:`.hf.export_hf` / :func:`.hf.import_hf`, which dispatch here on ``arch.is_hybrid``.
"""

from __future__ import annotations

from ..config import ArchConfig, UnsupportedConfigError

__all__ = ["hybrid_param_shapes", "hybrid_plan"]

_MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def hybrid_plan(arch: ArchConfig) -> list[tuple[str, list[str], str]]:
    """Entries ``(megatron_name, [hf_names], kind)``; kinds as in :mod:`.hf` (``copy``, ``qkv``) and :mod:`.moe` (``experts_fc2`` = per-expert stack)."""
    if not arch.is_hybrid:
        raise UnsupportedConfigError(f"{arch.architecture} is not a hybrid architecture")
    plan = [("embedding.word_embeddings.weight", ["backbone.embeddings.weight"], "copy")]
    for i, kind in enumerate(arch.layer_types):
        m, h = f"decoder.layers.{i}.", f"backbone.layers.{i}."
        if kind == "mamba":
            plan.append((m + "norm.weight", [h + "norm.weight"], "copy"))
            names = [n for n in _MIXER if n != "conv1d.bias" or arch.ssm.use_conv_bias]
            plan += [(m + "mixer." + n, [h + "mixer." + n], "copy") for n in names]
        elif kind == "attention":
            plan.append((m + "input_layernorm.weight", [h + "norm.weight"], "copy"))
            plan.append((m + "self_attention.linear_qkv.weight", [h + f"mixer.{p}_proj.weight" for p in "qkv"], "qkv"))
            plan.append((m + "self_attention.linear_proj.weight", [h + "mixer.o_proj.weight"], "copy"))
        elif kind == "mlp":
            plan.append((m + "pre_mlp_layernorm.weight", [h + "norm.weight"], "copy"))
            plan.append((m + "mlp.linear_fc1.weight", [h + "mixer.up_proj.weight"], "copy"))
            plan.append((m + "mlp.linear_fc2.weight", [h + "mixer.down_proj.weight"], "copy"))
        else:  # moe
            E = arch.num_experts
            plan += [
                (m + "pre_mlp_layernorm.weight", [h + "norm.weight"], "copy"),
                (m + "mlp.router.weight", [h + "mixer.gate.weight"], "copy"),
                (m + "mlp.router.expert_bias", [h + "mixer.gate.e_score_correction_bias"], "copy"),
                (m + "mlp.experts.linear_fc1.weight", [h + f"mixer.experts.{e}.up_proj.weight" for e in range(E)], "experts_fc2"),
                (m + "mlp.experts.linear_fc2.weight", [h + f"mixer.experts.{e}.down_proj.weight" for e in range(E)], "experts_fc2"),
                (m + "mlp.shared_experts.linear_fc1.weight", [h + "mixer.shared_experts.up_proj.weight"], "copy"),
                (m + "mlp.shared_experts.linear_fc2.weight", [h + "mixer.shared_experts.down_proj.weight"], "copy"),
            ]
    plan.append(("decoder.final_norm.weight", ["backbone.norm_f.weight"], "copy"))
    if not arch.tie_word_embeddings:
        plan.append(("output_layer.weight", ["lm_head.weight"], "copy"))
    return plan


def hybrid_param_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Megatron parameter name -> the shape ``arch`` implies (checked before any export / import)."""
    H, V = arch.hidden_size, arch.vocab_size
    out = {"embedding.word_embeddings.weight": (V, H), "decoder.final_norm.weight": (H,), "output_layer.weight": (V, H)}
    for i, kind in enumerate(arch.layer_types):
        m = f"decoder.layers.{i}."
        if kind == "mamba":
            s = arch.ssm
            out.update({m + "norm.weight": (H,), m + "mixer.in_proj.weight": (s.in_proj_size, H),
                        m + "mixer.conv1d.weight": (s.conv_dim, 1, s.conv_kernel), m + "mixer.conv1d.bias": (s.conv_dim,),
                        m + "mixer.dt_bias": (s.num_heads,), m + "mixer.A_log": (s.num_heads,), m + "mixer.D": (s.num_heads,),
                        m + "mixer.norm.weight": (s.d_inner,), m + "mixer.out_proj.weight": (H, s.d_inner)})
        elif kind == "attention":
            q, kv, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
            out.update({m + "input_layernorm.weight": (H,), m + "self_attention.linear_qkv.weight": ((q + 2 * kv) * hd, H),
                        m + "self_attention.linear_proj.weight": (H, q * hd)})
        elif kind == "mlp":
            out.update({m + "pre_mlp_layernorm.weight": (H,), m + "mlp.linear_fc1.weight": (arch.intermediate_size, H),
                        m + "mlp.linear_fc2.weight": (H, arch.intermediate_size)})
        else:
            E, inter, si = arch.num_experts, arch.moe_intermediate_size, arch.shared_expert_intermediate_size
            out.update({m + "pre_mlp_layernorm.weight": (H,), m + "mlp.router.weight": (E, H), m + "mlp.router.expert_bias": (E,),
                        m + "mlp.experts.linear_fc1.weight": (E, inter, H), m + "mlp.experts.linear_fc2.weight": (E, H, inter),
                        m + "mlp.shared_experts.linear_fc1.weight": (si, H), m + "mlp.shared_experts.linear_fc2.weight": (H, si)})
    return out

