"""vLLM plugin: run rollouts on the same kernels as the Megatron trainer.

Entry point ``vllm.general_plugins`` -> :func:`register`, which vLLM calls in
every process (front end, engine core, workers).  Opt in with the environment
variable ``MEGATRON_CONSISTENT_VLLM=1`` set before the engine starts (it is
inherited by vLLM's worker processes).  When enabled, the plugin

* maps the supported architectures (see :mod:`megatron_consistent.config`) to
  :class:`~.model.ConsistentForCausalLM` (hybrid Mamba-2 ones to :mod:`.hybrid_model`),
* overrides vLLM's ``CPU_ATTN`` backend with :mod:`.attention`,
* routes log-probs through the consistent ``log_softmax`` (:mod:`.sampler`),

and logs that the consistent path is active.  Calling :func:`register` again
is a no-op.
"""

from __future__ import annotations

import os

ENV_VAR = "MEGATRON_CONSISTENT_VLLM"
_MODEL_CLASS = "megatron_consistent.vllm_plugin.model:ConsistentForCausalLM"
_BACKEND_CLASS = "megatron_consistent.vllm_plugin.attention.ConsistentAttentionBackend"
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
    from vllm import ModelRegistry
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    from ..config import SUPPORTED_ARCHITECTURES, UnsupportedConfigError

    if not current_platform.is_cpu():
        raise UnsupportedConfigError(
            f"{ENV_VAR}=1: the consistent vLLM attention path is implemented for vLLM's CPU platform only "
            f"(this is {current_platform.device_type}); unset {ENV_VAR} to run stock vLLM")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .sampler import patch_sampler

    for arch in SUPPORTED_ARCHITECTURES:
        ModelRegistry.register_model(arch, _HYBRID_CLASSES.get(arch, _MODEL_CLASS))
    register_backend(AttentionBackendEnum.CPU_ATTN, _BACKEND_CLASS)
    patch_sampler()
    _state["registered"] = True
    init_logger("vllm.plugins.megatron_consistent").info(
        "megatron-consistent plugin active (pid %d): %s -> consistent model, CPU_ATTN -> consistent attention, "
        "log-probs -> consistent log_softmax", os.getpid(), ", ".join(SUPPORTED_ARCHITECTURES))
