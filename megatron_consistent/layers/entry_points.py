"""Public spec entry points: turn the consistent path on from a framework's own model builder.

Each framework resolves a layer spec its own way; each form below is what that
consumer expects (see ``docs/integration.md`` for the exact config lines):

* :data:`consistent_layer_spec` — a ``ModuleSpec`` constant for Megatron-LM's
  ``--spec megatron_consistent.layers.entry_points consistent_layer_spec``
  (``import_module`` -> ``vars(module)[name]``, used as is by the legacy GPT
  builder).  Its submodules adapt to the ``TransformerConfig`` they are built
  with: q/k RMSNorm follows ``config.qk_layernorm``, q/k/v biases follow
  ``config.add_qkv_bias``, the SwiGLU runs on the consistent kernel whatever
  ``use_te_activation_func`` says, and RoPE is read at build time (see
  :func:`resolve_rope`).
* :func:`consistent_layer_spec_provider` ``(provider_or_config, vp_stage=None)``
  — for Megatron-Bridge's ``GPTModelProvider.transformer_layer_spec`` and for
  the builders that call a non-``ModuleSpec`` spec as ``fn(config[, vp_stage])``.
  Returns a ``TransformerBlockSubmodules`` (the consistent layers and the
  consistent final norm), freshly built on every call.
* :func:`consistent_slime_spec` ``(args, config, vp_stage)`` — slime's ``--spec``
  form; RoPE comes from slime's (Megatron-LM's) ``args``.

* :data:`consistent_hybrid_stack_spec` — the hybrid (Mamba-2 / Nemotron-H) stack
  ``ModuleSpec`` for Megatron-LM's Mamba/hybrid builder
  (``--spec megatron_consistent.layers.entry_points consistent_hybrid_stack_spec``):
  :class:`.hybrid.ConsistentHybridStack` with the consistent Mamba mixer, no-RoPE
  attention, relu2 MLP and MoE layers (sizes read from the ``TransformerConfig``'s
  ``mamba_*`` / ``moe_*`` fields at build time; see :mod:`.hybrid`).

Every path puts every numerics-bearing op on the consistent kernels, including
the two modules a layer spec cannot name: the block's final norm and
``GPTModel.output_layer`` (swapped by the module-registration hook of :mod:`.head_swap`).

Tensor, pipeline and data parallelism as the framework sets them up: TP ∈ {1, 2, 4, 8} dividing the model's S (the
row-parallel K tree has S segments, 8 unless the config carries ``consistent_row_parallel_segments``: set it on the
framework's config as the HF checkpoint's ``config.json`` has it; the vocabulary tree has 8: the bits of TP = 1),
sequence parallelism at TP > 1 and any PP (the stage's layers).

MoE (the function forms): the layers ``moe_layer_freq`` names run Megatron's ``MoELayer`` with the consistent router
and experts (``layers/moe_megatron.py``), at any expert parallelism (``expert_model_parallel_size`` over the TP x DP
ranks, ``allgather`` or ``alltoall`` dispatcher) and at TP > 1 with sequence parallelism, with the one-process bits;
expert TP must be 1 (Megatron defaults it to the TP size).  The spec call refuses by name what it does not implement
(:func:`.moe_megatron.check_megatron_moe_config`: TP > 1 without sequence parallelism, expert TP > 1, token dropping,
fusions, ...).  The router's renormalisation follows ``moe_router_pre_softmax``.

Refused by name at build time: LayerNorm, MoE through the ``ModuleSpec`` constant, MLA, MTP, learned absolute
position embeddings, partial or interleaved RoPE, biases other than q/k/v,
non-SwiGLU MLPs, CP > 1, virtual pipeline stages (``docs/parallel.md``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from ..config import UnsupportedConfigError
from ..kernels import RopeConfig
from ..kernels.rotary import rope_scaling_items
from .attention import ConsistentCoreAttention
from .head_swap import install_head_swap_hook
from .hybrid import get_consistent_hybrid_stack_spec
from .linear import ConsistentColumnParallelLinear, ConsistentRowParallelLinear
from .mlp import ConsistentSiluAndMul, consistent_bias_dropout_add
from .norm import ConsistentRMSNorm
from .parallel import check_parallel_config

__all__ = [
    "ConsistentSelfAttention",
    "ConsistentTransformerLayer",
    "ConfigRopeCoreAttention",
    "consistent_hybrid_stack_spec",
    "consistent_layer_spec",
    "consistent_layer_spec_provider",
    "consistent_slime_spec",
    "make_consistent_layer_spec",
    "resolve_rope",
]

# Megatron's llama3 RoPE scaling takes only the factor; these are its fixed defaults
# (RotaryEmbedding._apply_scaling), which are also Llama 3.1's HF values.
_MEGATRON_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}


# --- RoPE, read at build time --------------------------------------------------------------------------------------
def _megatron_lm_args():
    """Megatron-LM's (and slime's) global training args, when that framework is running; else None."""
    try:
        from megatron.training.global_vars import get_args
    except ImportError:
        return None
    try:
        return get_args()
    except Exception:  # args not initialised (plain megatron-core use)
        return None


def _rope_from(src, head_dim: int) -> RopeConfig | None:
    """RoPE from an object with Megatron's rope fields (a Bridge provider, Megatron-LM/slime args); None if it has none."""
    base = getattr(src, "rotary_base", None)
    if base is None:
        return None
    pet = getattr(src, "position_embedding_type", None)
    if pet not in (None, "rope", "none"):
        raise UnsupportedConfigError(
            f"position_embedding_type={pet!r}: the consistent layers apply RoPE themselves; use 'rope' (Megatron's own rotary "
            "tensor is then ignored) or 'none'")
    if float(getattr(src, "rotary_percent", 1.0)) != 1.0:
        raise UnsupportedConfigError(f"unsupported feature: rotary_percent={src.rotary_percent} (partial rotary)")
    if getattr(src, "rotary_interleaved", False):
        raise UnsupportedConfigError("unsupported feature: rotary_interleaved (GPT-J style); the consistent layers use NeoX halves")
    if getattr(src, "seq_len_interpolation_factor", None):
        raise UnsupportedConfigError(f"unsupported feature: seq_len_interpolation_factor={src.seq_len_interpolation_factor}")
    scaling = None
    use_scaling = getattr(src, "use_rope_scaling", None)
    if use_scaling is None:
        use_scaling = getattr(src, "rope_scaling", False) is True
    if use_scaling:
        scaling = {"rope_type": "llama3", "factor": float(getattr(src, "rope_scaling_factor", 8.0)), **_MEGATRON_LLAMA3_DEFAULTS}
    max_pos = getattr(src, "max_position_embeddings", None) or getattr(src, "seq_length", None) or 4096
    return RopeConfig(int(head_dim), int(max_pos), float(base), "neox", rope_scaling_items(scaling))


def resolve_rope(config) -> RopeConfig:
    """The RoPE table the consistent core attention uses for ``config``, looked up at build time.

    In order: ``config.consistent_rope`` (a :class:`RopeConfig` set by hand: the
    escape hatch for llama3 parameters Megatron cannot express); the rope fields
    of ``config`` itself (a Megatron-Bridge ``GPTModelProvider`` carries
    ``rotary_base`` / ``rotary_percent`` / ``seq_length`` / ``position_embedding_type``);
    Megatron-LM's global args (``--rotary-base``, ``--use-rope-scaling``,
    ``--rope-scaling-factor``, ``--max-position-embeddings``,
    ``--position-embedding-type``).  Refuses when none is available.
    """
    explicit = getattr(config, "consistent_rope", None)
    if isinstance(explicit, RopeConfig):
        return explicit
    head_dim = getattr(config, "kv_channels", None) or config.hidden_size // config.num_attention_heads
    for src in (config, _megatron_lm_args()):
        if src is not None:
            rope = _rope_from(src, head_dim)
            if rope is not None:
                return rope
    raise UnsupportedConfigError(
        "no RoPE settings for the consistent attention: the config has no rotary_base and no Megatron-LM args are initialised; "
        "set config.consistent_rope = megatron_consistent.kernels.RopeConfig(...) or use consistent_layer_spec_provider")


def _check_config(config) -> None:
    """Refuse, by name, what the consistent layers do not implement (before any module is built)."""
    refusals = [
        (getattr(config, "multi_latent_attention", False), "multi-latent attention"),
        (getattr(config, "mtp_num_layers", None), "multi-token prediction (mtp_num_layers)"),
        (getattr(config, "add_bias_linear", False), "add_bias_linear (biases other than q/k/v)"),
        (getattr(config, "experimental_attention_variant", None), "experimental_attention_variant"),
        (getattr(config, "heterogeneous_block_specs", False), "heterogeneous_block_specs"),
    ]
    for value, what in refusals:
        if value:
            raise UnsupportedConfigError(f"unsupported feature for the consistent layers: {what}")
    if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
        raise UnsupportedConfigError(f"unsupported normalization {config.normalization!r} (the consistent layers implement RMSNorm)")
    if not getattr(config, "gated_linear_unit", False):
        raise UnsupportedConfigError("the consistent MLP is SwiGLU: set gated_linear_unit=True (Megatron-LM: --swiglu)")
    act = getattr(config, "activation_func", F.silu)
    if act is not F.silu:
        raise UnsupportedConfigError(f"unsupported activation {getattr(act, '__name__', act)!r} (SwiGLU: silu only)")
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise UnsupportedConfigError("virtual pipeline stages (virtual_pipeline_model_parallel_size) are not supported")
    cp = getattr(config, "context_parallel_size", 1)
    if cp != 1:  # the layers implement it (layers/context_parallel.py); this path is untested with a framework's CP
        raise UnsupportedConfigError(f"context parallelism (context_parallel_size={cp}) through the framework entry "
                                     "points is not supported (build_consistent_model / recompute_logprobs_parallel "
                                     "run GPT models at CP 2 / 4)")
    check_parallel_config(config)  # TP in {1, 2, 4, 8} dividing S, any PP, SP at TP > 1


# --- modules that adapt to the config they are built with ----------------------------------------------------------
class ConfigRopeCoreAttention(ConsistentCoreAttention):
    """:class:`ConsistentCoreAttention` whose RoPE is bound on the class or else read by :func:`resolve_rope` at build time."""

    def __init__(self, *, config, rope: RopeConfig | None = None, **kwargs):
        super().__init__(config=config, rope=rope or self.rope or resolve_rope(config), **kwargs)


class ConsistentSelfAttention(SelfAttention):
    """Megatron's SelfAttention with q/k norm following ``config.qk_layernorm`` and Megatron's rotary tensor ignored.

    RoPE runs inside the consistent core attention, so a model built with
    ``position_embedding_type='rope'`` (Megatron-LM's usual setting) must not
    rotate q/k a second time with Megatron's own kernel: the rotary arguments
    are dropped here.  q/k/v biases come from ``config.add_qkv_bias`` inside
    ``linear_qkv`` as in stock Megatron.
    """

    def __init__(self, config, submodules: SelfAttentionSubmodules, *args, **kwargs):
        if not getattr(config, "qk_layernorm", False):
            submodules = dataclasses.replace(submodules, q_layernorm=None, k_layernorm=None)
        super().__init__(config, submodules, *args, **kwargs)

    def forward(self, *args, **kwargs):
        for name in ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin"):
            if kwargs.get(name) is not None:
                kwargs[name] = None
        return super().forward(*args, **kwargs)


class ConsistentTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer; marks the block as consistent (final norm and LM head are swapped, see module doc).

    Stock MLP applies ``submodules.activation_func`` (here the consistent
    SwiGLU kernel) only when ``config.use_te_activation_func`` is set and
    otherwise runs its own torch GLU; when the framework's config does not set
    it, the layer is built with a shallow config copy that does, so no extra
    flag is needed on the framework side.
    """

    megatron_consistent = True  # read by the head-swap hook (layers/head_swap.py)

    def __init__(self, config, *args, layers_by_config: bool = False, **kwargs):
        _check_config(config)
        if getattr(config, "num_moe_experts", None) and not layers_by_config:
            raise UnsupportedConfigError("MoE (num_moe_experts) through the ModuleSpec constant (every layer dense): use "
                                         "consistent_layer_spec_provider / consistent_slime_spec, whose layers follow "
                                         "moe_layer_freq")
        install_head_swap_hook()
        if not getattr(config, "use_te_activation_func", False):
            config = copy.copy(config)
            config.use_te_activation_func = True
        super().__init__(config, *args, **kwargs)


# --- the specs -------------------------------------------------------------------------------------------------------
def make_consistent_layer_spec(rope: RopeConfig | None = None) -> ModuleSpec:
    """A fresh consistent TransformerLayer ModuleSpec; ``rope`` binds the RoPE table (else read at build time)."""
    core = ConfigRopeCoreAttention
    if rope is not None:
        core = type(f"ConfigRopeCoreAttention_{abs(hash(rope)):x}", (ConfigRopeCoreAttention,), {"rope": rope, "__module__": __name__})
    return ModuleSpec(
        module=ConsistentTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ConsistentRMSNorm,
            self_attention=ModuleSpec(
                module=ConsistentSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ConsistentColumnParallelLinear,
                    core_attention=core,
                    linear_proj=ConsistentRowParallelLinear,
                    q_layernorm=ConsistentRMSNorm,  # dropped at build time unless config.qk_layernorm
                    k_layernorm=ConsistentRMSNorm,
                ),
            ),
            self_attn_bda=consistent_bias_dropout_add,
            pre_mlp_layernorm=ConsistentRMSNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=ConsistentColumnParallelLinear,
                    linear_fc2=ConsistentRowParallelLinear,
                    activation_func=ConsistentSiluAndMul,
                ),
            ),
            mlp_bda=consistent_bias_dropout_add,
        ),
    )


#: Megatron-LM: ``--spec megatron_consistent.layers.entry_points consistent_layer_spec``.
consistent_layer_spec: ModuleSpec = make_consistent_layer_spec()

#: Megatron-LM hybrid / Mamba models: ``--spec megatron_consistent.layers.entry_points consistent_hybrid_stack_spec``.
consistent_hybrid_stack_spec: ModuleSpec = get_consistent_hybrid_stack_spec()


def _moe_pattern(config) -> list[bool]:
    """Which layers are MoE: Megatron's ``moe_layer_freq`` (an int k: every k-th layer from 0; a list: 1 / 0 a layer)."""
    n, freq = int(config.num_layers), getattr(config, "moe_layer_freq", 1)
    if not getattr(config, "num_moe_experts", None):
        return [False] * n
    pattern = [i % freq == 0 for i in range(n)] if isinstance(freq, int) else [bool(f) for f in freq]
    if len(pattern) != n:
        raise UnsupportedConfigError(f"moe_layer_freq {freq} names {len(pattern)} layers, the model has {n}")
    return pattern


def _block_spec(config, rope: RopeConfig | None) -> TransformerBlockSubmodules:
    """The consistent layers of this pipeline stage (all ``num_layers`` at PP = 1) and the consistent final norm; MoE
    layers (``moe_layer_freq``) on Megatron's ``MoELayer`` with the consistent router and experts
    (:func:`.moe_megatron.moe_layer_spec_from`; the MoE options it does not implement are refused here, by name)."""
    from .moe_megatron import check_megatron_moe_config, moe_layer_spec_from, norm_topk_prob_of

    _check_config(config)
    if getattr(config, "num_moe_experts", None):
        check_megatron_moe_config(config)
    dense = make_consistent_layer_spec(rope)
    dense.params = {**dense.params, "layers_by_config": True}
    first, layers = 0, int(config.num_layers)
    if (getattr(config, "pipeline_model_parallel_size", 1) or 1) > 1:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        first, layers = get_transformer_layer_offset(config), get_num_layers_to_build(config)
    pattern = _moe_pattern(config)[first:first + layers]  # a MoE spec a layer: each its own router-to-experts context
    return TransformerBlockSubmodules(layer_specs=[moe_layer_spec_from(dense, norm_topk_prob_of(config)) if is_moe
                                                   else dense for is_moe in pattern], layer_norm=ConsistentRMSNorm)


def consistent_layer_spec_provider(provider_or_config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Megatron-Bridge ``transformer_layer_spec`` / ``fn(config[, vp_stage])`` form.

    Reads RoPE from the provider (``rotary_base``, ...) when it has the fields
    (else at build time, :func:`resolve_rope`).  Returns a fresh
    ``TransformerBlockSubmodules`` on every call: the consistent layers of this pipeline stage (all ``num_layers``
    at PP = 1, Megatron's ``get_num_layers_to_build`` at PP > 1) and the consistent final norm.  (A block spec also
    keeps Bridge's ``attention_backend=local`` override, which rewrites ``spec.submodules...core_attention`` on a
    layer ModuleSpec, from touching it.)  ``vp_stage`` is accepted for the callers that pass it; virtual pipeline
    stages are refused by name.
    """
    config = provider_or_config
    _check_config(config)
    head_dim = getattr(config, "kv_channels", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "consistent_rope", None) or _rope_from(config, head_dim)
    return _block_spec(config, rope)


def consistent_slime_spec(args, config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """slime's ``--spec`` function form: ``fn(args, config, vp_stage)``; RoPE from slime's Megatron-LM ``args``."""
    head_dim = getattr(config, "kv_channels", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "consistent_rope", None) or _rope_from(args, head_dim)
    return _block_spec(config, rope)
