"""vLLM plugin: run rollouts on the same kernels as the Megatron trainer.

Entry point ``vllm.general_plugins`` -> :func:`register`, which vLLM calls in
every process (front end, engine core, workers).  Opt in with the environment
variable ``MEGATRON_CONSISTENT_VLLM=1`` set before the engine starts (it is
inherited by vLLM's worker processes).  When enabled, the plugin

* maps the supported architectures (see :mod:`megatron_consistent.config`) to
  :class:`~.model.ConsistentForCausalLM` (hybrid Mamba-2 ones to :mod:`.hybrid_model`),
* installs the consistent attention backend (CPU: over ``CPU_ATTN``, :mod:`.attention`;
  CUDA: over ``CUSTOM``, :mod:`.cuda_attention`; the tested vLLM versions and
  everything that differs between them live in :mod:`.compat`),
* routes log-probs through the consistent ``log_softmax`` (:mod:`.sampler`),

and logs that the consistent path is active.  Calling :func:`register` again
is a no-op.
"""

from __future__ import annotations

import os

ENV_VAR = "MEGATRON_CONSISTENT_VLLM"
_MODEL_CLASS = "megatron_consistent.vllm_plugin.model:ConsistentForCausalLM"
_HYBRID_CLASSES = {"NemotronHForCausalLM": "megatron_consistent.vllm_plugin.hybrid_model:ConsistentNemotronHForCausalLM",
                   "Mamba2ForCausalLM": "megatron_consistent.vllm_plugin.hybrid_model:ConsistentMamba2ForCausalLM"}
_state = {"registered": False}


def enabled() -> bool:
    """Whether the consistent path is switched on for engines started from this environment."""
    return os.environ.get(ENV_VAR, "0").lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM general-plugin hook (idempotent)."""
    if _state["registered"] or not enabled():
        return
    import vllm
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    from ..config import SUPPORTED_ARCHITECTURES
    from .compat import check_platform, install_attention_backend, patch_samplers

    device = current_platform.device_type
    check_platform(device, vllm.__version__)  # untested platform / vLLM version: refused by name
    for arch in SUPPORTED_ARCHITECTURES:
        ModelRegistry.register_model(arch, _HYBRID_CLASSES.get(arch, _MODEL_CLASS))
    install_attention_backend(device)
    patch_samplers(device)
    _state["registered"] = True
    _state["device"] = device


def announce() -> None:
    """Log, once per process, that the plugin is active; the consistent model classes call it when vLLM builds them.
    Not from :func:`register`: plugins load before vLLM configures logging in the engine's first process (with the
    engine core in-process that would drop the line), and the process that builds the model is the one that counts."""
    if _state.get("announced") or not _state["registered"]:
        return
    import vllm
    from vllm.logger import init_logger

    from ..config import SUPPORTED_ARCHITECTURES

    _state["announced"] = True
    init_logger("vllm.plugins.megatron_consistent").info(
        "megatron-consistent plugin active (pid %d, %s, vllm %s): %s -> consistent model, attention -> consistent "
        "attention, log-probs -> consistent log_softmax", os.getpid(), _state["device"], vllm.__version__,
        ", ".join(SUPPORTED_ARCHITECTURES))
