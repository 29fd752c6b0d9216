"""The RL lifecycle on one GPU (issue #14 item 7): Megatron-Core's optimizer + dist_checkpointing, engine beside it.

* ``test_megatron_optimizer_dist_checkpoint``: trainer only (``tests/_megatron_restore.py``): DDP +
  ``get_megatron_optimizer`` (distributed optimizer) steps, model and optimizer saved through
  ``dist_checkpointing`` and restored bitwise (weights equal, and the next step equal to the uninterrupted run's);
  the wrong optimizer kind and the safetensors source are refused.
* ``test_grpo_tiny_cuda_save_restore``: ``examples/grpo_tiny.py --device cuda`` (engine compiled + CUDA graphs
  and trainer on the same GPU): 3 GRPO steps, save; ``--restore``, 1 step; zero mismatch at every step (the first
  after the restore included), pointers unchanged on both sides, restored weights bitwise the saved ones; and the
  same with ``--quantization fp8`` (block-FP8 engine; the trainer's FP8 forward on its bf16 masters, the quantized
  values and scales pushed after every step; the restored engine holds the quantized export of the restored masters;
  passed on an H100 in session 40) and ``nvfp4`` (NVFP4 W4A16, not yet run on a GPU).

Each runs in its own process (the NCCL group and the vLLM plugin switch are process-wide).  The first also runs on
any machine without CUDA, with CUDA emulated on the CPU (``tests/_cuda_on_cpu.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: Megatron-Core's optimizer and the GPU engine")


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


def _megatron_restore(tmp_path, *flags: str) -> None:
    r = _run([sys.executable, "tests/_megatron_restore.py", str(tmp_path), *flags], timeout=600)
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    print(json.dumps(res, indent=1))
    assert res["stepped"] == [True, True] and res["next_stepped"] == [True, True]
    assert res["moved"] == res["tensors"] and res["trainer_pointers_unchanged"]
    assert res["files"]["optimizer"] == "megatron" and res["files"]["megatron"] == "megatron"
    assert res["fresh_differs"] and res["restored_step"] == 2
    assert res["restore_bitwise"] and res["restore_pointers_unchanged"]
    assert res["next_step_moved"] > 0 and res["next_step_bitwise"]
    assert res["fresh_optimizer_step_differs"]  # the control: without the optimizer state the step differs
    assert "source='dist'" in res["hf_source"]
    assert "CPU stand-in" in res["stand_in"] or "Megatron" in res["stand_in"]


@pytest.mark.gpu
@needs_cuda
def test_megatron_optimizer_dist_checkpoint(tmp_path):
    _megatron_restore(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CUDA device is present: test_megatron_optimizer_dist_checkpoint runs on it for real")
def test_megatron_optimizer_dist_checkpoint_cuda_emulated_on_cpu(tmp_path):
    """The same on any machine: Megatron-Core's distributed optimizer on the CPU under ``tests/_cuda_on_cpu.py``.
    It found (session 7, megatron-core 0.16.1) the two restore failures the H200 had shown with 0.19.2."""
    _megatron_restore(tmp_path, "--emulate-cuda-on-cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantization", [None, "fp8", "nvfp4"])
def test_grpo_tiny_cuda_save_restore(tmp_path, quantization):
    base = [sys.executable, "examples/grpo_tiny.py", "--device", "cuda", "--mode", "consistent", "--prompts", "8",
            "--group", "4", "--max-tokens", "4", *(["--quantization", quantization] if quantization else [])]
    _run(base + ["--steps", "3", "--out", str(tmp_path / "a")], timeout=900)
    _run(base + ["--steps", "1", "--out", str(tmp_path / "b"), "--restore", str(tmp_path / "a")], timeout=900)
    first = json.loads((tmp_path / "a" / "metrics.json").read_text())
    second = json.loads((tmp_path / "b" / "metrics.json").read_text())
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert [r["step"] for r in first] == [0, 1, 2] and [r["step"] for r in second] == [3]
    assert summary["optimizer"] == "MegatronOptimizer" and summary["device"] == "cuda"
    assert summary["quantization"] == quantization and all(r["quantization"] == quantization for r in first + second)
    assert summary["restore_check"]["trainer_equals_saved"] and summary["restore_check"]["engine_equals_trainer"]
    for r in first + second:
        assert r["bitwise_equal"] and r["max_abs"] == 0.0 and r["exact_fraction"] == 1.0, r
        assert r["pointers_unchanged"] and r["trainer_pointers_unchanged"], r
        assert r["optimizer_stepped"], r
    assert second[0]["first_after_restore"] and second[0]["version"] == 3
    assert [r["sync_version"] for r in first + second] == [1, 2, 3, 4]
