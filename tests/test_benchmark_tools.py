"""Benchmark tools on the CPU: ``bench_rollout_gpu.py --interleave`` with stand-in engine processes, and the kernel
events of a profiler trace (``benchmarks/kernel_trace.py``).

For ``--interleave`` the stand-in speaks the worker's protocol (a ``ready`` event, then one ``{"tokens", "seconds",
"passes"}`` event per ``pass`` line: a round) at a throughput set by its environment, and writes its name to a shared
file at every round, so the order of the rounds, the per-round figures, and what happens to an engine that dies or
hangs are checked without vLLM or a GPU.
"""

from __future__ import annotations

import contextlib

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

FAKE_ENGINE = r'''
import json, os, sys, time
events, order = sys.argv[2], os.environ["FAKE_ORDER"]
tps, die_after = float(os.environ["FAKE_TPS"]), int(os.environ.get("FAKE_DIE_AFTER", "-1"))

def emit(event):
    with open(events, "a") as f:
        f.write(json.dumps(event) + "\n")

emit({"ready": True, "startup_s": 0.5, "package_dir": "/fake"})
done = 0
for line in sys.stdin:
    if line.strip() != "pass":
        break
    if done == die_after:
        print("fake engine: out of resource", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_HANG"):
        time.sleep(60)
    with open(order, "a") as f:
        f.write(os.environ["FAKE_NAME"] + "\n")
    done += 1
    passes = int(os.environ.get("FAKE_PASSES", "1"))  # generations in the round (the worker: until --min-seconds)
    emit({"tokens": 1000 * passes, "seconds": 1000 * passes / (tps * done), "passes": passes})  # speeds up by round
'''


def _load(name: str):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path: Path, engines: dict[str, dict], rounds: int, timeout_s: float = 30.0):
    fake = tmp_path / "fake_engine.py"
    fake.write_text(FAKE_ENGINE)
    order = tmp_path / "order.txt"
    envs = {name: {"FAKE_NAME": name, "FAKE_ORDER": str(order), **env} for name, env in engines.items()}
    results = _load("bench_rollout_gpu").interleave(envs, {"prompts": []}, tmp_path, rounds, timeout_s,
                                  command=lambda req, events: [sys.executable, str(fake), str(req), str(events)])
    return results, order.read_text().split() if order.exists() else []


def test_rounds_alternate_order_and_report_each_pass(tmp_path):
    results, order = _run(tmp_path, {"consistent": {"FAKE_TPS": "900"}, "stock": {"FAKE_TPS": "1000", "FAKE_PASSES": "2"}},
                          rounds=3)
    assert order == ["consistent", "stock", "stock", "consistent", "consistent", "stock"]
    for name, tps, passes in (("consistent", 900, 1), ("stock", 1000, 2)):
        res = results[name]
        assert res["round_passes"] == [passes] * 3 and res["passes"] == 3 * passes
        assert res["gen_tokens"] == 3000 * passes and res["startup_s"] == 0.5
        assert res["round_tokens_per_s"] == pytest.approx([tps, 2 * tps, 3 * tps])
        assert res["gen_tokens_per_s"] == pytest.approx(3000 / sum(1000 / (tps * k) for k in (1, 2, 3)))
    assert json.loads((tmp_path / "consistent.req.json").read_text()) == {"prompts": []}


def test_an_engine_that_dies_is_reported_and_the_others_go_on(tmp_path, capsys):
    results, order = _run(tmp_path, {"a": {"FAKE_TPS": "1"}, "b": {"FAKE_TPS": "1", "FAKE_DIE_AFTER": "1"},
                                     "c": {"FAKE_TPS": "1"}}, rounds=3)
    assert "exited with status 3" in results["b"]["error"]
    assert results["b"]["log_tail"][-1] == "fake engine: out of resource"  # why it died, in the report
    assert "log_tail" not in results["a"]
    assert "passes" not in results["b"]
    assert results["a"]["passes"] == results["c"]["passes"] == 3
    assert order == ["a", "b", "c", "c", "a", "a", "c"]
    printed = capsys.readouterr().out  # at once, with its last words: a run cut short still shows why
    assert "b failed: engine b exited with status 3" in printed and "| fake engine: out of resource" in printed


def test_an_engine_that_hangs_is_cut_off_after_the_timeout(tmp_path):
    t = time.monotonic()
    results, _ = _run(tmp_path, {"a": {"FAKE_TPS": "1", "FAKE_HANG": "1"}, "b": {"FAKE_TPS": "1"}}, rounds=2,
                      timeout_s=2.0)
    assert time.monotonic() - t < 30
    assert "gave no answer in 2 s" in results["a"]["error"]
    assert results["b"]["passes"] == 2


def test_interleave_refuses_profile_by_name(tmp_path):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rollout_gpu.py"
    out = subprocess.run([sys.executable, str(script), "--interleave", "2", "--profile", "--out",
                          str(tmp_path / "r.json")], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode != 0
    assert "--interleave and --profile" in out.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("gz", [False, True])
def test_kernel_events_are_the_trace_kernels_in_start_order(tmp_path, gz):
    import gzip

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "_attn_kernel", "ts": 30.0, "dur": 4.0},
        {"cat": "cpu_op", "name": "aten::empty", "ts": 1.0, "dur": 9.0},
        {"cat": "kernel", "name": "_attn_kernel", "ts": 10.0, "dur": 7.5},
        {"cat": "kernel", "name": "no duration", "ts": 5.0},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 2.0, "dur": 1.0}]}
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    with (gzip.open(path, "wt") if gz else open(path, "w")) as f:
        json.dump(trace, f)
    assert _load("kernel_trace").kernel_events(path) == [("_attn_kernel", 10.0, 7.5), ("_attn_kernel", 30.0, 4.0)]


def test_a_round_repeats_generation_until_min_seconds():
    """The worker's timing loop: whole generations until ``min_seconds`` were timed, at least one."""
    from types import SimpleNamespace

    class FakeLLM:
        calls = 0

        def generate(self, prompts, params, use_tqdm=False):
            FakeLLM.calls += 1
            time.sleep(0.02)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * 7)]) for _ in prompts]

    timed = _load("bench_rollout_gpu")._timed_passes
    out = timed(FakeLLM(), ["p"] * 3, None, min_seconds=0.1)
    each = out["pass_seconds"]
    assert len(each) == FakeLLM.calls >= 5 and out["tokens"] == 21 * len(each) and out["seconds"] >= 0.1
    assert out["seconds"] == sum(each) and min(each) >= 0.02
    assert len(set(out["pass_tokens_digest"])) == 1 and out["pass_new_binaries"] == [0] * len(each)
    assert len(timed(FakeLLM(), ["p"], None, min_seconds=0.0)["pass_seconds"]) == 1


def test_a_pass_that_compiles_or_generates_other_tokens_is_reported(tmp_path, monkeypatch):
    """Binaries written into the engine's own cache during a pass are counted and named (the kernel) for that pass,
    and a pass whose tokens differ from the others gets another digest."""
    from types import SimpleNamespace

    bench = _load("bench_rollout_gpu")
    for k, v in bench.engine_caches("consistent", tmp_path).items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "consistent.cache" / "triton"

    class CompilingLLM:
        calls = 0

        def generate(self, prompts, params, use_tqdm=False):
            CompilingLLM.calls += 1
            if CompilingLLM.calls == 2:  # the second pass meets a new launch shape
                (cache / "abc").mkdir(parents=True)
                for name in ("tree_gemm.cubin", "tree_gemm.json"):
                    (cache / "abc" / name).write_text("x")
            token = 7 if CompilingLLM.calls == 3 else 1
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[token] * 4)]) for _ in prompts]

    out = bench._timed_passes(CompilingLLM(), ["p"] * 2, None, min_seconds=0.0)
    assert out["pass_new_binaries"] == [0]
    while CompilingLLM.calls < 3:
        more = bench._timed_passes(CompilingLLM(), ["p"] * 2, None, min_seconds=0.0)
        out = {k: out[k] + more[k] for k in out}
    assert out["pass_new_binaries"] == [0, 1, 0] and out["pass_new_kernels"] == [[], ["tree_gemm"], []]
    assert out["pass_tokens_digest"][0] == out["pass_tokens_digest"][1] != out["pass_tokens_digest"][2]


def test_passes_that_compile_are_not_counted_until_they_never_end(tmp_path, monkeypatch):
    """Steady-state timing: a pass that compiled kernels is reported but its tokens and seconds are not counted, so
    compiles inside a pass cannot lower the rate; after ``MAX_COMPILING_PASSES`` such passes they are counted."""
    from types import SimpleNamespace

    bench = _load("bench_rollout_gpu")
    for k, v in bench.engine_caches("consistent", tmp_path).items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "consistent.cache" / "triton"

    def llm(compiling_passes: int):
        calls = []

        class LLM:
            def generate(self, prompts, params, use_tqdm=False):
                calls.append(1)
                if len(calls) <= compiling_passes:
                    (cache / f"c{len(calls)}-{compiling_passes}").mkdir(parents=True)
                    (cache / f"c{len(calls)}-{compiling_passes}" / "k.cubin").write_text("x")
                    time.sleep(0.05)  # the compile
                return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * 5)]) for _ in prompts]
        return LLM()

    out = bench._timed_passes(llm(2), ["p"], None, min_seconds=0.0)
    assert out["pass_new_binaries"] == [1, 1, 0] and out["passes_not_counted"] == 2
    assert out["tokens"] == 5 and out["seconds"] == out["pass_seconds"][2] < 0.05
    forever = bench.MAX_COMPILING_PASSES + 2
    out = bench._timed_passes(llm(forever), ["p"], None, min_seconds=0.0)
    assert out["pass_new_binaries"] == [1] * (bench.MAX_COMPILING_PASSES + 1)
    assert out["passes_not_counted"] == bench.MAX_COMPILING_PASSES and out["tokens"] == 5


def test_a_failed_engine_reports_its_root_cause_above_the_last_lines(tmp_path):
    """vLLM's engine core prints the root cause far above its last lines: the report keeps the error lines too."""
    log = tmp_path / "stock.log"
    log.write_text("\n".join(["INFO start"] * 5 + ["ValueError: block-FP8 kernel not found"] + ["  trace line"] * 40
                             + ["RuntimeError: Engine core initialization failed. See root cause above."]) + "\n")
    lines = _load("bench_rollout_gpu").failure_lines(log)
    assert lines[0] == "ValueError: block-FP8 kernel not found"
    assert lines[-1].startswith("RuntimeError: Engine core initialization failed") and len(lines) == 16


def test_a_killed_engine_reports_how_far_it_got(tmp_path):
    """An engine killed at its time limit: its progress lines survive the warnings logged after them."""
    bench = _load("bench_rollout_gpu")
    log = tmp_path / "consistent.log"
    with open(log, "w") as f, contextlib.redirect_stdout(f):
        bench.progress("engine started in 60.1 s; warm-up pass (64 prompts)")
        print("\n".join(["WARNING Triton kernel JIT compilation during inference"] * 30))
    lines = bench.failure_lines(log)
    assert lines[0] == "[bench] engine started in 60.1 s; warm-up pass (64 prompts)" and len(lines) == 16


def test_the_specialisations_a_pass_met_are_kept_by_pass(tmp_path):
    """The lines ``MC_LOG_SPECIALIZATIONS`` prints, grouped by the timed pass they came in (each pass's before its
    progress line); the engine start's and the warm-up's are not a pass's."""
    from megatron_consistent.kernels.triton.compile_log import PREFIX

    bench = _load("bench_rollout_gpu")
    log = tmp_path / "consistent.log"
    log.write_text("\n".join([
        f"(EngineCore pid=9) {PREFIX} mod._attn_kernel[num_warps=4](Q: *bf16) constexprs {{'MODE': 0}}",
        "[bench] engine started in 60.1 s; warm-up pass (8 prompts)",
        f"{PREFIX} mod._attn_kernel[num_warps=4](Q: *bf16) constexprs {{'MODE': 1}}",
        "[bench] warm-up pass done in 9.0 s",
        "[bench] timed pass 1: 100 tokens in 5.0 s",
        f"(EngineCore pid=9) {PREFIX} mod._attn_kernel[num_warps=2](Q: *bf16) constexprs {{'MODE': 2}}",
        "INFO something else",
        f"{PREFIX} mod._zero_rows_kernel[num_warps=4](O: *bf16) constexprs {{'G': 4}}",
        "[bench] timed pass 2: 100 tokens in 6.0 s (2 kernels compiled: not counted)",
        "[bench] timed pass 3: 100 tokens in 5.0 s"]) + "\n")
    assert bench.specializations_by_pass(log) == [
        [], ["mod._attn_kernel[num_warps=2](Q: *bf16) constexprs {'MODE': 2}",
             "mod._zero_rows_kernel[num_warps=4](O: *bf16) constexprs {'G': 4}"], []]
    log.write_text("[bench] engine started in 60.1 s; warm-up pass (8 prompts)\n")  # killed in its warm-up
    assert bench.specializations_by_pass(log) == []


def _fake_check(tmp_path: Path, monkeypatch, report: dict | None, rc: int = 0, hang: bool = False) -> tuple:
    """``check_shapes_gpu`` with ``run_group`` replaced: the stand-in writes ``report`` where ``--json`` says (or
    times out: None); returns the module and the commands it was given."""
    mod = _load("check_shapes_gpu")
    seen = []

    def fake_run_group(cmd, log_path, timeout_s):
        seen.append(cmd)
        Path(log_path).write_text("engine log line\n")
        if hang:
            return None
        if report is not None:
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(report))
        return rc

    monkeypatch.setattr(mod, "run_group", fake_run_group)
    return mod, seen


def _shape_args(mod, *extra):
    import argparse

    args = argparse.Namespace(layers=4, num_prompts=4, max_tokens=8, min_prompt_len=8, max_prompt_len=40,
                              max_num_batched_tokens=64, block_size=32, recompute_batch=2, gpu_memory_utilization=0.3,
                              device="cpu", timeout=5.0, engine_tp=1, trainer_tp=1, row_parallel_segments=8)
    for key, value in extra:
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("key", ["a", "b", "d", "b8", "d8", "h"])
def test_check_shapes_configs_are_the_rollout_shapes_and_valid_check_settings(tmp_path, monkeypatch, key):
    from megatron_consistent.config import ArchConfig, load_hf_config
    from megatron_consistent.verify.check import load_check_config

    zero = {"consistent": {"tokens": 32, "max_abs": 0.0, "exact_fraction": 1.0}, "zero_mismatch": True}
    mod, seen = _fake_check(tmp_path, monkeypatch, zero)
    row = mod.run_shape(key, _shape_args(mod), tmp_path)
    folder = Path(seen[0][seen[0].index("--hf-config") + 1])
    cfg = json.loads((folder / "config.json").read_text())
    shape = mod.SHAPES[key]["model"]
    kept = {"num_hidden_layers", "hybrid_override_pattern"}
    assert cfg["num_hidden_layers"] == 4 and all(cfg[k] == v for k, v in shape.items() if k not in kept)
    arch = ArchConfig.from_hf(load_hf_config(str(folder)))
    assert arch.is_moe == bool(shape.get("num_experts")) and arch.is_hybrid == (key == "h")
    if arch.is_hybrid:  # 4 of the 52 layers, every kind kept: Mamba-2, attention, MLP
        assert set(arch.hybrid_pattern) == {"M", "*", "-"} and len(arch.hybrid_pattern) == 4
    settings = load_check_config(seen[0][seen[0].index("--config") + 1])  # the check's own validation
    assert settings.max_model_len >= settings.max_prompt_len + settings.max_tokens and settings.mode == "consistent"
    assert ("--quantization" in seen[0]) == key.endswith("8")
    assert row["zero_mismatch"] and row["layers"] == 4 and "ZERO MISMATCH" in mod.render([row])
    mod.run_shape(key, _shape_args(mod, ("engine_tp", 2), ("trainer_tp", 4)), tmp_path)
    assert seen[1][seen[1].index("--engine-tp") + 1] == "2" and seen[1][seen[1].index("--trainer-tp") + 1] == "4"
    assert "consistent_row_parallel_segments" not in cfg  # S = 8: the key absent, the default
    mod.run_shape(key, _shape_args(mod, ("row_parallel_segments", 2)), tmp_path)
    folder = Path(seen[2][seen[2].index("--hf-config") + 1])
    assert ArchConfig.from_hf(load_hf_config(str(folder))).row_parallel_segments == 2


def test_check_shapes_refuses_a_hybrid_too_short_for_its_layer_kinds(tmp_path, monkeypatch):
    mod, seen = _fake_check(tmp_path, monkeypatch, None)
    monkeypatch.setattr(sys, "argv", ["check_shapes_gpu.py", "--shapes", "a", "h", "--layers", "2",
                                      "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="shape h is a hybrid"):
        mod.main()
    assert not seen and not (tmp_path / "r.json").exists()  # nothing ran, shape a included


def test_check_shapes_reports_a_mismatch_and_a_hung_check(tmp_path, monkeypatch):
    mismatch = {"consistent": {"tokens": 32, "max_abs": 0.01, "exact_fraction": 0.5,
                               "first_divergence": {"request": 3, "response_token": 0}}, "zero_mismatch": False}
    mod, _ = _fake_check(tmp_path, monkeypatch, mismatch, rc=1)
    row = mod.run_shape("a", _shape_args(mod), tmp_path)
    assert not row["zero_mismatch"] and row["first_divergence"]["request"] == 3 and row["max_abs"] == 0.01
    assert "MISMATCH / rc 1" in mod.render([row]) and "engine log line" in mod.render([row])
    (tmp_path / "check-d.json").write_text(json.dumps({"consistent": {"tokens": 32}, "zero_mismatch": True}))  # stale
    mod, _ = _fake_check(tmp_path, monkeypatch, None, hang=True)
    row = mod.run_shape("d", _shape_args(mod), tmp_path)
    assert row["rc"] is None and not row["zero_mismatch"] and "timed out" in mod.render([row])


def test_attention_bench_decode_cases_parse_and_refuse_by_name(monkeypatch):
    """``bench_gpu_attention.py --decode-cases``: ``B:CTX`` pairs in order; a malformed pair, a zero, a context past the
    cases' 32k ``max_model_len`` or an empty list is refused naming the item."""
    import argparse

    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    parse = _load("bench_gpu_attention").decode_cases_arg
    assert parse("48:4096, 64:8192,") == [(48, 4096), (64, 8192)]
    for bad, named in (("48", "'48'"), ("48:0", "'48:0'"), ("1:40000", "'1:40000'"), ("a:1", "'a:1'"), (",", "no decode")):
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            parse(bad)
