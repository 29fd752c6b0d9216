"""Token log-probabilities: lm head -> float32 logits -> temperature -> log-softmax -> gather.

Numerics contract (CPU):

* ``logits = linear(hidden, lm_head, out_dtype=float32)`` — the float32
  accumulator of the batch-invariant linear, never rounded to the model dtype;
* ``z = logits / float32(temperature)`` (IEEE float32 division, always
  performed; temperature 1 is the identity, temperature <= 0 means greedy and
  is treated as 1; one temperature per row is allowed);
* ``m = max(z)`` (exact); ``s = tree_sum(exp(z - m))`` over the vocabulary
  (deterministic exp, fixed pairwise tree); ``logp = (z - m) - log(s)``.

Backward: ``dz = g * (onehot - softmax(z))``, ``dlogits = dz / temperature``.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .linear import linear
from .numerics import exp, log, tree_sum


@register("log_softmax", "cpu")
def _log_softmax_cpu(z: torch.Tensor) -> torch.Tensor:
    shifted = z - z.amax(-1, keepdim=True)
    return shifted - log(tree_sum(exp(shifted)))[..., None]


def scale_by_temperature(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``float32(logits) / temperature`` by IEEE float32 division (exact identity at 1).

    ``temperature`` is a number or a float32 tensor broadcastable to the logits
    (e.g. ``[rows, 1]``, one per request); values <= 0 (greedy) count as 1.
    """
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    return logits.to(torch.float32) / torch.where(t > 0, t, torch.ones_like(t))


def log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """float32 log-softmax over the last axis of ``logits / temperature`` (no autograd)."""
    z = scale_by_temperature(logits, temperature)
    return implementation("log_softmax", z.device)(z)


class LogprobsFunction(torch.autograd.Function):
    """Autograd wrapper: gathered log-softmax of float32 logits at a temperature."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        lp = log_softmax(logits, temperature)
        ctx.save_for_backward(lp, tokens)
        ctx.temperature = temperature if temperature > 0 else 1.0
        return lp.gather(-1, tokens[..., None])[..., 0]

    @staticmethod
    def backward(ctx, grad):
        lp, tokens = ctx.saved_tensors
        dz = -torch.exp(lp) * grad[..., None]
        dz.scatter_add_(-1, tokens[..., None], grad[..., None])
        return dz / ctx.temperature, None, None


def compute_logits(hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """float32 logits ``hidden @ lm_head.T`` under the linear contract."""
    return linear(hidden, lm_head, out_dtype=torch.float32)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax of float32 ``logits / temperature`` at ``tokens`` (shape ``logits.shape[:-1]``)."""
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"gather_logprobs: tokens {tuple(tokens.shape)} do not match logits {tuple(logits.shape[:-1])}")
    if logits.dtype != torch.float32:
        raise ValueError(f"gather_logprobs: logits must be float32 (the linear accumulator), got {logits.dtype}")
    return LogprobsFunction.apply(logits, tokens.to(torch.int64), float(temperature))


def token_logprobs(hidden: torch.Tensor, lm_head: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens | hidden) in float32, shape ``hidden.shape[:-1]``."""
    return gather_logprobs(compute_logits(hidden, lm_head), tokens, temperature)


class TokenLogprobs(nn.Module):
    """Thin module around :func:`token_logprobs` at a fixed temperature."""

    def __init__(self, temperature: float = 1.0):
        super().__init__()
        self.temperature = temperature

    def forward(self, hidden, lm_head, tokens):
        return token_logprobs(hidden, lm_head, tokens, self.temperature)
