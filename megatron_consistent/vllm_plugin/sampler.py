"""Route vLLM's log-probs through the consistent ``log_softmax`` op.

* raw log-probs (vLLM's default ``logprobs_mode``): ``Sampler.compute_logprobs``
  becomes :func:`kernels.log_softmax` of the model's float32 logits;
* processed log-probs (``logprobs_mode="processed_logprobs"``): computed from
  the same logits and each request's temperature (greedy rows: 1) by
  :func:`kernels.log_softmax` — the trainer's ``gather_logprobs`` at that
  temperature.  Sampling itself is left to vLLM.  Top-k, top-p, min-p,
  penalties, bad words and logit bias would change the processed
  distribution; a batch that uses them is refused by name rather than
  answered inconsistently.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.sampler import Sampler

from ..config import UnsupportedConfigError
from ..kernels import log_softmax

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy


def consistent_compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return log_softmax(logits)


def _unsupported_processing(sm) -> list[str]:
    used = []
    if sm.top_k is not None:
        used.append("top_k")
    if sm.top_p is not None:
        used.append("top_p")
    if not sm.no_penalties:
        used.append("penalties")
    if sm.bad_words_token_ids:
        used.append("bad_words")
    if sm.allowed_token_ids_mask is not None:
        used.append("allowed_token_ids")
    if any(getattr(proc, "min_p_count", 0) for proc in sm.logitsprocs.argmax_invariant):
        used.append("min_p")
    return used


def patch_sampler() -> None:
    """Install the consistent log-prob paths on vLLM's ``Sampler`` (idempotent)."""
    if getattr(Sampler, "_megatron_consistent", False):
        return
    original_sample = Sampler.sample

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        mode = logprobs_mode_override or self.logprobs_mode
        wants = sampling_metadata.max_num_logprobs is not None or sampling_metadata.logprob_token_ids
        if mode != "processed_logprobs" or not wants:
            return original_sample(self, logits, sampling_metadata, logprobs_mode_override)
        used = _unsupported_processing(sampling_metadata)
        if used:
            raise UnsupportedConfigError(f"processed log-probs with {', '.join(used)} are not supported by megatron-consistent")
        temp = sampling_metadata.temperature
        if temp is None:
            temp = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
        temp = torch.where(temp < _GREEDY_EPS, 1.0, temp).to(torch.float32)
        processed = log_softmax(logits, temp[:, None])
        sampled, _ = original_sample(self, logits, sampling_metadata, logprobs_mode_override)
        return sampled, processed

    Sampler.compute_logprobs = staticmethod(consistent_compute_logprobs)
    Sampler.sample = sample
    Sampler._megatron_consistent = True
