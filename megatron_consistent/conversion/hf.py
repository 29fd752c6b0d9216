"""Megatron (consistent or stock GPTModel, TP=1) <-> HF safetensors checkpoints, bitwise.

The names, shapes and splits come from the architecture family's weight table
(:mod:`megatron_consistent.architectures`: dense, MoE, hybrid ``backbone.*``); the split of each
entry is its ``layout`` (``copy``, ``qkv``, ``fc1`` = gate|up, ``experts_fc1`` / ``experts_fc2`` =
per-expert stacks, :mod:`.moe`).  ``linear_qkv`` rows are grouped per query group: for each of
the ``ng`` KV groups, its ``np/ng`` query heads, then its key head, then its value head
(``head_dim`` rows each); the q/k/v biases (Qwen2) follow the same order.

Only slicing, concatenation and copies are involved — no arithmetic — so
export -> import is bitwise.  Files are safetensors only (no pickle).
:func:`import_hf` validates everything (config, names, shapes, dtypes) before
copying anything, and copies in place (``param.data.copy_``) so parameter
storage never moves.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..architectures import weight_entries
from ..config import ROW_PARALLEL_SEGMENTS_KEY, ArchConfig, UnsupportedConfigError
from .moe import MOE_KINDS, moe_hf_shapes, moe_join, moe_split

__all__ = ["CheckpointMismatchError", "export_hf", "hf_state_dict", "import_hf", "megatron_to_hf_names"]

_DTYPE_NAMES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_DTYPE_STR = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class CheckpointMismatchError(ValueError):
    """An HF checkpoint that does not fit the Megatron model; the message lists every problem."""


# ---------------------------------------------------------------------------------------------- name/shape plan
def _plan(arch: ArchConfig) -> list[tuple[str, list[str], str]]:
    """Entries ``(megatron_name, [hf_names], layout)`` of ``arch``'s weight table (:mod:`..architectures`)."""
    return [(w.megatron, list(w.hf), w.layout) for w in weight_entries(arch)]


def megatron_to_hf_names(arch: ArchConfig) -> dict[str, list[str]]:
    """Megatron parameter name -> the HF tensor names it maps to."""
    return {m: hf for m, hf, _ in _plan(arch)}


def _qkv_sizes(arch: ArchConfig) -> tuple[int, int, int]:
    return arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim


def _split(arch: ArchConfig, kind: str, t: torch.Tensor) -> list[torch.Tensor]:
    if kind in MOE_KINDS:
        return moe_split(kind, t)
    if kind == "copy":
        return [t]
    if kind == "fc1":
        inter = t.shape[0] // 2
        return [t[:inter], t[inter:]]
    ng, g, hd = _qkv_sizes(arch)
    grouped = t.reshape(ng, g + 2, hd, *t.shape[1:])
    rest = tuple(t.shape[1:])
    return [grouped[:, :g].reshape(ng * g * hd, *rest), grouped[:, g].reshape(ng * hd, *rest), grouped[:, g + 1].reshape(ng * hd, *rest)]


def _hf_shapes(arch: ArchConfig, kind: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    if kind in MOE_KINDS:
        return moe_hf_shapes(kind, shape)
    if kind == "copy":
        return [shape]
    rest = shape[1:]
    if kind == "fc1":
        return [(shape[0] // 2, *rest)] * 2
    ng, g, hd = _qkv_sizes(arch)
    return [(ng * g * hd, *rest), (ng * hd, *rest), (ng * hd, *rest)]


def _join(arch: ArchConfig, kind: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if kind in MOE_KINDS:
        return moe_join(kind, parts)
    if kind == "copy":
        return parts[0]
    if kind == "fc1":
        return torch.cat(parts, dim=0)
    ng, g, hd = _qkv_sizes(arch)
    q, k, v = parts
    rest = tuple(q.shape[1:])
    grouped = torch.cat([q.reshape(ng, g, hd, *rest), k.reshape(ng, 1, hd, *rest), v.reshape(ng, 1, hd, *rest)], dim=1)
    return grouped.reshape(ng * (g + 2) * hd, *rest)


def segments_refusal(model, arch: ArchConfig) -> str:
    """Why the ``model``'s row-parallel layers do not run ``arch``'s K tree ("" when they do): each consistent
    row-parallel linear keeps the S it was built with (``row_parallel_segments``, from the Megatron config's
    ``consistent_row_parallel_segments``, 8 when the config lacks it); a framework config that lacks the key while the
    checkpoint's ``config.json`` sets it would train and roll out on two different trees -- different bits, silently."""
    running = sorted({m.row_parallel_segments for m in model.modules()
                      if isinstance(getattr(m, "row_parallel_segments", None), int)} - {arch.row_parallel_segments})
    if not running:
        return ""
    return (f"{ROW_PARALLEL_SEGMENTS_KEY}: the model's row-parallel layers were built with S = {running[0]}, its "
            f"architecture says S = {arch.row_parallel_segments}; set config.{ROW_PARALLEL_SEGMENTS_KEY} = "
            f"{arch.row_parallel_segments} on the Megatron config before building the model")


def _model_params(model, arch: ArchConfig) -> dict[str, torch.nn.Parameter]:
    """The model's parameters, checked against the plan for ``arch`` (names and fused shapes) and its layers' K tree
    against ``arch``'s (:func:`segments_refusal`)."""
    reason = segments_refusal(model, arch)
    if reason:
        raise UnsupportedConfigError(reason)
    params = dict(model.named_parameters())
    plan = _plan(arch)
    expected = {m for m, _, _ in plan}
    problems = []
    missing = sorted(expected - params.keys())
    extra = sorted(params.keys() - expected)
    if missing:
        problems.append(f"model lacks parameters {missing}")
    if extra:
        problems.append(f"model has parameters the {arch.architecture} layout does not map: {extra}")
    want = {w.megatron: w.shape for w in weight_entries(arch)}
    for name, shape in want.items():
        if name in params and tuple(params[name].shape) != shape:
            problems.append(f"model parameter {name} has shape {tuple(params[name].shape)}, {arch.architecture} config implies {shape}")
    if problems:
        raise CheckpointMismatchError("model does not match the architecture config:\n  " + "\n  ".join(problems))
    return params


# ---------------------------------------------------------------------------------------------- export
def hf_state_dict(model, arch: ArchConfig, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The Megatron ``model``'s weights as HF-named CPU tensors (the q/k/v and gate/up splits of the table above).

    ``copy=True`` (default) returns contiguous clones; ``copy=False`` returns
    views of the parameters where possible (contiguous copies only where a
    split needs one) — read them before the next optimizer step.
    """
    params = _model_params(model, arch)
    with torch.no_grad():
        return hf_tensors_from_megatron(arch, {m: p.detach() for m, p in params.items()}, copy=copy)


def hf_tensors_from_megatron(arch: ArchConfig, full: dict[str, torch.Tensor], *, copy: bool = True) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of the whole (TP = 1) Megatron tensors ``full`` (global layer numbers) by the weight table's
    splits; entries of the table ``full`` does not hold (another pipeline stage's) are skipped."""
    tensors: dict[str, torch.Tensor] = {}
    for mname, hf_names, kind in _plan(arch):
        if mname not in full:
            continue
        for hf_name, part in zip(hf_names, _split(arch, kind, full[mname])):
            part = part.to("cpu").contiguous()
            tensors[hf_name] = part.clone() if copy else part
    return tensors


def write_hf_config(arch: ArchConfig, dtypes, out_dir) -> None:
    """``config.json`` of an export: ``arch.to_hf()`` with ``torch_dtype`` when the tensors share one dtype."""
    hf = arch.to_hf()
    dtypes = set(dtypes)
    if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPE_STR:
        hf["torch_dtype"] = _DTYPE_STR[next(iter(dtypes))]
    (Path(out_dir) / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


def export_hf(model, arch: ArchConfig, out_dir) -> Path:
    """Write ``config.json`` (``arch.to_hf()``, ``torch_dtype`` = the parameters' dtype) and ``model.safetensors``."""
    tensors = hf_state_dict(model, arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_hf_config(arch, (t.dtype for t in tensors.values()), out)
    return out


# ---------------------------------------------------------------------------------------------- import
def _checkpoint_files(in_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of an HF folder, and the index's ``weight_map`` when it is sharded (``None``: one file).

    The index is checked on its own here: a JSON object with a ``weight_map`` of ``{tensor: shard file}``, every shard
    a file inside the folder (no absolute paths, no ``..`` leaving it).  That every tensor lies in exactly one shard, the
    one the index names, is checked against the shards' headers by :func:`import_hf`.
    """
    single = in_dir / "model.safetensors"
    index = in_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single], None
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointMismatchError(f"{index}: not a JSON object with a weight_map ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointMismatchError(f"{index}: weight_map must be a non-empty {{tensor name: shard file}} object")
        root, problems = in_dir.resolve(), []
        for shard in sorted(set(weight_map.values())):
            path = (in_dir / shard).resolve()
            if Path(shard).is_absolute() or not path.is_relative_to(root):
                problems.append(f"shard path {shard!r} leaves the checkpoint folder")
            elif not path.is_file():
                problems.append(f"shard {shard!r} named by the index does not exist")
        if problems:
            raise CheckpointMismatchError(f"cannot import {in_dir} (nothing was loaded):\n  " + "\n  ".join(problems))
        return [in_dir / s for s in sorted(set(weight_map.values()))], weight_map
    if any(in_dir.glob("*.bin")) or any(in_dir.glob("*.pt")):
        raise CheckpointMismatchError(f"{in_dir}: only safetensors checkpoints are read (found pickle-based *.bin/*.pt)")
    raise FileNotFoundError(f"{in_dir}: no model.safetensors or model.safetensors.index.json")


def _arch_differences(arch: ArchConfig, in_dir: Path) -> list[str]:
    from ..config import load_hf_config

    cfg_path = in_dir / "config.json"
    if not cfg_path.is_file():
        return []
    try:
        found = ArchConfig.from_hf(load_hf_config(cfg_path))  # as vLLM reads it (transformers' encodings understood)
    except UnsupportedConfigError as e:
        return [f"config.json: {e}"]
    a, b = replace(arch, dtype="float32"), replace(found, dtype="float32")
    expected = a.as_dict()
    return [f"config.json {k}={v!r}, expected {expected[k]!r}" for k, v in b.as_dict().items() if expected[k] != v]


def nonfinite_names(tensors) -> list[str]:
    """Names of the floating-point tensors in ``(name, tensor)`` pairs holding a NaN or an infinity."""
    return [n for n, t in tensors  # float8: no isfinite kernel; its NaN survives the exact widening
            if t.is_floating_point() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all())]


def import_hf(model, arch: ArchConfig, in_dir, *, allow_nonfinite: bool = False) -> None:
    """Load an HF safetensors checkpoint into the Megatron ``model`` in place, all or nothing.

    Every problem (config mismatch, missing / extra tensors, wrong shape or
    dtype; a sharded checkpoint whose index does not name every tensor exactly
    once, in the shard that holds it, or names a shard outside the folder) is
    collected first and raised as one :class:`CheckpointMismatchError`; in that
    case no parameter is touched.  Tensors holding NaN / infinity are refused by
    name (after reading, before any copy) unless ``allow_nonfinite``.
    """
    in_dir = Path(in_dir)
    params = _model_params(model, arch)
    files, weight_map = _checkpoint_files(in_dir)
    problems = _arch_differences(arch, in_dir)
    meta: dict[str, tuple[Path, tuple[int, ...], torch.dtype | str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    dt = sl.get_dtype()
                    if k in meta:
                        problems.append(f"tensor {k} is in two shards: {meta[k][0].name} and {f.name}")
                    meta[k] = (f, tuple(sl.get_shape()), _DTYPE_NAMES.get(dt, dt))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a corrupt header
            raise CheckpointMismatchError(f"cannot read {f} (nothing was loaded): {type(e).__name__}: {e}") from None
    if weight_map is not None:
        unindexed = sorted(meta.keys() - weight_map.keys())
        absent = sorted(weight_map.keys() - meta.keys())
        misplaced = sorted(k for k in weight_map.keys() & meta.keys() if (in_dir / weight_map[k]).resolve() != meta[k][0].resolve())
        if unindexed:
            problems.append(f"tensors in shards but not in the index: {unindexed[:8]}")
        if absent:
            problems.append(f"index names tensors no shard holds: {absent[:8]}")
        if misplaced:
            problems.append(f"index names the wrong shard for: {misplaced[:8]}")
    plan = _plan(arch)
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for mname, hf_names, kind in plan:
        p = params[mname]
        for hf_name, shape in zip(hf_names, _hf_shapes(arch, kind, tuple(p.shape))):
            expected[hf_name] = (shape, p.dtype)
    missing = sorted(expected.keys() - meta.keys())
    extra = sorted(meta.keys() - expected.keys())
    if missing:
        problems.append(f"missing tensors: {missing}")
    if extra:
        problems.append(f"unexpected tensors: {extra}")
    for name in sorted(expected.keys() & meta.keys()):
        (shape, dtype), (_, fshape, fdtype) = expected[name], meta[name]
        if fshape != shape:
            problems.append(f"wrong shape for {name}: file {fshape}, model expects {shape}")
        if fdtype != dtype and not (dtype == torch.float32 and fdtype in (torch.bfloat16, torch.float16)):
            # (a 16-bit tensor into a float32 parameter widens exactly, as vLLM's load does: e.g. a router's
            # e_score_correction_bias that transformers saved in the model dtype)
            problems.append(f"wrong dtype for {name}: file {fdtype}, model expects {dtype}")
    if problems:
        raise CheckpointMismatchError(f"cannot import {in_dir} (nothing was loaded):\n  " + "\n  ".join(problems))

    # Everything fits: read, refuse non-finite values, assemble, then copy in place.
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                loaded[k] = sf.get_tensor(k)
    bad = [] if allow_nonfinite else nonfinite_names(loaded.items())
    if bad:
        raise CheckpointMismatchError(f"cannot import {in_dir} (nothing was loaded): non-finite values (NaN/Inf) in {bad[:8]} "
                                      "(allow_nonfinite=True accepts them)")
    staged = [(params[m], _join(arch, kind, [loaded[n] for n in hf_names])) for m, hf_names, kind in plan]
    with torch.no_grad():
        for p, t in staged:
            p.data.copy_(t)
