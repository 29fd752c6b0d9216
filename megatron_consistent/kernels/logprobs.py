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

Both engines and both layouts compose the same two dispatched ops,
``sum_exp_subtree`` and ``log_softmax_normalise`` (:func:`log_softmax` is
their TP = 1 composition); on ``cuda`` they are the Triton kernels of
``kernels/triton/log_softmax.py`` — the same segment structure with the GPU's
exp / log and its own fixed in-segment order (its docstring), bits invariant
to TP, batch and row position but not equal to the CPU bits.

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


@register("sum_exp_subtree", "cpu")
def _sum_exp_subtree_cpu(z: torch.Tensor, m: torch.Tensor, segments: int) -> torch.Tensor:
    return adjacent_tree_sum(segment_sums(exp(z - m), segments), dim=0)


@register("log_softmax_normalise", "cpu")
def _log_softmax_normalise_cpu(z: torch.Tensor, m: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return (z - m) - log(total)[..., None]


def sum_exp_subtree(z: torch.Tensor, m: torch.Tensor, segments: int) -> torch.Tensor:
    """A vocabulary shard's float32 subtree ``[...]``: ``adjacent_tree_sum`` of the ``segments`` segment sums of
    ``exp(z - m)``.

    ``z``: the shard's float32 ``[..., n]``; ``m``: the global max ``[..., 1]``.  With ``segments = VOCAB_SEGMENTS``
    over the whole vocabulary it is the full ``s`` of the contract.
    """
    return implementation("sum_exp_subtree", z.device)(z, m, segments)


def log_softmax_normalise(z: torch.Tensor, m: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """float32 ``(z - m) - log(total)``: ``m`` the global max ``[..., 1]``, ``total`` the whole tree's ``s`` ``[...]``."""
    return implementation("log_softmax_normalise", z.device)(z, m, total)


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
    m = z.amax(-1, keepdim=True)
    return log_softmax_normalise(z, m, sum_exp_subtree(z, m, VOCAB_SEGMENTS))


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
