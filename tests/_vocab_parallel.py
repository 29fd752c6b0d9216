"""The vocab-parallel log-softmax of ``layers/tensor_parallel.py`` by hand, without processes, on any device.

Each rank's shard is its own contiguous tensor (as a rank holds it); the global max is the max of the shard maxima;
each shard gives its subtree (``kernels.sum_exp_subtree`` of its ``VOCAB_SEGMENTS / t`` segments); the t float32
values are reduced in rank order by ``top`` (``adjacent_tree_sum``: the top of the tree); each shard is normalised.
"""

from __future__ import annotations

import torch

from megatron_consistent import kernels
from megatron_consistent.kernels.logprobs import VOCAB_SEGMENTS, log_softmax_normalise
from megatron_consistent.kernels.numerics import adjacent_tree_sum


def vocab_parallel(z, t, top=adjacent_tree_sum, shard_segments=None):
    """``(s, log-probs)`` of float32 ``z [..., V]`` over ``t`` vocabulary shards (``shard_segments``: override
    the shard's segment count, for broken variants)."""
    shards = [s.contiguous() for s in z.chunk(t, dim=-1)]
    m = torch.stack([s.amax(-1) for s in shards]).amax(0)[..., None]
    subs = [kernels.sum_exp_subtree(s, m, shard_segments or VOCAB_SEGMENTS // t) for s in shards]
    total = top(torch.stack(subs), dim=0)
    return total, torch.cat([log_softmax_normalise(s, m, total) for s in shards], dim=-1)


def tp1(z):
    """``(s, log-probs)`` at TP = 1: one ``sum_exp_subtree`` over the 8 segments, and ``kernels.log_softmax``."""
    return kernels.sum_exp_subtree(z, z.amax(-1, keepdim=True), VOCAB_SEGMENTS), kernels.log_softmax(z)


def left_to_right(x, dim=0):
    """A reduction in another order (an all-reduce's): ``((x0 + x1) + x2) + ...`` -- the broken top of the tree."""
    x = x.movedim(dim, 0)
    out = x[0]
    for i in range(1, x.shape[0]):
        out = out + x[i]
    return out


def same(a, b):
    """Both ``(s, log-probs)`` pairs bitwise equal."""
    return all(torch.equal(x, y) for x, y in zip(a, b))
