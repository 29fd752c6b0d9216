"""Block-FP8 checkpoints in the consistent vLLM model (issue #9).

A checkpoint written by :func:`megatron_consistent.conversion.fp8.export_hf_fp8`
carries ``megatron_consistent_quantization`` in its ``config.json``;
:func:`quantization_of` reads it (the standard ``quantization_config`` is
written too, for other readers, but the plugin never hands the linears to
vLLM's FP8 methods: the model class holds raw parameters and ignores vLLM's
``quant_config`` object).

:class:`FP8DecoderLayer` stores each fused linear as E4M3 values
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` in
``float8_e4m3fn``) plus one block-scale parameter per HF tensor
(``q_proj_scale`` … ``down_proj_scale``, float32 ``[ceil(N/128), ceil(K/128)]``,
loaded from ``<name>.weight_scale_inv``); every call expands the block scales
to per-row scales in the fused row order and runs the custom op
``inference_ops.fp8_linear`` (:func:`megatron_consistent.kernels.fp8.fp8_linear`, the trainer's FP8 forward, as one
opaque node, so vLLM compiles the model and replays CUDA graphs).
MoE layers (:class:`FP8MoEDecoderLayer`): q/k/v/o the same way; stacked E4M3
experts with per-expert block scales through the custom op ``inference_ops.fp8_moe_experts``
(:func:`megatron_consistent.kernels.fp8.fp8_moe_experts`; on CUDA grouped FP8 GEMMs); the router and the
shared-expert gate stay in the model dtype.  At TP > 1 a rank holds its whole experts ``[r E/t, (r+1) E/t)`` with
their whole block scales (the shared expert whole on every rank) and sums its experts' outputs with the other ranks'
before the combine, as the model-dtype MoE layer does (:mod:`.moe`).
o_proj and down run the FP8 linear's row-parallel K-segment tree (``inference_ops.fp8_row_parallel_linear``); at
tensor-parallel size t > 1 (block-FP8 / NVFP4 checkpoints whose rank parts are whole scale blocks:
:func:`..conversion.fp8.fp8_tp_refusal`) each rank holds its part of every quantized weight and of its block scales
(:meth:`_BlockScales.quantized_layout`; NVFP4's global scale whole) and o_proj / down give its float32 subtree,
all-gathered (:func:`.parallel.fp8_row_parallel_for`).
Refits send the same two tensors per linear.  NVFP4 checkpoints (W4A16): the
fused storage holds the packed E2M1 codes (``uint8 [N, K/2]``), each HF tensor
its E4M3 ``weight_scale [N, K/16]`` and float32 ``weight_scale_2``; every call
unpacks and runs the same ``fp8_linear`` with ``a_fmt=None``.  NVFP4 MoE layers: the
same FP8 expert ops on the unpacked codes with per-row scales ``float32(weight_scale) *
weight_scale_2`` (each expert tensor its own global scale).
"""

from __future__ import annotations

import torch
from torch import nn

from ..architectures import tp_part
from ..config import ArchConfig, UnsupportedConfigError
from ..conversion.fp8 import QUANT_KEY, check_fp8_arch, formats_from_entry, hf_layout, scale_part
from ..kernels import inference_ops
from ..kernels.fp8 import row_block_of_parts, weight_row_scales
from ..kernels.nvfp4 import nvfp4_effective_scales, unpack_e2m1
from .decoder_layer import ConsistentDecoderLayer
from .moe import ConsistentMoEDecoderLayer
from .parallel import fp8_row_parallel_for, tp_rank_size

# a layer's scale parameters of a stem (e.g. ``q_proj``, ``experts_gate``): ``<stem>_scale`` and (NVFP4) ``<stem>_scale_2``,
# for the format's HF scale tensors in their order (conversion.fp8.HF_QUANT_LAYOUTS)
_SCALE_PARAMS = ("_scale", "_scale_2")

__all__ = ["FP8DecoderLayer", "quantization_of"]

# fused op -> (fused parameter, its HF tensors' short names: the stems of the block-scale parameters, in row order)
_FUSED = {
    "qkv": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("o_proj", ("o_proj",)),
    "gate_up": ("gate_up_proj", ("gate_proj", "up_proj")),
    "down": ("down_proj", ("down_proj",)),
}
ROW_PARALLEL_OPS = ("o_proj", "down")  # the K-segment tree (docs/parallel.md), in FP8 as in the model dtype


def quantization_of(hf: dict):
    """``(weight_format, activation_format)`` from an HF config dict, or None for an unquantized checkpoint."""
    entry = hf.get(QUANT_KEY)
    if entry is None:
        qc = hf.get("quantization_config")
        if qc:
            raise UnsupportedConfigError(
                f"checkpoint has quantization_config={qc} but no {QUANT_KEY}: the consistent plugin runs only block-FP8 "
                "checkpoints written by megatron_consistent.conversion.fp8.export_hf_fp8")
        return None
    return formats_from_entry(entry)


def _quantize_fused(layer, ops, arch: ArchConfig, formats) -> None:
    """Replace ``layer``'s fused linears ``ops`` by E4M3 storage + one block-scale parameter per HF tensor."""
    layer.w_fmt, layer.a_fmt = formats
    layer.format_specs = (layer.w_fmt.spec, layer.a_fmt.spec if layer.a_fmt is not None else "")  # the ops' arguments
    br, bc = layer.w_fmt.block
    nv = layer.nvfp4 = layer.w_fmt.name == "e2m1"  # NVFP4: codes packed two per byte, E4M3 block scales + float32 global
    layer.value_packing = {_FUSED[op][0]: 2 for op in ops} if nv else {}  # fused parameter -> values a stored element
    layer._rows = {}
    layer._scale_stems = {_FUSED[op][0]: _FUSED[op][1] for op in ops}
    _, tp = tp_rank_size()  # TP > 1: the rank's rows of q|k|v and gate|up; o_proj / down: its K columns (old.shape)
    sizes = {"q_proj": layer.q_size, "k_proj": layer.kv_size, "v_proj": layer.kv_size, "o_proj": arch.hidden_size,
             "gate_proj": arch.intermediate_size // tp, "up_proj": arch.intermediate_size // tp, "down_proj": arch.hidden_size}
    for op in ops:
        pname, parts = _FUSED[op]
        old = getattr(layer, pname)
        n_all, k = old.shape
        shape = (n_all, k // 2) if nv else old.shape
        setattr(layer, pname, nn.Parameter(torch.zeros(shape, dtype=layer.w_fmt.storage_dtype), requires_grad=False))
        for short in parts:
            n = sizes[short]
            if nv:
                setattr(layer, f"{short}_scale", nn.Parameter(torch.ones(n, -(-k // bc), dtype=torch.float8_e4m3fn), requires_grad=False))
                setattr(layer, f"{short}_scale_2", nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False))
                continue
            setattr(layer, f"{short}_scale", nn.Parameter(torch.ones(-(-n // br), -(-k // bc), dtype=torch.float32), requires_grad=False))
        layer._rows[op] = [sizes[s] for s in parts]
        layer.lin[op] = _make_linear(layer, op, tp)


def _make_linear(layer, op: str, tp: int):
    """The FP8 linear of ``op``: column-parallel ones (qkv, gate_up) the whole-K ``fp8_linear``; the row-parallel ones
    (o_proj, down) the FP8 linear's K-segment tree of the model's S segments (TP > 1: this rank's subtree, all-gathered,
    the top of the tree; :func:`.parallel.fp8_row_parallel_for`)."""
    parts = _FUSED[op][1]
    formats = layer.format_specs
    block_rows = row_block_of_parts(tuple(layer._rows[op]), layer.w_fmt.block[0])  # the parts' blocks, stacked
    row = fp8_row_parallel_for(layer.arch.row_parallel_segments, tp) if op in ROW_PARALLEL_OPS else None

    def run(x, w_q, b=None):
        if layer.nvfp4:
            rows = torch.cat([nvfp4_effective_scales(getattr(layer, f"{s}_scale"), getattr(layer, f"{s}_scale_2")) for s in parts])
            w_q = unpack_e2m1(w_q)
        else:
            rows = torch.cat([weight_row_scales(getattr(layer, f"{s}_scale"), n, layer.w_fmt) for s, n in zip(parts, layer._rows[op])])
        if row is not None:
            return row(x, w_q, rows, b, *formats, block_rows)
        return inference_ops.fp8_linear(x, w_q, rows, b, *formats, block_rows)

    return run


class _BlockScales:
    """``block_scales``: the HF scale tensors of a quantized weight entry -> this layer's scale parameters."""

    def block_scales(self, entry, held: str) -> dict[str, torch.Tensor]:
        """HF scale names of ``entry`` (a weight-table entry held in this layer's parameter ``held``) -> views of the
        scale parameters: ``<HF weight>_scale_inv`` (block-FP8), ``<HF weight>_scale`` / ``_scale_2`` (NVFP4, ModelOpt
        names: :func:`..conversion.fp8.hf_layout`); empty for a parameter that is not quantized."""
        scale_names = hf_layout(self.w_fmt).scale_names

        def scales(name, stem, take=lambda p: p):  # the HF scale names of weight ``name`` -> the stem's parameters
            names = scale_names(name)
            return {n: take(getattr(self, stem + p)) for n, p in zip(names, _SCALE_PARAMS[: len(names)])}

        if held in ("experts_fc1", "experts_fc2"):  # per-expert views of the stacked scales, in the entry's HF order
            first, run = self.expert_first, self.experts_down_scale.shape[0]  # TP > 1: this rank's experts only

            def view(e):  # another rank's expert: an empty view (its empty part, as the weight table's values)
                return lambda stack: stack[e - first] if first <= e < first + run else (stack[0] if stack.dim() > 1 else stack)[:0]

            stems = ("experts_gate", "experts_up") if held == "experts_fc1" else ("experts_down",)
            hf, out = iter(entry.hf), {}
            for e in range(self.arch.num_experts):
                for stem in stems:
                    out.update(scales(next(hf), stem, view(e)))
            return out
        return {n: p for name, stem in zip(entry.hf, self._scale_stems.get(held, ())) for n, p in scales(name, stem).items()}

    def quantized_layout(self, entry, held: str, rank: int, size: int) -> dict[str, tuple]:
        """HF name of each scale tensor of ``entry`` (NVFP4: and of its packed codes) -> (the part of the whole tensor
        this tensor-parallel rank holds, the whole tensor's shape).  A scale: the part of its weight (the weight
        table's ``shard`` rule, :func:`..architectures.tp_part`) in whole blocks (:func:`..conversion.fp8.scale_part`)
        of the ``[ceil(N/br), ceil(K/bc)]`` grid (layouts of whole blocks only at TP > 1: ``fp8_tp_refusal``; an expert's
        scales whole on its rank, nothing of them elsewhere);
        NVFP4's ``weight_scale_2`` (one float32 per HF tensor) whole on every rank; NVFP4 codes ``[N, K/2]``: the
        weight's part with K counted in bytes."""
        out = {}
        if self.value_packing.get(held):
            for i, (name, (n, k)) in enumerate(zip(entry.hf, entry.hf_shapes)):
                out[name] = (_packed_part(tp_part(entry, i, rank, size)), (n, k // 2))
        layout = hf_layout(self.w_fmt)
        for name in self.block_scales(entry, held):
            i = entry.hf.index(layout.weight_of(name))
            (n, k), (br, bc) = entry.hf_shapes[i], self.w_fmt.block
            part = tp_part(entry, i, rank, size)
            if layout.per_tensor_scale and name.endswith("." + layout.per_tensor_scale):
                # whole; an expert's on its rank only (another rank's: nothing of it)
                out[name] = (part if entry.shard == "experts" else None, ())
                continue
            out[name] = (scale_part(part, self.w_fmt), (-(-n // br), -(-k // bc)))
        return out


def _packed_part(part: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The part of NVFP4 codes ``[N, K/2]`` (two a byte along K) that goes with the part ``part`` of the ``[N, K]``
    weight (a rank's K columns: whole 16-groups, so whole bytes)."""
    if part is None or part[0] == 0:
        return part
    return part[0], part[1] // 2, part[2] // 2


class FP8DecoderLayer(_BlockScales, ConsistentDecoderLayer):
    """Dense decoder layer whose four linears are block-FP8 (E4M3 values + per-HF-tensor block scales)."""

    OPS = ("qkv", "o_proj", "gate_up", "down")

    def __init__(self, arch: ArchConfig, cache_config, prefix: str, *, formats):
        super().__init__(arch, cache_config, prefix)
        _quantize_fused(self, self.OPS, arch, formats)


class FP8MoEDecoderLayer(_BlockScales, ConsistentMoEDecoderLayer):
    """MoE decoder layer in block-FP8 or NVFP4: q/k/v/o as :class:`FP8DecoderLayer`; every expert's gate / up / down
    (and the shared expert's) quantized with its own scales; the router and ``shared_expert_gate`` in the model dtype.

    Storage: ``experts_fc1`` ``[E_r, 2I, H]`` / ``experts_fc2`` ``[E_r, H, I]`` (and ``shared_fc1`` / ``shared_fc2``) in
    ``float8_e4m3fn``; scales ``experts_{gate,up,down}_scale`` ``[E_r, ceil(N/128), ceil(K/128)]`` (and
    ``shared_{gate,up,down}_scale``); ``E_r`` = E / t, the rank's whole experts ``[r E/t, (r+1) E/t)`` with their
    whole scales (the weight table's ``experts`` rule; the shared expert whole on every rank).  NVFP4: the values
    ``uint8`` codes two a byte along K, scales E4M3 ``[E_r, N, ceil(K/16)]`` plus ``experts_{gate,up,down}_scale_2``
    float32 ``[E_r]`` (one global per expert tensor; shared: 0-d), unpacked for the ops.  The MLP runs the
    custom op ``inference_ops.fp8_moe_experts`` at TP = 1; at TP > 1 ``fp8_moe_owned_expert_outputs`` (the rank's
    experts' pairs, ``+0.0`` for the others'), the ranks' sum (:func:`.parallel.sum_owned_slots`) and
    ``fp8_moe_combine`` (the FP8 shared expert, the slot-order combine) -- the bits of TP = 1."""

    OPS = ("qkv", "o_proj")

    def __init__(self, arch: ArchConfig, cache_config, prefix: str, *, formats):
        super().__init__(arch, cache_config, prefix)
        _quantize_fused(self, self.OPS, arch, formats)
        store, nv = self.w_fmt.storage_dtype, self.nvfp4
        pack = 2 if nv else 1  # NVFP4: two E2M1 codes a byte along K
        br, bc = self.w_fmt.block
        run, H, inter = arch.num_experts // self.tp_size, arch.hidden_size, arch.moe_intermediate_size  # the rank's experts

        def values(*shape):
            return nn.Parameter(torch.zeros(*shape[:-1], shape[-1] // pack, dtype=store), requires_grad=False)

        def scales(stem, *lead, n, k):  # block-FP8: float32 blocks; NVFP4: E4M3 per 16 + a float32 global per HF tensor
            dt = torch.float8_e4m3fn if nv else torch.float32
            setattr(self, f"{stem}_scale", nn.Parameter(torch.ones(*lead, -(-n // br), -(-k // bc), dtype=dt), requires_grad=False))
            if nv:
                setattr(self, f"{stem}_scale_2", nn.Parameter(torch.ones(lead, dtype=torch.float32), requires_grad=False))

        self.experts_fc1, self.experts_fc2 = values(run, 2 * inter, H), values(run, H, inter)
        scales("experts_gate", run, n=inter, k=H)
        scales("experts_up", run, n=inter, k=H)
        scales("experts_down", run, n=H, k=inter)
        if self.shared is not None:
            s = arch.shared_expert_intermediate_size
            self.shared_fc1, self.shared_fc2 = values(2 * s, H), values(H, s)
            scales("shared_gate", n=s, k=H)
            scales("shared_up", n=s, k=H)
            scales("shared_down", n=H, k=s)
            self.shared = (self.shared_fc1, self.shared_fc2, self.shared_gate)
            self._scale_stems.update(shared_fc1=("shared_gate", "shared_up"), shared_fc2=("shared_down",))
        if nv:
            self.value_packing.update(dict.fromkeys(("experts_fc1", "experts_fc2", "shared_fc1", "shared_fc2"), 2))

    def _row_scales(self, stem: str, n: int) -> torch.Tensor:
        """Per-row scales of the HF tensor(s) ``stem`` of ``n`` rows (stacked experts or the shared expert): block-FP8
        blocks repeated per row; NVFP4 ``float32(weight_scale) * weight_scale_2``, each expert's global its own."""
        if self.nvfp4:
            g = getattr(self, f"{stem}_scale_2")
            return nvfp4_effective_scales(getattr(self, f"{stem}_scale"), g.reshape(*g.shape, 1, 1))
        return weight_row_scales(getattr(self, f"{stem}_scale"), n, self.w_fmt)

    def _values(self, held: torch.Tensor) -> torch.Tensor:
        """The values the FP8 ops take: block-FP8 as stored; NVFP4 codes unpacked one per byte."""
        return unpack_e2m1(held) if self.nvfp4 else held

    def _fc1_rows(self, stem: str, n: int) -> torch.Tensor:
        """Per-row scales of gate|up rows (``stem`` ``experts`` or ``shared``): ``[..., 2n, ceil(H/bc)]``."""
        return torch.cat([self._row_scales(f"{stem}_gate", n), self._row_scales(f"{stem}_up", n)], dim=-2)

    def mlp_forward(self, x: torch.Tensor, positions: torch.Tensor):
        """(router logits, routed experts, MLP output): the bf16 MoE layer's router and route ops, then the FP8 experts as
        one opaque custom op with no host read (so the model compiles and replays CUDA graphs)."""
        from . import moe as pmoe

        z = inference_ops.router_logits(x, self.router)
        w, experts = inference_ops.moe_route(z, self.arch.num_experts_per_tok, "softmax", None, self.arch.norm_topk_prob,
                                             1, 1, 1.0)
        if pmoe.RECORDER is not None:
            pmoe.RECORDER.record(self.idx, positions, experts)
        inter, H = self.arch.moe_intermediate_size, self.arch.hidden_size
        fc1, fc1_rows = self._values(self.experts_fc1), self._fc1_rows("experts", inter)
        fc2, fc2_rows = self._values(self.experts_fc2), self._row_scales("experts_down", H)
        shared = (None,) * 5
        if self.shared is not None:
            s = self.arch.shared_expert_intermediate_size
            shared = (self._values(self.shared_fc1), self._fc1_rows("shared", s), self._values(self.shared_fc2),
                      self._row_scales("shared_down", H), self.shared_gate)
        if self.tp_size == 1:
            return z, experts, inference_ops.fp8_moe_experts(x, experts, w, fc1, fc1_rows, fc2, fc2_rows, *shared,
                                                             *self.format_specs)
        mine = inference_ops.fp8_moe_owned_expert_outputs(x, experts, self.expert_first, fc1, fc1_rows, fc2, fc2_rows,
                                                          *self.format_specs)
        return z, experts, inference_ops.fp8_moe_combine(x, pmoe.sum_owned_slots(mine), w, *shared, *self.format_specs)


def layer_factory(arch: ArchConfig, formats):
    """Layer constructor for a block-FP8 checkpoint: :class:`FP8MoEDecoderLayer` where the config puts MoE, else dense."""
    check_fp8_arch(arch, formats[0])

    def make(a, cache_config, prefix):
        cls = FP8MoEDecoderLayer if a.layer_is_moe(int(prefix.rsplit(".", 1)[-1])) else FP8DecoderLayer
        return cls(a, cache_config, prefix, formats=formats)

    return make
