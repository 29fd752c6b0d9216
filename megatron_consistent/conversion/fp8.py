"""Block-FP8 export (issue #9): the bf16 Megatron masters -> HF block-FP8 safetensors.

Quantized tensors: every decoder linear in HF layout — ``self_attn.{q,k,v,o}_proj``
and ``mlp.{gate,up,down}_proj``; in MoE layers every expert's
``{gate,up,down}_proj`` (Mixtral ``w1/w3/w2``) and the shared expert's — each
quantized on its own (per HF tensor, so the 128x128 block grid is the HF
tensor's, whatever fusion or stacking the engine uses).  Embeddings, norms,
biases, ``lm_head``, the MoE router (``mlp.gate``) and ``shared_expert_gate``
stay in the model dtype (the router as in vLLM / the published block-FP8 MoE
checkpoints: its logits decide discrete routes, and it is tiny).

Per quantized tensor ``<name>.weight``: the E4M3 values (``float8_e4m3fn``) and
``<name>.weight_scale_inv`` (float32 ``[ceil(N/128), ceil(K/128)]``, the
dequantization multiplier: ``w ~= float32(weight) * weight_scale_inv`` per
block) — the DeepSeek-V3 / HF block-FP8 naming.  ``config.json`` gets

* ``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic"}`` (what vLLM / HF users expect), and
* ``megatron_consistent_quantization`` — the exact scheme the consistent
  plugin reads (value codec, weight and activation blocks, scale format,
  quantized modules).  The plugin never relies on vLLM's own FP8 methods: its
  model class ignores vLLM's ``quant_config`` object and runs
  :func:`megatron_consistent.kernels.fp8.fp8_linear` (see vllm_plugin/fp8.py).

:func:`quantized_parts` is the single quantization routine for both the export
and the trainer's forward (layers/fp8.py), so the exported FP8 values and
scales are bitwise the ones the trainer computed with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..architectures import router_hf_modules, tp_part, weight_entries
from ..config import ArchConfig, UnsupportedConfigError
from ..kernels.fp8 import E4M3_ACT_1x128, E4M3_WEIGHT_128, NVFP4_WEIGHT, QuantFormat, quantize
from ..kernels.nvfp4 import nvfp4_quantize, pack_e2m1
from .hf import _DTYPE_STR, _model_params, _plan, _split

__all__ = ["HF_QUANT_LAYOUTS", "QUANT_KEY", "QUANTIZATION_METHODS", "QUANTIZED_MEGATRON_SUFFIXES", "HFQuantLayout",
           "export_hf_fp8", "fp8_arch_refusal", "fp8_hf_state_dict", "fp8_tp_refusal", "hf_layout", "method_formats",
           "quantization_entry", "quantized_parts", "scale_part"]

QUANT_KEY = "megatron_consistent_quantization"
QUANTIZED_MEGATRON_SUFFIXES = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                               "mlp.linear_fc2.weight", "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight",
                               "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight")


@dataclass(frozen=True)
class HFQuantLayout:
    """A quantization method's facts -- the one place they live: the formats ``--quantization <method>`` (``check``,
    ``RLSession``) runs (:func:`method_formats`) and the HF checkpoint names of its weight format: the export writes
    them (:func:`fp8_hf_state_dict`), ``sync.protocol.quantization_of`` tells a format by them, the consistent vLLM
    plugin loads its scale parameters under them and the check report names them."""

    method: str  # the format's name in megatron_consistent_quantization ("method") and on the command line (--quantization)
    name: str  # what messages and reports call it
    weight: QuantFormat  # the weight format
    activations: QuantFormat | None  # the activation format the method runs (None: weight-only, the activations unquantized)
    values: str  # what ``<module>.weight`` holds
    scales: tuple[tuple[str, str], ...]  # (HF name suffix, stored as) of each scale tensor beside the weight, in order
    per_tensor_scale: str = ""  # the suffix of the scale that is one float32 per HF tensor (whole on every rank), if any

    @property
    def scale_suffixes(self) -> tuple[str, ...]:
        return tuple(suffix for suffix, _ in self.scales)

    def scale_names(self, weight: str) -> tuple[str, ...]:
        """HF names of the scale tensors of the HF weight ``weight`` (``<module>.weight``), in :attr:`scales` order."""
        return tuple(weight.removesuffix("weight") + suffix for suffix in self.scale_suffixes)

    def weight_of(self, scale: str) -> str:
        """The HF weight name of the scale tensor ``scale`` (inverse of :meth:`scale_names`)."""
        suffix = next(s for s in sorted(self.scale_suffixes, key=len, reverse=True) if scale.endswith("." + s))
        return scale.removesuffix(suffix) + "weight"


# value codec (QuantFormat.name) -> its method and HF layout (block-FP8 W8A8: 128x128 E4M3 weights, dynamic 1x128
# E4M3 activations, DeepSeek-V3 / HF naming; NVFP4 W4A16: NVFP4 weights, unquantized activations, ModelOpt naming)
HF_QUANT_LAYOUTS = {
    "e4m3": HFQuantLayout("fp8", "block-FP8", E4M3_WEIGHT_128, E4M3_ACT_1x128, "E4M3", (("weight_scale_inv", "float32"),)),
    "e2m1": HFQuantLayout("nvfp4", "NVFP4", NVFP4_WEIGHT, None, "packed E2M1",
                          (("weight_scale", "E4M3"), ("weight_scale_2", "float32")), per_tensor_scale="weight_scale_2"),
}
QUANTIZATION_METHODS = tuple(layout.method for layout in HF_QUANT_LAYOUTS.values())  # --quantization's choices


def method_formats(method: str) -> tuple[QuantFormat, QuantFormat | None]:
    """``(weight format, activation format)`` of the quantization method ``method`` (``--quantization``); another
    name: one-line ``ValueError``."""
    for layout in HF_QUANT_LAYOUTS.values():
        if layout.method == method:
            return layout.weight, layout.activations
    raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")


def hf_layout(fmt: QuantFormat) -> HFQuantLayout:
    """The HF layout of the weight format ``fmt``."""
    return HF_QUANT_LAYOUTS[fmt.name]


def fp8_arch_refusal(arch: ArchConfig, fmt: QuantFormat = E4M3_WEIGHT_128) -> str:
    """Why ``arch`` cannot be quantized in ``fmt`` at all ('' when it can): dense and SwiGLU-MoE decoders in block-FP8
    and in NVFP4 (every quantized tensor's K even: two E2M1 codes a byte); hybrid (Mamba) models and non-gated experts
    are refused by name."""
    if arch.is_hybrid:
        return f"hybrid Mamba architectures ({arch.architecture}) are not supported"
    if arch.is_moe and not arch.mlp_gated:
        return f"non-gated (relu2) MoE experts ({arch.architecture}) are not supported"
    if fmt.name == "e2m1":
        for entry in weight_entries(arch):
            odd = [(hf, shape) for hf, shape in zip(entry.hf, entry.hf_shapes) if is_quantized(entry.megatron) and shape[-1] % 2]
            if odd:
                return f"{odd[0][0]} {tuple(odd[0][1])} has an odd input size (two E2M1 codes per byte)"
    return ""


def check_fp8_arch(arch: ArchConfig, fmt: QuantFormat = E4M3_WEIGHT_128, tp: int = 1) -> None:
    """Raise :class:`UnsupportedConfigError` with :func:`fp8_arch_refusal`'s reason (at ``tp`` > 1
    :func:`fp8_tp_refusal`'s), if any."""
    if tp > 1:
        reason = fp8_tp_refusal(arch, tp, fmt)  # names the format and the TP itself
    else:
        reason = fp8_arch_refusal(arch, fmt)
        reason = reason and f"{hf_layout(fmt).method} quantization: {reason}"
    if reason:
        raise UnsupportedConfigError(reason)


def fp8_tp_refusal(arch: ArchConfig, tp: int, fmt: QuantFormat = E4M3_WEIGHT_128) -> str:
    """Why ``arch``'s decoder linears cannot run in ``fmt`` at tensor-parallel size ``tp`` > 1 ('' when they can; both
    engines ask it, before any work).  Every rank's part of every quantized HF tensor (the weight table's ``shard``
    rule) must hold whole scale blocks -- column-parallel rows in runs of ``block[0]`` (block-FP8 128, NVFP4 1),
    row-parallel K in runs of ``block[1]`` (128, 16) -- and every segment of the row-parallel K tree (K / S, S the
    model's) whole activation groups / weight block columns: no quantization group straddles a rank or a segment
    boundary (docs/fp8.md, "Tensor parallelism").  MoE experts (``experts`` rule) are whole on their rank, so every
    expert's blocks are whole at any TP; the shared expert and the router are replicated."""
    if tp == 1:
        return ""
    name = f"{hf_layout(fmt).method} quantization at TP={tp}"
    reason = fp8_arch_refusal(arch, fmt)
    if reason:
        return f"{name}: {reason}"
    segments = arch.row_parallel_segments
    for entry in weight_entries(arch):
        if not is_quantized(entry.megatron) or entry.shard == "experts":  # experts: whole on their rank
            continue
        for i, (hf, shape) in enumerate(zip(entry.hf, entry.hf_shapes)):
            cut = tp_part(entry, i, 0, tp)
            if cut is None:
                continue
            dim = cut[0]
            block = fmt.block[0] if dim == 0 else fmt.block[1]
            if (cut[2] - cut[1]) % block:  # NVFP4: K in whole 16-groups (also whole bytes of two codes)
                return (f"{name}: {hf} {tuple(shape)} gives each rank {cut[2] - cut[1]} "
                        f"{'rows' if dim == 0 else 'K columns'}, not whole {block}-wide scale blocks")
            if entry.shard == "row" and (shape[-1] // segments) % fmt.block[1]:
                return (f"{name}: {hf} K = {shape[-1]} in S = {segments} row-parallel segments of {shape[-1] // segments}, "
                        f"not whole {fmt.block[1]}-wide quantization groups")
    return ""


def scale_part(part: tuple[int, ...] | None, fmt: QuantFormat = E4M3_WEIGHT_128) -> tuple[int, ...] | None:
    """The part of a block-scale tensor ``[ceil(N/br), ceil(K/bc)]`` that goes with the part ``part`` of its weight
    (:func:`..architectures.tp_part`, one run; whole blocks, as :func:`fp8_tp_refusal` requires)."""
    if part is None:
        return None
    dim, start, stop = part
    block = fmt.block[0] if dim == 0 else fmt.block[1]
    return dim, start // block, -(-stop // block)


def is_quantized(megatron_name: str) -> bool:
    return megatron_name.startswith("decoder.layers.") and megatron_name.endswith(QUANTIZED_MEGATRON_SUFFIXES)


def quantized_parts(arch: ArchConfig, kind: str, weight: torch.Tensor, fmt: QuantFormat = E4M3_WEIGHT_128):
    """``[(q, scale)]`` per HF tensor of the Megatron ``weight`` (split as by the HF conversion), each quantized on its own."""
    with torch.no_grad():
        return [quantize(part.contiguous(), fmt) for part in _split(arch, kind, weight.detach())]


def quantization_entry(fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat | None = E4M3_ACT_1x128) -> dict:
    """The ``megatron_consistent_quantization`` config entry (read back by :func:`formats_from_entry`); ``a_fmt`` None:
    weight-only (NVFP4 W4A16)."""
    return {"method": hf_layout(fmt).method, "weight": fmt.as_dict(),
            "activation": None if a_fmt is None else {**a_fmt.as_dict(), "dynamic": True},
            "modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts.*.{gate,up,down}_proj|w1|w3|w2",
                        "shared_expert.{gate,up,down}_proj"],
            "not_quantized": ["embed_tokens", "norms", "lm_head", "mlp.gate (MoE router)", "shared_expert_gate"]}


def formats_from_entry(entry: dict) -> tuple[QuantFormat, QuantFormat | None]:
    if entry.get("method") not in QUANTIZATION_METHODS:
        raise UnsupportedConfigError(f"{QUANT_KEY}: unsupported method {entry.get('method')!r} "
                                     f"({' or '.join(QUANTIZATION_METHODS)})")
    w, a = entry["weight"], entry["activation"]
    return (QuantFormat(w["name"], tuple(w["block"]), w["scale_format"]),
            None if a is None else QuantFormat(a["name"], tuple(a["block"]), a["scale_format"]))


def fp8_hf_state_dict(model, arch: ArchConfig, fmt: QuantFormat = E4M3_WEIGHT_128) -> dict[str, torch.Tensor]:
    """HF-named tensors: FP8 ``.weight`` + ``.weight_scale_inv`` for the decoder linears (NVFP4: packed ``.weight`` uint8
    ``[N, K/2]``, ``.weight_scale`` E4M3 ``[N, K/16]``, ``.weight_scale_2`` float32 scalar), the model dtype elsewhere."""
    check_fp8_arch(arch, fmt)
    scale_names = hf_layout(fmt).scale_names
    params = _model_params(model, arch)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for mname, hf_names, kind in _plan(arch):
            p = params[mname].detach().cpu()
            if is_quantized(mname) and fmt.name == "e2m1":  # NVFP4: ModelOpt names, two codes per byte
                for hf_name, part in zip(hf_names, _split(arch, kind, p)):
                    codes, sb, g = nvfp4_quantize(part.contiguous(), fmt.block[1])
                    tensors[hf_name] = pack_e2m1(codes).contiguous()
                    tensors.update(zip(scale_names(hf_name), (sb.contiguous(), g.contiguous()), strict=True))
            elif is_quantized(mname):
                for hf_name, (q, s) in zip(hf_names, quantized_parts(arch, kind, p, fmt)):
                    tensors[hf_name] = q.contiguous()
                    tensors.update(zip(scale_names(hf_name), (s.contiguous(),), strict=True))
            else:
                for hf_name, part in zip(hf_names, _split(arch, kind, p)):
                    tensors[hf_name] = part.contiguous().clone()
    return tensors


def export_hf_fp8(model, arch: ArchConfig, out_dir, fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat | None = E4M3_ACT_1x128,
                  hf_quantization_config: bool = True) -> Path:
    """Write a block-FP8 (or NVFP4) HF folder (``config.json`` + ``model.safetensors``); see the module doc for the layout.

    NVFP4: no standard ``quantization_config`` is written (vLLM's ModelOpt NVFP4 methods are CUDA-only; the
    consistent plugin reads ``megatron_consistent_quantization``)."""
    if fmt.name == "e2m1":
        hf_quantization_config = False
    tensors = fp8_hf_state_dict(model, arch, fmt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = arch.to_hf()
    dtype = next(p.dtype for p in model.parameters())
    if dtype in _DTYPE_STR:
        hf["torch_dtype"] = _DTYPE_STR[dtype]
    hf[QUANT_KEY] = quantization_entry(fmt, a_fmt)
    if hf_quantization_config:
        hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(fmt.block), "activation_scheme": "dynamic",
                                     "fmt": "e4m3"}
        if arch.is_moe:  # routers stay in the model dtype (as in the published block-FP8 MoE checkpoints)
            hf["quantization_config"]["modules_to_not_convert"] = router_hf_modules(arch)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out

