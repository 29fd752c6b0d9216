"""MoE decoder family (``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` with shared expert, ``MixtralForCausalLM``): its weight table.

Embedding, attention, norms and the dense layers are the dense family's (:mod:`.dense`); an MoE
layer's MLP (``P`` = ``model.layers.i.mlp``; Mixtral: ``model.layers.i.block_sparse_moe``):

==========================================  =============================================================  ============
Megatron (``decoder.layers.i.``)            HF                                                             vLLM plugin
==========================================  =============================================================  ============
mlp.router.weight                 [E, H]    P.gate.weight                                                  router
mlp.experts.linear_fc1.weight     [E, 2I, H]  P.experts.{e}.gate_proj / up_proj .weight (Mixtral w1 / w3)  experts_fc1
mlp.experts.linear_fc2.weight     [E, H, I]   P.experts.{e}.down_proj.weight (Mixtral w2)                  experts_fc2
mlp.shared_experts.linear_fc1     [2Is, H]  P.shared_expert.gate_proj / up_proj .weight (Qwen2-MoE)        shared_fc1
mlp.shared_experts.linear_fc2     [H, Is]   P.shared_expert.down_proj.weight                               shared_fc2
mlp.shared_experts.gate_weight    [1, H]    P.shared_expert_gate.weight                                    shared_gate
==========================================  =============================================================  ============

The per-expert names are the layout of the published Qwen-MoE / Mixtral checkpoints
(what vLLM's loaders read; transformers 5 fuses them on load).

Tensor parallelism (the ``shard`` rule): the experts are sharded by expert (``experts``: rank r of t holds experts
``[r E/t, (r+1) E/t)``, as the trainer's ``ConsistentMoELayer``); the router and the shared expert are replicated
(the shared expert's down projection is the one-rank ``linear``, not the row-parallel tree, in both engines).
"""

from __future__ import annotations

from ..config import ArchConfig
from .dense import attention_entries, dense_mlp_entries, embedding_entries, final_entries, layer_prefixes
from .weights import WeightEntry

__all__ = ["moe_entries", "moe_mlp_entries", "router_hf_modules"]


def _hf_names(arch: ArchConfig) -> tuple[str, tuple[str, str, str]]:
    """(HF MoE block name, (gate, up, down) projection names of one expert)."""
    if arch.architecture == "MixtralForCausalLM":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def moe_mlp_entries(arch: ArchConfig, i: int) -> list[WeightEntry]:
    """Router, stacked experts and (Qwen2-MoE) shared expert of MoE layer ``i``."""
    m, h, e = layer_prefixes(i)
    block, (gate, up, down) = _hf_names(arch)
    p, dt = f"{h}{block}.", arch.dtype
    E, H, inter = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
    out = [WeightEntry(m + "mlp.router.weight", (p + "gate.weight",), (E, H), ((E, H),), dt, "copy", e + "router"),
           WeightEntry(m + "mlp.experts.linear_fc1.weight", tuple(p + f"experts.{x}.{n}.weight" for x in range(E) for n in (gate, up)),
                       (E, 2 * inter, H), ((inter, H),) * (2 * E), dt, "experts_fc1", e + "experts_fc1", "experts"),
           WeightEntry(m + "mlp.experts.linear_fc2.weight", tuple(p + f"experts.{x}.{down}.weight" for x in range(E)),
                       (E, H, inter), ((H, inter),) * E, dt, "experts_fc2", e + "experts_fc2", "experts")]
    s = arch.shared_expert_intermediate_size
    if s:
        out += [WeightEntry(m + "mlp.shared_experts.linear_fc1.weight", (p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight"),
                            (2 * s, H), ((s, H),) * 2, dt, "fc1", e + "shared_fc1"),
                WeightEntry(m + "mlp.shared_experts.linear_fc2.weight", (p + "shared_expert.down_proj.weight",), (H, s), ((H, s),), dt, "copy",
                            e + "shared_fc2"),
                WeightEntry(m + "mlp.shared_experts.gate_weight", (p + "shared_expert_gate.weight",), (1, H), ((1, H),), dt, "copy",
                            e + "shared_gate")]
    return out


def router_hf_modules(arch: ArchConfig) -> list[str]:
    """HF module names of the routers and shared-expert gates (kept in the model dtype by block-FP8 checkpoints)."""
    return [n.removesuffix(".weight") for i in arch.moe_layers for w in moe_mlp_entries(arch, i)
            if w.megatron.endswith(("router.weight", "gate_weight")) for n in w.hf]


def moe_entries(arch: ArchConfig) -> list[WeightEntry]:
    """The MoE family's table for ``arch``, in checkpoint order."""
    out = embedding_entries(arch)
    for i in range(arch.num_layers):
        out += attention_entries(arch, i) + (moe_mlp_entries(arch, i) if arch.layer_is_moe(i) else dense_mlp_entries(arch, i))
    return out + final_entries(arch)
