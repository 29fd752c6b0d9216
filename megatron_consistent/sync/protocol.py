"""The weight-update wire format: raw bytes in POSIX shared memory + a JSON-able schema. No pickle.

An update is a plain ``dict`` (only str/int/bool/list/dict, so it crosses
vLLM's ``collective_rpc`` msgpack channel unchanged)::

    {"protocol": 1, "version": 7, "path": "/dev/shm/mc-sync-....bin", "total_nbytes": 123456,
     "require_inplace": true,
     "tensors": [{"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [64, 64],
                  "offset": 0, "nbytes": 8192}, ...],
     "buckets": [[0, 5], [5, 9], ...],
     "arch": {"architecture": "LlamaForCausalLM", ..., "row_parallel_segments": 8}}

``arch`` (optional; the trainer's ``push_model`` sends it, ``pack_update(arch=)`` attaches it for a refit; both
receivers check it) is the sender's ``ArchConfig.as_dict()``: a whole update also needs the engine to run the *same*
model, and what makes two models' bits differ is not all in the tensors' shapes -- the row-parallel tree width S
(``consistent_row_parallel_segments``), norm eps, rope theta and scaling, the router's scoring, the activation.
:func:`arch_problems` names every field that differs (the storage dtype and ``max_position_embeddings`` aside: the
tensors' dtypes are checked one by one, and the position limit changes no value), so an engine started from another
``config.json`` refuses the push whole instead of serving other bits.

``path`` is a file in ``/dev/shm`` (tmpfs, i.e. POSIX shared memory) holding
the tensors' raw little-endian bytes back to back, each at a 64-byte aligned
``offset``.  ``buckets`` splits ``tensors`` into consecutive ``[start, stop)``
runs for receivers that load bucket by bucket (:func:`iter_buckets`; the
NeMo-RL / verl refit shape of :class:`megatron_consistent.integration.RefitWorkerExtension`).

Two receivers read this format:

* :class:`~.worker.WeightSyncExtension` — a *whole* update: :func:`validate_update`
  checks it against the engine's expected ``{name: (shape, dtype)}`` and its
  current version before a single byte is copied; nothing is applied unless it
  returns no problems.
* ``RefitWorkerExtension`` — any subset, in any order: :func:`validate_update`
  without ``expected`` / ``current_version`` checks the framing only (dtypes,
  byte counts, spans, buckets, the file) and ``arch`` where the update carries
  one; the model's ``load_weights`` refuses unknown names and wrong shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from ..architectures import hf_tensor_specs
from ..conversion.fp8 import HF_QUANT_LAYOUTS

__all__ = ["PROTOCOL", "DTYPES", "WeightSyncError", "arch_problems", "hf_tensor_specs", "pack_update", "quantization_of",
           "validate_update", "tensor_views", "iter_buckets"]

PROTOCOL = 1
ALIGN = 64
# explicit wire names (no pickle): the model dtypes, block-FP8 / NVFP4 E4M3 values and scales, NVFP4's packed E2M1 codes
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ARCH_FIELDS_IGNORED = ("dtype", "max_position_embeddings")  # checked per tensor / changes no value (module docstring)


class WeightSyncError(RuntimeError):
    """A weight update the engine refused (the message lists every problem) or an in-place guarantee broken."""


def raw_digest(t: torch.Tensor) -> str:
    """SHA-256 hex of a tensor's raw bytes (row-major; any device): what the weight checks compare."""
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()  # 0-dim: NVFP4 scale_2


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def pack_update(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int = 0, *,
                require_inplace: bool = True, path: str | None = None, bucket_bytes: int | None = None,
                arch=None) -> dict:
    """Write ``tensors`` (CPU; a :data:`DTYPES` dtype), in order, into a new shared-memory file; returns the update dict.

    ``tensors``: a ``{name: tensor}`` mapping or ``(name, tensor)`` pairs.
    ``version``: the weight version (:class:`~.worker.WeightSyncExtension`
    requires it to increase; refits ignore it).  ``bucket_bytes``: split the
    tensors into buckets of at most that many bytes (a tensor larger than it
    gets a bucket of its own); ``None``: one bucket; ``0``: one tensor per bucket.
    ``arch``: the sender's ``ArchConfig`` (sent as ``as_dict()``; the engine refuses the update whole when it runs
    another architecture, :func:`arch_problems`).  The caller owns the file (``update["path"]``) and removes it after the push.
    """
    items = list(tensors.items()) if isinstance(tensors, Mapping) else [(n, t) for n, t in tensors]
    entries, offset = [], 0
    for name, t in items:
        if t.dtype not in _DTYPE_NAMES:
            raise WeightSyncError(f"{name}: dtype {t.dtype} cannot be sent ({'/'.join(DTYPES)} only)")
        nbytes = t.numel() * t.element_size()
        entries.append({"name": str(name), "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    total = max(offset, ALIGN)
    path = path or str(Path(_shm_dir()) / f"mc-sync-{os.getpid()}-{uuid.uuid4().hex[:12]}.bin")
    with open(path, "wb") as f:
        f.truncate(total)
    buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    with torch.no_grad():
        for e, (_, t) in zip(entries, items):
            src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buf[e["offset"] : e["offset"] + e["nbytes"]].copy_(src)
    del buf
    update = {"protocol": PROTOCOL, "version": int(version), "path": path, "total_nbytes": total,
              "require_inplace": bool(require_inplace), "tensors": entries, "buckets": _split(entries, bucket_bytes)}
    if arch is not None:
        update["arch"] = json.loads(json.dumps(arch.as_dict()))  # plain JSON types (tuples -> lists), as received
    return update


def _split(entries: list[dict], bucket_bytes: int | None) -> list[list[int]]:
    """``[start, stop)`` runs of ``entries``: greedy up to ``bucket_bytes`` (``None``: one run; ``0``: one per entry)."""
    buckets, start, size = [], 0, 0
    for i, e in enumerate(entries):
        if i > start and (bucket_bytes == 0 or (bucket_bytes is not None and size + e["nbytes"] > bucket_bytes)):
            buckets.append([start, i])
            start, size = i, 0
        size += e["nbytes"]
    if entries:
        buckets.append([start, len(entries)])
    return buckets


def arch_problems(sent, engine: dict) -> list[str]:
    """The fields of the update's ``arch`` (``ArchConfig.as_dict()``, JSON round trip) that differ from the engine's
    (:data:`ARCH_FIELDS_IGNORED` aside), one problem naming them all; empty when they agree."""
    if not isinstance(sent, dict):
        return [f"arch must be a dict (ArchConfig.as_dict()), got {type(sent).__name__}"]
    differ = [f"{key} {sent.get(key)!r} (update) vs {engine.get(key)!r} (engine)"
              for key in sorted(sent.keys() | engine.keys())
              if key not in ARCH_FIELDS_IGNORED and _json_form(sent.get(key)) != _json_form(engine.get(key))]
    if not differ:
        return []
    return ["the update comes from another architecture than the engine runs (same tensors would give other bits; "
            "start the engine from the trainer's config.json): " + "; ".join(differ)]


def _json_form(value):
    """``value`` as a JSON round trip gives it (tuples as lists), so a sent dict and a local one compare alike."""
    if isinstance(value, dict):
        return {k: _json_form(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_form(v) for v in value]
    return value


def quantization_of(names: Iterable[str]) -> str:
    """How a set of HF tensor names is quantized: the name of the weight format whose scale tensors it holds
    (:data:`megatron_consistent.conversion.fp8.HF_QUANT_LAYOUTS`: ``block-FP8`` ``weight_scale_inv``, ``NVFP4``
    ``weight_scale`` / ``weight_scale_2``) or ``unquantized`` (the names of
    :func:`megatron_consistent.conversion.fp8.fp8_hf_state_dict` / ``hf_state_dict``)."""
    names = list(names)
    for layout in HF_QUANT_LAYOUTS.values():
        suffixes = tuple("." + s for s in layout.scale_suffixes)
        if any(n.endswith(suffixes) for n in names):
            return layout.name
    return "unquantized"


def validate_update(update, expected: dict[str, tuple[tuple[int, ...], str]] | None = None,
                    current_version: int | None = None, expected_arch: dict | None = None) -> list[str]:
    """Every problem of ``update`` against ``expected`` ``{name: (shape, dtype)}``; empty list = it fits entirely.

    Checks: protocol and field types; version strictly greater than
    ``current_version``; the update quantized as the engine is (:func:`quantization_of`: one problem when not, the
    tensors then unchecked); no missing, extra or duplicate names; shapes; dtypes;
    ``nbytes == numel * itemsize``; offsets aligned, inside the buffer and not
    overlapping; ``buckets`` (if present) split the tensors into consecutive
    runs; the shared-memory file exists with ``total_nbytes`` bytes.
    ``expected=None``: names and shapes are not checked (a partial update, any
    subset; dtypes must still be ones :data:`DTYPES` knows); ``current_version=None``:
    the version need only be an int.  ``expected_arch``: the engine's ``ArchConfig.as_dict()``; an update that carries
    an ``arch`` is checked against it (:func:`arch_problems`).
    """
    if not isinstance(update, dict):
        return [f"update must be a dict, got {type(update).__name__}"]
    problems = []
    if update.get("protocol") != PROTOCOL:
        problems.append(f"protocol {update.get('protocol')!r}, expected {PROTOCOL}")
    version = update.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        problems.append(f"version must be an int, got {version!r}")
    elif current_version is not None and version <= current_version:
        problems.append(f"stale version {version}: the engine already holds version {current_version} (versions must increase strictly)")
    total = update.get("total_nbytes")
    path = update.get("path")
    if not isinstance(total, int) or total < 0:
        problems.append(f"total_nbytes must be a non-negative int, got {total!r}")
        total = None
    if not isinstance(path, str) or not os.path.isfile(path):
        problems.append(f"shared-memory file {path!r} does not exist")
    elif total is not None and os.path.getsize(path) != total:
        problems.append(f"shared-memory file holds {os.path.getsize(path)} bytes, schema says {total}")
    if expected_arch is not None and "arch" in update:
        problems += arch_problems(update["arch"], expected_arch)
    entries = update.get("tensors")
    if not isinstance(entries, list):
        return problems + [f"tensors must be a list, got {type(entries).__name__}"]
    if expected is not None:
        sent, held = quantization_of(e["name"] for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)), quantization_of(expected)
        if sent != held:  # every quantized tensor would differ: one line instead of a wrong dtype / missing scale each
            return problems + [f"quantization mismatch: the update carries {sent} weights, the engine serves {held} weights "
                               f"(refused whole; send {held} tensors, e.g. push_model of a model with that forward on, or quantization=)"]
    seen, spans = set(), []
    for e in entries:
        if (not isinstance(e, dict) or not {"name", "dtype", "shape", "offset", "nbytes"} <= e.keys()
                or not isinstance(e["name"], str) or not isinstance(e["shape"], list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in e["shape"])):
            problems.append(f"malformed tensor entry {e!r}")
            continue
        name = e["name"]
        if name in seen:
            problems.append(f"duplicate tensor {name}")
        seen.add(name)
        if expected is not None:
            if name not in expected:
                continue
            shape, dtype = expected[name]
            if list(e["shape"]) != list(shape):
                problems.append(f"wrong shape for {name}: update {tuple(e['shape'])}, engine expects {tuple(shape)}")
            if e["dtype"] != dtype:
                problems.append(f"wrong dtype for {name}: update {e['dtype']}, engine expects {dtype}")
        elif e["dtype"] not in DTYPES:
            problems.append(f"{name}: dtype {e['dtype']!r} cannot be received ({'/'.join(DTYPES)} only)")
        if e["dtype"] in DTYPES:
            numel = 1
            for s in e["shape"]:
                numel *= int(s)
            if e["nbytes"] != numel * DTYPES[e["dtype"]].itemsize:
                problems.append(f"{name}: nbytes {e['nbytes']} != numel {numel} x itemsize")
        off, n = e["offset"], e["nbytes"]
        if not isinstance(off, int) or not isinstance(n, int) or off < 0 or off % ALIGN or (total is not None and off + n > total):
            problems.append(f"{name}: span offset={off} nbytes={n} is unaligned or outside the buffer ({total} bytes)")
        else:
            spans.append((off, off + n, name))
    if expected is not None:
        missing = sorted(expected.keys() - seen)
        extra = sorted(seen - expected.keys())
        if missing:
            problems.append(f"missing tensors: {missing}")
        if extra:
            problems.append(f"unexpected tensors: {extra}")
    buckets = update.get("buckets", [[0, len(entries)]] if entries else [])
    stop = 0
    for b in buckets if isinstance(buckets, list) else [None]:
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(i, int) for i in b) and b[0] == stop < b[1]):
            stop = -1
            break
        stop = b[1]
    if stop != len(entries):
        problems.append(f"buckets {buckets!r} do not split the {len(entries)} tensors into consecutive runs")
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            problems.append(f"tensors {an} and {bn} overlap in the buffer")
    return problems


def _mapped(update: dict) -> torch.Tensor:
    """The shared-memory file, mapped privately (copy-on-write), as bytes."""
    return torch.from_file(update["path"], shared=False, size=update["total_nbytes"], dtype=torch.uint8)


def _view(buf: torch.Tensor, e: dict) -> torch.Tensor:
    return buf[e["offset"] : e["offset"] + e["nbytes"]].view(DTYPES[e["dtype"]]).view(tuple(e["shape"]))


def tensor_views(update: dict) -> dict[str, torch.Tensor]:
    """Map the shared-memory file privately (copy-on-write) and return ``{name: tensor view}`` per the schema.

    Call only after :func:`validate_update` returned no problems.
    """
    buf = _mapped(update)
    return {e["name"]: _view(buf, e) for e in update["tensors"]}


def iter_buckets(update: dict) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The update's buckets, in order, as lists of ``(name, tensor view)`` (no ``buckets`` key: one bucket).

    Call only after :func:`validate_update` returned no problems.
    """
    buf = _mapped(update)
    entries = update["tensors"]
    for start, stop in update.get("buckets", [[0, len(entries)]] if entries else []):
        yield [(e["name"], _view(buf, e)) for e in entries[start:stop]]
