"""Run one vLLM engine (stock or consistent) over token prompts, in its own process.

``python -m megatron_consistent.verify.rollout REQUEST.json RESULT.json``

The request and result are JSON (no pickle).  Each engine runs in a fresh
process so the opt-in variable ``MEGATRON_CONSISTENT_VLLM`` and vLLM's
process-wide state never leak between the consistent and the stock engine.
Log-probs travel as JSON numbers: a float32 widened to float64 prints and
parses back exactly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..vllm_plugin import ENV_VAR
from .processes import ENGINE_TIMEOUT_S, run_group


@dataclass
class RolloutRequest:
    """Everything one engine run needs."""

    model_dir: str
    prompts: list[list[int]]
    consistent: bool
    dtype: str
    temperature: float = 1.0
    max_tokens: int = 64
    seed: int = 0
    request_seeds: bool = False  # prompt i sampled with its own generator (vLLM's per-request seed, seed + i): its tokens
    # then depend on its own logits alone, not on the batch's draw from the engine's global generator
    logprobs_mode: str = "processed"
    max_num_batched_tokens: int = 64
    block_size: int = 32
    max_model_len: int = 512
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool | None = None  # None: eager on CPU and for the models the plugin runs eager on CUDA, else compiled + CUDA graphs
    batch_invariant: bool = False  # stock engine with vLLM's own VLLM_BATCH_INVARIANT=1 mode (CUDA)
    tensor_parallel_size: int = 1  # vLLM TP (multiprocess executor when > 1)
    engine_kwargs: dict = field(default_factory=dict)
    routes_dir: str = ""  # MoE: the consistent engine writes its routes here (vllm_plugin/moe.py)
    stock_routes_dir: str = ""  # MoE, stock engine: capture its routes here (verify/stock_routes.py; no plugin)


def eager(req: RolloutRequest) -> bool:
    """Whether the engine runs eager: always on CPU; on CUDA the plugin's models compile unless it names a reason."""
    import torch

    if req.enforce_eager is not None:
        return req.enforce_eager
    if not torch.cuda.is_available():
        return True
    if not req.consistent:
        return False
    from ..config import ArchConfig, load_hf_config
    from ..vllm_plugin.model import eager_only_reason

    hf = load_hf_config(req.model_dir)
    arch = ArchConfig.from_hf(hf)
    return bool(eager_only_reason(arch, hf))


def engine(req: RolloutRequest):
    """A vLLM ``LLM`` configured from the request: the one place an engine is built (rollouts, gates, captures,
    the RL session; ``engine_kwargs`` adds what a caller needs, e.g. a worker extension).  The caller's process
    environment decides stock or consistent (``MEGATRON_CONSISTENT_VLLM``, inherited by vLLM's workers)."""
    from vllm import LLM

    extra = {}
    if req.tensor_parallel_size > 1:
        extra.update(tensor_parallel_size=req.tensor_parallel_size, distributed_executor_backend="mp")
    if req.stock_routes_dir and stock_routes_from_outputs():  # stock MoE routes: vLLM's own output on CUDA,
        extra["enable_return_routed_experts"] = True  # a capture hook on CPU (verify/stock_routes.py)
    elif req.stock_routes_dir:
        from .stock_routes import EXTENSION

        extra["worker_extension_cls"] = EXTENSION
    llm = LLM(
        model=req.model_dir,
        skip_tokenizer_init=True,
        dtype=req.dtype,
        seed=req.seed,
        gpu_memory_utilization=req.gpu_memory_utilization,
        max_num_batched_tokens=req.max_num_batched_tokens,
        max_model_len=req.max_model_len,
        block_size=req.block_size,
        enable_prefix_caching=req.enable_prefix_caching,
        logprobs_mode="processed_logprobs" if req.logprobs_mode == "processed" else "raw_logprobs",
        enforce_eager=eager(req),
        **extra,
        **req.engine_kwargs,
    )
    if req.stock_routes_dir and not stock_routes_from_outputs():
        from .stock_routes import RPC

        llm.collective_rpc(RPC, args=(req.stock_routes_dir,))
    return llm


def stock_routes_from_outputs() -> bool:
    """Whether a stock engine's MoE routes come from vLLM's ``routed_experts`` output (CUDA) rather than the capture
    hook (CPU, where vLLM refuses that output)."""
    import torch

    return torch.cuda.is_available()


def token_logprobs(logprobs, token_ids) -> list[float | None]:
    """The log-prob of each of ``token_ids`` from vLLM's per-position ``{token id: Logprob}`` dicts (a completion's
    ``logprobs`` or a request's ``prompt_logprobs``; a ``None`` position, the first prompt token, stays ``None``)."""
    return [None if d is None else d[t].logprob for d, t in zip(logprobs, token_ids)]


def completions(llm, prompts: list[list[int]], params) -> list:
    """``llm.generate`` over token prompts (``params``: one ``SamplingParams`` or one per prompt): the first
    completion of each prompt, in prompt order."""
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def tokens_and_logprobs(done: list) -> tuple[list[list[int]], list[list[float]]]:
    """The sampled tokens of each completion and their log-probs."""
    return [list(c.token_ids) for c in done], [token_logprobs(c.logprobs, c.token_ids) for c in done]


def sample(llm, prompts: list[list[int]], params) -> tuple[list[list[int]], list[list[float]]]:
    """The sampled tokens and their log-probs, one list per prompt (see :func:`completions`)."""
    return tokens_and_logprobs(completions(llm, prompts, params))


def generate(llm, req: RolloutRequest) -> dict:
    """Sample every prompt; returns tokens, their log-probs and the generation rate (and, for a stock engine whose
    routes come with its outputs, writes them to ``req.stock_routes_dir`` after the timing)."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens, logprobs=0, ignore_eos=True,
                             seed=req.seed + i if req.request_seeds else None) for i in range(len(req.prompts))]
    t0 = time.perf_counter()
    done = completions(llm, req.prompts, params)
    seconds = time.perf_counter() - t0
    tokens, logprobs = tokens_and_logprobs(done)
    n = sum(len(t) for t in tokens)
    result = {"tokens": tokens, "logprobs": logprobs, "gen_tokens": n, "seconds": seconds, "gen_tokens_per_s": n / seconds}
    if req.stock_routes_dir:
        from ..config import ArchConfig, load_hf_config
        from .stock_routes import ROUTE_SOURCES, write_output_routes

        if stock_routes_from_outputs():
            write_output_routes(req.stock_routes_dir, [c.routed_experts for c in done],
                                ArchConfig.from_hf(load_hf_config(req.model_dir)).moe_layers)
        result["stock_route_source"] = ROUTE_SOURCES["cuda" if stock_routes_from_outputs() else "cpu"]
    return result


def _failure_reason(log_text: str) -> str:
    """The root cause of a failed engine run: the last error message of a worker process, else of the engine core
    process (on one GPU vLLM runs the model inside its engine core: no worker), else the last error line."""
    for procs in (("(Worker", "(VllmWorker"), ("(EngineCore",)):
        logged = [ln.split("] ", 1)[-1] for ln in log_text.splitlines() if " ERROR " in ln and ln.startswith(procs)]
        logged = [m.strip() for m in logged if m.strip() and not m.startswith((" ", "Traceback"))]
        raised = [i for i, m in enumerate(logged) if "Error:" in m or "Exception:" in m]
        if raised:  # the exception message, with the lines it continues on
            return " ".join(logged[raised[-1]:])
    errors = [ln for ln in log_text.splitlines() if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else log_text[-400:]).strip()


def cpu_tp_binding(tp: int) -> dict:
    """vLLM CPU binds each TP worker's threads to its own NUMA node and refuses TP > the number of nodes; on a machine
    with fewer nodes the allowed CPUs are split among the ranks instead (``VLLM_CPU_OMP_THREADS_BIND``, ranks
    separated by ``|``).  Nothing when TP is 1, CUDA is visible, or the variable is already set."""
    import torch

    if tp <= 1 or torch.cuda.is_available() or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    groups = [cpus[r::tp] or [cpus[r % len(cpus)]] for r in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


def cpu_engine_in_process(tp: int) -> dict:
    """A CPU engine of one rank runs its engine core and worker inside the process :func:`run_in_subprocess` starts for
    it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): that process exists for this one engine, so vLLM's two extra processes
    only add start-up (their imports: ~30 s of an engine's ~75 s on 2 cores); the kernels, and so the bits, are the
    same.  Nothing when TP > 1 (a worker per rank), CUDA is visible (vLLM's default: the engine core overlaps
    scheduling with the GPU) or the variable is already set."""
    import torch

    if tp > 1 or torch.cuda.is_available() or "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_module(module: str, request: dict, work_dir: Path, name: str, env: dict,
               timeout_s: float = ENGINE_TIMEOUT_S) -> dict:
    """``python -m module REQUEST.json RESULT.json`` in a fresh process (``HF_HUB_OFFLINE=1`` + ``env`` added to
    this environment; an engine that runs in that one process is forked from the warm launcher, ``launcher.py``);
    the result dict with ``plugin_active`` and ``log``, or ``{"error", "log"}`` with the log's tail.  The process
    leads its own group: past ``timeout_s`` seconds it and the engine processes it spawned are killed (verify/processes.py)."""
    import torch

    work_dir.mkdir(parents=True, exist_ok=True)
    req_path, res_path, log_path = work_dir / f"{name}.request.json", work_dir / f"{name}.result.json", work_dir / f"{name}.log"
    req_path.write_text(json.dumps(request))
    res_path.unlink(missing_ok=True)
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", **env)
    if full_env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and not torch.cuda.is_available():
        from .launcher import run_forked  # a CPU engine entirely in this one process: forked warm

        returncode = run_forked(module, [str(req_path), str(res_path)], full_env, log_path, timeout_s)
    else:
        returncode = run_group([sys.executable, "-m", module, str(req_path), str(res_path)], log_path, timeout_s, full_env)
    text = log_path.read_text(errors="replace")
    if returncode is None:
        return {"error": f"engine run {name!r} gave no result in {timeout_s:.0f} s: killed with the processes it "
                         f"started (log {log_path})", "log": str(log_path)}
    if returncode != 0 or not res_path.exists():
        return {"error": _failure_reason(text), "log": str(log_path)}
    result = json.loads(res_path.read_text())
    result["plugin_active"] = "megatron-consistent plugin active" in text
    result["log"] = str(log_path)
    return result


def run_in_subprocess(req: RolloutRequest, work_dir: Path, name: str, timeout_s: float = ENGINE_TIMEOUT_S) -> dict:
    """Run the request in a fresh process; returns the result or ``{"error": ...}`` with the log's tail (also when it
    runs past ``timeout_s`` seconds: then it is killed with the engine processes it started)."""
    env = {ENV_VAR: "1" if req.consistent else "0"}
    if req.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    if req.routes_dir:  # the recorder changes the compiled graph; vLLM's compile-cache key does not see it
        env.update(MEGATRON_CONSISTENT_ROUTES=req.routes_dir, VLLM_DISABLE_COMPILE_CACHE="1")
    env.update(cpu_tp_binding(req.tensor_parallel_size), **cpu_engine_in_process(req.tensor_parallel_size))
    return run_module(__name__, asdict(req), work_dir, name, env, timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    req = RolloutRequest(**json.loads(Path(args[0]).read_text()))
    llm = engine(req)
    result = generate(llm, req)
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
