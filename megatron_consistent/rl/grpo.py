"""GRPO: :func:`group_advantages` (reward minus the group mean, over the group std) and :func:`grpo_loss` (the
clipped importance-ratio surrogate of PPO/GRPO, with the *rollout* log-probs as the behaviour policy).  With
bitwise-consistent log-probs and one update per step the ratio is exactly 1 before the update.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "grpo_loss"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: rewards ``[n]`` in consecutive groups of ``group_size``; (r - mean) / (std + eps) per group."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
    r = rewards.double().reshape(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(-1).to(torch.float32)


def grpo_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor, clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO surrogate over response tokens.

    ``logp`` ``[n, t]`` (differentiable trainer log-probs), ``rollout_logp``
    ``[n, t]`` (behaviour policy, from the engine), ``advantages`` ``[n]``.
    Returns ``(loss, stats)``; ``stats['ratio_max_dev']`` is ``max |ratio - 1|``
    (0 exactly when trainer and engine agree bit for bit).
    """
    ratio = torch.exp(logp - rollout_logp)
    a = advantages[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    loss = -surrogate.mean()
    with torch.no_grad():
        stats = {"ratio_max_dev": (ratio - 1).abs().max().item(), "loss": loss.item()}
    return loss, stats
