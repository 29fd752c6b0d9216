"""Build Megatron-Core GPT models from an HF config: the consistent model and the stock baseline.

* :func:`build_consistent_model` — every numerics-bearing op is a
  :mod:`megatron_consistent.kernels` call (spec from :mod:`.spec`, LM head
  from :mod:`.output`); ``position_embedding_type='none'`` (RoPE runs inside
  the core attention).  Its per-token log-probs
  (:func:`compute_token_logprobs`: float32 logits -> ``kernels.gather_logprobs``)
  are bitwise those of the vLLM plugin for the same weights and tokens.
* :func:`build_stock_gpt_model` — the same architecture with Megatron's stock
  ``get_gpt_layer_local_spec`` and stock RoPE (the BASELINE recompute path;
  CPU shims from :mod:`.cpu_shims`); :func:`compute_stock_token_logprobs` takes
  its logits to float32 and uses ``torch.log_softmax``.  No consistency is
  claimed for it.

Both use ``use_cpu_initialization=True``, dropout 0, init std 0.02, and a
seeded RNG (the global RNG is restored afterwards), so the same seed gives the
same weights in both models (shared with the hybrid builder: :mod:`.builder`).  The vocabulary is kept exact
(no padding).
"""

from __future__ import annotations

import inspect

import torch

from .. import kernels
from ..config import ArchConfig, UnsupportedConfigError
from .builder import CONSISTENT, STOCK, as_arch_config, filter_kwargs, make_transformer_config, prepare_build, seeded_build
from .context_parallel import cp_positions, cp_share, sequence_token_logprobs
from .hybrid import build_consistent_hybrid_model
from .output import ConsistentOutputLayer
from .spec import get_consistent_gpt_block_spec
from .tensor_parallel import sequence_parallel_embedding

__all__ = [
    "build_consistent_gpt_model",
    "build_consistent_model",
    "build_stock_gpt_model",
    "compute_token_logprobs",
    "compute_stock_token_logprobs",
]

def _gpt_model_class():
    try:
        from megatron.core.models.gpt.gpt_model import GPTModel
    except ImportError as e:  # pragma: no cover - a future release without GPTModel
        raise UnsupportedConfigError(f"this megatron-core has no GPTModel ({e}); use the layer spec with its model class") from None
    return GPTModel


def _layers_in_stage(config, arch: ArchConfig) -> int:
    """Decoder layers this pipeline stage builds (all of them at PP = 1)."""
    if getattr(config, "pipeline_model_parallel_size", 1) == 1:
        return arch.num_layers
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return get_num_layers_to_build(config)


def _stage_layer_offset(config) -> int:
    """Global index of this pipeline stage's first decoder layer (0 at PP = 1)."""
    if getattr(config, "pipeline_model_parallel_size", 1) == 1:
        return 0
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config)


def _new_gpt_model(GPTModel, arch: ArchConfig, config, spec, **extra):
    """``GPTModel`` for ``arch``: this pipeline stage (``pre_process`` / ``post_process`` from Megatron's
    ``parallel_state``), the rank's vocabulary shard (``parallel_output=True``), output (un)tied as in the config.

    ``extra``: the position-embedding arguments (consistent: ``"none"``; stock: Megatron's RoPE).
    """
    from megatron.core import parallel_state

    kwargs = dict(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        **extra,
    )
    return GPTModel(**filter_kwargs(GPTModel.__init__, kwargs))


def build_consistent_model(hf_config, *, seed: int = 0, dtype: torch.dtype | None = None, moe_impl: str | None = None,
                           moe_token_dispatcher: str = "allgather", moe_aux_loss_coeff: float = 0.0, **parallel):
    """A Megatron model on CPU whose every op follows the kernels' numerics contract: a ``GPTModel`` for dense and MoE
    configs, Megatron's ``MambaModel`` / ``HybridModel`` for the hybrids.

    ``hf_config``: HF config dict, :class:`ArchConfig`, or path.  ``dtype``
    defaults to the config's.  ``parallel`` may name
    ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` /
    ``context_parallel_size`` / ``sequence_parallel`` / ``expert_model_parallel_size``: TP ∈ {1, 2, 4, 8} dividing the
    model's ``row_parallel_segments``, any PP
    and sequence parallelism (TP > 1) are supported for dense and MoE (experts sharded over the TP ranks) configs,
    EP for MoE configs (experts sharded over Megatron's EP groups; at TP > 1 with sequence parallelism), CP ∈ {2, 4}
    for dense and MoE (``moe_impl="module"``) configs at EP = 1 (the model then takes the CP rank's share of each
    sequence, :mod:`.context_parallel`)
    (``torch.distributed`` initialized by the caller with a world size TP x CP x PP divides; contract in
    ``docs/parallel.md``; hybrid configs too: the Mamba mixer's heads and groups over the TP ranks); EP at
    TP > 1 without sequence parallelism, EP and CP for hybrid configs are refused
    (:class:`UnsupportedConfigError`).  MoE: ``moe_impl="megatron"`` = Megatron-Core's
    ``MoELayer`` with its ``moe_token_dispatcher`` (``"allgather"`` | ``"alltoall"``, GPU) and the
    consistent router / experts (layers/moe_megatron.py); ``"module"`` = :class:`.moe.ConsistentMoELayer`;
    ``None`` = :data:`.moe_megatron.DEFAULT_MOE_IMPL` where supported.  Hybrid Mamba-2 / Nemotron-H
    configs (``arch.is_hybrid``) are built by :func:`.hybrid.build_consistent_hybrid_model`
    (Megatron's MambaModel / HybridModel; MoE layers: :class:`.moe.ConsistentMoELayer`).
    """
    from .moe_megatron import megatron_moe_setup

    arch = as_arch_config(hf_config)
    if arch.is_hybrid:
        if moe_impl not in (None, "module"):
            raise UnsupportedConfigError(f"moe_impl={moe_impl!r} is not supported for the hybrid {arch.architecture} (module only)")
        return build_consistent_hybrid_model(arch, seed=seed, dtype=dtype, **parallel)
    model_parallel = any(parallel.get(k, 1) != 1 for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                          "expert_model_parallel_size", "context_parallel_size"))
    if arch.is_moe and model_parallel:
        if moe_impl == "megatron":
            raise UnsupportedConfigError(
                "moe_impl='megatron' with TP/PP/EP/CP > 1 is not supported by build_consistent_model (its ranks may be gloo CPU "
                "ranks, where Megatron's token dispatchers allocate their collectives on CUDA); Megatron's MoELayer at EP > 1 (and at TP > 1 "
                "with sequence parallelism) is built by the framework entry points (consistent_layer_spec_provider / "
                "consistent_slime_spec); here use moe_impl='module' (experts sharded over the TP or EP ranks, the same bits)")
        moe_impl = "module"
    arch, dtype = prepare_build(arch, dtype, parallel)
    moe_impl, moe_kwargs = megatron_moe_setup(arch, moe_impl, moe_token_dispatcher, moe_aux_loss_coeff)
    sizes = {k: parallel[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                                      "sequence_parallel") if k in parallel}
    config = make_transformer_config(arch, dtype, consistent=True, **moe_kwargs, **sizes)
    GPTModel = _gpt_model_class()
    if config.sequence_parallel and not torch.cuda.is_available():
        from .cpu_shims import apply_cpu_shims

        apply_cpu_shims()  # the sequence-parallel block forks Megatron's CUDA RNG tracker (no RNG is drawn: dropout 0)
    block_spec = get_consistent_gpt_block_spec(_layers_in_stage(config, arch), arch.qk_norm, rope=arch.rope)
    if arch.is_moe:  # MoE layers: the mlp slot is Megatron's MoELayer (layers/moe_megatron.py) or our block (layers/moe.py)
        if moe_impl == "megatron":
            from .moe_megatron import megatron_moe_layer_spec as moe_layer_spec
        else:
            from .moe import moe_layer_spec

        offset = _stage_layer_offset(config)  # layer_is_moe takes the global layer index
        block_spec.layer_specs = [moe_layer_spec(s, arch) if arch.layer_is_moe(offset + i) else s
                                  for i, s in enumerate(block_spec.layer_specs)]

    def build():
        model = _new_gpt_model(GPTModel, arch, config, block_spec, position_embedding_type="none")
        if model.post_process:
            model.output_layer = ConsistentOutputLayer.from_megatron(model.output_layer)
        if model.pre_process and config.sequence_parallel:
            sequence_parallel_embedding(model.embedding)
        return model

    model = seeded_build(seed, build)
    model.parallel_sizes = (sizes.get("tensor_model_parallel_size", 1), sizes.get("pipeline_model_parallel_size", 1))
    model.context_parallel_size = sizes.get("context_parallel_size", 1)
    model.expert_parallel_size = parallel.get("expert_model_parallel_size", 1)
    model.sequence_parallel = bool(sizes.get("sequence_parallel", False))
    model.consistent_kind = CONSISTENT
    model.arch_config = arch
    model.moe_impl = moe_impl
    return model


build_consistent_gpt_model = build_consistent_model  # the earlier name, kept for callers


def _stock_rope_kwargs(arch: ArchConfig, GPTModel) -> tuple[dict, dict | None]:
    kwargs = {"position_embedding_type": "rope", "rotary_base": arch.rope_theta, "rotary_percent": 1.0}
    if not arch.rope_scaling:
        return kwargs, None
    scaling = dict(arch.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3" or "rope_scaling" not in inspect.signature(GPTModel.__init__).parameters:
        raise UnsupportedConfigError(f"rope_scaling {kind!r} is not supported by the stock Megatron baseline")
    kwargs.update(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
    return kwargs, scaling


def _apply_full_llama3_scaling(model, scaling: dict) -> None:
    """Megatron's ctor passes only ``factor``; re-derive inv_freq with all four llama3 parameters via its own _apply_scaling."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rot = model.rotary_pos_emb
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if not set(names) <= set(inspect.signature(RotaryEmbedding._apply_scaling).parameters):
        raise UnsupportedConfigError("this megatron-core's llama3 rope scaling does not take all llama3 parameters")
    dim = rot.inv_freq.shape[0] * 2
    base_inv = 1.0 / (model.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rot.inv_freq.device) / dim))
    rot.inv_freq = rot._apply_scaling(base_inv, **{n: float(scaling[n]) for n in names})
    if hasattr(type(rot).forward, "cache_clear"):
        type(rot).forward.cache_clear()


def build_stock_gpt_model(hf_config, *, seed: int = 0, dtype: torch.dtype | None = None, **parallel):
    """The same architecture with Megatron's stock local spec and stock RoPE — the BASELINE path (not consistent).

    Applies :func:`.cpu_shims.apply_cpu_shims` when CUDA is absent.
    """
    from .cpu_shims import apply_cpu_shims

    arch, dtype = prepare_build(hf_config, dtype, parallel)
    if arch.is_hybrid:
        raise UnsupportedConfigError(f"no stock Megatron baseline is built for the hybrid architecture {arch.architecture}")
    apply_cpu_shims()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = make_transformer_config(arch, dtype, consistent=False)
    GPTModel = _gpt_model_class()
    rope_kwargs, scaling = _stock_rope_kwargs(arch, GPTModel)
    spec = get_gpt_layer_local_spec(**filter_kwargs(get_gpt_layer_local_spec, {"qk_layernorm": arch.qk_norm, "normalization": "RMSNorm"}))
    if arch.is_moe:  # MoE layers: plain-torch MoE block (layers/moe.py StockMoELayer), same parameter names
        from .moe import stock_moe_block_spec

        spec = stock_moe_block_spec(spec, arch)

    model = seeded_build(seed, lambda: _new_gpt_model(GPTModel, arch, config, spec, **rope_kwargs))
    # Megatron's stock RMSNorm (WrappedTorchNorm -> torch.nn.RMSNorm) creates float32 weights even in a bf16
    # model; training wraps the model in Float16Module, which casts everything to the model dtype. Do the same.
    model.to(dtype=dtype)
    if scaling is not None:
        _apply_full_llama3_scaling(model, scaling)
    model.consistent_kind = STOCK
    model.arch_config = arch
    return model


def _check_ids(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    return input_ids


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    return kernels.causal_positions(*_check_ids(input_ids).shape, device=input_ids.device)


def compute_token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 ``[b, s-1]``: log p(input_ids[:, t+1] | input_ids[:, :t+1]) by the CONSISTENT path.

    The model's float32 logits (``kernels.compute_logits``) go through
    ``kernels.gather_logprobs`` — the op sequence the vLLM plugin uses.
    Differentiable.  At context parallelism every CP rank passes the whole ``input_ids`` and gets all the log-probs
    (its share computed, the others gathered).  Refuses the stock model (use :func:`compute_stock_token_logprobs`).
    """
    if getattr(model, "consistent_kind", None) != CONSISTENT:
        raise ValueError("compute_token_logprobs needs a model from build_consistent_model; use compute_stock_token_logprobs for the stock baseline")
    if getattr(model, "parallel_sizes", (1, 1))[1] != 1:
        raise ValueError("compute_token_logprobs runs a single-stage model; at PP > 1 use layers.distributed.stage_logprobs")
    share = cp_share(_check_ids(input_ids))  # at CP > 1 the rank's tokens (context_parallel.py); the log-probs in token order
    logits = model(share, cp_positions(*share.shape, device=share.device), None)  # [b, s/CP, V/TP] float32
    return sequence_token_logprobs(logits, input_ids, temperature)


def compute_stock_token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 ``[b, s-1]`` by the STOCK path: logits (model dtype) -> float32 -> ``/ temperature`` -> ``torch.log_softmax``."""
    logits = model(input_ids, _positions(input_ids), None).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    return lp.gather(-1, input_ids[:, 1:, None])[..., 0]
