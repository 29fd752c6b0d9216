"""Framework integration on the rollout side: refit transport for a live vLLM engine, NeMo-RL metric names.

Nothing here imports Megatron or vLLM at import time (vLLM workers import this
module by the dotted path of :class:`RefitWorkerExtension`).  The trainer-side
spec entry points are in :mod:`megatron_consistent.layers.entry_points`.

* :class:`RefitWorkerExtension` — pass
  ``worker_extension_cls="megatron_consistent.integration.RefitWorkerExtension"``;
  pack HF-named ``(name, tensor)`` pairs, in any order and any subset, with
  :func:`megatron_consistent.sync.protocol.pack_update` (``bucket_bytes=``
  splits them into buckets: raw bytes in one ``/dev/shm`` file, a plain
  JSON-able schema; tensor bytes never go through pickle or through
  ``collective_rpc``'s arguments, in which vLLM's multiprocess engine does
  not keep tensors); then ``llm.collective_rpc("mc_update_weights_from_shm",
  args=(update,))`` streams the tensors bucket by bucket into the model's
  ``load_weights`` (the call NeMo-RL's and verl's refits make) and reports
  whether every target kept its storage; an update packed with ``arch=`` (the
  trainer's ``ArchConfig``) is refused whole when the engine runs another
  architecture (another row-parallel tree width S, eps, rope, ...).  Same wire format as the whole-model
  sync of :mod:`megatron_consistent.sync`.
* :func:`nemo_rl_metrics` — ``token_mult_prob_error``, ``gen_kl_error`` and
  ``policy_kl_error`` as NeMo-RL's ClippedPGLossFn defines them (k3 estimator).
"""

from __future__ import annotations

import torch

from .sync.protocol import iter_buckets, validate_update
from .sync.worker import engine_arch

__all__ = ["RefitWorkerExtension", "nemo_rl_metrics"]


class RefitWorkerExtension:
    """vLLM worker extension (mixed into the worker class): in-place refit from a shared-memory update."""

    def mc_update_weights_from_shm(self, update: dict) -> dict:
        """Stream the update's tensors (:func:`~.sync.protocol.pack_update`), bucket by bucket, into
        ``model.load_weights``; plain-python report back.  The sender owns (and removes) the shared-memory file."""
        model = self.model_runner.model
        targets = model.hf_targets() if hasattr(model, "hf_targets") else {}
        before = {n: t.data_ptr() for n, t in targets.items()}
        report = {"loaded": 0, "buckets": 0}
        # framing (dtypes, byte counts, spans, buckets, file) and the sender's architecture where the update carries
        # one (pack_update(arch=)); names and shapes are load_weights' to refuse
        problems = validate_update(update, expected_arch=engine_arch(self.vllm_config).as_dict() if "arch" in update else None)
        if problems:
            report["error"] = "ValueError: not a valid refit update: " + "; ".join(problems)
        else:
            try:
                for bucket in iter_buckets(update):
                    model.load_weights(bucket)
                    report["loaded"] += len(bucket)
                    report["buckets"] += 1
                    del bucket
            except (ValueError, KeyError) as e:  # UnsupportedConfigError is a ValueError
                report["error"] = f"{type(e).__name__}: {e}"
        after = {n: t.data_ptr() for n, t in model.hf_targets().items()} if targets else {}
        report["storage_unchanged"] = before == after
        return report

    def mc_weight_pointers(self) -> dict:
        """HF name -> data pointer of the tensor it is copied into (plain ints)."""
        return {n: t.data_ptr() for n, t in self.model_runner.model.hf_targets().items()}


def nemo_rl_metrics(train_logp: torch.Tensor, gen_logp: torch.Tensor) -> dict:
    """NeMo-RL's train/generation mismatch metrics over 1-D float32 log-probs of the sampled tokens.

    As in NeMo-RL's ``ClippedPGLossFn`` (default ``reference_policy_kl_type='k3'``):
    ``token_mult_prob_error = mean(exp(|gen - train|))`` (1.0 is perfect);
    ``gen_kl_error = mean(exp(r) - 1 - r)`` with ``r = train - gen`` (KL(P_gen || P_train));
    ``policy_kl_error`` the same with ``r = gen - train``.  Computed in float64.
    """
    t, g = train_logp.double(), gen_logp.double()
    r = t - g
    return {
        "token_mult_prob_error": torch.exp((g - t).abs()).mean().item(),
        "gen_kl_error": (torch.expm1(r) - r).mean().item(),
        "policy_kl_error": (torch.expm1(-r) + r).mean().item(),
    }
