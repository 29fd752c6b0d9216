"""Every CPU shim the package applies to megatron-core, in one place.

The consistent layers (:mod:`.spec`) need **none** of these: they make no CUDA
calls.  The shims exist for the *stock* baseline model
(:func:`.model.build_stock_gpt_model`, Megatron's ``get_gpt_layer_local_spec``
with ``DotProductAttention`` and the stock ``RotaryEmbedding``), whose
training-path code assumes a GPU in four places.  :func:`apply_cpu_shims`
installs them only when CUDA is absent (``torch.cuda.is_available()`` is
False), is idempotent, and never changes numerics — each shim only moves an
allocation or RNG bookkeeping to the CPU.

Shims (megatron-core 0.16.1 call sites):

1. ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates its reusable
   buffer with ``device=torch.cuda.current_device()``.  DotProductAttention
   takes its ``baddbmm`` output buffer from it.  Shim: the same reuse-by-name
   logic, allocating on the CPU.
2. ``megatron.core.transformer.utils.get_default_causal_mask`` builds the
   upper-triangular causal mask with ``device="cuda"``; FusedScaleMaskSoftmax
   calls it (imported by name into ``megatron.core.fusions.fused_softmax``)
   when the attention mask is None.  Shim: the same boolean mask on the CPU,
   patched in both modules.
3. ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork`` swaps the
   CUDA RNG state; DotProductAttention always enters it around its (p=0)
   dropout.  Shim: fork the CPU RNG instead (``torch.random.fork_rng`` with no
   devices), so the global CPU RNG is restored on exit.
4. ``megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb``
   moves ``inv_freq`` to ``torch.cuda.current_device()`` on first use.  Shim:
   the same ``[s, 1, 1, dim]`` angle table built where ``inv_freq`` lives (CPU).
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch

__all__ = ["apply_cpu_shims", "cpu_shims_applied", "cuda_stubs_for_checkpoint", "SHIMS"]

SHIMS = (
    "GlobalMemoryBuffer.get_tensor -> CPU buffer",
    "get_default_causal_mask -> CPU mask (transformer.utils and fusions.fused_softmax)",
    "CudaRNGStatesTracker.fork -> fork the CPU RNG",
    "RotaryEmbedding.get_emb -> keep inv_freq on the CPU",
)

_APPLIED = False


def cpu_shims_applied() -> bool:
    return _APPLIED


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    n = functools.reduce(operator.mul, tensor_shape, 1)
    key = (name, dtype)
    buf = self.buffer.get(key)
    if buf is None or buf.numel() < n:
        buf = self.buffer[key] = torch.empty(n, dtype=dtype, device="cpu", requires_grad=False)
    return buf[:n].view(*tensor_shape)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


@contextlib.contextmanager
def _cpu_fork(self, name=None):
    with torch.random.fork_rng(devices=[]):
        yield


def _cpu_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def apply_cpu_shims() -> bool:
    """Install the shims above if CUDA is absent; returns whether they are in place."""
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary_pos_embedding
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.utils as transformer_utils
    import megatron.core.utils as mcore_utils

    mcore_utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    if hasattr(fused_softmax, "get_default_causal_mask"):
        fused_softmax.get_default_causal_mask = _cpu_causal_mask
    tp_random.CudaRNGStatesTracker.fork = _cpu_fork
    rotary_pos_embedding.RotaryEmbedding.get_emb = _cpu_get_emb
    _APPLIED = True
    return True


@contextlib.contextmanager
def cuda_stubs_for_checkpoint():
    """Context manager for ``megatron.core.dist_checkpointing.save`` on a machine without CUDA.

    megatron-core 0.16.1's torch_dist save path calls ``torch.cuda.synchronize()``
    (``strategies/filesystem_async.py``, after preloading tensors) and
    ``torch.cuda.current_device()`` (``strategies/state_dict_saver.py``, as the
    device of small bookkeeping tensors).  Inside this block the first is a no-op
    and the second answers ``"cpu"``; both are restored on exit, even on error.
    A no-op when CUDA is available.  Loading needs no stub.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = (torch.cuda.synchronize, torch.cuda.current_device)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
