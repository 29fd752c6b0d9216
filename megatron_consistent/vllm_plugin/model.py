"""vLLM model class for the dense and MoE decoders of :mod:`megatron_consistent.config`.

The op sequence is the one the Megatron-Core layers of
:mod:`megatron_consistent.layers` run, op for op, with the same kernels:

    h = embed(ids)
    per layer:  h = decoder layer (:mod:`.decoder_layer`; MoE layers: :mod:`.moe`; block-FP8 / NVFP4: :mod:`.fp8`)
    logits = compute_logits(rms_norm(h), W_lm_head)         (float32)

Weights: the family's weight table (:mod:`megatron_consistent.architectures`) gives every HF
tensor's view of this model's storage (:meth:`ConsistentForCausalLM.hf_targets`).
Diagnostics (off by default, one ``is None`` test per op when off): the op probe of :mod:`.probe`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.logger import init_logger

from ..architectures import engine_views, weight_entries
from ..config import ArchConfig, UnsupportedConfigError
from ..kernels import compute_logits, inference_ops, rope_cache
from . import probe
from .compat import compiled_by_vllm
from .decoder_layer import _param
from .moe import decoder_layer_class

logger = init_logger("vllm.plugins.megatron_consistent.model")


def eager_only_reason(arch: ArchConfig, hf_config: dict) -> str:
    """Why this model runs eager on CUDA ('' when vLLM compiles it and replays CUDA graphs)."""
    from .fp8 import quantization_of

    if arch.is_hybrid:
        return "Mamba-2 mixers (their state bookkeeping runs on the host)"
    if arch.is_moe:
        return "MoE layers (routing and grouped experts synchronise with the host)"
    if quantization_of(hf_config):
        return "FP8 / NVFP4 weights"
    if os.environ.get(probe.PROBE_ENV) or os.environ.get(probe.FAULT_ENV):
        return f"{probe.PROBE_ENV} / {probe.FAULT_ENV} diagnostics"
    return ""


def _compiled(vllm_config: VllmConfig) -> bool:
    """``support_torch_compile``'s ``enable_if``: compile where :func:`eager_only_reason` finds nothing."""
    hf = vllm_config.model_config.hf_config.to_dict()
    return not eager_only_reason(ArchConfig.from_hf(hf), hf)


def check_engine_config(arch: ArchConfig, vllm_config: VllmConfig) -> None:
    """Refuse by name an engine whose dtype differs from the checkpoint's, or TP / PP > 1."""
    mc = vllm_config.model_config
    if mc.dtype != arch.torch_dtype:
        raise UnsupportedConfigError(
            f"engine dtype {mc.dtype} differs from the checkpoint's {arch.dtype}: pass dtype='{arch.dtype}' to vLLM")
    tp = vllm_config.parallel_config.tensor_parallel_size
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if tp != 1 or pp != 1:
        raise UnsupportedConfigError(f"megatron-consistent supports TP=1, PP=1 only (got TP={tp}, PP={pp})")
    if vllm_config.model_config.max_model_len > arch.rope.max_positions:
        raise UnsupportedConfigError(
            f"max_model_len {vllm_config.model_config.max_model_len} exceeds the rope table ({arch.rope.max_positions})")
    reason = eager_only_reason(arch, vllm_config.model_config.hf_config.to_dict())
    graphs = vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    if reason and vllm_config.device_config.device_type == "cuda" and graphs:
        raise UnsupportedConfigError(
            f"{arch.architecture} with {reason} runs eager on CUDA in megatron-consistent: start vLLM with enforce_eager=True")


@compiled_by_vllm(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0}, enable_if=_compiled)
class ConsistentForCausalLM(nn.Module):
    """Out-of-tree vLLM model computing with megatron-consistent kernels.

    vLLM compiles ``forward`` (every kernel is one opaque custom op, :mod:`..kernels.inference_ops`) and replays
    it as CUDA graphs, except for the models :func:`eager_only_reason` names."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        mc = vllm_config.model_config
        arch = ArchConfig.from_hf(mc.hf_config.to_dict())
        check_engine_config(arch, vllm_config)
        self.arch = arch
        # refit bookkeeping (load_weights): HF targets ever loaded; a dummy-started engine gets its weights from refits
        self._loaded_targets: set[str] = set()
        self._dummy_start = str(getattr(vllm_config.load_config, "load_format", "")).lower().endswith("dummy")
        dt = arch.torch_dtype
        from .fp8 import layer_factory, quantization_of  # block-FP8 checkpoints (issue #9): vllm_plugin/fp8.py

        self.fp8_formats = quantization_of(mc.hf_config.to_dict())
        fp8_layer = layer_factory(arch, self.fp8_formats) if self.fp8_formats else None
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, dtype=dt)
        self.layers = nn.ModuleList(
            (fp8_layer or decoder_layer_class(arch, i))(arch, vllm_config.cache_config, f"{prefix}model.layers.{i}") for i in range(arch.num_layers))
        self.norm = _param(arch.hidden_size, dtype=dt)
        self.lm_head = self.embed_tokens if arch.tie_word_embeddings else _param(arch.vocab_size, arch.hidden_size, dtype=dt)
        cos, sin = rope_cache(arch.rope, torch.device(vllm_config.device_config.device))  # the trainer's float32 tables
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        probe.install_from_env()
        logger.info("megatron-consistent: %s runs on the consistent kernels (bitwise-matching the Megatron trainer)",
                    arch.architecture)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[input_ids]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cap = probe.PROBE
        if cap is not None:
            cap.begin(input_ids, positions)
            cap("embed", h)
        rope = (self.rope_cos[positions], self.rope_sin[positions])
        for layer in self.layers:
            h = layer(positions, h, rope)
        out = inference_ops.rms_norm(h, self.norm, self.arch.rms_norm_eps)
        if cap is not None:
            cap("final_norm", out)
            cap.end()
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden_states, self.lm_head)
        if probe.PROBE is not None:
            probe.PROBE.logits(hidden_states, logits)
        return logits

    # --- weights in HF layout -------------------------------------------------------------
    def hf_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the view of this model's storage it is copied into (the family's weight table,
        :mod:`megatron_consistent.architectures`; block-FP8 / NVFP4 scales: the layer's ``block_scales``, vllm_plugin/fp8.py)."""
        out = {}
        for entry in weight_entries(self.arch):
            out.update(zip(entry.hf, engine_views(entry, self.get_parameter(entry.engine))))
            module, _, held = entry.engine.rpartition(".")
            block_scales = getattr(self.get_submodule(module), "block_scales", None)
            if block_scales is not None:
                out.update(block_scales(entry, held))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this model's storage in place (no data pointer ever changes).

        Accepts any order and any subset per call — the initial load, or a refit
        stream (per tensor or bucketed, NeMo-RL / verl style); a tensor of
        another dtype is cast by the copy.  Unknown names and shape mismatches
        are refused by name (tensors before the bad one are already copied).
        The targets ever loaded are tracked: the first call (the engine's
        initial load) must set every tensor, unless the engine was started with
        ``load_format="dummy"`` (its weights come from the refits).  Returns the
        parameters whose every HF tensor has been loaded so far (vLLM's loader
        checks that set after the initial load).
        """
        targets = self.hf_targets()
        seen = set()
        for name, tensor in weights:
            if name not in targets:
                if self.arch.tie_word_embeddings and name == "lm_head.weight":
                    continue
                raise UnsupportedConfigError(f"unexpected checkpoint tensor {name!r} (not a tensor of {self.arch.architecture})")
            dst = targets[name]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise UnsupportedConfigError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            seen.add(name)
        first = not self._loaded_targets
        self._loaded_targets |= seen
        missing = sorted(set(targets) - self._loaded_targets)
        if first and missing and not self._dummy_start:
            raise UnsupportedConfigError(
                f"initial load leaves {len(missing)} tensors unset: {missing[:8]}{' …' if len(missing) > 8 else ''}")
        unset = {targets[n].untyped_storage().data_ptr() for n in missing}
        return {n for n, p in self.named_parameters() if p.untyped_storage().data_ptr() not in unset}
