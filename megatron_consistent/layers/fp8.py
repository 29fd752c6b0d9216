"""FP8 forward for the consistent Megatron linears (issue #9); the trainer keeps its bf16 masters.

:func:`enable_fp8` binds an :class:`FP8Binding` to every decoder linear of a
model from :func:`build_consistent_model` (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``; not the LM head).  On every forward the bound
linear quantizes its bf16 master weight exactly as the block-FP8 export does
(:func:`megatron_consistent.conversion.fp8.quantized_parts`: split into the HF
tensors q/k/v or gate/up, 128x128 blocks per HF tensor, rejoined in Megatron's
fused row order), then calls
:func:`megatron_consistent.kernels.fp8.fp8_linear_ste` — forward bitwise the
vLLM plugin's ``fp8_linear`` on the exported checkpoint, backward the
straight-through estimator into the master weight.  MoE layers: the attention
linears as above, and :class:`FP8MoEBinding` on the MoE block quantizes every
expert (and shared expert) per HF tensor the same way; the router and the
shared-expert gate stay in the model dtype.  Row-parallel linears (``linear_proj``, ``linear_fc2``) run the FP8
linear's K-segment tree (:meth:`FP8Binding.subtree`); at TP > 1 (layouts whose rank parts are whole scale blocks,
:func:`megatron_consistent.conversion.fp8.fp8_tp_refusal`) each rank quantizes the full HF tensors and keeps its part,
and an MoE block's TP or EP rank quantizes its whole experts (docs/fp8.md, "Tensor parallelism", "Expert
parallelism").  The weights are
re-quantized on every call (no cache: an in-place update through ``.data``
would not be seen by a version-keyed cache).
"""

from __future__ import annotations

import torch

from ..config import ArchConfig, UnsupportedConfigError
from ..conversion.fp8 import check_fp8_arch, fp8_tp_refusal, is_quantized, quantized_parts
from ..conversion.hf import _join, _plan, segments_refusal
from ..conversion.moe import MOE_KINDS
from ..kernels.fp8 import (E4M3_ACT_1x128, E4M3_MAX, E4M3_WEIGHT_128, FP8Weights, QuantFormat, _encode_e4m3, constant_row_block,
                           fp8_combine_experts, fp8_expert_outputs, fp8_linear_ste, fp8_moe_experts, gate_up_block_rows,
                           kv_round_trip, part_block_ids, row_block_of_parts, weight_row_scales)
from . import tensor_parallel as tpar
from .parallel import global_layer_name

__all__ = ["FP8Binding", "FP8MoEBinding", "enable_fp8", "disable_fp8", "quantize_and_export"]


def _joined_block_ids(arch: ArchConfig, kind: str, part_rows: list[int], fmt: QuantFormat) -> torch.Tensor:
    """Each row's scale-block id of a Megatron fused weight whose HF parts (``part_rows`` rows each) were quantized one
    by one: the parts' ids joined in Megatron's row order (interleaved per query group for qkv)."""
    return _join(arch, kind, part_block_ids(part_rows, fmt.block[0]))


def _tp_split(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is this rank's tensor-parallel shard of a larger Megatron tensor."""
    return getattr(weight, "tensor_model_parallel", False) and tpar.tp_size() > 1


class FP8Binding:
    """Quantize a Megatron fused weight as the export does, then the FP8 linear with STE backward.

    At TP > 1 the rank's ``weight`` is a shard: the full Megatron tensor is all-gathered (bytes only,
    ``tensor_parallel.unshard_like``), quantized per HF tensor on the HF tensor's own block grid (the export's
    :func:`quantized_parts`), and the rank keeps its part of values and per-row scales (``shard_like``: rows of a
    column-parallel weight, whole 128-wide K blocks of a row-parallel one) -- the values and scales the engine's rank
    loads.  Row-parallel linears run :meth:`subtree` (the FP8 linear's K-segment tree, ``kernels.fp8``)."""

    def __init__(self, arch: ArchConfig, kind: str, w_fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat = E4M3_ACT_1x128):
        self.arch, self.kind, self.w_fmt, self.a_fmt = arch, kind, w_fmt, a_fmt
        self.block_rows = None  # of the rank's row scales, from the parts' shapes at the first call

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w_q, row_scales)`` of the fused weight (this rank's part at TP > 1), in Megatron's row order."""
        split = _tp_split(weight)
        full = tpar.unshard_like(weight.detach(), weight) if split else weight
        parts = quantized_parts(self.arch, self.kind, full, self.w_fmt)
        w_q = _join(self.arch, self.kind, [q for q, _ in parts])
        rows = _join(self.arch, self.kind, [weight_row_scales(s, q.shape[0], self.w_fmt) for q, s in parts])
        if self.block_rows is None:
            ids = _joined_block_ids(self.arch, self.kind, [q.shape[0] for q, _ in parts], self.w_fmt)
            self.block_rows = constant_row_block(tpar.shard_like(ids, weight) if split and weight.partition_dim == 0 else ids)
        if split:
            w_q, rows = tpar.shard_like(w_q, weight), tpar.shard_like(rows, weight)
        return w_q.contiguous(), rows.contiguous()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w_q, rows = self.quantize_weight(weight)
        return fp8_linear_ste(x, weight, bias, w_q, rows, w_fmt=self.w_fmt, a_fmt=self.a_fmt, w_block_rows=self.block_rows)

    def subtree(self, x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
        """The float32 FP8 subtree of ``segments`` K segments of this rank's row-parallel shard (no bias, STE backward):
        ``tensor_parallel.row_parallel_forward``'s ``subtree``."""
        w_q, rows = self.quantize_weight(weight)
        return fp8_linear_ste(x, weight, None, w_q, rows, torch.float32, w_fmt=self.w_fmt, a_fmt=self.a_fmt,
                              w_block_rows=self.block_rows, segments=segments)


class FP8MoEBinding:
    """Block-FP8 or NVFP4 experts of a :class:`~megatron_consistent.layers.moe.ConsistentMoELayer` (router unquantized).

    Each forward quantizes every expert's gate / up / down (and the shared expert's) per HF tensor with
    :func:`quantized_parts` (the export's routine), restacks values and per-row scales in the Megatron layout, and
    runs the FP8 experts (:mod:`megatron_consistent.kernels.fp8`; NVFP4: each expert tensor its own global scale, the
    activations unquantized) with the bf16 masters attached (STE backward).  At
    TP > 1 (or EP > 1) the block holds whole experts ``[r E/t, (r+1) E/t)`` of its TP (EP) rank: each is quantized
    whole on its own grid (no gather: an expert's values and scales do not depend on the others'), so the rank's
    values and scales are those of TP = 1 (and of the engine's rank); the layer runs its pairs through them
    (:meth:`expert_outputs`: the owned pairs summed over the TP ranks, or the pairs sent to the EP rank and their
    outputs sent back) and combines with the shared expert, whole on every rank (:meth:`combine`)."""

    def __init__(self, arch: ArchConfig, w_fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat = E4M3_ACT_1x128):
        self.arch, self.w_fmt, self.a_fmt = arch, w_fmt, a_fmt

    def quantize_weight(self, kind: str, weight: torch.Tensor) -> FP8Weights:
        parts = quantized_parts(self.arch, kind, weight, self.w_fmt)
        q = _join(self.arch, kind, [q for q, _ in parts]).contiguous()
        rows = _join(self.arch, kind, [weight_row_scales(s, q.shape[0], self.w_fmt) for q, s in parts]).contiguous()
        br = self.w_fmt.block[0]
        block_rows = gate_up_block_rows(q.shape[-2], br) if kind in ("experts_fc1", "fc1") else row_block_of_parts((q.shape[-2],), br)
        return FP8Weights(q, rows, weight, block_rows)

    def _experts(self, block) -> tuple[FP8Weights, FP8Weights]:
        return (self.quantize_weight("experts_fc1", block.experts.linear_fc1.weight),
                self.quantize_weight("experts_fc2", block.experts.linear_fc2.weight))

    def _shared(self, block) -> tuple | None:
        se = block.shared_experts
        if se is None:
            return None
        return self.quantize_weight("fc1", se.linear_fc1.weight), self.quantize_weight("copy", se.linear_fc2.weight), se.gate_weight

    def __call__(self, block, h: torch.Tensor, experts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The whole MoE output (every expert held: TP = 1)."""
        return fp8_moe_experts(h, experts, w, *self._experts(block), self._shared(block), w_fmt=self.w_fmt, a_fmt=self.a_fmt)

    def expert_outputs(self, block):
        """``outputs(rows [n, H], local_experts [n, k]) -> [n, k, H]``: the rows through the block's experts in FP8
        (:func:`~megatron_consistent.kernels.fp8.fp8_expert_outputs`, local indices), the block's whole experts
        quantized once for the call -- what ``kernels.moe.owned_pair_outputs`` (experts over the TP ranks) and
        ``layers.moe.pairs_through_expert_ranks`` (over the EP ranks) run."""
        fc1, fc2 = self._experts(block)
        return lambda rows, local: fp8_expert_outputs(rows, local, fc1, fc2, self.w_fmt, self.a_fmt)

    def combine(self, block, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The slot-order combine of the experts' outputs ``y`` (summed over the ranks) with the FP8 shared expert."""
        return fp8_combine_experts(h, y, w, self._shared(block), w_fmt=self.w_fmt, a_fmt=self.a_fmt)


def enable_fp8(model, w_fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat = E4M3_ACT_1x128) -> list[str]:
    """Switch the decoder linears of a consistent GPTModel to the FP8 forward (MoE layers: the experts, via
    :class:`FP8MoEBinding` on the block); returns the bound module names.  A pipeline stage binds the layers it holds
    (its local ``decoder.layers.<i>`` looked up in the weight table at their global numbers); every stage, context- and
    data-parallel rank quantizes those layers' full HF tensors, as the one-process model does (a tensor- or
    expert-parallel rank its part: whole experts, or whole scale blocks, ``conversion.fp8.fp8_tp_refusal``, asked at the
    TP size of the model's own ``config`` -- ``build_consistent_model``'s or the framework's)."""
    from .moe import ConsistentMoELayer
    from .moe_megatron import ConsistentExperts

    arch: ArchConfig = model.arch_config
    check_fp8_arch(arch, w_fmt)
    tp = model.config.tensor_model_parallel_size  # the model's TransformerConfig: set on a framework-built model too
    # the layers' K tree must be the architecture's (the scale blocks are checked at its S), then the engine's
    # refusal too (vllm_plugin/parallel.py tp_refusal)
    reason = segments_refusal(model, arch) or fp8_tp_refusal(arch, tp, w_fmt)
    if reason:
        raise UnsupportedConfigError(reason)
    bound = []
    for i, layer in enumerate(model.decoder.layers):
        if isinstance(layer.mlp, ConsistentMoELayer):
            layer.mlp.fp8 = FP8MoEBinding(arch, w_fmt, a_fmt)
            bound.append(f"decoder.layers.{i}.mlp")
        elif isinstance(getattr(layer.mlp, "experts", None), ConsistentExperts):  # Megatron's MoELayer (layers/moe_megatron.py)
            layer.mlp.experts.fp8 = FP8MoEBinding(arch, w_fmt, a_fmt)
            if layer.mlp.shared_experts is not None:
                layer.mlp.shared_experts.fp8 = layer.mlp.experts.fp8
            bound.append(f"decoder.layers.{i}.mlp")
    held = {global_layer_name(model, name): name for name, _ in model.named_modules()}  # a stage: its layers, global names
    held_layers = {f"decoder.layers.{layer.layer_number - 1}" for layer in model.decoder.layers}
    for mname, _, kind in _plan(arch):
        module_name = mname.rsplit(".", 1)[0]
        if not is_quantized(mname) or kind in MOE_KINDS or ".shared_experts." in mname:
            continue
        if module_name in held:
            model.get_submodule(held[module_name]).fp8 = FP8Binding(arch, kind, w_fmt, a_fmt)
            bound.append(held[module_name])
        elif ".".join(module_name.split(".")[:3]) in held_layers:  # a layer held without the table's module: no silent bf16
            raise UnsupportedConfigError(f"FP8: the weight table's {module_name} is not a module of the model (its layer is held)")
    model.fp8_formats = (w_fmt, a_fmt)
    return bound


def disable_fp8(model) -> None:
    for m in model.modules():
        if getattr(m, "fp8", None) is not None:
            m.fp8 = None
    model.fp8_formats = None


def quantize_and_export(model, arch: ArchConfig, out_dir, method: str):
    """Switch the consistent ``model`` to the forward of the quantization ``method`` (``"fp8"`` / ``"nvfp4"``,
    :func:`~megatron_consistent.conversion.fp8.method_formats`: every forward quantizes the bf16 masters) and write
    the quantized HF export of those masters (``conversion.fp8.export_hf_fp8``, the same quantization routine): the
    folder a quantized consistent engine starts from (``check --quantization``, ``RLSession(quantization=)``).
    Returns the folder."""
    from ..conversion.fp8 import export_hf_fp8, method_formats

    formats = method_formats(method)
    enable_fp8(model, *formats)
    return export_hf_fp8(model, arch, out_dir, *formats)


def enable_fp8_kv(model, on: bool = True) -> int:
    """FP8 KV cache round trip in the trainer: every consistent core attention quantizes -> dequantizes its
    post-RoPE K and V (private copies) exactly as the vLLM plugin's E4M3 cache does (kernels.fp8.kv_round_trip)."""
    from .attention import ConsistentCoreAttention

    n = 0
    for m in model.modules():
        if isinstance(m, ConsistentCoreAttention):
            m.fp8_kv = on
            n += 1
    return n


# ------------------------------------------------------------------------------------------- BASELINE (stock) fake quant
STOCK_FP8_QUANTIZATION = "fp8_per_channel"  # the stock vLLM FP8 path that runs on this CPU (docs/fp8.md, "Baseline")
_STOCK_MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)  # vLLM's minimum FP8 scaling factor


def _stock_fake_quant_rows(t: torch.Tensor, reciprocal: bool) -> torch.Tensor:
    """Per-row E4M3 fake quant as stock vLLM's online ``fp8_per_channel`` does it: ``s = max(amax_row / 448, 1/(448*512))``,
    ``q = e4m3(clamp(t / s))`` (weights: true division; activations: ``t * (1/s)``), back to ``t.dtype`` as ``q * s``."""
    tf = t.to(torch.float32)
    s = (tf.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=_STOCK_MIN_SCALE)
    q = _encode_e4m3(tf * s.reciprocal() if reciprocal else tf / s)
    return (q.to(torch.float32) * s).to(t.dtype)


def _fake_quant_input_per_token(module, args, kwargs):
    return (_stock_fake_quant_rows(args[0], reciprocal=True), *args[1:]), kwargs


def enable_stock_fp8_fake_quant(model) -> list[str]:
    """BASELINE trainer for ``check --quantization fp8``: a stock Megatron model (``build_stock_gpt_model``) fake-quantized
    the way the stock engine (vLLM ``quantization="fp8_per_channel"``, online, on the bf16 checkpoint) quantizes: every
    decoder linear's weight per output channel (written into the parameters — recompute only) and, for the dense /
    attention linears, the input per token (a forward pre-hook); then stock ``F.linear`` in the model dtype (the engine
    runs ``torch._scaled_mm`` with float32 accumulation).  MoE experts (StockMoELayer): weights only."""
    arch: ArchConfig = model.arch_config
    params = dict(model.named_parameters())
    done = []
    for mname, _, kind in _plan(arch):
        if not is_quantized(mname):
            continue
        with torch.no_grad():
            params[mname].copy_(_stock_fake_quant_rows(params[mname].detach(), reciprocal=False))
        if kind not in MOE_KINDS and ".shared_experts." not in mname:
            model.get_submodule(mname.rsplit(".", 1)[0]).register_forward_pre_hook(_fake_quant_input_per_token, with_kwargs=True)
        done.append(mname)
    return done


def enable_stock_fp8_kv(model) -> int:
    """BASELINE trainer for ``check --kv-cache-dtype fp8``: Megatron's stock core attention sees K and V after the
    E4M3 round trip (``kernels.fp8.kv_round_trip``, scale 1 — stock vLLM's default k/v scale)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def hook(module, args, kwargs):
        args = list(args)
        for i, name in ((1, "key"), (2, "value")):
            if len(args) > i:
                args[i] = kv_round_trip(args[i])
            elif name in kwargs:
                kwargs[name] = kv_round_trip(kwargs[name])
        return tuple(args), kwargs

    n = 0
    for m in model.modules():
        if isinstance(m, DotProductAttention):
            m.register_forward_pre_hook(hook, with_kwargs=True)
            n += 1
    return n
