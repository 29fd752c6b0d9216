"""Expert-weight layouts: Megatron's stacked experts <-> HF per-expert tensors (also what the vLLM plugin holds).

``experts_fc1``: ``[E, 2I, H]``, per expert its gate rows then its up rows -> ``2E`` HF tensors (gate, up per
expert); ``experts_fc2``: any ``[E, ...]`` stack -> one HF tensor per expert.  The names are the MoE family's
weight table (:mod:`megatron_consistent.architectures.moe`).  Only slicing and stacking — export -> import is
bitwise.
"""

from __future__ import annotations

import torch

MOE_KINDS = ("experts_fc1", "experts_fc2")


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
