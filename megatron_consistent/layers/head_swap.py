"""Final norm and LM head of framework-built consistent models: a torch module-registration hook.

A layer spec cannot name a block's final norm or ``GPTModel.output_layer``.  The first time a
consistent layer or hybrid stack is built (:class:`.entry_points.ConsistentTransformerLayer`,
:class:`.hybrid.ConsistentHybridStack`) it calls :func:`install_head_swap_hook` (once per
process).  The hook then, for a ``TransformerBlock`` whose layers are all consistent layers,
swaps the stock ``final_layernorm`` for :class:`.norm.ConsistentRMSNorm` and, for a model whose
``decoder`` is such a block or a consistent hybrid stack, wraps the stock ``output_layer`` in
:class:`.output.ConsistentOutputLayer` (same weight ``Parameter``, same state-dict keys, float32
logits); under sequence parallelism the model's embedding (registered before its decoder) gets
:func:`.tensor_parallel.sequence_parallel_embedding`, as :func:`.model.build_consistent_model` gives it.  Modules of
any other model are never touched.

The hook knows those classes by their class attributes (``megatron_consistent = True`` on the
consistent transformer layer, ``megatron_consistent_hybrid_stack = True`` on the hybrid stack),
so this module imports neither of their modules (both import this one).
"""

from __future__ import annotations

from ..config import UnsupportedConfigError
from .norm import ConsistentRMSNorm
from .output import ConsistentOutputLayer

__all__ = ["install_head_swap_hook"]

_HOOK = {"handle": None}


def _is_consistent_block(block) -> bool:
    layers = getattr(block, "_modules", {}).get("layers") if block is not None else None
    return layers is not None and len(layers) > 0 and all(getattr(layer, "megatron_consistent", False) for layer in layers)


def _is_consistent_hybrid_stack(block) -> bool:
    return getattr(block, "megatron_consistent_hybrid_stack", False)


def _swap_final_norm_and_head(parent, name: str, child):
    if child is None:
        return None
    embedding = parent._modules.get("embedding")
    if name == "decoder" and embedding is not None and getattr(getattr(child, "config", None), "sequence_parallel", False) \
            and _is_consistent_block(child):
        from .tensor_parallel import sequence_parallel_embedding

        sequence_parallel_embedding(embedding)  # its reduce-scatter as an all-reduce (exact) and the rank's chunk
        return None
    if name == "final_layernorm" and not isinstance(child, ConsistentRMSNorm) and _is_consistent_block(parent):
        cfg = parent.config
        return ConsistentRMSNorm(config=cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon)
    decoder = parent._modules.get("decoder")
    if name == "output_layer" and _is_consistent_hybrid_stack(decoder) and parent._modules.get("rotary_pos_emb") is not None:
        raise UnsupportedConfigError("rotary position embeddings in a hybrid model (position_embedding_type='rope'): Nemotron-H "
                                     "attention has none; build it with position_embedding_type='none'")
    if name == "output_layer" and not isinstance(child, ConsistentOutputLayer) and (
            _is_consistent_block(decoder) or _is_consistent_hybrid_stack(decoder)):
        return ConsistentOutputLayer.from_megatron(child)
    return None


def install_head_swap_hook() -> None:
    """Install the hook (once per process)."""
    if _HOOK["handle"] is None:
        from torch.nn.modules.module import register_module_module_registration_hook

        _HOOK["handle"] = register_module_module_registration_hook(_swap_final_norm_and_head)
