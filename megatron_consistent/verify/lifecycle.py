"""Gates of the RL lifecycle: in-place weight update (C7) and checkpoint restore (C8), on a live engine.

* :func:`check_weight_update` (C7): a consistent session (Megatron trainer +
  multiprocess vLLM engine with the weight-sync extension) runs ``steps``
  GRPO steps; before every update the engine's log-probs must equal the
  trainer's bit for bit, after every push every engine and trainer
  parameter must keep its ``data_ptr`` and both sides must report the new
  version, and the first rollout after the last push must be bitwise equal
  too.  Then bad updates (missing / extra / mis-shaped / wrong-dtype tensor,
  stale version), each carrying perturbed weights, must be refused with
  nothing applied: same version, same pointers, the next rollout still
  bitwise equal to the trainer's (old) weights; a valid push afterwards works.
* :func:`check_checkpoint_restore` (C8): a trainer takes optimizer steps,
  saves (dist_checkpointing + safetensors optimizer + HF export), is restored
  into fresh Megatron models (from the safetensors and from the dist
  checkpoint) — weights and optimizer state bitwise equal to the saved ones —
  and a fresh engine is started on the checkpoint's HF folder; its weights
  must hash equal to the trainer's and the first GRPO step's rollout must
  match the trainer bit for bit.  A checkpoint of another architecture must
  be refused with nothing applied.

Each check runs in a fresh process (``python -m megatron_consistent.rl.lifecycle_scenarios``, the scenarios
driving an :class:`~megatron_consistent.rl.session.RLSession`; JSON in, JSON out) so vLLM's and torch.distributed's
process state never leak, and returns ``{"status": "pass"|"fail", "detail": str, ...numbers}``.  This module names
that module only (``verify`` does not import ``rl``, which builds on ``verify.rollout`` and ``verify.metrics``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .processes import run_group

__all__ = ["LifecycleConfig", "SCENARIOS_MODULE", "check_checkpoint_restore", "check_weight_update"]

SCENARIOS_MODULE = "megatron_consistent.rl.lifecycle_scenarios"  # run as ``python -m``; the checks' child process


@dataclass
class LifecycleConfig:
    """Settings of the lifecycle checks (small by default: tiny model, few prompts)."""

    hf_config: str = ""  # folder/file of an HF config; empty: megatron_consistent.rl.TINY_RL_HF_CONFIG
    steps: int = 3
    prompts: int = 4
    group: int = 4
    max_tokens: int = 2
    lr: float = 1e-2
    seed: int = 0
    out_dir: str = "runs/lifecycle"
    rejections: bool = True
    timeout_s: int = 900


def _as_config(cfg) -> LifecycleConfig:
    if cfg is None:
        return LifecycleConfig()
    if isinstance(cfg, LifecycleConfig):
        return cfg
    if isinstance(cfg, dict):
        known = LifecycleConfig.__dataclass_fields__.keys()
        return LifecycleConfig(**{k: v for k, v in cfg.items() if k in known})
    known = LifecycleConfig.__dataclass_fields__.keys()  # e.g. the gates runner's own config object
    return LifecycleConfig(**{k: getattr(cfg, k) for k in known if hasattr(cfg, k)})


def _run(kind: str, cfg) -> dict:
    cfg = _as_config(cfg)
    work = Path(cfg.out_dir) / kind
    work.mkdir(parents=True, exist_ok=True)
    req, res, log = work / "request.json", work / "result.json", work / "log.txt"
    req.write_text(json.dumps(asdict(cfg)))
    res.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    rc = run_group([sys.executable, "-m", SCENARIOS_MODULE, kind, str(req), str(res)], log, cfg.timeout_s, env)
    rc = "timeout" if rc is None else rc
    seconds = time.perf_counter() - t0
    if res.is_file():
        out = json.loads(res.read_text())
    else:
        tail = log.read_text(errors="replace")[-1500:]
        out = {"status": "fail", "detail": f"{kind} process ended ({rc}) without a result; log {log}:\n{tail}"}
    out.update(seconds=seconds, log=str(log))
    return out


def check_weight_update(cfg=None) -> dict:
    """C7 (see the module docstring); ``cfg``: :class:`LifecycleConfig`, a dict of its fields, or None."""
    return _run("weight_update", cfg)


def check_checkpoint_restore(cfg=None) -> dict:
    """C8 (see the module docstring); ``cfg``: :class:`LifecycleConfig`, a dict of its fields, or None."""
    return _run("checkpoint_restore", cfg)
