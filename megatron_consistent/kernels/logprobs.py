"""Token log-probabilities: lm head -> float32 logits -> temperature -> log-softmax -> gather.

Numerics contract (CPU):

* ``logits = linear(hidden, lm_head, out_dtype=float32)`` — the float32
  accumulator of the batch-invariant linear, never rounded to the model dtype;
* ``z = logits / float32(temperature)`` (IEEE float32 division, always
  performed; temperature 1 is the identity, temperature <= 0 means greedy and
  is treated as 1; one temperature per row is allowed);
* ``m = max(z)`` over the vocabulary (exact in any order);
* ``e = exp(z - m)`` (deterministic exp); the vocabulary is cut into
  ``VOCAB_SEGMENTS`` (S = 8) equal contiguous segments of ``ceil(V / S)``
  entries: segment ``j`` holds vocabulary entries ``[j c, (j+1) c)``, where
  ``c = ceil(V / S)``; when S does not divide V (possible at TP = 1 only) the
  last segments are completed with padding entries of logit ``-inf``, i.e.
  ``e = 0`` exactly, and a segment lying wholly beyond V sums to ``+0``;
* each segment's sum is :func:`numerics.tree_sum` of its ``c`` values (the
  pairwise tree, ``i`` with ``i + n/2``, zero-padded to a power of two);
* ``s = adjacent_tree_sum(segment sums)``
  (``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))``);
  ``logp = (z - m) - log(s)``.

Vocab parallelism: at TP = t (t divides S, S divides V) rank r holds the
vocabulary shard ``[r V/t, (r+1) V/t)`` = segments ``r S/t ... (r+1) S/t - 1``.
The global max is an all-reduce MAX (exact in any order); the rank computes
its subtree (:func:`sum_exp_subtree` of its ``S/t`` segments), the t float32
subtree values are all-gathered in rank order and reduced by
``adjacent_tree_sum`` — the top of the same tree, so TP = 1, 2, 4, 8 give
identical bits (``layers/tensor_parallel.py`` does the communication).

The CUDA implementation (``kernels/triton/log_softmax.py``, registered as
``log_softmax`` for ``cuda``) must follow the same segment structure: per
row, 8 contiguous segments each summed by the ``i + n/2`` pairwise tree, then
the tree of neighbours over the 8 segment sums.

Backward: ``dz = g * (onehot - softmax(z))``, ``dlogits = dz / temperature``.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import implementation, register
from .linear import linear
from .numerics import adjacent_tree_sum, exp, log, tree_sum

VOCAB_SEGMENTS = 8


def segment_sums(e: torch.Tensor, segments: int) -> torch.Tensor:
    """``[segments, ...]``: ``tree_sum`` of each of ``segments`` equal contiguous slices of the last axis of ``e``.

    The last axis is zero-padded at its end to ``segments * ceil(n / segments)`` entries (the padding
    entries of the contract: ``exp(-inf) = 0``).
    """
    n = e.shape[-1]
    c = -(-n // segments)
    if c * segments != n:
        e = torch.nn.functional.pad(e, (0, c * segments - n))
    return tree_sum(e.reshape(*e.shape[:-1], segments, c), dim=-1).movedim(-1, 0)


def sum_exp_subtree(shifted: torch.Tensor, segments: int) -> torch.Tensor:
    """A vocabulary shard's float32 subtree: ``adjacent_tree_sum`` of the ``segments`` segment sums of ``exp(shifted)``.

    ``shifted`` = ``z - m`` over the shard (``m`` the global max).  With ``segments = VOCAB_SEGMENTS`` over the
    whole vocabulary it is the full ``s`` of the contract.
    """
    return adjacent_tree_sum(segment_sums(exp(shifted), segments), dim=0)


@register("log_softmax", "cpu")
def _log_softmax_cpu(z: torch.Tensor) -> torch.Tensor:
    shifted = z - z.amax(-1, keepdim=True)
    return shifted - log(sum_exp_subtree(shifted, VOCAB_SEGMENTS))[..., None]


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
