"""vLLM worker extension: receive weight updates in place, inside a live (multiprocess) engine.

Start the engine with
``LLM(..., worker_extension_cls="megatron_consistent.sync.worker.WeightSyncExtension")``;
vLLM mixes this class into its worker, so ``self`` below is the worker and
the methods are reachable with ``llm.collective_rpc("mc_sync_<name>", args=(...))``.
Arguments and results are plain JSON-like values (see :mod:`.protocol`).

* Consistent engine (``MEGATRON_CONSISTENT_VLLM=1``): the model is
  :class:`~megatron_consistent.vllm_plugin.model.ConsistentForCausalLM`; each
  HF tensor is ``copy_``-ed into the view ``hf_targets()`` gives for it, i.e.
  into the engine's existing parameter storage — at tensor-parallel size t > 1
  every rank validates the whole update against the whole HF shapes and copies
  its part (the weight table's ``shard`` rule, ``model.hf_parts()``), so a
  push that does not fit is refused by every rank alike (a target the model holds wider
  than the checkpoint, ``hf_wire_dtypes()`` — the hybrid Mamba mixers' float32
  small parameters — is validated against the checkpoint dtype and widened
  exactly by the copy).  Every parameter's
  ``data_ptr`` is recorded before and after; a moved storage is reported as a
  failure (``require_inplace``).
* Stock engine (baseline): vLLM's CPU linear layers keep only a repacked copy
  of their weights (oneDNN / sgl), so a plain ``copy_`` would be ignored; the
  update goes through vLLM's own ``reload_weights`` (layerwise reload, which
  re-packs).  Pointers are still reported, with ``require_inplace`` False.

An update that carries the sender's architecture (``push_model``) is refused whole when the engine runs another
(:func:`.protocol.arch_problems`, e.g. another row-parallel tree width S).  A refused update
(see :func:`.protocol.validate_update`) copies nothing and
leaves the version unchanged; the engine keeps serving the previous weights.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import threading
import time

import torch

from .protocol import hf_tensor_specs, tensor_views, validate_update

__all__ = ["WeightSyncExtension", "engine_arch"]


def engine_arch(vllm_config):
    """The ``ArchConfig`` an engine runs, from its own ``config.json`` (what an update's ``arch`` is checked against)."""
    from ..config import ArchConfig

    return ArchConfig.from_hf(vllm_config.model_config.hf_config.to_dict())


class WeightSyncExtension:
    """Mixed into vLLM's worker class; every public method is an RPC target (prefix ``mc_sync_``)."""

    def _mc_model(self):
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _mc_arch(self):
        return engine_arch(self.vllm_config)

    def _mc_expected(self, model) -> tuple[dict, dict | None]:
        """(expected specs, in-place targets or None for the stock model)."""
        if hasattr(model, "hf_targets"):
            targets, wire = model.hf_targets(), self._mc_wire_dtypes(model)
            # an update carries whole HF tensors; at TP > 1 each rank keeps its part (model.hf_local)
            full = model.hf_full_shapes() if hasattr(model, "hf_full_shapes") else {n: tuple(t.shape) for n, t in targets.items()}
            specs = {n: (full[n], wire.get(n, str(t.dtype).replace("torch.", ""))) for n, t in targets.items()}
            return specs, targets
        return hf_tensor_specs(self._mc_arch()), None

    @staticmethod
    def _mc_wire_dtypes(model) -> dict[str, str]:
        """Targets the model holds wider than the checkpoint (hybrid Mamba mixers: float32) -> the dtype updates carry."""
        return model.hf_wire_dtypes() if hasattr(model, "hf_wire_dtypes") else {}

    def mc_sync_version(self) -> int:
        """The weight version this engine serves (0 = the weights it was started with)."""
        return int(getattr(self, "_mc_weight_version", 0))

    def mc_sync_pointers(self) -> dict:
        """``{parameter name: data_ptr}`` of the engine's model."""
        return {n: int(p.data_ptr()) for n, p in self._mc_model().named_parameters()}

    def mc_sync_digests(self) -> dict:
        """``{HF name: sha256 hex of the raw bytes}`` of this rank's weights (consistent model; stock: empty; at TP > 1
        the part the rank holds, :meth:`mc_sync_parts`)."""
        model = self._mc_model()
        if not hasattr(model, "hf_targets"):
            return {}
        from .protocol import DTYPES, raw_digest

        def wire(n, t):  # a widened target hashes as its checkpoint dtype when that is exact, else as held (differs)
            if n not in wire_dtypes:  # held as sent (float8 has no CPU equal kernel: nothing to compare)
                return t
            w = DTYPES[wire_dtypes[n]]
            return t.to(w) if torch.equal(t.to(w).to(t.dtype), t) else t

        wire_dtypes = self._mc_wire_dtypes(model)
        return {n: raw_digest(wire(n, t.detach())) for n, t in model.hf_targets().items()}

    def mc_sync_parts(self) -> dict:
        """``{HF name: part}`` of the whole HF tensor this TP rank holds, for the tensors it holds a part of
        (:func:`..architectures.tp_part` as a list: ``[dim, start, stop]``, one run a block for a Mamba mixer's
        ``in_proj`` / ``conv1d``; ``[0, 0, 0]``: nothing, another rank's expert); empty at TP = 1 and for a stock model."""
        model = self._mc_model()
        if getattr(model, "tp_size", 1) == 1 or not hasattr(model, "hf_parts"):
            return {}
        return {n: list(cut) for n, cut in model.hf_parts().items() if cut is not None}

    def mc_sync_model_kind(self) -> str:
        """``consistent`` or ``stock`` (the model class the engine runs)."""
        return "consistent" if hasattr(self._mc_model(), "hf_targets") else "stock"

    def mc_sync_watch_parent(self, pid: int, interval: float = 0.5) -> int:
        """Exit this engine when process ``pid`` (the trainer) dies; returns the pid of this process.

        A daemon thread polls ``/proc/<pid>`` (a zombie or a reused pid counts as dead: the start time is compared).
        On its death the thread removes the trainer's leftover ``/dev/shm/mc-sync-<pid>-*`` files, kills the engine
        core process when this worker is its child (multiprocess executor) and exits this process."""
        pid = int(pid)
        if getattr(self, "_mc_watched_pid", None) == pid:
            return os.getpid()
        start = _start_time(pid)
        if start is None:
            raise RuntimeError(f"trainer process {pid} is not running")
        engine_pid = os.getppid() if os.getppid() != pid else None  # our parent is the engine core, not the trainer
        engine_start = _start_time(engine_pid) if engine_pid else None

        def watch():
            while _start_time(pid) == start:
                time.sleep(interval)
            for f in glob.glob(os.path.join("/dev/shm", f"mc-sync-{pid}-*.bin")):
                with contextlib.suppress(OSError):
                    os.unlink(f)
            if engine_pid and _start_time(engine_pid) == engine_start:
                with contextlib.suppress(OSError):
                    os.kill(engine_pid, signal.SIGTERM)  # vLLM shuts down cleanly on SIGTERM
            os._exit(1)

        threading.Thread(target=watch, name="mc-sync-parent-watch", daemon=True).start()
        self._mc_watched_pid = pid
        return os.getpid()

    def mc_sync_apply(self, update: dict) -> dict:
        """Validate, then copy an update into the model; returns a report dict (``ok`` False = refused, nothing applied)."""
        t0 = time.perf_counter()
        model = self._mc_model()
        version = self.mc_sync_version()
        expected, targets = self._mc_expected(model)
        problems = validate_update(update, expected, version, expected_arch=self._mc_arch().as_dict())
        if problems:
            return {"ok": False, "version": version, "problems": problems}
        views = tensor_views(update)
        if not update.get("allow_nonfinite", False):
            from ..conversion.hf import nonfinite_names

            bad = nonfinite_names(views.items())
            if bad:
                return {"ok": False, "version": version,
                        "problems": [f"non-finite values (NaN/Inf) in {bad[:8]} (the sender may set allow_nonfinite)"]}
        before = self.mc_sync_pointers()
        with torch.no_grad():
            if targets is not None:
                parts = model.hf_parts() if hasattr(model, "hf_parts") else None
                for name, src in views.items():  # TP > 1: this rank's part of the whole tensor (weight table shard rule)
                    targets[name].copy_(src if parts is None else model.hf_local(name, src, parts))
                if any(t.is_cuda for t in targets.values()):  # GPU engine: the host->device copies from the mapped
                    torch.cuda.synchronize()  # file have landed before it is unmapped and the version advances
            else:
                from vllm.config import set_current_vllm_config

                with set_current_vllm_config(self.vllm_config):
                    self.model_runner.reload_weights(weights_iterator=list(views.items()), is_checkpoint_format=True)
        after = self.mc_sync_pointers()
        moved = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        report = {"ok": True, "version": version, "bytes": int(sum(e["nbytes"] for e in update["tensors"])),
                  "tensors": len(views), "pointers_unchanged": not moved, "moved": moved[:16],
                  "num_parameters": len(after), "seconds": 0.0, "model_kind": "consistent" if targets is not None else "stock"}
        if moved and update.get("require_inplace", True):
            report.update(ok=False, problems=[f"parameter storage moved during the update: {moved[:16]}"])
            return report
        self._mc_weight_version = int(update["version"])
        report["version"] = self._mc_weight_version
        report["seconds"] = time.perf_counter() - t0
        return report


def _start_time(pid: int | None) -> int | None:
    """The start time (clock ticks since boot) of a live, non-zombie process ``pid``; ``None`` when it is gone."""
    if not pid:
        return None
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return None if fields[0] in ("Z", "X") else int(fields[19])
