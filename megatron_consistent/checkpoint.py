"""Checkpoints of the RL lifecycle: save, export, reload — bitwise, all or nothing, no pickle on the default path.

A checkpoint folder written by :func:`save_checkpoint`::

    manifest.json           format, architecture (ArchConfig), model kind, step, weight version, extra metrics
    hf/                     export_hf: config.json + model.safetensors (what a fresh vLLM engine loads)
    optimizer.safetensors   the CPU stand-in optimizer's float32 main params and Adam moments (safetensors, no pickle)
    megatron/               Megatron-Core dist_checkpointing (torch_dist) of the model — and, for Megatron's own
                            optimizer (training.MegatronOptimizer, GPU), of its state under the key ``optimizer``
                            (``optimizer.sharded_state_dict(model_sharded_state_dict)``; then there is no
                            optimizer.safetensors and ``files["optimizer"]`` is ``"megatron"``)

:func:`load_checkpoint` checks the manifest's architecture against the model
and the optimizer state against the optimizer **before** touching anything
and raises :class:`~megatron_consistent.conversion.CheckpointMismatchError`
listing every difference; nothing is applied then.  Weights are copied into
the existing parameters in place.

Sources (``source=``):

* ``"hf"`` (default): safetensors only (``import_hf``) — no unpickling at all.
* ``"dist"``: Megatron ``dist_checkpointing.load`` of ``megatron/`` (the only source of Megatron's
  optimizer state: a :class:`~megatron_consistent.training.MegatronOptimizer` restores from it and
  is refused with ``"hf"``).  The
  torch_dist format unpickles its ``.metadata`` file with ``pickle.load`` and
  reads ``common.pt`` with ``torch.load`` (weights_only by default in torch >= 2.6);
  byte items (Megatron ``ShardedObject``\\ s such as ``_extra_state``) would be
  read with ``torch.load(weights_only=False)``.  Before loading, we therefore
  (1) replay ``.metadata`` through a restricted unpickler that admits only
  ``torch.distributed.checkpoint`` metadata classes and a few torch/builtin
  types (anything else: refused, nothing loaded), (2) refuse if
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set, and (3) request tensors only —
  ``ShardedObject`` entries are not read.  Tensors land in staging buffers and
  are copied into the model only when all of them loaded.

``dist_checkpointing.save`` on a CPU-only machine runs under
:func:`megatron_consistent.layers.cpu_shims.cuda_stubs_for_checkpoint`.  Its
writer starts helper processes, so the calling script needs the usual
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from .config import ArchConfig
from .conversion import CheckpointMismatchError, export_hf, import_hf

__all__ = ["FORMAT", "audit_dist_metadata", "load_checkpoint", "read_manifest", "save_checkpoint", "model_arch"]

FORMAT = "megatron-consistent-checkpoint/1"


def model_arch(model, arch: ArchConfig | None = None) -> ArchConfig:
    arch = arch or getattr(model, "arch_config", None)
    if arch is None:
        raise ValueError("pass arch= (the model has no arch_config attribute)")
    return arch


def _arch_json(arch: ArchConfig) -> dict:
    return json.loads(json.dumps(arch.as_dict()))


def _is_megatron(optimizer) -> bool:
    from .training import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def _sharded(model, optimizer, is_loading: bool = False) -> dict:
    """The model's sharded state dict; with Megatron's optimizer, its sharded state under ``"optimizer"``."""
    sharded = model.sharded_state_dict()
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=is_loading)
    return sharded


def _save_dist(model, out: Path, optimizer=None) -> None:
    from megatron.core import dist_checkpointing

    from .layers.cpu_shims import cuda_stubs_for_checkpoint

    out.mkdir(parents=True, exist_ok=False)
    with cuda_stubs_for_checkpoint():
        dist_checkpointing.save(_sharded(model, optimizer), str(out))


def save_checkpoint(ckpt_dir, model, optimizer=None, *, arch: ArchConfig | None = None, step: int = 0, weight_version: int = 0,
                    extra: dict | None = None, dist: bool = True) -> Path:
    """Write the checkpoint folder described in the module docstring (the folder must not exist or be empty)."""
    arch = model_arch(model, arch)
    out = Path(ckpt_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"checkpoint folder {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    megatron_opt = _is_megatron(optimizer)
    if megatron_opt and not dist:
        raise ValueError("Megatron's optimizer state is saved only through dist_checkpointing: pass dist=True")
    files = {"hf": "hf"}
    export_hf(model, arch, out / "hf")
    if optimizer is not None and not megatron_opt:
        save_file(optimizer.state_dict(), str(out / "optimizer.safetensors"), metadata={"format": FORMAT})
        files["optimizer"] = "optimizer.safetensors"
    if dist:
        _save_dist(model, out / "megatron", optimizer if megatron_opt else None)
        files["megatron"] = "megatron"
        if megatron_opt:
            files["optimizer"] = "megatron"
    manifest = {"format": FORMAT, "arch": _arch_json(arch), "model_kind": getattr(model, "consistent_kind", "unknown"),
                "step": int(step), "weight_version": int(weight_version), "files": files,
                "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "extra": extra or {}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


def read_manifest(ckpt_dir) -> dict:
    p = Path(ckpt_dir) / "manifest.json"
    if not p.is_file():
        raise CheckpointMismatchError(f"{ckpt_dir}: no manifest.json (not a megatron-consistent checkpoint)")
    m = json.loads(p.read_text())
    if m.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{ckpt_dir}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


# ---------------------------------------------------------------------------------------------- dist audit
_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                 ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("torch", "strided")}
_SAFE_GLOBALS |= {("torch", n) for n in ("bfloat16", "float16", "float32", "float64", "int64", "int32", "int8", "uint8", "bool")}


class _AuditUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise CheckpointMismatchError(f"dist checkpoint metadata references {module}.{name}, which is not on the allowlist; refusing to load")


def audit_dist_metadata(dist_dir) -> None:
    """Refuse (``CheckpointMismatchError``) a torch_dist folder whose ``.metadata`` pickle names anything outside the allowlist."""
    path = Path(dist_dir) / ".metadata"
    if not path.is_file():
        raise CheckpointMismatchError(f"{dist_dir}: no .metadata (not a torch_dist checkpoint)")
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") not in ("", "0"):
        raise CheckpointMismatchError("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: common.pt would be unpickled without weights_only")
    _AuditUnpickler(io.BytesIO(path.read_bytes())).load()


def _staged(tree):
    """``tree`` (nested dicts / lists of a sharded state dict) without ``ShardedObject`` s — byte items are unpickled
    with weights_only=False: never requested — and with every sharded tensor reading into a fresh buffer."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    if isinstance(tree, dict):
        return {k: _staged(v) for k, v in tree.items() if not isinstance(v, ShardedObject)}
    if isinstance(tree, list):
        return [_staged(v) for v in tree if not isinstance(v, ShardedObject)]
    if isinstance(tree, (ShardedTensor, ShardedTensorFactory)):
        tree.data = torch.empty_like(tree.data)
    return tree


def _load_dist_staged(model, dist_dir: Path, optimizer=None) -> dict:
    """dist_checkpointing.load of the model's tensors (and Megatron's optimizer state, under ``"optimizer"``) into
    fresh buffers (the model is not touched; Megatron's optimizer initializes the Adam state it lacks, as its own
    loading does)."""
    from megatron.core import dist_checkpointing

    audit_dist_metadata(dist_dir)
    request = _staged(_sharded(model, optimizer, is_loading=True))
    try:
        return dist_checkpointing.load(request, str(dist_dir))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - mismatches surface as various megatron / torch errors
        # (torch's CheckpointException derives from BaseException: it escaped `except Exception`)
        raise CheckpointMismatchError(f"cannot load {dist_dir} into this model (nothing was loaded): {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------------------- load
def load_checkpoint(ckpt_dir, model, optimizer=None, *, arch: ArchConfig | None = None, source: str = "hf",
                    allow_nonfinite: bool = False) -> dict:
    """Restore ``model`` (and ``optimizer``) from ``ckpt_dir``, all or nothing; returns the manifest.

    Order: manifest and architecture, the optimizer state in full (keys, shapes, dtypes, finiteness), the model weights
    in full (``import_hf`` / the staged dist load, finiteness) — only then is anything copied, the weights first, the
    optimizer (which can no longer fail) second.  Non-finite values are refused by name unless ``allow_nonfinite``."""
    if source not in ("hf", "dist"):
        raise ValueError(f"source must be 'hf' or 'dist', got {source!r}")
    arch = model_arch(model, arch)
    ckpt = Path(ckpt_dir)
    manifest = read_manifest(ckpt)
    problems = []
    want = _arch_json(arch)
    # a manifest written before the row-parallel segment count was an ArchConfig field: S = 8, the only one then
    saved = {"row_parallel_segments": ArchConfig.row_parallel_segments, **manifest["arch"]}
    for k in sorted(set(want) | set(saved)):
        if want.get(k) != saved.get(k):
            problems.append(f"architecture {k}: checkpoint {saved.get(k)!r}, model {want.get(k)!r}")
    opt_sd = None
    megatron_opt = _is_megatron(optimizer)
    saved_opt = manifest["files"].get("optimizer")
    if optimizer is not None:
        if saved_opt is None:
            problems.append("checkpoint holds no optimizer state")
        elif megatron_opt != (saved_opt == "megatron"):
            problems.append(f"checkpoint's optimizer state is {'Megatron' if saved_opt == 'megatron' else 'the CPU stand-in'}'s "
                            f"({saved_opt}), this optimizer is {type(optimizer).__name__}")
        elif megatron_opt and source != "dist":
            problems.append("Megatron's optimizer state is in the dist checkpoint: load with source='dist'")
        elif not problems and not megatron_opt:
            try:
                opt_sd = load_file(str(ckpt / manifest["files"]["optimizer"]))
            except Exception as e:  # noqa: BLE001 - missing / corrupt file: named, nothing loaded
                problems.append(f"cannot read the optimizer state: {type(e).__name__}: {e}")
            else:
                problems += optimizer.check_state_dict(opt_sd, allow_nonfinite=allow_nonfinite)
    if source == "dist" and "megatron" not in manifest["files"]:
        problems.append("checkpoint holds no Megatron dist checkpoint")
    if problems:
        raise CheckpointMismatchError(f"cannot restore {ckpt} into this model (nothing was loaded):\n  " + "\n  ".join(problems))

    if source == "hf":
        import_hf(model, arch, ckpt / manifest["files"]["hf"], allow_nonfinite=allow_nonfinite)  # validates all, then copies
    else:
        from .conversion.hf import nonfinite_names

        staged = _load_dist_staged(model, ckpt / manifest["files"]["megatron"], optimizer if megatron_opt else None)
        if megatron_opt:
            opt_sd = staged.pop("optimizer")
        params = dict(model.named_parameters())
        missing = sorted(n for n in params if n not in staged)
        if missing:
            raise CheckpointMismatchError(f"dist checkpoint lacks parameters {missing} (nothing was loaded)")
        bad = [] if allow_nonfinite else nonfinite_names((n, staged[n]) for n in params)
        if bad:
            raise CheckpointMismatchError(f"dist checkpoint has non-finite values (NaN/Inf) in {bad[:8]} (nothing was loaded)")
        with torch.no_grad():
            for n, p in params.items():
                p.data.copy_(staged[n])
    if megatron_opt:
        optimizer.load_state_dict(opt_sd)  # Megatron's own loading (its state read in full above)
    elif opt_sd is not None:
        optimizer.load_state_dict(opt_sd, allow_nonfinite=allow_nonfinite)  # validated above: cannot fail half way
    return manifest


def copy_hf_folder(ckpt_dir, dest) -> Path:
    """Copy the checkpoint's HF export to ``dest`` (e.g. to start a fresh engine from it)."""
    manifest = read_manifest(ckpt_dir)
    dest = Path(dest)
    shutil.copytree(Path(ckpt_dir) / manifest["files"]["hf"], dest)
    return dest
