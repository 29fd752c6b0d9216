"""Issue #16: real checkpoints and hostile inputs (each test would have caught the defect it names)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_consistent.config import builtin_model_dir


# ---------------------------------------------------------------------------------------------- 3: unwritten attention output
def _attn_impl(monkeypatch):
    from megatron_consistent.vllm_plugin import attention as A

    monkeypatch.setenv(A.POISON_ENV, "1")
    monkeypatch.setattr(A.CPUAttentionBackendImpl, "__init__", lambda self, *a, **k: None)  # vLLM's needs a live engine config
    return A.ConsistentAttentionImpl(2, 32, 32**-0.5, 2, None, None, "auto")


def test_dummy_run_attention_writes_zeros(monkeypatch):
    """Profiling / dummy run (attn_metadata None): the output buffer (NaN-filled first) comes back as zeros."""
    impl = _attn_impl(monkeypatch)
    out = torch.full((5, 2 * 32), float("nan"), dtype=torch.bfloat16)
    q = torch.randn(5, 2, 32, dtype=torch.bfloat16)
    res = impl.forward(None, q, q, q, torch.empty(0), None, output=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(res, torch.zeros_like(res))


@pytest.mark.engine
def test_moe_engine_starts_with_poisoned_attention_output(tmp_path):
    """Every attention forward in the engine NaN-fills its output buffer first (stand-in for unwritten memory); the
    engine start runs vLLM's warm-up profile forward (attn_metadata None), whose output reaches the MoE router: the
    engine must come up and sample finite log-probs.  It first died with 'router scores contain NaN'; since the engine
    routes with device ops only (``moe_select_experts``: a NaN score still gives valid experts, no host read), the
    warm-up's zeros are proven by ``test_dummy_run_attention_writes_zeros`` and this test catches real rows the
    attention leaves unwritten (a forward that skips the decode rows fails it: NaN log-probs)."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron_consistent.config import ArchConfig, load_hf_config
    from megatron_consistent.conversion import export_hf
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.vllm_plugin.attention import POISON_ENV

    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-qwen3moe-top1")))
    export_hf(build_consistent_gpt_model(arch, seed=0), arch, tmp_path / "model")
    # the engine core in this process (as check's CPU engines run): the warm-up profile forward is the same model-runner
    # code either way, without vLLM's two extra processes to start
    env = dict(os.environ, HF_HUB_OFFLINE="1", MEGATRON_CONSISTENT_VLLM="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", **{POISON_ENV: "1"})
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "_warmup_engine.py"), str(tmp_path / "model")], env=env,
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert "Warming up model" in log, log[-3000:]  # the profile forward did run
    assert "ENGINE-OK True 8" in run.stdout, log[-3000:]


# ---------------------------------------------------------------------------------------------- 2: configs as transformers writes them
def _write_cfg(tmp_path, hf: dict):
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def _builtin(name: str) -> dict:
    import json

    return json.loads((builtin_model_dir(name) / "config.json").read_text())


def test_config_saved_by_transformers_with_encoded_infinity(tmp_path):
    """transformers 5 writes time_step_limit (0, inf) as {"__float__": "Infinity"}: read as vLLM reads it."""
    from transformers import AutoConfig

    from megatron_consistent.config import ArchConfig, load_hf_config

    hf = _builtin("tiny-nemotronh")
    hf["time_step_limit"] = [0.0, float("inf")]
    AutoConfig.for_model("nemotron_h", **{k: v for k, v in hf.items() if k != "model_type"}).save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert '"__float__": "Infinity"' in text  # what made config.py raise TypeError before
    arch = ArchConfig.from_hf(load_hf_config(tmp_path))
    assert arch.ssm.time_step_limit == (0.0, float("inf"))
    assert arch == ArchConfig.from_hf(hf)


def test_mamba2_residual_in_fp32_accepted_as_vllm_does(tmp_path):
    """HF Mamba2's default residual_in_fp32=True: vLLM serves it (and ignores the flag); so do we, same arch."""
    from megatron_consistent.config import ArchConfig, load_hf_config

    hf = _builtin("tiny-mamba2")
    base = ArchConfig.from_hf(hf)
    hf.pop("residual_in_fp32", None)  # absent: transformers' default True
    assert ArchConfig.from_hf(load_hf_config(_write_cfg(tmp_path, hf))) == base
    hf["residual_in_fp32"] = True
    assert ArchConfig.from_hf(hf) == base


@pytest.mark.parametrize("name, edit, message", [
    ("tiny-llama", {"hidden_size": None}, "missing field hidden_size"),
    ("tiny-llama", {"num_attention_heads": 0}, "field num_attention_heads must be > 0"),
    ("tiny-llama", {"num_key_value_heads": 0}, "field num_key_value_heads must be > 0"),
    ("tiny-llama", {"vocab_size": -3}, "field vocab_size must be > 0"),
    ("tiny-llama", {"intermediate_size": 2.5}, "field intermediate_size must be an integer"),
    ("tiny-llama", {"rms_norm_eps": 0}, "rms_norm_eps must be a finite number > 0"),
    ("tiny-qwen3moe-top1", {"num_hidden_layers": None}, "missing field num_hidden_layers"),
    ("tiny-mamba2", {"hidden_size": None}, "missing field hidden_size"),
    ("tiny-mamba2", {"num_heads": 0}, "field num_heads must be > 0"),
    ("tiny-nemotronh", {"vocab_size": None}, "missing field vocab_size"),
    ("tiny-llama", {"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ("tiny-llama", {"consistent_row_parallel_segments": 3}, "consistent_row_parallel_segments=3: the row-parallel K tree"),
    ("tiny-nemotronh", {"consistent_row_parallel_segments": 16}, "consistent_row_parallel_segments=16: the row-parallel"),
])
def test_config_bad_fields_named(tmp_path, name, edit, message):
    """Missing / zero / negative fields: one structured line (was KeyError / ZeroDivisionError)."""
    from megatron_consistent.config import UnsupportedConfigError, load_hf_config

    hf = _builtin(name)
    for k, v in edit.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    with pytest.raises(UnsupportedConfigError, match=message):
        load_hf_config(_write_cfg(tmp_path, hf))


def test_config_not_json_is_one_line(tmp_path):
    from megatron_consistent.config import UnsupportedConfigError, load_hf_config

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedConfigError, match="not a JSON file"):
        load_hf_config(tmp_path)


# ---------------------------------------------------------------------------------------------- 4: every command validates first
@pytest.fixture
def no_engines(monkeypatch):
    """Any subprocess (every engine runs in one) fails the test: validation must come first."""
    import subprocess

    def refuse(*a, **k):
        raise AssertionError(f"a process was started before validation finished: {a[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def _bad_llama(tmp_path):
    hf = _builtin("tiny-llama")
    hf["num_attention_heads"] = 0
    return str(_write_cfg(tmp_path / "badcfg", hf))


def _cases(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = ["--out-dir", str(tmp_path / "out")]
    return {
        "check": [
            (["--temperature", "-1"], "--temperature must be a finite number > 0"),
            (["--temperature", "nan"], "--temperature must be a finite number > 0"),
            (["--engine-timeout-s", "0"], "--engine-timeout-s must be a finite number > 0"),
            (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
            (["--num-prompts", "0"], "--num-prompts must be >= 1"),
            (["--max-tokens", "-5"], "--max-tokens must be >= 1"),
            (["--seed", "-1"], "--seed must be >= 0"),
            (["--json", str(blocker / "r.json")], "--json .* cannot be written"),
            (["--json", str(tmp_path)], "--json .* is a directory"),
            (["--out-dir", str(blocker / "sub")], "--out-dir .* is not a writable folder"),
            (["--hf-config", str(tmp_path / "nowhere")], "no HF config"),
            (["--hf-config", _bad_llama(tmp_path)], "field num_attention_heads must be > 0"),
            (["--config", str(tmp_path / "none.yaml")], "--config .*: no such file"),
            (["--engine-args", "[1]"], "--engine-args must be a JSON object"),
            (["--engine-args", "{async_scheduling: false}"], "--engine-args must be a JSON object"),
        ],
        "gates": [
            (["--hf-config", _bad_llama(tmp_path)], "field num_attention_heads must be > 0"),
            (["--num-prompts", "0"], "--num-prompts must be >= 1"),
            (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
            (["--json", str(tmp_path)], "--json .* is a directory"),
            (["--only", "C99"], "unknown gate ids"),
        ],
        "diagnose": [
            (["--prompt", "1,2", "--response", "3", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
            (["--prompt", "1,a", "--response", "3"], "--prompt: token ids must be integers >= 0"),
            (["--prompt", "1,2", "--response", "99999"], "outside the vocabulary"),
            (["--prompt", "1,2"], "give --check-dir"),
            (["--check-dir", str(tmp_path), "--request-index", "-1"], "--request-index must be >= 0"),
            (["--prompt", "1", "--response", "2", "--model-dir", str(tmp_path / "nomodel")], "no such file"),
            (["--prompt", "1", "--response", "2", "--json", str(blocker / "x.json")], "cannot be written"),
        ],
    }, out


@pytest.mark.parametrize("command", ["check", "gates", "diagnose"])
def test_cli_bad_input_exits_2_with_one_line_before_any_engine(tmp_path, capsys, no_engines, command):
    from megatron_consistent.cli import main

    cases, out = _cases(tmp_path)
    for argv, message in cases[command]:
        rc = main([command, *out, *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2, (argv, rc, err)
        assert len(err.splitlines()) == 1 and err.startswith(f"megatron-consistent {command}: error:"), (argv, err)
        import re

        assert re.search(message, err), (argv, err)
        assert not list((tmp_path / "out").glob("*.json")), argv


def test_check_report_written_when_a_later_stage_fails(tmp_path, monkeypatch, capsys):
    """The engine stage raises: the JSON report is still written (settings + error), exit 1."""
    import json

    from megatron_consistent.cli import main
    from megatron_consistent.verify import check

    def boom(*a, **k):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(check, "run_in_subprocess", boom)
    path = tmp_path / "r.json"
    rc = main(["check", "--mode", "consistent", "--num-prompts", "2", "--max-tokens", "2", "--out-dir", str(tmp_path),
               "--json", str(path)])
    assert rc == 1
    report = json.loads(path.read_text())
    assert report["error"] == "RuntimeError: engine exploded" and report["settings"]["num_prompts"] == 2
    assert report["zero_mismatch"] is False


def test_checkpoint_exception_does_not_escape(tmp_path, monkeypatch):
    """torch's CheckpointException derives from BaseException: a gate raising it is a failing gate, a dist restore turns it
    into CheckpointMismatchError."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_consistent.verify.gates import Gate, run_gates

    def raises(ctx):
        raise CheckpointException("load failed", {})

    gate = Gate("C8", "checkpoint restore", raises)
    results = run_gates([gate], ctx=None)
    assert results[0]["status"] == "fail" and "CheckpointException" in results[0]["detail"]

    from megatron.core import dist_checkpointing

    from megatron_consistent import checkpoint
    from megatron_consistent.conversion import CheckpointMismatchError
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.rl import TINY_RL_HF_CONFIG

    monkeypatch.setattr(checkpoint, "audit_dist_metadata", lambda d: None)
    monkeypatch.setattr(dist_checkpointing, "load", lambda *a, **k: raises(None))
    with pytest.raises(CheckpointMismatchError, match="CheckpointException"):
        checkpoint._load_dist_staged(build_consistent_gpt_model(TINY_RL_HF_CONFIG, seed=0), tmp_path)


# ---------------------------------------------------------------------------------------------- 5: restore / import all or nothing
def _tiny_model(seed=0):
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.rl import TINY_RL_HF_CONFIG

    return build_consistent_gpt_model(TINY_RL_HF_CONFIG, seed=seed)


def _snapshot(model, opt=None):
    snap = {n: p.detach().clone() for n, p in model.named_parameters()}
    if opt is not None:
        snap.update({f"opt.{k}": v.clone() for k, v in opt.state_dict().items()})
    return snap


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint (HF weights + optimizer after one AdamW step) and a fresh model/optimizer to restore into."""
    from megatron_consistent.checkpoint import save_checkpoint
    from megatron_consistent.training import make_optimizer

    model = _tiny_model(0)
    opt = make_optimizer(model, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert opt.step()
    ckpt = save_checkpoint(tmp_path / "ckpt", model, opt, dist=False)
    dst = _tiny_model(1)
    dst_opt = make_optimizer(dst, lr=1e-2)
    return ckpt, dst, dst_opt


def _edit_optimizer(ckpt, fn):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(ckpt / "optimizer.safetensors"))
    fn(sd)
    save_file(sd, str(ckpt / "optimizer.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("adam_step.0"), r"partial Adam state for parameter 0 .*lacks \['adam_step'\]"),
    (lambda sd: sd.update({"main.x": torch.zeros(1)}), r"unknown optimizer state key 'main.x'"),
    (lambda sd: sd.update({"bogus": torch.zeros(1)}), r"unknown optimizer state key 'bogus'"),
    (lambda sd: sd.update({"exp_avg.999": torch.zeros(1)}), r"entries for parameters this model lacks \(it has \d+\): \['exp_avg.999'\]"),
    (lambda sd: sd.update({"adam_step.1": torch.zeros(2)}), r"adam_step.1 .*expected \(1,\) float32"),
    (lambda sd: sd["exp_avg_sq.2"].view(-1).__setitem__(0, float("nan")), r"exp_avg_sq.2 .*non-finite"),
    (lambda sd: sd.pop("step"), r"lacks 'step'"),
])
def test_restore_validates_optimizer_before_copying_anything(saved, edit, message):
    """Was: the weights were copied, then the optimizer load raised (e.g. adam_step.N missing): half restored."""
    from megatron_consistent.checkpoint import load_checkpoint
    from megatron_consistent.conversion import CheckpointMismatchError

    ckpt, dst, dst_opt = saved
    _edit_optimizer(ckpt, edit)
    before = _snapshot(dst, dst_opt)
    with pytest.raises(CheckpointMismatchError, match=message):
        load_checkpoint(ckpt, dst, dst_opt)
    assert _same(before, _snapshot(dst, dst_opt))


def test_restore_manifest_from_before_the_segment_count_reads_s_8(saved):
    """A manifest written before ``row_parallel_segments`` was an ArchConfig field restores into an S = 8 model; one
    with another S is refused by name."""
    import json

    from megatron_consistent.checkpoint import load_checkpoint
    from megatron_consistent.conversion import CheckpointMismatchError

    ckpt, dst, dst_opt = saved
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for segments, refused in ((None, False), (4, True)):
        if segments is None:
            manifest["arch"].pop("row_parallel_segments")
        else:
            manifest["arch"]["row_parallel_segments"] = segments
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        if refused:
            with pytest.raises(CheckpointMismatchError, match="architecture row_parallel_segments: checkpoint 4, model 8"):
                load_checkpoint(ckpt, dst, dst_opt)
        else:
            load_checkpoint(ckpt, dst, dst_opt)


def test_restore_nonfinite_weights_refused_and_opt_out(saved):
    from safetensors.torch import load_file, save_file

    from megatron_consistent.checkpoint import load_checkpoint
    from megatron_consistent.conversion import CheckpointMismatchError

    ckpt, dst, dst_opt = saved
    f = ckpt / "hf" / "model.safetensors"
    sd = load_file(str(f))
    sd["model.norm.weight"][3] = float("inf")
    save_file(sd, str(f), metadata={"format": "pt"})
    before = _snapshot(dst, dst_opt)
    with pytest.raises(CheckpointMismatchError, match=r"non-finite .*model.norm.weight"):
        load_checkpoint(ckpt, dst, dst_opt)
    assert _same(before, _snapshot(dst, dst_opt))
    load_checkpoint(ckpt, dst, dst_opt, allow_nonfinite=True)  # the explicit opt-out
    assert torch.isinf(dst.decoder.final_layernorm.weight).any()


def _shard(src_dir, dst_dir, edit=None):
    """Split an export into two shards + index (``edit(shards, weight_map)`` may break it)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst_dir.mkdir(parents=True)
    shutil.copy(src_dir / "config.json", dst_dir / "config.json")
    sd = load_file(str(src_dir / "model.safetensors"))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": {n: sd[n] for n in names[::2]},
              "model-00002-of-00002.safetensors": {n: sd[n] for n in names[1::2]}}
    weight_map = {n: f for f, part in shards.items() for n in part}
    if edit:
        edit(shards, weight_map)
    for f, part in shards.items():
        save_file(part, str(dst_dir / f), metadata={"format": "pt"})
    (dst_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst_dir


def _dup(shards, wm):
    first = next(iter(shards["model-00001-of-00002.safetensors"]))
    shards["model-00002-of-00002.safetensors"][first] = shards["model-00001-of-00002.safetensors"][first].clone() + 1


def _escape(shards, wm):
    name = next(iter(wm))
    wm[name] = "../model-00001-of-00002.safetensors"


def _unindexed(shards, wm):
    wm.pop(sorted(wm)[0])


def _wrong_shard(shards, wm):
    name = next(iter(shards["model-00001-of-00002.safetensors"]))
    wm[name] = "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("edit, message", [
    (None, None),
    (_dup, "is in two shards"),
    (_escape, "leaves the checkpoint folder"),
    (_unindexed, "in shards but not in the index"),
    (_wrong_shard, "index names the wrong shard"),
])
def test_sharded_checkpoint_verified_against_index(tmp_path, edit, message):
    from megatron_consistent.conversion import CheckpointMismatchError, export_hf, import_hf

    src = _tiny_model(0)
    export_hf(src, src.arch_config, tmp_path / "single")
    d = _shard(tmp_path / "single", tmp_path / "sharded", edit)
    dst = _tiny_model(1)
    before = _snapshot(dst)
    if message is None:
        import_hf(dst, dst.arch_config, d)
        assert _same(_snapshot(src), _snapshot(dst))
    else:
        with pytest.raises(CheckpointMismatchError, match=message):
            import_hf(dst, dst.arch_config, d)
        assert _same(before, _snapshot(dst))


# ---------------------------------------------------------------------------------------------- 6: sync never hangs, never orphans
class _FakeProc:
    def __init__(self, alive=True):
        self.alive, self.name, self.pid, self.exitcode = alive, "EngineCore_DP0", 4242, None if alive else -9

    def is_alive(self):
        return self.alive


class _FakeLLM:
    """collective_rpc answers the channel's start-up RPCs, then blocks (a hung engine) when told to."""

    def __init__(self):
        import threading
        from types import SimpleNamespace

        self.block = threading.Event()
        self.proc = _FakeProc()
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
            engine_manager=SimpleNamespace(processes=[self.proc]), engine_dead=False)), has_unfinished_requests=lambda: False)

    def collective_rpc(self, method, args=()):
        if self.block.is_set():
            import time

            time.sleep(3600)
        return [{"mc_sync_model_kind": "consistent", "mc_sync_version": 0}.get(method, 0)]


def test_sync_rpc_timeout_and_dead_engine_raise_named_errors():
    import time

    from megatron_consistent.sync import WeightSyncChannel, WeightSyncError

    llm = _FakeLLM()
    ch = WeightSyncChannel(llm, rpc_timeout=0.5, watch_parent=False)
    llm.block.set()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"mc_sync_version: the engine did not answer within 0.5 s"):
        ch.engine_version()
    assert time.monotonic() - t0 < 5
    with pytest.raises(WeightSyncError, match="channel unusable"):
        ch.engine_version()  # a late reply could still land: the channel stays closed

    llm = _FakeLLM()
    ch = WeightSyncChannel(llm, rpc_timeout=3600, watch_parent=False)
    llm.block.set()
    import threading

    threading.Timer(0.5, lambda: setattr(llm.proc, "alive", False)).start()  # the engine dies while we wait
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"engine process EngineCore_DP0 \(pid 4242\) exited"):
        ch.engine_version()
    assert time.monotonic() - t0 < 5


@pytest.mark.engine
def test_live_sync_guards_and_no_orphans(tmp_path):
    """A trainer process with a live multiprocess engine: in-flight push refused (unless drained), NaN refused by name on
    both sides, then (a) the worker is killed: the next push raises a named WeightSyncError quickly; (b) the trainer is
    killed: the engine processes exit (they were orphans holding memory and /dev/shm)."""
    import json
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from megatron_consistent.conversion import export_hf

    model = _tiny_model(0)
    export_hf(model, model.arch_config, tmp_path / "model")
    script = str(Path(__file__).parent / "_sync_trainer.py")
    env = dict(os.environ, HF_HUB_OFFLINE="1", MEGATRON_CONSISTENT_VLLM="1")

    def alive(pid):
        from megatron_consistent.sync.worker import _start_time

        return _start_time(pid) is not None

    # (a) the worker dies
    run = subprocess.run([sys.executable, script, str(tmp_path / "model"), "kill"], env=env, capture_output=True, text=True,
                         timeout=600)
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads(line[0][7:])
    assert r["push_inflight"].startswith("WeightSyncError: push refused: the engine has requests in flight"), r
    assert r["version_after_inflight"] == 0 and r["push_inflight_drained"] == "ok"
    assert "non-finite values (NaN/Inf) in ['model.norm.weight']" in r["push_nan"], r
    assert not r["engine_nan_reply"]["ok"] and "model.norm.weight" in r["engine_nan_reply"]["problems"][0]
    assert r["version_after_nan"] == 1 and r["push_ok"] == "ok" and r["version_final"] == 2
    assert r["push_after_kill"].startswith("WeightSyncError: mc_sync_apply"), r
    assert "exited with code" in r["push_after_kill"] or "engine core dead" in r["push_after_kill"], r  # the cause, named
    assert r["rpc_after_kill"].startswith("WeightSyncError: weight-sync channel unusable"), r  # never waits again
    assert r["push_after_kill_seconds"] < 60 and r["rpc_after_kill_seconds"] < 1, r

    # (b) the trainer dies
    proc = subprocess.Popen([sys.executable, script, str(tmp_path / "model"), "orphan"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while not line.startswith("RESULT "):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "trainer exited early"
        r = json.loads(line[7:])
        pids = r["worker_pids"] + r["engine_pids"]
        assert all(alive(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.5)
    left = [p for p in pids if alive(p)]
    for p in left:  # clean up before failing
        os.kill(p, signal.SIGKILL)
    assert not left, f"engine processes {left} outlived the trainer"


# ---------------------------------------------------------------------------------------------- 1: check --checkpoint
ALL_MODELS = sorted(p.name for p in builtin_model_dir().parent.iterdir() if (p / "config.json").is_file())


def _hf_ckpt(name, out, tokenizer=True):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _hf_checkpoints import write_checkpoint

    return write_checkpoint(name, out, tokenizer=tokenizer)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_transformers_written_checkpoint_loads(tmp_path, name):
    """save_pretrained of transformers' own model class for every supported architecture: config and weights load."""
    from megatron_consistent.config import ArchConfig, load_hf_config
    from megatron_consistent.conversion import import_hf
    from megatron_consistent.layers import build_consistent_gpt_model

    d = _hf_ckpt(name, tmp_path / name, tokenizer=False)
    arch = ArchConfig.from_hf(load_hf_config(d))
    assert arch == ArchConfig.from_hf(load_hf_config(builtin_model_dir(name)))
    import_hf(build_consistent_gpt_model(arch, seed=0), arch, d)


def test_check_checkpoint_bad_input_exits_2(tmp_path, capsys, no_engines):
    from safetensors.torch import load_file, save_file

    from megatron_consistent.cli import main

    ck = _hf_ckpt("tiny-llama", tmp_path / "ck")
    bare = _hf_ckpt("tiny-llama", tmp_path / "bare", tokenizer=False)
    broken = _hf_ckpt("tiny-llama", tmp_path / "broken", tokenizer=False)
    sd = load_file(str(broken / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"][:-1].clone()
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "text.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "big.jsonl").write_text('{"token_ids": [1, 2, 99999]}\n')
    (tmp_path / "junk.jsonl").write_text('{"prompt": "x"}\n')
    out = ["--out-dir", str(tmp_path / "out"), "--mode", "consistent"]
    capsys.readouterr()  # save_pretrained's progress bars
    cases = [
        (["--checkpoint", str(tmp_path / "nowhere")], "no such folder"),
        (["--checkpoint", str(ck), "--hf-config", str(builtin_model_dir())], "not with --hf-config"),
        (["--prompts", str(tmp_path / "text.jsonl")], "--prompts needs --checkpoint"),
        (["--checkpoint", str(ck), "--prompts", str(tmp_path / "junk.jsonl")], 'line 1: expected {"text"'),
        (["--checkpoint", str(ck), "--prompts", str(tmp_path / "none.jsonl")], "no such file"),
        (["--checkpoint", str(bare), "--prompts", str(tmp_path / "text.jsonl")], "has no tokenizer"),
        (["--checkpoint", str(ck), "--prompts", str(tmp_path / "big.jsonl")], "outside the model's vocabulary"),
        (["--checkpoint", str(broken)], "wrong shape for model.norm.weight"),
    ]
    import re

    for argv, message in cases:
        rc = main(["check", *out, *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and re.search(message, err), (argv, rc, err)


@pytest.mark.engine
@pytest.mark.parametrize("name, prompts", [("tiny-llama", "file"), ("tiny-qwen3moe-top1", "chat")])
def test_check_checkpoint_zero_mismatch_on_text(tmp_path, name, prompts):
    """A transformers-written checkpoint with a tokenizer: text prompts (a JSONL file, or the built-in chat prompts through
    the chat template); trainer and engine on those weights, every token bitwise equal."""
    import json

    from megatron_consistent.cli import main

    ck = _hf_ckpt(name, tmp_path / "ck")
    argv = ["check", "--checkpoint", str(ck), "--mode", "consistent", "--num-prompts", "6", "--max-tokens", "8",
            "--max-num-batched-tokens", "32", "--out-dir", str(tmp_path / "out"), "--json", str(tmp_path / "r.json")]
    if prompts == "file":
        (tmp_path / "p.jsonl").write_text('{"text": "What is the capital of France?"}\n{"text": "Why is the sky blue?"}\n'
                                          '{"token_ids": [5, 6, 7, 8, 9]}\n')
        argv += ["--prompts", str(tmp_path / "p.jsonl")]
    assert main(argv) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["zero_mismatch"] and r["consistent"]["exact_fraction"] == 1.0 and r["consistent"]["max_abs"] == 0.0
    n = 3 if prompts == "file" else 6
    assert r["consistent"]["tokens"] == n * 8 and r["settings"]["num_prompts"] == n
    assert ("file" if prompts == "file" else "chat template") in r["settings"]["prompt_source"]


# ---------------------------------------------------------------------------------------------- 7: soak (reduced)
@pytest.mark.engine
@pytest.mark.slow
def test_soak_reduced(tmp_path):
    """The soak's stream, short: preemptions and aborts happen, n=2 requests too, and every finished sample is bitwise
    equal to the trainer's recompute (make soak runs 1500 requests on a dense and a MoE model)."""
    from megatron_consistent.verify.soak import SoakConfig, run_soak

    cfg = SoakConfig(models=["tiny-llama"], requests=60, out_dir=str(tmp_path))
    cfg.validate()
    r = run_soak(cfg)["models"][0]
    assert r["requests"] == 60 and r["samples"] > 0 and r["n2_requests"] > 0
    assert r["preemptions"] > 0 and r["aborts"] > 0, r
    assert r["mismatched_tokens"] == 0 and r["mismatched_samples"] == 0, r


def test_soak_bad_input_exits_2(tmp_path, capsys, no_engines):
    from megatron_consistent.cli import main

    for argv, message in [(["--requests", "0"], "--requests must be >= 1"), (["--kv-blocks", "2"], "cannot hold one sequence"),
                          (["--abort-probability", "1.5"], "--abort-probability must be in"),
                          (["--engine-timeout-s", "-1"], "--engine-timeout-s must be a finite number > 0"),
                          (["--models", "tiny-mamba2"], "hybrid models refuse prefix caching"),
                          *([(["--device", "cuda"], "no CUDA device is visible")] if not torch.cuda.is_available() else [])]:
        rc = main(["soak", "--out-dir", str(tmp_path), *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and message in err, (argv, err)


def test_tree_schedule_keys_refused_by_name():
    """A row-parallel tree schedule a table entry (or a caller) names but the kernel has not is refused in one line
    naming the key, at planning time (before any buffer or launch)."""
    pytest.importorskip("triton")
    from megatron_consistent.kernels.triton import segment_tree as tst

    base = {"BM": 64, "BN": 128, "W": 4, "S": 2, "G": 8, "BK": 64, "SPLIT_STEPS": 1 << 20}
    assert tst.plan(4096, 4096, 4096, 8, torch.bfloat16, {**base, "TREE_PROGS": 2})["progs"] == 2
    assert tst.plan(4096, 4096, 4096, 8, torch.bfloat16, base)["progs"] == 1
    for bad, key in (({"TREE_PROGS": 3}, "TREE_PROGS"), ({"TREE_LANES": 3}, "LANES"), ({"TREE_REG": 3}, "REG"),
                     ({"TREE_PATH": "zigzag"}, "path")):
        with pytest.raises(ValueError, match=key) as err:
            tst.plan(4096, 4096, 4096, 8, torch.bfloat16, {**base, **bad})
        assert "\n" not in str(err.value)


def test_tree_lanes_fit_shared_memory():
    """Four segment chains per K loop are planned only where two pipeline stages of their operand tiles fit in shared
    memory; a larger tile falls back to two chains (a schedule, never a bit), the stages shrink to what fits."""
    pytest.importorskip("triton")
    from megatron_consistent.kernels.triton import segment_tree as tst

    base = {"W": 8, "S": 4, "G": 8, "BK": 64, "SPLIT_STEPS": 1 << 20, "TREE_PATH": "serial", "TREE_LANES": 4}
    for bm, bn, reg, lanes, stages in ((64, 128, 8, 4, 2), (128, 64, 4, 4, 2), (128, 128, 8, 2, 3), (64, 128, 2, 2, 4)):
        p = tst.plan(4096, 4096, 4096, 8, torch.bfloat16, {**base, "BM": bm, "BN": bn, "TREE_REG": reg})
        assert (p["LANES"], p["cfg"]["S"]) == (lanes, stages), (bm, bn, reg, p)
        lane_bytes = (bm + bn) * 64 * 2
        assert 2 * p["LANES"] * lane_bytes <= tst.SMEM_BUDGET
        assert p["cfg"]["S"] * p["LANES"] * lane_bytes <= tst.SMEM_BUDGET


def test_split_path_rule_follows_programs_per_sm(monkeypatch):
    """The attention path rule (shapes only): a decode step splits while its in-program grid has fewer programs than
    the SMs (default 1 per SM: B = 16 of GQA 32/8 makes 128 programs and splits, B = 32 makes 256 and does not), and
    with 8 (``MC_ATTN_SPLIT_PER_SM``, a rollout variant's knob) B = 64 splits too; one partition never splits."""
    pytest.importorskip("triton")
    from megatron_consistent.kernels.triton import attention as tattn
    from megatron_consistent.kernels.triton import paged_attention as tpa

    cpu = torch.device("cpu")  # 132 SMs assumed off the GPU
    assert [tpa.paged_plan(b, 32, 8, b, 1, 32768, cpu)[2] for b in (1, 8, 16, 24, 32, 64)] == [True] * 3 + [False] * 3
    assert not tpa.paged_plan(1, 32, 8, 1, 1, 512, cpu)[2]
    monkeypatch.setattr(tattn, "SPLIT_PER_SM", 8)
    assert tpa.paged_plan(64, 32, 8, 64, 1, 32768, cpu)[2] and not tpa.paged_plan(64, 32, 8, 64, 1, 512, cpu)[2]


def test_merge_slices_follow_the_merge_grid(monkeypatch):
    """The split path's merge launch is cut into head-dimension slices while the sliced grid fits one wave of the
    132 SMs (shapes only): 8 / 4 / 2 / 1 slices for 8 / 32 / 64 / 128 merge programs (B = 1 / 4 / 8 / 16 decode rows
    of GQA 32/8: the H200's measured winners), never narrower than 16 columns; ``MC_ATTN_MERGE_DSPLIT`` forces a count."""
    pytest.importorskip("triton")
    from megatron_consistent.kernels.triton import attention as tattn
    from megatron_consistent.kernels.triton import paged_attention as tpa

    cpu = torch.device("cpu")  # 132 SMs assumed off the GPU
    monkeypatch.setattr(tattn, "MERGE_DSPLIT", 0)
    assert [tattn._merge_slices(p, 128, cpu) for p in (1, 8, 32, 64, 128, 1024)] == [8, 8, 4, 2, 1, 1]
    assert tattn._merge_slices(8, 32, cpu) == 2 and tattn._merge_slices(8, 16, cpu) == 1
    # a paged decode step counts the programs with rows (B sequences x 8 kv heads), not its grid's upper bound
    assert [tpa.paged_plan(b, 32, 8, b, 1, 32768, cpu)[3] for b in (1, 4, 8, 16)] == [8, 32, 64, 128]
    monkeypatch.setattr(tattn, "MERGE_DSPLIT", 2)
    assert tattn._merge_slices(8, 128, cpu) == 2 and tattn._merge_slices(1024, 128, cpu) == 2


def test_merge_binaries_cover_every_slice_count_once(monkeypatch):
    """The split path compiles its merge for every slice count :func:`_merge_slices` can pick (for any number of merge
    programs and head width), once per configuration, and on CUDA only: the first split launch compiles the others
    beside the one it launches, a later launch of the same constexprs none, the interpreter's CPU tensors none."""
    pytest.importorskip("triton")
    from megatron_consistent.kernels.triton import attention as tattn

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(tattn, "MERGE_DSPLIT", 0)
    for block_d in (16, 32, 64, 128, 256):
        picked = {tattn._merge_slices(p, block_d, cpu) for p in range(1, 300)}
        assert picked == set(tattn._merge_slice_counts(block_d)), block_d
    warmed = []
    monkeypatch.setattr(tattn, "_attn_kernel", type("K", (), {"warmup": lambda self, *a, grid, **kw: warmed.append(
        (grid, kw["MERGE_DSPLIT"]))})())
    monkeypatch.setattr(tattn, "_merge_binaries_built", set())
    merge = {"MODE": 2, "MERGE_DSPLIT": 2, "MERGE_STAGES": 4, "PAGE": 16}
    tattn._build_merge_binaries((), (9, 8, 2), merge, 128, cpu)
    assert warmed == []
    tattn._build_merge_binaries((), (9, 8, 2), merge, 128, cuda)
    assert warmed == [((9, 8, 1), 1), ((9, 8, 4), 4), ((9, 8, 8), 8)]
    tattn._build_merge_binaries((), (9, 8, 8), dict(merge, MERGE_DSPLIT=8), 128, cuda)
    tattn._build_merge_binaries((), (9, 8, 1), dict(merge, MERGE_DSPLIT=1), 64, cuda)
    assert len(warmed) == 3  # the same constexprs: built already
    tattn._build_merge_binaries((), (9, 8, 1), dict(merge, MERGE_DSPLIT=1, PAGE=32), 64, cuda)
    assert warmed[3:] == [((9, 8, 2), 2), ((9, 8, 4), 4)]  # another page size; 64 columns: at most 4 slices
    monkeypatch.setattr(tattn, "MERGE_DSPLIT", 2)  # a forced count is the only one launched
    assert tattn._merge_slice_counts(128) == (2,) and tattn._merge_slice_counts(16) == (1,)


def test_attention_launches_fit_shared_memory_by_head_dim():
    """The tile and merge rules that keep every launch inside the H200's 227 KB of shared memory (offline compile,
    ``benchmarks/offline_compile_attention.py``): 128-row tiles only up to head dim 128; the merge loop's stages
    capped at 2 beyond a 64-row x 128-wide tile; a forced tile that cannot fit, or a head dim over 256, refused by
    name in one line before any launch."""
    pytest.importorskip("triton")
    from megatron_consistent.kernels.triton import attention as tattn
    from megatron_consistent.kernels.triton import paged_attention as tpa

    assert [tattn._block_m_for(r, 128) for r in (4, 64, 4096)] == [16, 64, 128]
    assert [tattn._block_m_for(r, 256) for r in (4, 64, 4096)] == [16, 64, 64]
    assert tpa.paged_plan(4096, 32, 8, 1, 4096, 4096, torch.device("cpu"), head_dim=256)[0] == 64
    assert tattn._merge_stages(16, 128) == tattn.MERGE_STAGES and tattn._merge_stages(64, 128) == tattn.MERGE_STAGES
    assert tattn._merge_stages(128, 128) <= 2 and tattn._merge_stages(64, 256) <= 2 and tattn._merge_stages(128, 64) == tattn.MERGE_STAGES
    for rows, head_dim, forced, msg in ((4096, 256, 128, "a query tile of 128 rows does not fit"), (4, 300, 0, "head dim up to 256")):
        with pytest.raises(ValueError, match=msg) as err:
            tattn._block_m_for(rows, head_dim, forced)
        assert "\n" not in str(err.value)


def test_experiment_knobs_refuse_bad_specs_in_one_line(tmp_path):
    """The launch-shape override (``MC_ATTN_TILES``) and the rollout benchmark's ``--variant`` parse what they are
    given exactly, and a malformed spec is a one-line error naming it (before any kernel or engine starts)."""
    pytest.importorskip("triton")
    import importlib.util
    import subprocess
    import sys

    from megatron_consistent.kernels.triton import attention as tattn

    assert tattn.tiles_from_spec("16:0:4:4; 64:1:4:2") == {(16, False): (4, 4), (64, True): (4, 2)}
    assert tattn.tiles_from_spec("") == {}
    for bad in ("16:2:4:4", "32:0:4:4", "16:0:4", "16:0:four:4"):
        with pytest.raises(ValueError, match="MC_ATTN_TILES") as err:
            tattn.tiles_from_spec(bad)
        assert "\n" not in str(err.value)
    bad_stages = subprocess.run([sys.executable, "-c", "import megatron_consistent.kernels.triton.attention"],
                                env=dict(os.environ, MC_ATTN_MERGE_STAGES="0"), capture_output=True, text=True)
    assert bad_stages.returncode != 0 and "MC_ATTN_MERGE_STAGES=0: the merge loop needs at least 1 stage" in bad_stages.stderr
    bad_slices = subprocess.run([sys.executable, "-c", "import megatron_consistent.kernels.triton.attention"],
                                env=dict(os.environ, MC_ATTN_MERGE_DSPLIT="3"), capture_output=True, text=True)
    assert bad_slices.returncode != 0 and "MC_ATTN_MERGE_DSPLIT=3: the head-dimension slices" in bad_slices.stderr
    bad_rule = subprocess.run([sys.executable, "-c", "import megatron_consistent.kernels.triton.attention"],
                              env=dict(os.environ, MC_ATTN_SPLIT_PER_SM="-1"), capture_output=True, text=True)
    assert bad_rule.returncode != 0 and "MC_ATTN_SPLIT_PER_SM=-1: programs per SM" in bad_rule.stderr
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_rollout_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_rollout_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    name, env = bench.parse_variant("tile44:MC_ATTN_TILES=16:0:4:4,MC_TREE_PATH=serial")
    assert name == "consistent_tile44"
    assert env == {**bench.ENGINES["consistent"], "MC_ATTN_TILES": "16:0:4:4", "MC_TREE_PATH": "serial"}
    for bad in ("tile44", "tile44:", "tile 44:A=1", "t:=1", "t:A"):
        with pytest.raises(SystemExit, match="--variant"):
            bench.parse_variant(bad)
    # a candidate table's variant: a package copy first on PYTHONPATH (colons in the value) wins over the install
    name, env = bench.parse_variant("table:PYTHONPATH=/tmp/cand:/tmp/vsite")
    assert (name, env["PYTHONPATH"]) == ("consistent_table", "/tmp/cand:/tmp/vsite")
    cand = tmp_path / "cand" / "megatron_consistent"
    cand.mkdir(parents=True)
    (cand / "__init__.py").write_text("")
    probe = "import importlib.util; print(importlib.util.find_spec('megatron_consistent').origin)"
    origin = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=str(tmp_path / "cand")),
                            cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()  # not the repo root
    assert origin == str(cand / "__init__.py")
