"""Trainer side of the in-place weight sync: Megatron model -> HF tensors -> shared memory -> live vLLM engine.

:class:`WeightSyncChannel` wraps an ``LLM`` started with
``worker_extension_cls=WORKER_EXTENSION``.  :meth:`WeightSyncChannel.push`
exports the Megatron weights in HF naming
(:func:`megatron_consistent.conversion.hf_state_dict`), writes their raw bytes
into a ``/dev/shm`` file, sends the JSON schema through
``llm.collective_rpc`` (no tensor, no pickle crosses the RPC), removes the
file, resets the prefix cache (KV computed with the old weights must not be
reused) and returns a :class:`SyncReport`.  A refused update raises
:class:`~.protocol.WeightSyncError` and leaves the engine on its previous
weights and version.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch

from .protocol import WeightSyncError, pack_update

__all__ = ["WORKER_EXTENSION", "SyncReport", "WeightSyncChannel"]

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
    """Push weights into a live engine's existing parameter storage; track the weight version on both sides."""

    def __init__(self, llm, *, require_inplace: bool | None = None):
        self.llm = llm
        kinds = set(llm.collective_rpc("mc_sync_model_kind"))
        if len(kinds) != 1:
            raise WeightSyncError(f"workers run different model classes: {kinds}")
        self.model_kind = kinds.pop()
        # The stock CPU model repacks its linear weights on reload, so in-place is only required of the consistent model.
        self.require_inplace = self.model_kind == "consistent" if require_inplace is None else require_inplace
        self.version = self.engine_version()

    def engine_version(self) -> int:
        """The version every worker reports (they must agree)."""
        versions = set(self.llm.collective_rpc("mc_sync_version"))
        if len(versions) != 1:
            raise WeightSyncError(f"workers disagree on the weight version: {sorted(versions)}")
        return versions.pop()

    def engine_pointers(self) -> dict[str, int]:
        """``{name: data_ptr}`` of the (first) worker's parameters."""
        return self.llm.collective_rpc("mc_sync_pointers")[0]

    def push_tensors(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> SyncReport:
        """Send HF-named tensors as ``version`` (default: current + 1); raises :class:`WeightSyncError` on refusal."""
        t0 = time.perf_counter()
        version = self.version + 1 if version is None else version
        update = pack_update(tensors, version, require_inplace=self.require_inplace)
        t1 = time.perf_counter()
        try:
            replies = self.llm.collective_rpc("mc_sync_apply", args=(update,))
        finally:
            os.unlink(update["path"])
        t2 = time.perf_counter()
        bad = [r for r in replies if not r.get("ok")]
        if bad:
            problems = [p for r in bad for p in r.get("problems", [])]
            raise WeightSyncError(f"engine refused weight update v{version} (nothing applied; engine stays at "
                                  f"v{bad[0].get('version')}):\n  " + "\n  ".join(problems))
        self.llm.reset_prefix_cache()
        t3 = time.perf_counter()
        self.version = version
        r = replies[0]
        return SyncReport(version=version, bytes=r["bytes"], tensors=r["tensors"], pack_seconds=t1 - t0,
                          rpc_seconds=t2 - t1, seconds=t3 - t0, pointers_unchanged=all(x["pointers_unchanged"] for x in replies),
                          model_kind=r["model_kind"], moved=r.get("moved", []))

    def push_model(self, model, arch=None, version: int | None = None) -> SyncReport:
        """Export the Megatron ``model`` (consistent or stock) in HF naming and push it."""
        from ..conversion import hf_state_dict

        arch = arch or model.arch_config
        return self.push_tensors(hf_state_dict(model, arch, copy=False), version)
