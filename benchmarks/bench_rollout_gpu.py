"""Rollout throughput on a CUDA machine: consistent plugin vs stock vLLM vs stock with VLLM_BATCH_INVARIANT=1.

Each engine runs in its own process on the same seeded prompts and random
(``load_format="dummy"``) weights of a Llama shape, with vLLM's default
torch.compile + CUDA-graph mode, and samples ``max_tokens`` new tokens per
prompt with log-probs (``logprobs=0``, processed mode, as an RL rollout asks).
Generation is repeated until at least ``--min-seconds`` of it were timed; the
first (warm-up) pass is not timed, nor a pass that compiled kernels (reported; counted after three
such passes).  Ratios consistent / stock come from one run.
Each engine gets compile caches of its own, and every timed pass reports its seconds, the GPU binaries compiled
during it (``pass_new_binaries``, their kernels' names in ``pass_new_kernels``: a pass that met a launch shape the
warm-up had not) and a digest of its tokens
(``pass_tokens_digest``: the same requests with the same seeds, so a batch-invariant engine repeats them).
With ``--profile``, each engine then runs one more, untimed generation (the first
``--profile-prompts`` prompts x ``--profile-tokens`` tokens) under vLLM's torch
profiler (kernels inside CUDA graphs included) and the report gives its GPU
kernel time by category (GEMM, attention, norm, ...) and the top kernels, so
the gap to stock is attributed to kernels, not guessed.

    python benchmarks/bench_rollout_gpu.py --shapes a b c --out benchmarks/results/rollout_gpu.json
    python benchmarks/bench_rollout_gpu.py --plot benchmarks/results/<run>.json   # the profile chart again (CPU)
    python benchmarks/bench_rollout_gpu.py --shapes b --engines consistent stock \
        --variant tile44:MC_ATTN_TILES=16:0:4:4 --variant serial_trees:MC_TREE_PATH=serial   # bisect knobs

``--interleave ROUNDS`` starts every engine once, side by side on the GPU (each with ``--gpu-memory-utilization`` /
the number of engines, so a smaller KV cache than alone), then times ROUNDS rounds per engine (a round: passes until
``--min-seconds`` were timed, so a short shape's round is not a few seconds of noise), the order reversed every other
round: the run-to-run spread of sequential runs (about 10 % at shape b, session 12) falls on
every engine alike, and the ratios come per round too (their range is printed).

``--variant NAME:ENV=VALUE[,ENV=VALUE]`` adds a consistent engine run with extra environment (scheduling knobs
only: launch shapes, tree schedules), reported as ``consistent_NAME`` with its ratio to stock from the same run.
A candidate GEMM table runs the same way from a copy of the package that carries it, put first on the path
(``--variant table:PYTHONPATH=/tmp/cand:$PYTHONPATH``); each engine's ``package_dir`` says which copy it ran.

Shapes (issue #14): a = 1B Llama (hidden 2048, 16 layers, GQA 32/8, vocab 32000), 512 prompts of 64-1024
tokens x 512; b = 8B Llama (hidden 4096, 32 layers, GQA 32/8, vocab 128256), 256 x 512; c = the long tail,
8 prompts of 16k tokens x 512 on the 1B shape; d = MoE, the layers of Qwen3-30B-A3B (hidden 2048, GQA 32/4, head
dim 128, 128 experts, top-8, expert width 768, vocab 151936), 12 of its 48, 256 x 512 as b; b8 / d8 = b / d with
block-FP8 weights (each engine its own FP8 kernels: stock vLLM's block-FP8 linear and fused MoE, the plugin's).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_trace import kernel_events  # noqa: E402

from megatron_consistent.kernels.triton.compile_log import PREFIX as SPECIALIZED  # noqa: E402
from megatron_consistent.verify.processes import run_group, stop_group  # noqa: E402

SHAPES = {
    "a": {"model": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, vocab_size=32000),
          "prompts": 512, "min_len": 64, "max_len": 1024, "max_tokens": 512},
    "b": {"model": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256),
          "prompts": 256, "min_len": 64, "max_len": 1024, "max_tokens": 512},
    "c": {"model": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, vocab_size=32000),
          "prompts": 8, "min_len": 16384, "max_len": 16384, "max_tokens": 512},
    "d": {"model": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                        num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        intermediate_size=6144, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
          "prompts": 256, "min_len": 64, "max_len": 1024, "max_tokens": 512},
    "h": {"model": dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=4096,
                        num_hidden_layers=52, hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=21504,
                        mlp_hidden_act="relu2", mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                        conv_kernel=4, chunk_size=128, use_conv_bias=True, mamba_proj_bias=False, use_bias=False,
                        layer_norm_epsilon=1e-5, vocab_size=131072),  # Nemotron-H 8B's widths (Mamba-2, attention, MLP)
          "prompts": 256, "min_len": 64, "max_len": 1024, "max_tokens": 512},
}
# b8 / d8: shapes b and d with block-FP8 weights (E4M3, 128 x 128 weight blocks, dynamic 1 x 128 activations): stock
# vLLM runs its own block-FP8 methods from the standard quantization_config, the plugin its FP8 kernels
SHAPES |= {f"{key}8": {**SHAPES[key], "quantization": "fp8"} for key in ("b", "d")}
KERNEL_CATEGORIES = (  # first match wins; names of our Triton kernels and of vLLM's / cuBLAS's CUDA kernels
    ("attention", r"attn|flash|fmha|paged|attention"),
    ("moe", r"moe|grouped_gemm|_combine_kernel|expert|tile_table"),
    ("kv_write", r"reshape_and_cache|write_kv|kv_cache|cache_kernel"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|splitk|segment|_mm_|wgmma"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|act_and_mul|gelu|swiglu"),
    ("sampling_logprobs", r"softmax|logprob|sampl|topk|top_k|argmax|gumbel|exponential|log_"),
    ("elementwise_copy", r"elementwise|copy|fill|cat|index|gather|scatter|reduce|add"),
)
# the consistent engines log each Triton binary specialisation of the package's kernels as they meet it
# (kernels/triton/compile_log.py): what a pass that compiled met (``pass_new_specializations``)
ENGINES = {"consistent": {"MEGATRON_CONSISTENT_VLLM": "1", "MC_LOG_SPECIALIZATIONS": "1"},
           "stock": {"MEGATRON_CONSISTENT_VLLM": "0"},
           "stock_batch_invariant": {"MEGATRON_CONSISTENT_VLLM": "0", "VLLM_BATCH_INVARIANT": "1"}}


def write_model(folder: Path, dims: dict, max_len: int, quantization: str = "", row_parallel_segments: int = 8) -> None:
    """config.json of a random-weight model; ``quantization="fp8"``: the block-FP8 entries an FP8 export writes (the
    standard ``quantization_config`` for stock vLLM, ``megatron_consistent_quantization`` for the plugin);
    ``row_parallel_segments``: the model's S (``consistent_row_parallel_segments``, written unless 8; stock vLLM
    ignores it)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": max(32768, max_len), "tie_word_embeddings": False,
           "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
           "head_dim": dims["hidden_size"] // dims["num_attention_heads"], **dims}
    if quantization == "fp8":
        from megatron_consistent.conversion.fp8 import QUANT_KEY, quantization_entry

        cfg[QUANT_KEY] = quantization_entry()
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic", "fmt": "e4m3"}
        if dims.get("num_experts"):  # the router stays in the model dtype, as in published block-FP8 MoE checkpoints
            from megatron_consistent.architectures import router_hf_modules
            from megatron_consistent.config import ArchConfig

            cfg["quantization_config"]["modules_to_not_convert"] = router_hf_modules(ArchConfig.from_hf(cfg))
    if row_parallel_segments != 8:
        from megatron_consistent.config import ROW_PARALLEL_SEGMENTS_KEY

        cfg[ROW_PARALLEL_SEGMENTS_KEY] = row_parallel_segments
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))


def fewer_layers(model: dict, layers: int) -> dict:
    """``model`` with its first ``layers`` decoder layers (a hybrid: the first ``layers`` of its pattern)."""
    if layers > model["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: the shape has {model['num_hidden_layers']}")
    if "hybrid_override_pattern" in model:
        return model | {"num_hidden_layers": layers, "hybrid_override_pattern": model["hybrid_override_pattern"][:layers]}
    return model | {"num_hidden_layers": layers}


def prompts_for(shape: dict, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(shape["min_len"], shape["max_len"]))]
            for _ in range(shape["prompts"])]


def _engine(request: dict):
    """Inside the engine's process: build the engine and warm it up -> (llm, prompts, params, start-up seconds)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    extra = {}
    if request.get("block_size"):
        extra["block_size"] = request["block_size"]
    if request.get("profile_dir"):
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": request["profile_dir"],
                                    "torch_profiler_with_stack": False}
    llm = LLM(model=request["model_dir"], skip_tokenizer_init=True, dtype="bfloat16", seed=0, load_format="dummy",
              gpu_memory_utilization=request["gpu_memory_utilization"], max_model_len=request["max_model_len"],
              max_num_seqs=request["max_num_seqs"], enable_prefix_caching=False, logprobs_mode="processed_logprobs",
              tensor_parallel_size=request["tensor_parallel_size"], **extra)
    startup = time.perf_counter() - t0
    progress(f"engine started in {startup:.1f} s; warm-up pass ({len(request['prompts'])} prompts)")
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    params = SamplingParams(temperature=1.0, max_tokens=request["max_tokens"], logprobs=0, ignore_eos=True, seed=0)
    # warm-up, not timed: a whole pass, so every launch shape of the timed passes is compiled (Triton compiles on
    # first use; session 13's first interleaved round, after a warm-up on an eighth of the prompts, ran 25-60 % slow);
    # its time is reported (a timed pass much slower than it has met launch shapes the warm-up had not)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    progress(f"warm-up pass done in {time.perf_counter() - t:.1f} s")
    return llm, prompts, params, {"startup_s": startup, "warmup_s": time.perf_counter() - t,
                                  "binaries_after_warmup": len(compiled_binaries())}


def progress(message: str) -> None:
    """A line in the engine's log (its last lines are kept when an engine fails or is killed: how far it got)."""
    print(f"[bench] {message}", flush=True)


def compiled_binaries() -> set[Path]:
    """GPU binaries (``.cubin``) in this engine's compile caches: the parent gives each engine its own
    ``VLLM_CACHE_ROOT`` (vLLM points Triton's cache inside it) and ``TRITON_CACHE_DIR`` below it, so a set that
    grows during a timed pass means kernels were compiled inside it (seconds each); Triton names each binary after its
    kernel (``<hash>/<kernel>.cubin``)."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    return set(Path(root).rglob("*.cubin")) if root else set()


def engine_caches(name: str, work: Path) -> dict:
    """The environment that gives engine ``name`` compile caches of its own (see :func:`compiled_binaries`)."""
    root = work / f"{name}.cache"
    return {"VLLM_CACHE_ROOT": str(root), "TRITON_CACHE_DIR": str(root / "triton")}


MAX_COMPILING_PASSES = 3  # passes that compiled kernels, at most, before the timing counts them anyway


def _timed_passes(llm, prompts, params, min_seconds: float) -> dict:
    """Generations of every prompt, repeated until ``min_seconds`` of steady-state passes were timed -> generated
    ``tokens``, ``seconds``, and per pass its seconds, the binaries compiled during it and a digest of its tokens (the
    passes generate the same requests with the same seeds: a batch-invariant engine repeats its tokens exactly).  A
    pass that compiled kernels (a launch shape the warm-up had not met: seconds of compiles inside it) is reported but
    not counted, unless :data:`MAX_COMPILING_PASSES` of them went by already (the compiles then never end; counted)."""
    out = {"tokens": 0, "seconds": 0.0, "pass_seconds": [], "pass_new_binaries": [], "pass_new_kernels": [],
           "pass_tokens_digest": [], "passes_not_counted": 0}
    while out["seconds"] < min_seconds or out["tokens"] == 0:
        before = compiled_binaries()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        ids = [list(o.outputs[0].token_ids) for o in outs]
        new = compiled_binaries() - before
        compiled = len(new)
        out["pass_seconds"].append(dt)
        out["pass_new_binaries"].append(compiled)
        out["pass_new_kernels"].append(sorted(p.stem for p in new))  # which launch shapes the warm-up missed
        out["pass_tokens_digest"].append(hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16])
        counted = not compiled or out["passes_not_counted"] >= MAX_COMPILING_PASSES
        if counted:
            out["tokens"] += sum(len(x) for x in ids)
            out["seconds"] += dt
        else:
            out["passes_not_counted"] += 1
        progress(f"timed pass {len(out['pass_seconds'])}: {sum(len(x) for x in ids)} tokens in {dt:.1f} s"
                 + ("" if counted else f" ({compiled} kernels compiled: not counted)"))
    return out


def _package_dir() -> str:
    """Where this process's package came from (a variant may put another copy first on PYTHONPATH)."""
    return str(Path(importlib.util.find_spec("megatron_consistent").origin).parent)


def worker(request: dict) -> dict:
    """Inside the engine's process: build the engine, warm up, time generation."""
    llm, prompts, params, setup = _engine(request)
    timed = _timed_passes(llm, prompts, params, request["min_seconds"])
    out = {"gen_tokens": timed["tokens"], "seconds": timed["seconds"], "passes": len(timed["pass_seconds"]),
           "gen_tokens_per_s": timed["tokens"] / timed["seconds"], **setup, "package_dir": _package_dir(),
           "passes_not_counted": timed["passes_not_counted"], **{k: v for k, v in timed.items() if k.startswith("pass_")}}
    if request.get("profile_dir"):
        from vllm import SamplingParams

        short = SamplingParams(temperature=1.0, max_tokens=request["profile_tokens"], logprobs=0, ignore_eos=True, seed=0)
        llm.start_profile()
        t = time.perf_counter()
        llm.generate(prompts[: request["profile_prompts"]], short, use_tqdm=False)
        out["profile_wall_s"] = time.perf_counter() - t
        llm.stop_profile()
        out["profile"] = kernel_profile(Path(request["profile_dir"]))
    return out


def serve(request: dict, events: Path) -> None:
    """Inside the engine's process, for ``--interleave``: build and warm up, then one timed round per ``pass`` line on
    stdin (anything else ends it: passes until ``min_seconds`` were timed, so a round of a short shape is not a few
    seconds of noise); every event is one JSON line appended to ``events`` (the parent polls it)."""
    llm, prompts, params, setup = _engine(request)
    _emit(events, {"ready": True, **setup, "package_dir": _package_dir()})
    for line in sys.stdin:
        if line.strip() != "pass":
            break
        timed = _timed_passes(llm, prompts, params, request["min_seconds"])
        _emit(events, {"tokens": timed["tokens"], "seconds": timed["seconds"], "passes": len(timed["pass_seconds"]),
                       "new_binaries": sum(timed["pass_new_binaries"])})


def _emit(events: Path, event: dict) -> None:
    with open(events, "a") as f:
        f.write(json.dumps(event) + "\n")


def kernel_profile(folder: Path, top: int = 12) -> dict:
    """GPU kernel time (ms) by category and the top kernels, from the chrome traces vLLM's torch profiler wrote."""
    by_name: dict[str, float] = {}
    traces = sorted(folder.rglob("*.json*"))
    for trace in traces:
        for name, _, dur in kernel_events(trace):
            by_name[name] = by_name.get(name, 0.0) + dur / 1000.0
    cats: dict[str, float] = {}
    for name, ms in by_name.items():
        cat = next((c for c, rx in KERNEL_CATEGORIES if re.search(rx, name, re.IGNORECASE)), "other")
        cats[cat] = cats.get(cat, 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"traces": [t.name for t in traces], "kernel_ms_total": sum(by_name.values()),
            "kernel_ms_by_category": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": [[n[:120], ms] for n, ms in ranked]}


def parse_variant(spec: str) -> tuple[str, dict]:
    """``NAME:ENV=VALUE[,ENV=VALUE]`` -> (``consistent_NAME``, the consistent engine's environment plus those)."""
    name, _, assigns = spec.partition(":")
    pairs = [a.partition("=") for a in assigns.split(",") if a]
    if not re.fullmatch(r"\w+", name) or not pairs or any(not k or not sep for k, sep, _ in pairs):
        raise SystemExit(f"--variant {spec!r}: expected NAME:ENV=VALUE[,ENV=VALUE]")
    return f"consistent_{name}", {**ENGINES["consistent"], **{k: v for k, _, v in pairs}}


def specializations_by_pass(log: Path) -> list[list[str]]:
    """The kernel specialisations an engine met in each timed pass (after its warm-up pass; the lines
    ``MC_LOG_SPECIALIZATIONS`` prints, each pass's before its ``timed pass`` progress line), trimmed to the kernel's
    launch and constexprs."""
    passes: list[list[str]] | None = None
    current: list[str] = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("[bench] warm-up pass done"):
            passes, current = [], []
        elif passes is not None and line.startswith("[bench] timed pass"):
            passes.append(current)
            current = []
        elif passes is not None and SPECIALIZED in line:
            current.append(line[line.index(SPECIALIZED) + len(SPECIALIZED):].strip()[:600])
    return passes or []


def failure_lines(log: Path) -> list[str]:
    """A failed engine's last words: the log's error lines (vLLM's engine core prints the root cause well above its
    last lines, session 18) and the bench's own progress lines (how far it got), then its last 15 lines."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [line for line in lines[:-15] if re.search(r"Error|Exception|error:|^\[bench\]", line)]
    return errors[:20] + lines[-15:]


def failed(name: str, error: str, log: Path, open_log=None) -> dict:
    """An engine's failure with its last words, printed at once (the run may be cut before its table); ``open_log``:
    the file the engine still writes ``log`` through, flushed first."""
    if open_log is not None:
        open_log.flush()
    result = {"error": error, "log_tail": failure_lines(log)}
    print(f"  {name} failed: {error}\n" + "\n".join(f"    | {line[:200]}" for line in result["log_tail"]), flush=True)
    return result


def run_engine(name: str, request: dict, work: Path, engine_env: dict, timeout_s: float) -> dict:
    """One engine process (started, timed, stopped); past ``timeout_s`` it is killed with the processes it started."""
    req, res, log = work / f"{name}.req.json", work / f"{name}.res.json", work / f"{name}.log"
    req.write_text(json.dumps(request))
    env = dict(os.environ, **engine_caches(name, work), **engine_env)
    rc = run_group([sys.executable, __file__, "--worker", str(req), str(res)], log, timeout_s, env)
    if rc is None:
        return failed(name, f"no result in {timeout_s:.0f} s (killed)", log)
    if rc != 0 or not res.exists():
        return failed(name, f"exit {rc}", log)
    out = json.loads(res.read_text())
    out["plugin_active"] = "megatron-consistent plugin active" in log.read_text(errors="replace")
    out["pass_new_specializations"] = specializations_by_pass(log)
    return out


def _next_event(events: Path, seen: int, proc: subprocess.Popen, name: str, timeout_s: float) -> dict:
    """Event number ``seen`` (0-based) of an engine process, or RuntimeError when it exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = events.read_text().splitlines() if events.exists() else []
        if len(lines) > seen:
            return json.loads(lines[seen])
        if proc.poll() is not None:
            raise RuntimeError(f"engine {name} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine {name} gave no answer in {timeout_s:.0f} s")
        time.sleep(0.1)


def interleave(engine_envs: dict[str, dict], request: dict, work: Path, rounds: int, timeout_s: float,
               command=None) -> dict[str, dict]:
    """Every engine started once, one after another (each sizes its memory on what the others left), then ``rounds``
    timed rounds per engine, the order reversed every other round (A B C, C B A, ...) so a drift of the
    machine falls on every engine alike (a round: passes until ``min_seconds``).  -> per engine: totals,
    ``round_tokens_per_s`` and ``round_passes`` by round, start-up; an engine
    that exits or hangs past ``timeout_s`` gets ``{"error": ...}`` and is left out of later rounds.
    ``command(req, events)``: the engine process's argv (default: this script's ``--worker REQ EVENTS --serve``)."""
    command = command or (lambda req, events: [sys.executable, __file__, "--worker", str(req), str(events), "--serve"])
    procs, events, results, logs = {}, {}, {}, {}
    try:
        for name, engine_env in engine_envs.items():
            req, events[name] = work / f"{name}.req.json", work / f"{name}.events.jsonl"
            req.write_text(json.dumps(request))
            logs[name] = open(work / f"{name}.log", "w")
            env = dict(os.environ, **engine_caches(name, work), **engine_env)
            procs[name] = subprocess.Popen(command(req, events[name]), env=env, text=True, stdin=subprocess.PIPE,
                                           stdout=logs[name], stderr=subprocess.STDOUT, start_new_session=True)
            try:
                ready = _next_event(events[name], 0, procs[name], name, timeout_s)
                results[name] = {"startup_s": ready["startup_s"], "warmup_s": ready.get("warmup_s"),
                                 "package_dir": ready["package_dir"], "round_tokens": [], "round_seconds": [],
                                 "round_passes": [], "round_new_binaries": []}
            except RuntimeError as e:
                stop_group(procs.pop(name))
                results[name] = failed(name, str(e), work / f"{name}.log", logs[name])
                continue
            print(f"  {name}: {json.dumps(results[name])[:200]}", flush=True)
        names = [n for n in engine_envs if n in procs]
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                if name not in procs:
                    continue
                res = results[name]
                try:
                    procs[name].stdin.write("pass\n")
                    procs[name].stdin.flush()
                    event = _next_event(events[name], 1 + len(res["round_tokens"]), procs[name], name, timeout_s)
                except (RuntimeError, OSError) as e:
                    stop_group(procs.pop(name))
                    results[name] = failed(name, str(e), work / f"{name}.log", logs[name])
                    continue
                res["round_tokens"].append(event["tokens"])
                res["round_seconds"].append(event["seconds"])
                res["round_passes"].append(event.get("passes", 1))
                res["round_new_binaries"].append(event.get("new_binaries", 0))
            print(f"  round {r + 1}/{rounds}: " + "  ".join(
                f"{n} {results[n]['round_tokens'][-1] / results[n]['round_seconds'][-1]:.0f}" for n in names if n in procs),
                flush=True)
    finally:
        for proc in procs.values():
            try:
                proc.stdin.close()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
            stop_group(proc)
        for f in logs.values():
            f.close()
    for name, res in results.items():
        if res.get("round_tokens"):
            res.update(gen_tokens=sum(res["round_tokens"]), seconds=sum(res["round_seconds"]), passes=sum(res["round_passes"]),
                       round_tokens_per_s=[t / s for t, s in zip(res["round_tokens"], res["round_seconds"])])
            res["gen_tokens_per_s"] = res["gen_tokens"] / res["seconds"]
            res["plugin_active"] = "megatron-consistent plugin active" in (work / f"{name}.log").read_text(errors="replace")
        elif "error" not in res:
            res["error"] = "no timed pass"
        if "error" in res and "log_tail" not in res:  # the engine's last words (its log lives in a temporary folder)
            res["log_tail"] = failure_lines(work / f"{name}.log")
    return results


def print_profiles(report: dict, engines: list[str]) -> None:
    """Kernel ms by category per engine, and consistent minus stock: the kernels that cost the most."""
    for key, row in report["shapes"].items():
        profs = {n: row[n]["profile"] for n in engines if "profile" in row.get(n, {})}
        if not profs:
            continue
        cats = sorted({c for p in profs.values() for c in p["kernel_ms_by_category"]})
        print(f"\n[{key}] GPU kernel ms in the profiled generation")
        both = {"consistent", "stock"} <= set(profs)
        print(f"{'category':20}" + "".join(f"{n:>24}" for n in profs) + (f"{'consistent - stock':>20}" if both else ""))
        for c in cats + ["TOTAL"]:
            vals = {n: (p["kernel_ms_total"] if c == "TOTAL" else p["kernel_ms_by_category"].get(c, 0.0)) for n, p in profs.items()}
            diff = f"{vals['consistent'] - vals['stock']:20.1f}" if both else ""
            print(f"{c:20}" + "".join(f"{v:24.1f}" for v in vals.values()) + diff)
        for n, p in profs.items():
            print(f"  top kernels, {n}: " + "; ".join(f"{name[:60]} {ms:.1f}" for name, ms in p["top_kernels_ms"][:6]))


def plot_profiles(report: dict, png: Path) -> Path | None:
    """Bar chart of the profiled GPU kernel ms by category, one panel per shape, one bar per engine."""
    shapes = {k: {n: r["profile"] for n, r in row.items() if isinstance(r, dict) and "profile" in r}
              for k, row in report["shapes"].items()}
    shapes = {k: p for k, p in shapes.items() if p}
    if not shapes:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    for ax, (key, profs) in zip(axes[0], shapes.items()):
        cats = sorted({c for p in profs.values() for c in p["kernel_ms_by_category"]},
                      key=lambda c: -max(p["kernel_ms_by_category"].get(c, 0.0) for p in profs.values()))
        width = 0.8 / len(profs)
        for i, (name, p) in enumerate(profs.items()):
            ys = [j + i * width for j in range(len(cats))]
            ax.barh(ys, [p["kernel_ms_by_category"].get(c, 0.0) for c in cats], height=width,
                    label=f"{name} (total {p['kernel_ms_total']:.0f} ms)")
        ax.set_yticks([j + 0.4 - width / 2 for j in range(len(cats))], cats)
        ax.invert_yaxis()
        ax.set_xlabel("GPU kernel ms in the profiled generation")
        ax.set_title(f"shape ({key})")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["a", "b", "c"], choices=sorted(SHAPES))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--min-seconds", type=float, default=20.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--out", default="benchmarks/results/rollout_gpu.json")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="engine TP (must divide the model's S)")
    ap.add_argument("--row-parallel-segments", type=int, default=8, metavar="S",
                    help="the models' row-parallel K segments (consistent_row_parallel_segments: 1, 2, 4 or 8)")
    ap.add_argument("--profile", action="store_true", help="after timing, profile one short generation per engine")
    ap.add_argument("--profile-prompts", type=int, default=64)
    ap.add_argument("--profile-tokens", type=int, default=128)
    ap.add_argument("--plot", metavar="JSON", help="only draw the profile chart of an earlier run's JSON (PNG beside it)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV cache block size of every engine (default: vLLM's, 16); the consistent kernel serves 16-128")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:ENV=VALUE[,ENV=VALUE]",
                    help="one more consistent engine with extra environment (repeatable)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="start every engine once, side by side (each with --gpu-memory-utilization / engines), then "
                         "ROUNDS rounds each (passes until --min-seconds) in alternating order; ratios also per round")
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per pass instead of the shape's own count (a first, bounded run of a new shape)")
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (0: the shape's own); a hybrid keeps the first LAYERS of its own pattern, so "
                    "its mix of Mamba-2, attention and MLP layers")
    ap.add_argument("--engine-timeout", type=float, default=900.0,
                    help="seconds an engine may take (one run; --interleave: to start or to finish a round); past it "
                    "the engine is killed with the processes it started")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.interleave and args.profile:
        raise SystemExit("--interleave and --profile: profile in a sequential run (engines share the GPU when interleaved)")
    if args.prompts is not None and args.prompts < 1:
        raise SystemExit(f"--prompts {args.prompts}: at least one prompt")
    if args.layers < 0:
        raise SystemExit(f"--layers {args.layers}: must be >= 0")
    if args.interleave < 0:
        raise SystemExit(f"--interleave {args.interleave}: the number of rounds must be >= 1")
    from megatron_consistent.config import row_parallel_refusal

    refusal = row_parallel_refusal(args.row_parallel_segments, args.tensor_parallel_size)
    if refusal:
        raise SystemExit(f"--row-parallel-segments / --tensor-parallel-size: {refusal}")
    engine_envs = {name: ENGINES[name] for name in args.engines} | dict(parse_variant(v) for v in args.variant)
    if args.block_size is not None:
        from megatron_consistent.kernels.triton.paged_attention import PAGE_SIZES

        if args.block_size not in PAGE_SIZES:
            raise SystemExit(f"--block-size {args.block_size}: the consistent attention serves {PAGE_SIZES}")
    if args.plot:
        png = plot_profiles(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        print(f"chart: {png}" if png else f"{args.plot} holds no profile")
        return 0 if png else 1
    if args.worker and args.serve:
        serve(json.loads(Path(args.worker[0]).read_text()), Path(args.worker[1]))
        return 0
    if args.worker:
        result = worker(json.loads(Path(args.worker[0]).read_text()))
        Path(args.worker[1]).write_text(json.dumps(result))
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail on a bad path before any engine starts
    report = {"settings": vars(args), "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.shapes:
            shape = SHAPES[key] | ({"prompts": args.prompts} if args.prompts else {})
            if args.layers:
                shape = shape | {"model": fewer_layers(shape["model"], args.layers)}
            model_dir = Path(tmp) / f"llama-{key}"
            max_len = shape["max_len"] + shape["max_tokens"]
            write_model(model_dir, shape["model"], max_len, shape.get("quantization", ""), args.row_parallel_segments)
            request = {"model_dir": str(model_dir), "prompts": prompts_for(shape, shape["model"]["vocab_size"]),
                       "max_tokens": shape["max_tokens"], "min_seconds": args.min_seconds,
                       "gpu_memory_utilization": args.gpu_memory_utilization / (len(engine_envs) if args.interleave else 1),
                       "max_model_len": max_len,
                       "max_num_seqs": min(512, shape["prompts"]), "profile_tokens": args.profile_tokens,
                       "profile_prompts": args.profile_prompts, "tensor_parallel_size": args.tensor_parallel_size,
                       "block_size": args.block_size}
            row = {"shape": {k: v for k, v in shape.items() if k != "model"} | shape["model"]}
            if args.interleave:
                print(f"[{key}] {len(engine_envs)} engines side by side, {args.interleave} rounds", flush=True)
                row.update(interleave(engine_envs, request, Path(tmp), args.interleave, args.engine_timeout))
            for name, engine_env in ({} if args.interleave else engine_envs).items():
                if args.profile:
                    request["profile_dir"] = str(Path(tmp) / f"profile-{key}-{name}")
                row[name] = run_engine(name, request, Path(tmp), engine_env, args.engine_timeout)
                print(f"[{key}] {name}: {json.dumps(row[name])[:300]}", flush=True)
                report["shapes"][key] = row
                Path(args.out).write_text(json.dumps(report, indent=1))  # kept if a later engine is cut short
            for mine in (n for n in engine_envs if n.startswith("consistent")):
                for other in ("stock", "stock_batch_invariant"):
                    c, o = row.get(mine, {}), row.get(other, {})
                    if "gen_tokens_per_s" in c and "gen_tokens_per_s" in o:
                        row[f"{mine}_over_{other}"] = c["gen_tokens_per_s"] / o["gen_tokens_per_s"]
                    if c.get("round_tokens_per_s") and o.get("round_tokens_per_s"):
                        row[f"{mine}_over_{other}_by_round"] = [a / b for a, b in zip(c["round_tokens_per_s"],
                                                                                     o["round_tokens_per_s"])]
            report["shapes"][key] = row
            Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{'shape':6} {'engine':22} {'gen tok/s':>11} {'timed s':>8} {'startup s':>9} {'warm-up s':>9}  passes (s)")
    for key, row in report["shapes"].items():
        for name in engine_envs:
            r = row[name]
            if "gen_tokens_per_s" in r:
                warm = f"{r['warmup_s']:9.1f}" if r.get("warmup_s") is not None else f"{'—':>9}"
                new = r.get("pass_new_binaries") or [0] * len(r.get("pass_seconds", []))
                each = " ".join(f"{x:.1f}" + (f" (+{n} binaries)" if n else "") for x, n in zip(r.get("pass_seconds", []), new))
                if r.get("round_new_binaries") and any(r["round_new_binaries"]):
                    each += f"  binaries compiled in rounds: {r['round_new_binaries']}"
                if len(set(r.get("pass_tokens_digest", []))) > 1:
                    each += "  (passes generated different tokens)"
                kernels = sorted({k for ks in r.get("pass_new_kernels", []) for k in ks})
                if kernels:
                    each += f"  compiled in passes: {', '.join(kernels)}"
                print(f"{key:6} {name:22} {r['gen_tokens_per_s']:11.0f} {r['seconds']:8.1f} {r['startup_s']:9.1f} {warm}  {each}")
            else:
                print(f"{key:6} {name:22} {'failed: ' + r['error']}")
                for line in r.get("log_tail", [])[-3:]:
                    print(f"{'':29} | {line[:160]}")
        for mine in (n for n in engine_envs if n.startswith("consistent")):
            for other in ("stock", "stock_batch_invariant"):
                if f"{mine}_over_{other}" in row:
                    rounds = row.get(f"{mine}_over_{other}_by_round")
                    spread = f"  (rounds {min(rounds):.3f}-{max(rounds):.3f})" if rounds else ""
                    print(f"{key:6} {mine} / {other}: {row[f'{mine}_over_{other}']:.3f}{spread}")
        for name, r in row.items():  # what the warm-up pass missed, by timed pass
            for i, met in enumerate(r.get("pass_new_specializations", []) if isinstance(r, dict) else []):
                for line in met:
                    print(f"{key:6} {name} pass {i + 1} specialised {line[:300]}")
    if args.profile:
        print_profiles(report, list(engine_envs))
        png = plot_profiles(report, Path(args.out).with_suffix(".png"))
        if png:
            print(f"chart: {png}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
