"""Hybrid Mamba-2 / Nemotron-H models on Megatron-Core's MambaStack (0.16) / HybridStack (0.19), consistent kernels only.

Layer kinds (HF ``hybrid_override_pattern`` characters; Megatron's layer symbols):

* ``M`` -> Megatron ``MambaLayer``: ``norm`` (:class:`ConsistentHybridNorm`) ->
  :class:`ConsistentMambaMixer` -> residual add (:func:`kernels.add_residual`);
* ``*`` -> ``TransformerLayer`` with attention only: RMSNorm -> ``linear_qkv`` ->
  :class:`ConsistentNoRopeCoreAttention` (Nemotron-H attention has NO rotary
  embedding: neither HF's ``NemotronHAttention`` nor vLLM's ``nemotron_h.py``
  rotates q/k) -> ``linear_proj`` -> residual add;
* ``-`` -> ``MLPLayer``: RMSNorm -> ``linear_fc1`` -> :class:`ConsistentReluSquared`
  (non-gated ``relu2``) -> ``linear_fc2`` -> residual add;
* ``E`` -> ``TransformerLayer`` with the MoE slot only: RMSNorm ->
  :class:`.moe.ConsistentMoELayer` (non-gated relu2 experts, sigmoid routing with
  the float32 selection bias, group limit, routed scaling, ungated shared expert).

After the last layer the stack's final norm is :class:`ConsistentRMSNorm`
(:class:`ConsistentHybridStack` builds it instead of Megatron's hard-coded
``TENorm``) and the LM head is :class:`.output.ConsistentOutputLayer` (float32 logits).

Mixer dataflow (``docs/hybrid.md``; HF NemotronH / Mamba2
names), for hidden ``[s, b, H]`` taken to ``[b, s, H]``::

    zxbcdt = linear(h, in_proj.weight)                         # [b, s, d_inner + conv_dim + nh]
    z, xBC, dt = split(zxbcdt, [d_inner, conv_dim, nh])
    xBC, _ = causal_conv1d(xBC, conv1d.weight[:, 0, :], conv1d.bias, None, "silu")
    x, B, C = split(xBC, [d_inner, G*N, G*N])
    dt = mamba_dt(dt, dt_bias, *time_step_limit)               # float32
    A = ssm_decay_rate(A_log)                                  # -exp(float32(A_log)), own exp, float32
    y, _ = ssd_scan(x, dt, A, B, C, D, chunk_size)             # every sequence starts on a chunk boundary
    y = gated_rms_norm(y, z, norm.weight, d_inner // G, eps)
    out = row_parallel_linear(y, out_proj.weight)         # the row-parallel K-segment tree (kernels/linear.py)

Every sequence of a batch starts at position 0 (a chunk boundary); THD-packed
input is split at ``cu_seqlens_q`` and every segment is scanned on its own, so
packing never changes a row.  Parameters are all in the model dtype
(``A_log``, ``D``, ``dt_bias`` included, as in the HF checkpoints); the kernels
compute in float32.

Model builder: :func:`build_consistent_hybrid_model` (also reached through
:func:`.model.build_consistent_model`, which dispatches on ``arch.is_hybrid``);
the class is Megatron's ``HybridModel`` when it exists (0.19) else ``MambaModel``
(0.16), with ``position_embedding_type='none'``.

Tensor parallelism (TP = t ∈ {1, 2, 4, 8} dividing the Mamba groups, hence the heads; the attention / MLP widths
as for GPT layers): the numerics contract is the bits of TP = 1.  The mixer's rank holds whole heads and groups
(:class:`ConsistentMambaMixer`), every op between ``in_proj`` and ``out_proj`` reduces only within one head or one
group (the gated RMSNorm's sum of squares: one group's ``d_inner / G`` channels), ``out_proj`` / ``linear_proj`` /
``linear_fc2`` run the row-parallel K tree (rank subtrees all-gathered in rank order), the MoE layers shard their
experts over the TP ranks (:mod:`.moe`), embedding / LM head / log-softmax are vocab-parallel
(``docs/parallel.md``).  Pipeline parallelism: Megatron's stack builds the stage's slice of the pattern and the
stages pass activations unchanged.  Sequence parallelism: the mixer's ``in_proj`` takes the rank's ``[s/t, b, H]``
chunk and gives the whole sequence (all-gathered input), the scan runs on whole sequences, ``out_proj`` returns
the rank's chunk of the same tree.  Refused by name: EP / CP > 1 (:data:`.parallel.HYBRID_FEATURE`), a TP not
dividing the groups, inference contexts (KV / SSM cache inside Megatron), ``residual_in_fp32``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn

from .. import kernels
from ..config import ArchConfig, SSMConfig, UnsupportedConfigError
from .attention import ConsistentCoreAttention, _check_attention_features
from .builder import CONSISTENT, make_transformer_config, prepare_build, seeded_build
from .head_swap import install_head_swap_hook
from . import tensor_parallel as tpar
from .linear import ConsistentColumnParallelLinear, ConsistentRowParallelLinear, _set_tp_attributes, sharded_state_dict_tp1
from .mlp import consistent_bias_dropout_add
from .norm import ConsistentRMSNorm
from .output import ConsistentOutputLayer
from .parallel import HYBRID_FEATURE, check_parallel_config

__all__ = [
    "ConsistentHybridNorm", "ConsistentHybridStack", "ConsistentMambaMixer", "ConsistentNoRopeCoreAttention", "ConsistentReluSquared",
    "build_consistent_hybrid_model", "get_consistent_hybrid_stack_spec", "hybrid_pattern",
]


def hybrid_pattern(arch: ArchConfig) -> str:
    """Megatron's layer pattern (``M * - E``) of a hybrid ``arch``."""
    if not arch.is_hybrid:
        raise UnsupportedConfigError(f"{arch.architecture} is not a hybrid (Mamba) architecture")
    return arch.hybrid_pattern


# ---------------------------------------------------------------------------------------------- small modules
class ConsistentHybridNorm(ConsistentRMSNorm):
    """:class:`ConsistentRMSNorm` whose ``eps`` defaults to ``config.layernorm_epsilon`` (Megatron 0.16's MambaLayer passes none)."""

    def __init__(self, config, hidden_size: int, eps: float | None = None, **unused):
        super().__init__(config, hidden_size, config.layernorm_epsilon if eps is None else eps)


class ConsistentReluSquared(nn.Module):
    """MLP activation slot: ``relu(x)**2`` by :func:`kernels.relu_squared` (non-gated: ``gated_linear_unit`` must be False)."""

    def __init__(self, config=None, **unused):
        super().__init__()
        if config is not None and getattr(config, "gated_linear_unit", False):
            raise UnsupportedConfigError("ConsistentReluSquared is the non-gated relu2 MLP; gated_linear_unit must be False")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.relu_squared(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}


class ConsistentNoRopeCoreAttention(ConsistentCoreAttention):
    """:class:`ConsistentCoreAttention` without rotary embedding (Nemotron-H): causal :func:`kernels.attention` of q, k, v."""

    def __init__(self, *, config, layer_number: int = 1, attn_mask_type=None, attention_type: str = "self",
                 softmax_scale: float | None = None, **unused):
        nn.Module.__init__(self)
        check_parallel_config(config, feature=HYBRID_FEATURE)
        _check_attention_features(config, attention_type, attn_mask_type)
        self.layer_number = layer_number
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)

    def _rotate(self, q, k, positions):
        return q, k


# ---------------------------------------------------------------------------------------------- the mixer
class _Params(nn.Module):
    """A parameter holder (``conv1d`` / ``norm``) so state-dict names match HF's and Megatron's."""


def ssm_config_from_transformer_config(config, chunk_size: int = 128, conv_kernel: int = 4) -> SSMConfig:
    """The :class:`SSMConfig` that Megatron's own mixer would build from a ``TransformerConfig`` (``mamba_*`` fields)."""
    head_dim = int(getattr(config, "mamba_head_dim", 64))
    heads = getattr(config, "mamba_num_heads", None) or (2 * config.hidden_size) // head_dim
    return SSMConfig(num_heads=int(heads), head_dim=head_dim, state_size=int(getattr(config, "mamba_state_dim", 128)),
                     n_groups=int(getattr(config, "mamba_num_groups", 8)), conv_kernel=conv_kernel, chunk_size=chunk_size,
                     norm_eps=float(config.layernorm_epsilon))


class ConsistentMambaMixer(nn.Module):
    """Megatron mixer slot of ``MambaLayer``: ``forward(h [s, b, H]) -> (out [s, b, H], None)`` by the Mamba-2 kernels.

    Parameters (HF names inside ``mixer.``): ``in_proj.weight [d_inner + conv_dim + nh, H]``,
    ``conv1d.weight [conv_dim, 1, K]``, ``conv1d.bias [conv_dim]`` (``use_conv_bias``),
    ``dt_bias [nh]``, ``A_log [nh]``, ``D [nh]``, ``norm.weight [d_inner]``, ``out_proj.weight [H, d_inner]``.
    Init (seeded, float32 then cast): linears as Megatron's; conv uniform(+-1/sqrt(K)) like
    ``nn.Conv1d``; ``dt_bias`` = softplus^-1 of log-uniform dt in [1e-3, 1e-1] (floor 1e-4);
    ``A_log = log(1..nh)`` (HF NemotronH); ``D = 1``; ``norm.weight = 1``.

    Tensor parallelism (TP = t dividing ``num_heads`` and ``n_groups``, Megatron's layout of its own mixer): rank r
    holds heads ``[r nh/t, (r+1) nh/t)`` and the groups they read, ``[r G/t, (r+1) G/t)`` (heads of a group are
    consecutive): the rows of each ``in_proj`` block z | x | B | C | dt (``partition_sections``,
    :func:`.tensor_parallel.shard_like`), the ``conv1d`` channels of its x | B | C, its ``dt_bias`` / ``A_log`` /
    ``D`` and the ``norm.weight`` of its groups; ``out_proj`` is row-parallel (the model's S-segment K tree: rank
    subtrees all-gathered in rank order).  Every op between the two linears is per channel (conv), per head (dt, SSD
    scan) or per group (the gated RMSNorm's sum of squares), so a rank computes whole the values it owns and the output
    is bitwise that of TP = 1; the seeded init draws the full tensors, then takes the rank's piece.
    """

    capture = None  # diagnostics: a callable(in_proj, dt, ssd, gated_norm) of each sequence's [1, T, ...]; None = off

    def __init__(self, config, d_model: int | None = None, layer_number: int | None = None, pg_collection=None,
                 pp_layer_offset: int = 0, *, ssm: SSMConfig | None = None, chunk_size: int = 128, **unused):
        super().__init__()
        check_parallel_config(config, feature=HYBRID_FEATURE)
        self.config = config
        self.ssm = s = ssm or ssm_config_from_transformer_config(config, chunk_size)
        d_model = d_model or config.hidden_size
        self.d_model, self.layer_number = d_model, layer_number
        if s.d_inner % s.n_groups or s.num_heads % s.n_groups:
            raise UnsupportedConfigError(f"Mamba mixer: n_groups {s.n_groups} must divide num_heads {s.num_heads}")
        t, rank = tpar.tp_size(), tpar.tp_rank()
        self.local_ssm = s.per_rank(t)  # this rank's heads and groups
        dt = config.params_dtype
        self.in_proj = ConsistentColumnParallelLinear(d_model, s.in_proj_size, config=config, init_method=config.init_method,
                                                      bias=False, partition_sections=s.in_proj_blocks)

        def piece(full: torch.Tensor, sections=None) -> nn.Parameter:  # this rank's piece of a seeded full tensor
            p = nn.Parameter(torch.empty(full.shape[0] // t, *full.shape[1:], dtype=dt))
            _set_tp_attributes(p, 0, 1, sections)
            p.data.copy_(tpar.shard_like(full.to(dt), p, rank, t))
            return p

        self.conv1d = _Params()
        bound = 1.0 / math.sqrt(s.conv_kernel)
        self.conv1d.weight = piece(torch.empty(s.conv_dim, 1, s.conv_kernel).uniform_(-bound, bound), s.conv_blocks)
        self.conv1d.bias = piece(torch.empty(s.conv_dim).uniform_(-bound, bound), s.conv_blocks) if s.use_conv_bias else None
        dt0 = torch.exp(torch.rand(s.num_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = piece(dt0 + torch.log(-torch.expm1(-dt0)))
        self.A_log = piece(torch.log(torch.arange(1, s.num_heads + 1, dtype=torch.float32)))
        self.D = piece(torch.ones(s.num_heads))
        self.norm = _Params()
        self.norm.weight = piece(torch.ones(s.d_inner))
        self.out_proj = ConsistentRowParallelLinear(s.d_inner, d_model, config=config,
                                                    init_method=getattr(config, "output_layer_init_method", None), bias=False)

    # -- forward ---------------------------------------------------------------------------------------------
    def mix(self, h: torch.Tensor) -> torch.Tensor:
        """``[b, T, H] -> [b, T, H]`` for sequences that start at position 0 (no sequence parallelism)."""
        zxbcdt, _ = self.in_proj(h)
        out, _ = self.out_proj(self._scan(zxbcdt))
        return out

    def _scan(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """``in_proj`` rows of this rank ``[b, T, P]`` -> the gated-norm output of its heads ``[b, T, d_inner / t]``."""
        s = self.local_ssm
        b, t, _ = zxbcdt.shape
        z, xbc, dt_raw = torch.split(zxbcdt, [s.d_inner, s.conv_dim, s.num_heads], dim=-1)
        zero_state = xbc.new_zeros(b, s.conv_kernel - 1, s.conv_dim)  # sequences start at position 0 (explicit: autograd-safe)
        xbc, _ = kernels.causal_conv1d(xbc, self.conv1d.weight[:, 0, :], self.conv1d.bias, zero_state, "silu")
        gn = s.n_groups * s.state_size
        x, B, C = torch.split(xbc, [s.d_inner, gn, gn], dim=-1)
        dt = kernels.mamba_dt(dt_raw, self.dt_bias, *s.time_step_limit)
        y, _ = kernels.ssd_scan(x.reshape(b, t, s.num_heads, s.head_dim), dt, kernels.ssm_decay_rate(self.A_log),
                                B.reshape(b, t, s.n_groups, s.state_size), C.reshape(b, t, s.n_groups, s.state_size), self.D,
                                s.chunk_size)
        g = kernels.gated_rms_norm(y.reshape(b, t, s.d_inner), z, self.norm.weight, s.group_size, s.norm_eps)
        if self.capture is not None:
            self.capture(zxbcdt, dt, y.reshape(b, t, s.d_inner), g)
        return g

    def forward(self, hidden_states: torch.Tensor, inference_context=None, packed_seq_params=None, inference_params=None, **unused):
        if inference_context is not None or inference_params is not None:
            raise UnsupportedConfigError("Megatron inference contexts (SSM/conv state caches) are not supported by the consistent "
                                         "Mamba mixer; generate with the vLLM plugin")
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, P]; under sequence parallelism the whole sequence (gathered)
        if packed_seq_params is not None:
            g = self._scan_packed(zxbcdt, packed_seq_params)
        else:
            g = self._scan(zxbcdt.transpose(0, 1)).transpose(0, 1)
        out, _ = self.out_proj(g)  # under sequence parallelism: this rank's sequence chunk of the tree
        return out, None

    def _scan_packed(self, zxbcdt: torch.Tensor, psp) -> torch.Tensor:
        fmt = getattr(psp, "qkv_format", "thd")
        if fmt != "thd" or psp.cu_seqlens_q is None:
            raise UnsupportedConfigError(f"unsupported packed_seq_params (qkv_format {fmt!r}; thd with cu_seqlens_q only)")
        if zxbcdt.dim() == 3 and zxbcdt.shape[1] != 1:
            raise UnsupportedConfigError(f"packed (thd) input must have batch 1, got {zxbcdt.shape[1]}")
        flat = zxbcdt.reshape(zxbcdt.shape[0], zxbcdt.shape[-1])
        bounds = [int(x) for x in psp.cu_seqlens_q.tolist()]
        if bounds[0] != 0 or bounds[-1] != flat.shape[0] or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise UnsupportedConfigError(f"cu_seqlens_q {bounds} does not partition the {flat.shape[0]} packed tokens")
        outs = [self._scan(flat[s0:s1][None])[0] for s0, s1 in zip(bounds, bounds[1:]) if s1 > s0]
        return torch.cat(outs, dim=0).reshape(*zxbcdt.shape[:-1], -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's mixer checkpoint layout: TP-split tensors with their global offsets, ``in_proj.weight`` saved as
        its blocks ``.z .x .B .C .dt`` and ``conv1d.*`` as ``.x .B .C`` (Megatron's ``_split_tensor_factory``), so a
        checkpoint saved at one TP loads at another."""
        from megatron.core.ssm.mamba_mixer import _split_tensor_factory

        axes = {"in_proj.weight": 0, "conv1d.weight": 0, "conv1d.bias": 0, "dt_bias": 0, "A_log": 0, "D": 0, "norm.weight": 0,
                "out_proj.weight": 1}
        out = sharded_state_dict_tp1(self, prefix, sharded_offsets, metadata, axes)
        s = self.local_ssm
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(out[f"{prefix}in_proj.weight"], list(s.in_proj_blocks),
                                                               ["z", "x", "B", "C", "dt"], 0)
        for name in ("conv1d.weight", "conv1d.bias"):
            if f"{prefix}{name}" in out:
                out[f"{prefix}{name}"] = _split_tensor_factory(out[f"{prefix}{name}"], list(s.conv_blocks), ["x", "B", "C"], 0)
        return out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, {self.ssm}"


# ---------------------------------------------------------------------------------------------- the stack
def _stack_classes():
    """(stack class, submodules dataclass) — HybridStack (0.19) or MambaStack (0.16)."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules

        return HybridStack, HybridStackSubmodules
    except ImportError:
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        return MambaStack, MambaStackSubmodules


_Stack, _StackSubmodules = _stack_classes()


class ConsistentHybridStack(_Stack):
    """Megatron's Mamba/Hybrid stack with the consistent final RMSNorm in place of its hard-coded ``TENorm``."""

    megatron_consistent_hybrid_stack = True  # read by the head-swap hook (layers/head_swap.py)

    def __init__(self, config, submodules, *args, **kwargs):
        if kwargs.get("residual_in_fp32"):
            raise UnsupportedConfigError("unsupported feature: residual_in_fp32=True (the residual stream stays in the model dtype)")
        post_layer_norm = kwargs.pop("post_layer_norm", True)
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = ConsistentRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        install_head_swap_hook()  # a model whose decoder is this stack gets the consistent LM head (entry-point builds)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            raise UnsupportedConfigError("rotary position embeddings in a hybrid model (position_embedding_type='rope'): "
                                         "Nemotron-H attention has none; build the model with position_embedding_type='none'")
        return super().forward(hidden_states, attention_mask, inference_context=inference_context, rotary_pos_emb=None, **kwargs)


def _arch_from_transformer_config(config) -> ArchConfig:
    """The MoE fields :class:`.moe.ConsistentMoELayer` reads, from a Megatron ``TransformerConfig`` (entry-point use)."""
    experts = getattr(config, "num_moe_experts", None)
    if not experts:
        raise UnsupportedConfigError("an E (MoE) layer needs num_moe_experts in the TransformerConfig")
    scoring = getattr(config, "moe_router_score_function", "softmax")
    if getattr(config, "gated_linear_unit", False):
        raise UnsupportedConfigError("the consistent hybrid MoE layer implements Nemotron-H's non-gated relu2 experts only")
    top_k = int(config.moe_router_topk)
    return ArchConfig(
        architecture="NemotronHForCausalLM", vocab_size=1, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_layers=config.num_layers, num_heads=config.num_attention_heads, num_kv_heads=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels, rms_norm_eps=config.layernorm_epsilon, rope_theta=10000.0, max_position_embeddings=1,
        num_experts=int(experts), num_experts_per_tok=top_k, moe_intermediate_size=int(config.moe_ffn_hidden_size),
        norm_topk_prob=scoring == "sigmoid" and top_k > 1,  # Megatron's sigmoid top-k renormalizes when k > 1
        shared_expert_intermediate_size=int(getattr(config, "moe_shared_expert_intermediate_size", None) or 0),
        layer_types=("moe",), use_rope=False, hidden_act="relu2", moe_scoring=scoring,
        moe_n_group=int(getattr(config, "moe_router_num_groups", None) or 1), moe_topk_group=int(getattr(config, "moe_router_group_topk", None) or 1),
        routed_scaling_factor=float(getattr(config, "moe_router_topk_scaling_factor", None) or 1.0))


class ConsistentHybridMoELayer(nn.Module):
    """MoE slot for entry-point specs without an ``arch``: derives it from the TransformerConfig, then a ConsistentMoELayer."""

    def __new__(cls, config, **kwargs):
        from .moe import ConsistentMoELayer

        arch = kwargs.pop("arch", None) or _arch_from_transformer_config(config)
        return ConsistentMoELayer(config, arch=arch, **kwargs)


def get_consistent_hybrid_stack_spec(arch: ArchConfig | None = None):
    """ModuleSpec of :class:`ConsistentHybridStack` whose four layer kinds run on the consistent kernels.

    ``arch`` (from :class:`ArchConfig`) fixes the Mamba mixer's :class:`SSMConfig` and the MoE
    layer's routing; without it (Megatron-LM ``--spec``), both are read from the
    ``TransformerConfig`` (``mamba_*``, ``num_moe_experts``, ``moe_router_*`` fields; chunk size 128).
    """
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from .moe import ConsistentMoELayer

    bda = consistent_bias_dropout_add
    mixer_params = {"ssm": arch.ssm} if arch is not None and arch.ssm is not None else {}
    moe = (ModuleSpec(module=ConsistentMoELayer, params={"arch": arch}) if arch is not None and arch.is_moe
           else ModuleSpec(module=ConsistentHybridMoELayer))
    return ModuleSpec(
        module=ConsistentHybridStack,
        submodules=_StackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(norm=ConsistentHybridNorm, mixer=ModuleSpec(module=ConsistentMambaMixer, params=mixer_params),
                                                mamba_bda=bda),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=ConsistentRMSNorm,
                    self_attention=ModuleSpec(
                        module=SelfAttention,
                        params={"attn_mask_type": AttnMaskType.causal},
                        submodules=SelfAttentionSubmodules(linear_qkv=ConsistentColumnParallelLinear, core_attention=ConsistentNoRopeCoreAttention,
                                                           linear_proj=ConsistentRowParallelLinear),
                    ),
                    self_attn_bda=bda,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=ConsistentRMSNorm,
                    mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ConsistentColumnParallelLinear,
                                                                        linear_fc2=ConsistentRowParallelLinear,
                                                                        activation_func=ConsistentReluSquared)),
                    mlp_bda=bda,
                ),
            ),
            moe_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(pre_mlp_layernorm=ConsistentRMSNorm, mlp=moe, mlp_bda=bda),
            ),
        ),
    )


# ---------------------------------------------------------------------------------------------- the model
def make_hybrid_transformer_config(arch: ArchConfig, dtype: torch.dtype, **parallel):
    """``TransformerConfig`` of a hybrid ``arch``: non-gated relu2 MLP, Mamba sizes, no attention placeholders needed."""
    heads = arch.num_heads or 1  # pure Mamba-2: no attention layer is built; Megatron still wants > 0 heads
    if not arch.num_heads:
        arch = dataclasses.replace(arch, num_heads=heads, num_kv_heads=1, head_dim=arch.hidden_size)
    if not arch.intermediate_size:
        arch = dataclasses.replace(arch, intermediate_size=4 * arch.hidden_size)
    # activation_func is never called (the spec's ConsistentReluSquared runs); Megatron's use_te_activation_func
    # check only accepts names TE knows, so relu stands in for relu2 there.
    extra = dict(gated_linear_unit=False, activation_func=torch.nn.functional.relu)
    if arch.ssm is not None:
        extra.update(mamba_state_dim=arch.ssm.state_size, mamba_head_dim=arch.ssm.head_dim, mamba_num_groups=arch.ssm.n_groups,
                     mamba_num_heads=arch.ssm.num_heads)
    return make_transformer_config(arch, dtype, consistent=True, **parallel, **extra)


def _hybrid_model_class():
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel
    except ImportError:
        from megatron.core.models.mamba.mamba_model import MambaModel

        return MambaModel


def _hybrid_model_kwargs(cls, arch: ArchConfig, config, spec) -> dict:
    params = inspect.signature(cls.__init__).parameters
    from megatron.core import parallel_state

    kwargs = dict(config=config, vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                  pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
                  parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                  position_embedding_type="none")
    kwargs["hybrid_stack_spec" if "hybrid_stack_spec" in params else "mamba_stack_spec"] = spec
    kwargs["hybrid_layer_pattern" if "hybrid_layer_pattern" in params else "hybrid_override_pattern"] = hybrid_pattern(arch)
    return kwargs


def build_consistent_hybrid_model(hf_config, *, seed: int = 0, dtype: torch.dtype | None = None, **parallel):
    """A Megatron Mamba/Hybrid model of a NemotronH / Mamba2 config on CPU, every op a consistent kernel.

    Same conventions as :func:`.model.build_consistent_model` (seeded init with
    the global RNG restored, CPU init, exact vocabulary, ``consistent_kind`` and
    ``arch_config`` attributes, float32 logits): ``compute_token_logprobs`` works on it.
    ``parallel``: ``tensor_model_parallel_size`` (1, 2, 4, 8, dividing the attention heads, KV heads, MLP width,
    Mamba heads and groups), ``pipeline_model_parallel_size`` and ``sequence_parallel`` (``torch.distributed``
    initialized by the caller) — the bits of TP = PP = 1; EP and CP are refused by name.
    """
    arch, dtype = prepare_build(hf_config, dtype, parallel, feature=HYBRID_FEATURE)
    if not arch.is_hybrid:
        raise UnsupportedConfigError(f"{arch.architecture} is not a hybrid architecture; use build_consistent_model")
    sizes = {k: parallel[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel")
             if k in parallel}
    config = make_hybrid_transformer_config(arch, dtype, **sizes)
    if config.sequence_parallel and not torch.cuda.is_available():
        from .cpu_shims import apply_cpu_shims

        apply_cpu_shims()  # the sequence-parallel block forks Megatron's CUDA RNG tracker (no RNG is drawn: dropout 0)
    cls = _hybrid_model_class()
    spec = get_consistent_hybrid_stack_spec(arch)

    def build():
        model = cls(**_hybrid_model_kwargs(cls, arch, config, spec))
        if model.post_process and not isinstance(model.output_layer, ConsistentOutputLayer):  # the hook may have swapped it
            model.output_layer = ConsistentOutputLayer.from_megatron(model.output_layer)
        if model.pre_process and config.sequence_parallel:
            tpar.sequence_parallel_embedding(model.embedding)
        return model

    model = seeded_build(seed, build)
    model.parallel_sizes = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size)
    model.sequence_parallel = bool(config.sequence_parallel)
    model.consistent_kind = CONSISTENT
    model.arch_config = arch
    return model
