"""End to end: a real vLLM engine with the plugin vs the Megatron recompute (the main job).

Each run starts real vLLM engines in subprocesses, so the suite keeps the runs
few and small; the full set (>= 64 prompts x 64 tokens per config) is the CLI's
job (see README).  Zero means zero: every response token's float32 log-prob
must be bitwise equal (``exact_fraction == 1`` and ``max_abs == 0``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_consistent.cli import main as cli_main
from megatron_consistent.config import builtin_model_dir
from megatron_consistent.verify.check import load_check_config, run_check


def _cfg(tmp_path, **kw):
    base = dict(num_prompts=12, max_tokens=16, max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=60,
                shared_prefix_len=40, prefix_groups=3)
    base.update(kw)
    return load_check_config(**base)


@pytest.mark.engine
@pytest.mark.parametrize(
    "model, temperature, logprobs_mode",
    [
        ("tiny-llama", 1.0, "processed"),
        ("tiny-qwen3-qknorm-tied", 0.7, "processed"),
        ("tiny-qwen2-mqa", 0.7, "raw"),
        ("tiny-llama3-rope-oddvocab", 1.0, "processed"),
    ],
)
def test_consistent_engine_matches_megatron_recompute(tmp_path, model, temperature, logprobs_mode):
    report = run_check(_cfg(tmp_path, hf_config=str(builtin_model_dir(model)), temperature=temperature,
                            logprobs_mode=logprobs_mode, mode="consistent"))
    c = report["consistent"]
    assert c["tokens"] == 12 * 16
    assert c["exact_fraction"] == 1.0
    assert c["max_abs"] == 0.0 and c["mean_abs"] == 0.0 and c["std"] == 0.0 and c["k3"] == 0.0
    assert report["zero_mismatch"]


@pytest.mark.engine
def test_cli_both_modes_reports_baseline_mismatch(tmp_path):
    """The stock pair (vLLM + Megatron local spec) is not bitwise equal; ours is; JSON has the documented keys."""
    out = tmp_path / "r.json"
    rc = cli_main(["check", "--num-prompts", "8", "--max-tokens", "16", "--max-num-batched-tokens", "32",
                   "--temperature", "0.7", "--out-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    for mode in ("consistent", "baseline"):
        assert {"tokens", "max_abs", "mean_abs", "std", "k3", "exact_fraction", "gen_tokens_per_s", "token_mult_prob_error"} <= set(report[mode])
    assert report["consistent"]["max_abs"] == 0.0
    assert report["baseline"]["max_abs"] > 0.0 and report["baseline"]["exact_fraction"] < 1.0
    assert report["throughput_ratio"] > 0


def test_cli_refuses_unsupported_architecture_before_work(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    hf = json.loads((builtin_model_dir() / "config.json").read_text())
    hf["architectures"] = ["GPT2LMHeadModel"]
    cfg.write_text(json.dumps(hf))
    rc = cli_main(["check", "--hf-config", str(cfg), "--out-dir", str(tmp_path / "run")])
    assert rc == 2
    assert "GPT2LMHeadModel" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("feature, value", [("sliding_window", 64), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0})])
def test_cli_refuses_unsupported_features(tmp_path, capsys, feature, value):
    hf = json.loads((builtin_model_dir() / "config.json").read_text())
    hf["architectures"] = ["MistralForCausalLM"]
    hf[feature] = value
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(hf))
    assert cli_main(["check", "--hf-config", str(cfg), "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert feature.split("_")[0] in err or "yarn" in err


def test_engine_failure_reports_the_worker_root_cause():
    from megatron_consistent.verify.rollout import _failure_reason

    log = "\n".join([
        "(Worker pid=1) ERROR 11-29 [x.py:1] WorkerProc failed to start.",
        "(Worker pid=1) ERROR 11-29 [x.py:1] Traceback (most recent call last):",
        "(Worker pid=1) ERROR 11-29 [x.py:1]   File \"a.py\", line 3, in f",
        "(Worker pid=1) ERROR 11-29 [x.py:1] ValueError: no kernel. Reasons:",
        "(Worker pid=1) ERROR 11-29 [x.py:1] Kernel requires AMX tile support.",
        "(EngineCore pid=2) ERROR 11-29 [core.py:1] Exception: WorkerProc initialization failed.",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])
    assert _failure_reason(log) == "ValueError: no kernel. Reasons: Kernel requires AMX tile support."
    assert _failure_reason("x\nRuntimeError: boom") == "RuntimeError: boom"
    one_gpu = "\n".join([  # vLLM on one GPU: the model runs in the engine core, no worker process
        "(EngineCore pid=2) ERROR 12-05 [core.py:1] EngineCore failed to start.",
        "(EngineCore pid=2) ERROR 12-05 [core.py:1] Traceback (most recent call last):",
        "(EngineCore pid=2) ERROR 12-05 [core.py:1] torch.OutOfMemoryError: CUDA out of memory.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert _failure_reason(one_gpu) == "torch.OutOfMemoryError: CUDA out of memory."


def test_yaml_config_loads_with_flag_overrides():
    from pathlib import Path

    yaml = Path(__file__).resolve().parents[1] / "examples" / "configs" / "check.yaml"
    cfg = load_check_config(str(yaml), num_prompts=8)
    assert cfg.hf_config.endswith("tiny-qwen3-qknorm-tied") and cfg.temperature == 0.7
    assert cfg.num_prompts == 8 and cfg.max_tokens == 64
    with pytest.raises(ValueError, match="mode"):
        load_check_config(str(yaml), mode="sideways")


def test_report_names_the_kernel_switches_it_ran_with(monkeypatch):
    """A report's numbers depend on which evaluation of the contract ran (docs/gpu.md, the switches): the settings
    name every ``MC_*`` variable set and, on CUDA, whether the Gluon kernels took their calls; the text shows them."""
    import torch

    from megatron_consistent.verify.check import kernel_switches, render

    for k in [k for k in os.environ if k.startswith("MC_")]:
        monkeypatch.delenv(k)
    assert kernel_switches(torch.device("cpu")) == {}
    monkeypatch.setenv("MC_SSD_SCAN", "torch")
    monkeypatch.setenv("MC_GLUON", "0")
    switches = kernel_switches(torch.device("cpu"))
    assert switches == {"MC_GLUON": "0", "MC_SSD_SCAN": "torch"}
    report = {"settings": {"arch": {"architecture": "LlamaForCausalLM"}, "hf_config": "tiny-llama", "num_prompts": 1,
                           "max_tokens": 1, "temperature": 1.0, "logprobs_mode": "processed", "max_num_batched_tokens": 8,
                           "kernel_switches": switches}}
    assert "kernel switches: MC_GLUON=0  MC_SSD_SCAN=torch" in render(report)


def test_a_mismatch_points_at_diagnose_for_its_check_dir(tmp_path):
    """A consistent path that mismatches ends its text with the diagnose command for this run's folder; zero
    mismatch does not; ``diagnose --check-dir`` takes the model the engine ran on from the run's request (a
    ``--checkpoint`` folder outside the run's folder too)."""
    import json

    from megatron_consistent.verify.check import render
    from megatron_consistent.verify.diagnose import check_dir_model

    settings = {"arch": {"architecture": "LlamaForCausalLM"}, "hf_config": "tiny-llama", "num_prompts": 1, "max_tokens": 1,
                "temperature": 1.0, "logprobs_mode": "processed", "max_num_batched_tokens": 8, "out_dir": "runs/x"}
    report = {"settings": settings, "consistent": {"tokens": 4, "max_abs": 0.5}, "zero_mismatch": False}
    assert render(report).endswith("next: megatron-consistent diagnose --check-dir runs/x (the first divergent layer / op "
                                   "of the first mismatching request)")
    assert "diagnose" not in render({**report, "zero_mismatch": True})
    (tmp_path / "engines").mkdir()
    request = tmp_path / "engines" / "consistent.request.json"
    request.write_text(json.dumps({"model_dir": "/data/my-checkpoint", "prompts": []}))
    assert check_dir_model(tmp_path) == Path("/data/my-checkpoint")
    request.write_text(json.dumps({"prompts": []}))
    assert check_dir_model(tmp_path) == tmp_path / "model"
