"""Expert-weight layouts: HF per-expert tensors <-> Megatron's stacked layout (also what the vLLM plugin holds).

==========================================================  =====================================================
Megatron (layers/moe.py) / vLLM plugin (vllm_plugin/moe.py)  HF (``P`` = ``mlp``; Mixtral: ``block_sparse_moe``)
==========================================================  =====================================================
mlp.router.weight                 [E, H]                     P.gate.weight
mlp.experts.linear_fc1.weight     [E, 2I, H]                 P.experts.{e}.gate_proj / up_proj .weight (Mixtral w1 / w3)
mlp.experts.linear_fc2.weight     [E, H, I]                  P.experts.{e}.down_proj.weight            (Mixtral w2)
mlp.shared_experts.linear_fc1     [2Is, H]                   P.shared_expert.gate_proj / up_proj .weight   (Qwen2-MoE)
mlp.shared_experts.linear_fc2     [H, Is]                    P.shared_expert.down_proj.weight
mlp.shared_experts.gate_weight    [1, H]                     P.shared_expert_gate.weight
==========================================================  =====================================================

The per-expert names are the layout of the published Qwen-MoE / Mixtral
checkpoints (what vLLM's loaders read; transformers 5 fuses them on load).
Per expert, ``linear_fc1`` holds the gate rows then the up rows.  Only
slicing and stacking — export -> import is bitwise.
"""

from __future__ import annotations

import torch

from ..config import ArchConfig

MOE_KINDS = ("experts_fc1", "experts_fc2")


def moe_hf_prefix(arch: ArchConfig) -> str:
    return "block_sparse_moe" if arch.architecture == "MixtralForCausalLM" else "mlp"


def expert_proj_names(arch: ArchConfig) -> tuple[str, str, str]:
    """(gate, up, down) projection names of one HF expert."""
    return ("w1", "w3", "w2") if arch.architecture == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")


def moe_plan(arch: ArchConfig, m: str, h: str) -> list[tuple[str, list[str], str]]:
    """Plan entries (megatron name, [hf names], kind) of one MoE layer; ``m`` / ``h`` are the layer prefixes."""
    p = f"{h}{moe_hf_prefix(arch)}."
    gate, up, down = expert_proj_names(arch)
    E = arch.num_experts
    plan = [
        (m + "mlp.router.weight", [p + "gate.weight"], "copy"),
        (m + "mlp.experts.linear_fc1.weight", [p + f"experts.{e}.{n}.weight" for e in range(E) for n in (gate, up)], "experts_fc1"),
        (m + "mlp.experts.linear_fc2.weight", [p + f"experts.{e}.{down}.weight" for e in range(E)], "experts_fc2"),
    ]
    if arch.shared_expert_intermediate_size:
        plan += [
            (m + "mlp.shared_experts.linear_fc1.weight", [p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight"], "fc1"),
            (m + "mlp.shared_experts.linear_fc2.weight", [p + "shared_expert.down_proj.weight"], "copy"),
            (m + "mlp.shared_experts.gate_weight", [p + "shared_expert_gate.weight"], "copy"),
        ]
    return plan


def moe_split(kind: str, t: torch.Tensor) -> list[torch.Tensor]:
    if kind == "experts_fc1":
        inter = t.shape[1] // 2
        return [part for e in range(t.shape[0]) for part in (t[e, :inter], t[e, inter:])]
    return [t[e] for e in range(t.shape[0])]


def moe_hf_shapes(kind: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    if kind == "experts_fc1":
        return [(shape[1] // 2, shape[2])] * (2 * shape[0])
    return [tuple(shape[1:])] * shape[0]


def moe_join(kind: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if kind == "experts_fc1":
        return torch.stack([torch.cat([parts[2 * e], parts[2 * e + 1]], dim=0) for e in range(len(parts) // 2)])
    return torch.stack(parts)
