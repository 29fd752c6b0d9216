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
import vllm.envs as envs
from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig
from vllm.logger import init_logger

from ..architectures import engine_views, take_part, tp_part, weight_entries
from ..config import ArchConfig, UnsupportedConfigError
from ..kernels import CUDA_MAX_HEAD_DIM, compute_logits, inference_ops, rope_cache
from . import announce, probe
from .compat import compiled_by_vllm
from .decoder_layer import _param
from .moe import ROUTES_ENV, decoder_layer_class, start_recorder
from .parallel import check_tp, gather_vocab, tp_rank_size, vocab_parallel_embedding

logger = init_logger("vllm.plugins.megatron_consistent.model")


def eager_only_reason(arch: ArchConfig, hf_config: dict) -> str:
    """Why this model runs eager on CUDA ('' when vLLM compiles it and replays CUDA graphs).

    Dense and MoE models (router, route and grouped experts are opaque custom ops with no host read) compile with
    vLLM's default CUDA graphs, block-FP8 and NVFP4 ones too (the FP8 linear and FP8 experts are such ops); hybrid
    Mamba-2 models compile too, their mixer core a splitting op run eagerly between piecewise graphs (:mod:`.mamba`).
    Eager: MoE experts in a quantized format the CUDA FP8 GEMM does not serve (their per-expert path reads the host),
    and the diagnostics."""
    from ..kernels.fp8 import tensor_core_formats
    from .fp8 import quantization_of

    formats = quantization_of(hf_config)
    if formats and arch.is_moe and not tensor_core_formats(*formats):
        return f"MoE experts in {formats[0].spec} weights / {formats[1].spec if formats[1] else 'unquantized'} activations"
    if os.environ.get(probe.PROBE_ENV) or os.environ.get(probe.FAULT_ENV):
        return f"{probe.PROBE_ENV} / {probe.FAULT_ENV} diagnostics"
    return ""


def compile_enabled(vllm_config: VllmConfig) -> bool:
    """``support_torch_compile``'s ``enable_if``: compile where :func:`eager_only_reason` finds nothing."""
    hf = vllm_config.model_config.hf_config.to_dict()
    return not eager_only_reason(ArchConfig.from_hf(hf), hf)


def check_engine_config(arch: ArchConfig, vllm_config: VllmConfig) -> None:
    """Refuse by name an engine whose dtype differs from the checkpoint's, PP > 1, a TP the plugin cannot run
    (:func:`.parallel.tp_refusal`: TP dividing the model's S and the shapes it cuts, a hybrid's Mamba groups included;
    FP8 / NVFP4 layouts that are not whole scale blocks per rank;
    a row-parallel K that S does not divide at any TP), on CUDA a head dim the attention
    kernel does not serve, and a compiled engine recording MoE routes with vLLM's compile cache on (its key does not
    see :data:`.moe.ROUTES_ENV`: a cached graph without the recorder could be loaded)."""
    from .fp8 import quantization_of

    mc = vllm_config.model_config
    if mc.dtype != arch.torch_dtype:
        raise UnsupportedConfigError(
            f"engine dtype {mc.dtype} differs from the checkpoint's {arch.dtype}: pass dtype='{arch.dtype}' to vLLM")
    tp = vllm_config.parallel_config.tensor_parallel_size
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp != 1:
        raise UnsupportedConfigError(f"megatron-consistent supports PP=1 only (got PP={pp})")
    formats = quantization_of(mc.hf_config.to_dict())
    check_tp(arch, tp, formats[0] if formats else None)
    if vllm_config.model_config.max_model_len > arch.rope.max_positions:
        raise UnsupportedConfigError(
            f"max_model_len {vllm_config.model_config.max_model_len} exceeds the rope table ({arch.rope.max_positions})")
    if vllm_config.device_config.device_type == "cuda" and arch.head_dim > CUDA_MAX_HEAD_DIM:
        raise UnsupportedConfigError(f"head_dim {arch.head_dim}: megatron-consistent's CUDA attention serves head dims "
                                     f"up to {CUDA_MAX_HEAD_DIM}")
    reason = eager_only_reason(arch, vllm_config.model_config.hf_config.to_dict())
    compiled = not reason and vllm_config.compilation_config.mode != CompilationMode.NONE
    if arch.is_moe and os.environ.get(ROUTES_ENV) and compiled and not envs.VLLM_DISABLE_COMPILE_CACHE:
        raise UnsupportedConfigError(f"{ROUTES_ENV} in a compiled engine needs VLLM_DISABLE_COMPILE_CACHE=1 (vLLM's compile "
                                     "cache key does not see the route recorder)")
    graphs = vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    if reason and vllm_config.device_config.device_type == "cuda" and graphs:
        raise UnsupportedConfigError(
            f"{arch.architecture} with {reason} runs eager on CUDA in megatron-consistent: start vLLM with enforce_eager=True")


@compiled_by_vllm(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0}, enable_if=compile_enabled)
class ConsistentForCausalLM(nn.Module):
    """Out-of-tree vLLM model computing with megatron-consistent kernels.

    vLLM compiles ``forward`` (every kernel is one opaque custom op, :mod:`..kernels.inference_ops`) and replays
    it as CUDA graphs, except for the models :func:`eager_only_reason` names."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        mc = vllm_config.model_config
        arch = ArchConfig.from_hf(mc.hf_config.to_dict())
        check_engine_config(arch, vllm_config)
        self._hold_rank_and_vocabulary(arch, vllm_config)
        dt = arch.torch_dtype
        from .fp8 import layer_factory, quantization_of  # block-FP8 checkpoints (issue #9): vllm_plugin/fp8.py

        self.fp8_formats = quantization_of(mc.hf_config.to_dict())
        fp8_layer = layer_factory(arch, self.fp8_formats) if self.fp8_formats else None
        self.layers = nn.ModuleList(
            (fp8_layer or decoder_layer_class(arch, i))(arch, vllm_config.cache_config, f"{prefix}model.layers.{i}") for i in range(arch.num_layers))
        self.norm = _param(arch.hidden_size, dtype=dt)
        cos, sin = rope_cache(arch.rope, torch.device(vllm_config.device_config.device))  # the trainer's float32 tables
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._finish_build(vllm_config)
        logger.info("megatron-consistent: %s runs on the consistent kernels (bitwise-matching the Megatron trainer), "
                    "TP rank %d of %d", arch.architecture, self.tp_rank, self.tp_size)

    def _hold_rank_and_vocabulary(self, arch: ArchConfig, vllm_config: VllmConfig) -> None:
        """The start every model class shares: ``arch``, this process's place in vLLM's tensor-parallel group (checked
        against the engine's ``tensor_parallel_size``), the refit bookkeeping, and the embedding / lm head holding
        this rank's vocabulary part (weight table rule ``vocab``; the whole vocabulary at TP = 1)."""
        self.arch = arch
        self.tp_rank, self.tp_size = tp_rank_size()
        if self.tp_size != vllm_config.parallel_config.tensor_parallel_size:
            raise UnsupportedConfigError(f"tensor_parallel_size={vllm_config.parallel_config.tensor_parallel_size} but vLLM's "
                                         f"tensor-parallel group has {self.tp_size} ranks (model built outside its engine?)")
        # refit bookkeeping (load_weights): HF targets ever loaded; a dummy-started engine gets its weights from refits
        self._loaded_targets: set[str] = set()
        self._dummy_start = str(getattr(vllm_config.load_config, "load_format", "")).lower().endswith("dummy")
        vocab_rows = -(-arch.vocab_size // self.tp_size)  # TP > 1: this rank's vocabulary part (weight table: "vocab")
        self.embed_tokens = _param(vocab_rows, arch.hidden_size, dtype=arch.torch_dtype)
        self.lm_head = self.embed_tokens if arch.tie_word_embeddings else _param(vocab_rows, arch.hidden_size, dtype=arch.torch_dtype)

    def _finish_build(self, vllm_config: VllmConfig) -> None:
        """The end every model class shares: MoE route recording on rank 0 (every rank computes the same routes), the
        held shapes checked against the weight table's parts at TP > 1 (refused by name if not), the op probe."""
        if self.arch.is_moe and self.tp_rank == 0:
            start_recorder(self.arch, vllm_config)  # route recording (vllm_plugin/moe.py)
        if self.tp_size > 1:
            self.hf_targets()
        probe.install_from_env()
        announce()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            return vocab_parallel_embedding(input_ids, self.embed_tokens, self.tp_rank, self.tp_size)
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
        if self.tp_size > 1:  # this rank's vocabulary columns -> the full float32 logits on every rank
            logits = gather_vocab(logits, self.arch.vocab_size)
        if probe.PROBE is not None:
            probe.PROBE.logits(hidden_states, logits)
        return logits

    # --- weights in HF layout -------------------------------------------------------------
    def hf_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the view of this model's storage it is copied into (the family's weight table,
        :mod:`megatron_consistent.architectures`; block-FP8 / NVFP4 scales: the layer's ``block_scales``, vllm_plugin/fp8.py)."""
        out = {}
        for entry in weight_entries(self.arch):
            module, _, held = entry.engine.rpartition(".")
            packing = getattr(self.get_submodule(module), "value_packing", {}).get(held, 1)  # NVFP4 codes: 2 a byte
            out.update(zip(entry.hf, engine_views(entry, self.get_parameter(entry.engine), self.tp_rank, self.tp_size, packing)))
            block_scales = getattr(self.get_submodule(module), "block_scales", None)
            if block_scales is not None:
                out.update(block_scales(entry, held))
        return out

    def hf_parts(self) -> dict[str, tuple[int, ...] | None]:
        """HF tensor name -> the part of the full HF tensor this TP rank holds (:func:`..architectures.tp_part`:
        ``(dim, start, stop)``, one run a block for the Mamba mixer's blocks; ``None``: all of it; ``(0, 0, 0)``:
        nothing, another rank's expert)."""
        parts = {n: tp_part(entry, i, self.tp_rank, self.tp_size)
                 for entry in weight_entries(self.arch) for i, n in enumerate(entry.hf)}
        return {**parts, **{n: part for n, (part, _) in self._quantized_layout().items()}}

    def hf_full_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> the shape of the whole HF tensor (what a checkpoint and a weight update carry)."""
        shapes = {n: tuple(s) for entry in weight_entries(self.arch) for n, s in zip(entry.hf, entry.hf_shapes)}
        return {**shapes, **{n: shape for n, (_, shape) in self._quantized_layout().items()}}

    def _quantized_layout(self) -> dict[str, tuple]:
        """Block-FP8 / NVFP4 scale tensors and NVFP4's packed codes: HF name -> (this rank's part, the whole shape)
        (the layers' ``quantized_layout``, vllm_plugin/fp8.py; empty for a model-dtype checkpoint)."""
        out = {}
        for entry in weight_entries(self.arch):
            module, _, held = entry.engine.rpartition(".")
            layout = getattr(self.get_submodule(module), "quantized_layout", None)
            if layout is not None:
                out.update(layout(entry, held, self.tp_rank, self.tp_size))
        return out

    def hf_local(self, name: str, tensor: torch.Tensor, parts: dict | None = None) -> torch.Tensor:
        """The part of the whole HF tensor ``name`` this TP rank keeps (the tensor itself at TP=1)."""
        return take_part(tensor, (parts if parts is not None else self.hf_parts()).get(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this model's storage in place (no data pointer ever changes).

        At tensor-parallel size t > 1 every tensor arrives whole (checkpoint shape) and this rank copies its part
        (weight table ``shard`` rule, :meth:`hf_parts`).  Accepts any order and any subset per call — the initial load, or a refit
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
        sharded = self.tp_size > 1
        parts, full = (self.hf_parts(), self.hf_full_shapes()) if sharded else ({}, {})
        seen = set()
        for name, tensor in weights:
            if name not in targets:
                if self.arch.tie_word_embeddings and name == "lm_head.weight":
                    continue
                raise UnsupportedConfigError(f"unexpected checkpoint tensor {name!r} (not a tensor of {self.arch.architecture})")
            dst = targets[name]
            whole = full[name] if sharded else tuple(dst.shape)
            if whole != tuple(tensor.shape):
                raise UnsupportedConfigError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {whole}")
            with torch.no_grad():
                dst.copy_(self.hf_local(name, tensor, parts) if sharded else tensor)
            seen.add(name)
        first = not self._loaded_targets
        self._loaded_targets |= seen
        missing = sorted(set(targets) - self._loaded_targets)
        if first and missing and not self._dummy_start:
            raise UnsupportedConfigError(
                f"initial load leaves {len(missing)} tensors unset: {missing[:8]}{' …' if len(missing) > 8 else ''}")
        unset = {targets[n].untyped_storage().data_ptr() for n in missing}
        return {n for n, p in self.named_parameters() if p.untyped_storage().data_ptr() not in unset}
