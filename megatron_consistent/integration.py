"""Framework integration on the rollout side: refit transport for a live vLLM engine, NeMo-RL metric names.

Nothing here imports Megatron or vLLM at import time (vLLM workers import this
module by the dotted path of :class:`RefitWorkerExtension`).  The trainer-side
spec entry points are in :mod:`megatron_consistent.layers.entry_points`.

* :func:`pack_weights` / :func:`iter_buckets` — HF-named ``(name, tensor)``
  pairs through one POSIX shared-memory segment.  The control message is a
  plain JSON-able dict (names, dtypes, shapes, byte offsets, bucket split);
  tensor bytes never go through pickle or through ``collective_rpc``'s
  arguments (in vLLM's multiprocess engine tensors do not survive them).
* :class:`RefitWorkerExtension` — pass
  ``worker_extension_cls="megatron_consistent.integration.RefitWorkerExtension"``;
  then ``llm.collective_rpc("mc_update_weights_from_shm", args=(manifest,))``
  streams the tensors bucket by bucket into the model's ``load_weights``
  (the call NeMo-RL's and verl's refits make) and reports whether every
  target kept its storage.
* :func:`nemo_rl_metrics` — ``token_mult_prob_error``, ``gen_kl_error`` and
  ``policy_kl_error`` as NeMo-RL's ClippedPGLossFn defines them (k3 estimator).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from multiprocessing import resource_tracker, shared_memory

import torch

__all__ = ["MANIFEST_VERSION", "RefitWorkerExtension", "iter_buckets", "nemo_rl_metrics", "pack_weights"]

MANIFEST_VERSION = 1
_ALIGN = 64
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported tensor dtype {dtype} (supported: {', '.join(_DTYPES)})")


def pack_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int | None = None):
    """Copy ``(name, tensor)`` pairs, in the given order, into a new shared-memory segment.

    ``bucket_bytes``: split the stream into buckets of at most that many bytes
    (a tensor larger than it gets a bucket of its own); ``None``: one bucket;
    ``0``: one tensor per bucket.  Returns ``(shm, manifest)``; the caller
    owns ``shm`` (``close()`` + ``unlink()`` after the receivers are done).
    """
    items = [(str(n), t.detach().to("cpu").contiguous()) for n, t in named_tensors]
    entries, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    shm = shared_memory.SharedMemory(create=True, size=max(offset, 1))
    buf = torch.frombuffer(shm.buf, dtype=torch.uint8)
    for e, (_, t) in zip(entries, items):
        buf[e["offset"] : e["offset"] + e["nbytes"]].copy_(t.reshape(-1).view(torch.uint8))
    del buf
    buckets, cur, size = [], [], 0
    for e in entries:
        if cur and (bucket_bytes == 0 or (bucket_bytes is not None and size + e["nbytes"] > bucket_bytes)):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e["nbytes"]
    if cur:
        buckets.append(cur)
    return shm, {"version": MANIFEST_VERSION, "shm": shm.name, "size": shm.size, "buckets": buckets}


def _check_manifest(manifest: dict) -> None:
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"not a refit manifest of version {MANIFEST_VERSION}")
    if not isinstance(manifest.get("shm"), str) or not isinstance(manifest.get("buckets"), list):
        raise ValueError("refit manifest needs 'shm' (str) and 'buckets' (list)")
    size = int(manifest["size"])
    for bucket in manifest["buckets"]:
        for e in bucket:
            if set(e) != {"name", "dtype", "shape", "offset", "nbytes"} or e["dtype"] not in _DTYPES:
                raise ValueError(f"malformed refit manifest entry {e!r}")
            numel = 1
            for d in e["shape"]:
                numel *= int(d)
            if numel * _DTYPES[e["dtype"]].itemsize != e["nbytes"] or not 0 <= e["offset"] <= size - e["nbytes"]:
                raise ValueError(f"refit manifest entry {e['name']!r}: shape/dtype/offset do not fit its bytes")


def iter_buckets(manifest: dict, shm: shared_memory.SharedMemory) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The manifest's buckets as lists of ``(name, tensor)`` views into ``shm`` (valid until the next bucket)."""
    _check_manifest(manifest)
    buf = torch.frombuffer(shm.buf, dtype=torch.uint8)
    try:
        for bucket in manifest["buckets"]:
            yield [
                (e["name"], buf[e["offset"] : e["offset"] + e["nbytes"]].view(_DTYPES[e["dtype"]]).view(e["shape"]))
                for e in bucket
            ]
    finally:
        del buf


class RefitWorkerExtension:
    """vLLM worker extension (mixed into the worker class): in-place refit from a shared-memory manifest."""

    def mc_update_weights_from_shm(self, manifest: dict) -> dict:
        """Stream the manifest's tensors, bucket by bucket, into ``model.load_weights``; plain-python report back."""
        model = self.model_runner.model
        targets = model.hf_targets() if hasattr(model, "hf_targets") else {}
        before = {n: t.data_ptr() for n, t in targets.items()}
        shm = shared_memory.SharedMemory(name=manifest["shm"])
        try:  # attaching registers the segment with this process's resource tracker; the sender owns it
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        except Exception:
            pass
        report = {"loaded": 0, "buckets": 0}
        try:
            for bucket in iter_buckets(manifest, shm):
                model.load_weights(bucket)
                report["loaded"] += len(bucket)
                report["buckets"] += 1
                del bucket
        except (ValueError, KeyError) as e:  # UnsupportedConfigError is a ValueError
            report["error"] = f"{type(e).__name__}: {e}"
        finally:
            try:
                shm.close()
            except BufferError:  # a view is still referenced somewhere; the mapping goes with the process
                pass
        after = {n: t.data_ptr() for n, t in model.hf_targets().items()} if targets else {}
        report["storage_unchanged"] = before == after
        return report

    def mc_weight_pointers(self) -> dict:
        """HF name -> data pointer of the tensor it is copied into (plain ints)."""
        return {n: t.data_ptr() for n, t in self.model_runner.model.hf_targets().items()}


def nemo_rl_metrics(train_logp: torch.Tensor, gen_logp: torch.Tensor) -> dict:
    """NeMo-RL's train/generation mismatch metrics over 1-D float32 log-probs of the sampled tokens.

    As in NeMo-RL's ``ClippedPGLossFn`` (default ``reference_policy_kl_type='k3'``):
    ``token_mult_prob_error = mean(exp(|gen - train|))`` (1.0 is perfect);
    ``gen_kl_error = mean(exp(r) - 1 - r)`` with ``r = train - gen`` (KL(P_gen || P_train));
    ``policy_kl_error`` the same with ``r = gen - train``.  Computed in float64.
    """
    t, g = train_logp.double(), gen_logp.double()
    r = t - g
    return {
        "token_mult_prob_error": torch.exp((g - t).abs()).mean().item(),
        "gen_kl_error": (torch.expm1(r) - r).mean().item(),
        "policy_kl_error": (torch.expm1(-r) + r).mean().item(),
    }
