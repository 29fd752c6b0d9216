"""The LM head that replaces ``GPTModel.output_layer``: float32 logits by :func:`kernels.compute_logits`.

Numerics contract: ``logits = kernels.compute_logits(hidden, weight)`` — the
float32 accumulator of the batch-invariant linear, never rounded to the model
dtype — exactly what the vLLM plugin feeds into ``gather_logprobs``.  With
tied embeddings Megatron passes the embedding weight as ``weight=`` and this
module owns no parameter; otherwise it owns ``weight [V, H]`` (state-dict key
``output_layer.weight``, as Megatron's).

Interface (Megatron's): ``forward(hidden [s, b, H], weight=None,
runtime_gather_output=None) -> (logits [s, b, V] float32, None)``.

Tensor parallelism: the weight is the rank's vocabulary shard ``[V/t, H]``
(Megatron's ColumnParallelLinear / VocabParallelEmbedding rows); the forward
gives that shard's float32 logits (bits of the full logits' columns: each
logit is its own dot product) and all-reduces ``grad_hidden`` in backward.
``runtime_gather_output=True`` at TP > 1 is refused: the log-probs are
computed on the shards (:func:`.tensor_parallel.vocab_parallel_logprobs`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import UnsupportedConfigError
from . import tensor_parallel as tpar
from .linear import sharded_state_dict_tp1

__all__ = ["ConsistentOutputLayer"]


class ConsistentOutputLayer(nn.Module):
    """LM head; build with :meth:`from_megatron` to take over the stock layer's (initialized) weight."""

    def __init__(self, hidden_size: int, vocab_size: int, weight: nn.Parameter | None = None):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.tp_group = tpar.tp_group()
        self.tp_size = tpar.tp_size(self.tp_group)
        self.sequence_parallel = False  # set by from_megatron from the stock layer (config.sequence_parallel)
        self.skip_bias_add = False
        if weight is not None:
            if tuple(weight.shape) != (vocab_size // self.tp_size, hidden_size):
                raise ValueError(f"output weight has shape {tuple(weight.shape)}, expected {(vocab_size // self.tp_size, hidden_size)}")
            self.weight = weight
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        self._register_load_state_dict_pre_hook(lambda sd, prefix, *a, **k: sd.setdefault(f"{prefix}_extra_state"))

    def get_extra_state(self):  # same state-dict keys as Megatron's output layer
        return None

    def set_extra_state(self, state):
        pass

    @classmethod
    def from_megatron(cls, stock) -> "ConsistentOutputLayer":
        """Wrap a Megatron ColumnParallelLinear output layer, reusing its weight Parameter (and attributes)."""
        if getattr(stock, "bias", None) is not None:
            raise UnsupportedConfigError("unsupported feature: a bias on the output layer")
        weight = getattr(stock, "weight", None)
        out = getattr(stock, "output_size", None) or (weight.shape[0] * tpar.tp_size() if weight is not None else None)
        hidden = getattr(stock, "input_size", None) or (weight.shape[1] if weight is not None else None)
        layer = cls(hidden, out, weight)
        layer.sequence_parallel = bool(getattr(stock, "sequence_parallel", False)) and layer.tp_size > 1
        return layer

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if weight is None:
            weight = self.weight
        if weight is None:
            raise ValueError("ConsistentOutputLayer: no weight (tied embeddings need weight= from the model)")
        if runtime_gather_output and self.tp_size > 1:
            raise UnsupportedConfigError("runtime_gather_output=True at TP > 1: the consistent log-probs work on vocabulary shards")
        if self.sequence_parallel:  # [s/t, b, H] sequence chunks -> the whole sequence (concatenation)
            return kernels.compute_logits(tpar.gather_sequence(hidden, self.tp_group), weight), None
        return kernels.compute_logits(tpar.copy_to_tp(hidden, self.tp_group), weight), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        if self.weight is None:
            return {}
        return sharded_state_dict_tp1(self, prefix, sharded_offsets, metadata, {"weight": 0})

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, vocab={self.vocab_size}, tied={self.weight is None}"
