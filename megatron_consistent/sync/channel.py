"""Trainer side of the in-place weight sync: Megatron model -> HF tensors -> shared memory -> live vLLM engine.

:class:`WeightSyncChannel` wraps an ``LLM`` started with
``worker_extension_cls=WORKER_EXTENSION``.  :meth:`WeightSyncChannel.push`
exports the Megatron weights in HF naming
(:func:`megatron_consistent.conversion.hf_state_dict`; a model running block-FP8 / NVFP4: the quantized tensors of
:func:`megatron_consistent.conversion.fp8.fp8_hf_state_dict`), writes their raw bytes
into a ``/dev/shm`` file, sends the JSON schema through
``llm.collective_rpc`` (no tensor, no pickle crosses the RPC), removes the
file, resets the prefix cache (KV computed with the old weights must not be
reused) and returns a :class:`SyncReport`.  A refused update raises
:class:`~.protocol.WeightSyncError` and leaves the engine on its previous
weights and version.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from ..architectures import take_part
from .protocol import WeightSyncError, pack_update, raw_digest

__all__ = ["WORKER_EXTENSION", "SyncReport", "WeightSyncChannel", "model_update_tensors"]

WORKER_EXTENSION = "megatron_consistent.sync.worker.WeightSyncExtension"


@dataclass
class SyncReport:
    """One successful push: version, bytes moved, seconds (pack = export + write to shm; rpc = engine copy + round trip)."""

    version: int
    bytes: int
    tensors: int
    pack_seconds: float
    rpc_seconds: float
    seconds: float
    pointers_unchanged: bool
    model_kind: str
    moved: list = field(default_factory=list)

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {**asdict(self), "gbytes_per_s": self.gbytes_per_s}


class WeightSyncChannel:
    """Push weights into a live engine's existing parameter storage; track the weight version on both sides.

    Every RPC runs under a deadline (``rpc_timeout`` seconds; a push gets ``push_timeout``) while the engine's
    processes are watched: a dead engine or an RPC past its deadline raises :class:`WeightSyncError` naming the cause,
    and the channel then refuses further use (a late reply could still apply an update) instead of waiting forever.
    On creation the engine is told this process's pid (``mc_sync_watch_parent``): its processes exit when the trainer
    process dies.  A push while requests are in flight is refused unless the caller says it drained or paused the
    engine (``drained=True``): one sample must not span two weight versions.
    """

    def __init__(self, llm, *, require_inplace: bool | None = None, rpc_timeout: float = 120.0, push_timeout: float = 600.0,
                 watch_parent: bool = True):
        self.llm = llm
        self.rpc_timeout, self.push_timeout = float(rpc_timeout), float(push_timeout)
        self.broken: str | None = None
        kinds = set(self._rpc("mc_sync_model_kind"))
        if len(kinds) != 1:
            raise WeightSyncError(f"workers run different model classes: {kinds}")
        self.model_kind = kinds.pop()
        # The stock CPU model repacks its linear weights on reload, so in-place is only required of the consistent model.
        self.require_inplace = self.model_kind == "consistent" if require_inplace is None else require_inplace
        self.version = self.engine_version()
        if watch_parent:
            self._rpc("mc_sync_watch_parent", os.getpid())

    # ------------------------------------------------------------------------------------------ guarded RPC
    def engine_failure(self) -> str | None:
        """Why the engine cannot answer (a process exited, vLLM marked it dead), or ``None`` while it is alive."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        resources = getattr(client, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        for proc in getattr(manager, "processes", None) or []:
            if not proc.is_alive():
                return f"engine process {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        if getattr(resources, "engine_dead", False):
            return "vLLM marked the engine core dead"
        return None

    def _rpc(self, method: str, *args, timeout: float | None = None) -> list:
        """``llm.collective_rpc(method, args)`` with a deadline and a liveness watch; :class:`WeightSyncError` on failure."""
        if self.broken:
            raise WeightSyncError(f"weight-sync channel unusable: {self.broken}")
        timeout = self.rpc_timeout if timeout is None else timeout
        dead = self.engine_failure()
        if dead:
            self.broken = dead
            raise WeightSyncError(f"{method}: {dead}")
        box: dict = {}

        def call():
            try:
                box["result"] = self.llm.collective_rpc(method, args=args)
            except BaseException as e:  # noqa: BLE001 - re-raised below as WeightSyncError naming it
                box["error"] = e

        thread = threading.Thread(target=call, name=f"mc-sync-rpc-{method}", daemon=True)
        deadline = time.monotonic() + timeout
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if not thread.is_alive():
                break
            dead = self.engine_failure()
            if dead:
                self.broken = dead
                raise WeightSyncError(f"{method}: {dead} (no answer; the channel is closed)")
            if time.monotonic() > deadline:
                self.broken = f"{method} got no answer within {timeout:g} s"
                raise WeightSyncError(f"{method}: the engine did not answer within {timeout:g} s (the channel is closed; "
                                      "the engine may be hung or overloaded)")
        if "error" in box:
            e = box["error"]
            dead = self.engine_failure()
            settle = time.monotonic() + 5.0
            while dead is None and time.monotonic() < settle:  # a dying engine fails the call before vLLM notices
                time.sleep(0.2)
                dead = self.engine_failure()
            if dead:
                self.broken = dead
            raise WeightSyncError(f"{method} failed: {dead or f'{type(e).__name__}: {e}'}") from e
        return box["result"]

    # ------------------------------------------------------------------------------------------ API
    def engine_version(self) -> int:
        """The version every worker reports (they must agree)."""
        versions = set(self._rpc("mc_sync_version"))
        if len(versions) != 1:
            raise WeightSyncError(f"workers disagree on the weight version: {sorted(versions)}")
        return versions.pop()

    def engine_pointers(self) -> dict[str, int]:
        """``{name: data_ptr}`` of the (first) worker's parameters."""
        return self._rpc("mc_sync_pointers")[0]

    def engine_matches(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Whether every engine rank holds exactly its part of ``tensors`` (whole HF tensors, e.g. the trainer's
        ``hf_state_dict``): the SHA-256 of each rank's raw bytes against those of the same part of ``tensors`` (at
        TP > 1 a rank holds slices and, for MoE, only its own experts: ``mc_sync_parts``).  A stock engine has no
        digests: nothing matches.  ``{"equal", "differ": first 16 names, "tensors", "ranks"}``."""
        digests, parts = self._rpc("mc_sync_digests"), self._rpc("mc_sync_parts")
        differ = set()
        for rank_digests, rank_parts in zip(digests, parts):
            for name in tensors.keys() | rank_digests.keys():
                if name not in tensors or name not in rank_digests:
                    differ.add(name)
                    continue
                if raw_digest(take_part(tensors[name], rank_parts.get(name))) != rank_digests[name]:
                    differ.add(name)
        return {"equal": not differ, "differ": sorted(differ)[:16], "tensors": len(tensors), "ranks": len(digests)}

    def inflight_requests(self) -> bool:
        """Whether the engine holds unfinished requests (added and not yet finished or aborted)."""
        engine = getattr(self.llm, "llm_engine", None)
        return bool(engine is not None and engine.has_unfinished_requests())

    def push_tensors(self, tensors: dict[str, torch.Tensor], version: int | None = None, *, drained: bool = False,
                     allow_nonfinite: bool = False, arch=None) -> SyncReport:
        """Send HF-named tensors as ``version`` (default: current + 1); raises :class:`WeightSyncError` on refusal.

        ``drained``: the caller drained or paused the engine itself; without it a push while requests are in flight is
        refused.  ``allow_nonfinite``: accept NaN/Inf values (refused by name otherwise, here and in the engine).
        ``arch``: the sender's ``ArchConfig``; the engine refuses the update whole if it runs another one
        (:func:`.protocol.arch_problems`: S, eps, rope, ...)."""
        if not drained and self.inflight_requests():
            raise WeightSyncError("push refused: the engine has requests in flight (one sample would span two weight "
                                  "versions); finish or abort them, or pause the engine and pass drained=True")
        if not allow_nonfinite:
            from ..conversion.hf import nonfinite_names

            bad = nonfinite_names(tensors.items())
            if bad:
                raise WeightSyncError(f"push refused: non-finite values (NaN/Inf) in {bad[:8]} (nothing sent; "
                                      "allow_nonfinite=True sends them)")
        t0 = time.perf_counter()
        version = self.version + 1 if version is None else version
        update = pack_update(tensors, version, require_inplace=self.require_inplace, arch=arch)
        update["allow_nonfinite"] = bool(allow_nonfinite)
        t1 = time.perf_counter()
        try:
            replies = self._rpc("mc_sync_apply", update, timeout=self.push_timeout)
        finally:
            os.unlink(update["path"])
        t2 = time.perf_counter()
        bad = [r for r in replies if not r.get("ok")]
        if bad:
            problems = list(dict.fromkeys(p for r in bad for p in r.get("problems", [])))  # TP ranks refuse alike: once each
            raise WeightSyncError(f"engine refused weight update v{version} (nothing applied; engine stays at "
                                  f"v{bad[0].get('version')}):\n  " + "\n  ".join(problems))
        self._reset_prefix_cache()
        t3 = time.perf_counter()
        self.version = version
        r = replies[0]
        return SyncReport(version=version, bytes=r["bytes"], tensors=r["tensors"], pack_seconds=t1 - t0,
                          rpc_seconds=t2 - t1, seconds=t3 - t0, pointers_unchanged=all(x["pointers_unchanged"] for x in replies),
                          model_kind=r["model_kind"], moved=r.get("moved", []))

    def _reset_prefix_cache(self) -> None:
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault("ok", self.llm.reset_prefix_cache()), daemon=True)
        thread.start()
        thread.join(self.rpc_timeout)
        if thread.is_alive():
            self.broken = "reset_prefix_cache got no answer"
            raise WeightSyncError(f"reset_prefix_cache: no answer within {self.rpc_timeout:g} s ({self.engine_failure() or 'hung'})")

    def push_model(self, model, arch=None, version: int | None = None, *, drained: bool = False,
                   allow_nonfinite: bool = False, quantization=None) -> SyncReport:
        """Export the Megatron ``model`` (consistent or stock) in HF naming and push it with its architecture.

        ``quantization``: ``None`` -- what the model's forward runs: its block-FP8 / NVFP4 weight format when enabled
        (``layers.fp8.enable_fp8`` records it as ``model.fp8_formats``), the model dtype otherwise; a weight
        ``QuantFormat`` -- quantized in it; ``False`` -- the model dtype.  Quantized tensors are
        :func:`~megatron_consistent.conversion.fp8.fp8_hf_state_dict`'s (the export's, bitwise the trainer's FP8
        weights); an engine serving another quantization refuses the push whole (:func:`.protocol.quantization_of`)."""
        arch = arch or model.arch_config
        return self.push_tensors(model_update_tensors(model, arch, quantization), version, drained=drained,
                                 allow_nonfinite=allow_nonfinite, arch=arch)


def model_update_tensors(model, arch, quantization=None) -> dict[str, torch.Tensor]:
    """The HF-named tensors :meth:`WeightSyncChannel.push_model` sends for ``model`` (``quantization`` as there): the
    quantized tensors of :func:`~megatron_consistent.conversion.fp8.fp8_hf_state_dict` in the format of the model's
    FP8 / NVFP4 forward (``model.fp8_formats``) or the given one, else ``hf_state_dict``'s views of the parameters (read
    them before the next optimizer step)."""
    from ..conversion import hf_state_dict
    from ..conversion.fp8 import fp8_hf_state_dict

    if quantization is None:
        quantization = (getattr(model, "fp8_formats", None) or (False,))[0]
    return fp8_hf_state_dict(model, arch, quantization) if quantization else hf_state_dict(model, arch, copy=False)
