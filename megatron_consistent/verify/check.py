"""``megatron-consistent check``: rollout log-probs from a real vLLM engine vs Megatron recompute.

Steps: build the Megatron-Core model with the consistent spec (random, seeded
weights) -> export an HF folder -> sample prompts of varied lengths sharing
prefixes (so prefix caching hits) with a real vLLM engine (consistent plugin,
and/or stock vLLM as the baseline) with chunked prefill forced by a small
``max_num_batched_tokens`` -> recompute every response token's log-prob with
the Megatron model in training mode -> compare.  The baseline pairs stock vLLM
with Megatron's stock local spec on the same weights.

Hybrid Mamba-2 models (``arch.is_hybrid``): the engines run with prefix caching
off (the consistent plugin refuses it for hybrids by name), and the baseline's
stock trainer is HF transformers' PyTorch path (:mod:`.hf_baseline`; Megatron's
stock Mamba mixer needs the unavailable ``mamba_ssm`` package).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from ..config import ArchConfig, builtin_model_dir, load_hf_config
from ..conversion.fp8 import QUANTIZATION_METHODS, method_formats
from .metrics import first_divergence, format_table, is_zero_mismatch, mismatch_metrics
from .processes import ENGINE_TIMEOUT_S
from .rollout import RolloutRequest, eager, run_in_subprocess

MODES = ("consistent", "baseline", "both")
DEVICES = ("auto", "cpu", "cuda")
GPU_BLOCK_SIZES = (16, 32, 64, 128)  # what the consistent CUDA attention serves (vllm_plugin/cuda_attention.py)
BATCH_INVARIANT_ROW = "stock_batch_invariant"  # CUDA: stock vLLM with VLLM_BATCH_INVARIANT=1 vs the stock trainer
METRIC_COLUMNS = ["path", "tokens", "max_abs", "mean_abs", "std", "k3", "token_mult_prob_error", "exact_fraction", "gen_tokens_per_s",
                  "routing_agreement"]  # routing_agreement: MoE configs (verify/routing.py); routing_replay row: MoE baseline


@dataclass
class CheckConfig:
    """Settings of one check run (YAML via OmegaConf; CLI flags override)."""

    hf_config: str = ""  # folder with config.json, or the file; empty: the built-in tiny model
    num_prompts: int = 64
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int = 0
    max_num_batched_tokens: int = 64
    mode: str = "both"
    logprobs_mode: str = "processed"  # processed: at the sampling temperature; raw: temperature 1
    min_prompt_len: int = 4
    max_prompt_len: int = 80
    shared_prefix_len: int = 40
    prefix_groups: int = 8
    block_size: int = 32
    max_model_len: int = 512
    recompute_batch: int = 16
    out_dir: str = "runs/check"
    quantization: str = ""  # "" (model dtype) or "fp8": block-FP8 weights + dynamic 1x128 activations (kernels/fp8.py)
    kv_cache_dtype: str = "auto"  # "auto" (model dtype) or "fp8": E4M3 KV cache, fixed scale 1 (kernels/fp8.py)
    json: str = ""
    device: str = "auto"  # auto: cuda when available (engines and trainer on the GPU), else cpu
    gpu_memory_utilization: float = 0.3
    engine_timeout_s: float = ENGINE_TIMEOUT_S  # an engine run past this is killed with its processes and reported unavailable

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"
    engine_tp: int = 1  # vLLM tensor_parallel_size of the engines (dense, MoE and hybrid models; vllm_plugin/parallel.py)
    trainer_tp: int = 1  # tensor-parallel size of the consistent Megatron recompute (>1: ranks, see trainer_logprobs)
    trainer_pp: int = 1  # pipeline-parallel size of the consistent Megatron recompute (>1: ranks, see trainer_logprobs)
    trainer_dp: int = 1  # data-parallel replicas of the recompute, each with its share of the sequences (>1: ranks)
    trainer_ep: int = 1  # expert-parallel size of the recompute (MoE; divides trainer_tp * trainer_dp; TP > 1: with SP)
    trainer_sp: bool = False  # Megatron's sequence parallelism in the recompute (trainer_tp > 1)
    trainer_cp: int = 1  # context-parallel size of the recompute (GPT models; each sequence's tokens over the CP ranks)
    checkpoint: str = ""  # a user's HF folder (config.json + safetensors [+ tokenizer]): trainer and engines on its weights
    prompts: str = ""  # with checkpoint: JSONL of {"text": ...} / {"token_ids": [...]} (verify/user_prompts.py)
    engine_args: str = ""  # JSON object of extra vLLM engine arguments for every engine, e.g. '{"async_scheduling": false}'

    def engine_arg_dict(self) -> dict:
        """``engine_args`` parsed (one-line ``ValueError`` when it is not a JSON object)."""
        if not self.engine_args:
            return {}
        try:
            value = json.loads(self.engine_args)
        except json.JSONDecodeError as e:
            raise ValueError(f"--engine-args must be a JSON object, e.g. '{{\"async_scheduling\": false}}': {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--engine-args must be a JSON object, got {type(value).__name__}")
        return value

    def validate(self) -> None:
        """Every setting, before any work (one-line ``ValueError`` naming the flag)."""
        from .inputs import integer, positive_float

        for name in ("num_prompts", "max_tokens", "max_num_batched_tokens", "min_prompt_len", "max_prompt_len", "prefix_groups",
                     "block_size", "max_model_len", "recompute_batch"):
            integer("--" + name.replace("_", "-"), getattr(self, name))
        integer("--seed", self.seed, 0)
        integer("--engine-tp", self.engine_tp)
        integer("--trainer-tp", self.trainer_tp)
        integer("--trainer-pp", self.trainer_pp)
        integer("--trainer-dp", self.trainer_dp)
        integer("--trainer-ep", self.trainer_ep)
        integer("--trainer-cp", self.trainer_cp)
        integer("--shared-prefix-len", self.shared_prefix_len, 0)
        positive_float("--temperature", self.temperature)
        positive_float("--engine-timeout-s", self.engine_timeout_s)
        if not 0 < positive_float("--gpu-memory-utilization", self.gpu_memory_utilization) <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.min_prompt_len > self.max_prompt_len:
            raise ValueError(f"min_prompt_len {self.min_prompt_len} > max_prompt_len {self.max_prompt_len}")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"--logprobs-mode must be processed or raw, got {self.logprobs_mode!r}")
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("--num-prompts and --max-tokens must be >= 1")
        if self.max_prompt_len + self.max_tokens > self.max_model_len:
            raise ValueError(f"max_prompt_len + max_tokens ({self.max_prompt_len + self.max_tokens}) exceeds max_model_len {self.max_model_len}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"--kv-cache-dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.quantization not in ("", *QUANTIZATION_METHODS):
            raise ValueError(f"--quantization must be {' or '.join(QUANTIZATION_METHODS)} (or empty), got {self.quantization!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available() and not trainer_parallel(self):
            raise ValueError("--device cuda: no CUDA device is visible")  # trainer ranks: check_layouts names the count
        if self.resolved_device() == "cuda":
            if self.block_size not in GPU_BLOCK_SIZES:
                raise ValueError(f"block_size must be one of {GPU_BLOCK_SIZES} on CUDA, got {self.block_size}")
        elif self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 (vLLM CPU), got {self.block_size}")
        if self.checkpoint and (self.hf_config or self.quantization):
            raise ValueError("--checkpoint takes the model from the folder: not with --hf-config / --quantization")
        if self.prompts and not self.checkpoint:
            raise ValueError("--prompts needs --checkpoint")
        self.engine_arg_dict()


def trainer_parallel(cfg: CheckConfig) -> bool:
    """Whether the consistent recompute runs in ``trainer_tp * trainer_cp * trainer_pp * trainer_dp`` ranks (else in
    this process): gloo on the CPU, NCCL on CUDA (one device per rank)."""
    return trainer_ranks(cfg) > 1


def trainer_ranks(cfg: CheckConfig) -> int:
    """The recompute's processes: TP x CP x PP x DP."""
    return cfg.trainer_tp * cfg.trainer_cp * cfg.trainer_pp * cfg.trainer_dp


def trainer_flags(cfg: CheckConfig) -> str:
    """The trainer layout flags as given, for messages: ``--trainer-tp T`` and the others that are not 1."""
    extra = [(flag, v) for flag, v in (("--trainer-pp", cfg.trainer_pp), ("--trainer-dp", cfg.trainer_dp),
                                       ("--trainer-ep", cfg.trainer_ep), ("--trainer-cp", cfg.trainer_cp)) if v != 1]
    return " ".join([f"--trainer-tp {cfg.trainer_tp}", *(f"{flag} {v}" for flag, v in extra),
                     *(["--trainer-sp"] if cfg.trainer_sp else [])])


def trainer_refusal(cfg: CheckConfig, arch: ArchConfig) -> str:
    """Why the trainer layout ``--trainer-tp`` / ``--trainer-pp`` / ``--trainer-dp`` / ``--trainer-ep`` /
    ``--trainer-cp`` cannot run here ("" when it can)."""
    from ..config import UnsupportedConfigError
    from ..layers.builder import check_tp_shapes
    from ..layers.parallel import HYBRID_FEATURE, check_parallel_sizes, check_rank_devices

    tp, pp, dp, ep, cp = cfg.trainer_tp, cfg.trainer_pp, cfg.trainer_dp, cfg.trainer_ep, cfg.trainer_cp
    try:  # the helper's own refusals (layers/distributed.py recompute_logprobs_parallel)
        check_parallel_sizes(tp, pp, cp, sequence_parallel=cfg.trainer_sp, expert_model_parallel_size=ep,
                             feature=HYBRID_FEATURE if arch.is_hybrid else None)
        check_tp_shapes(arch, tp, pp, ep)
        check_rank_devices(cfg.resolved_device(), trainer_ranks(cfg))
    except UnsupportedConfigError as e:
        return str(e)
    if (tp * dp) % ep:
        return (f"EP={ep} must divide TP x DP = {tp * dp}, the ranks of a pipeline stage (expert-parallel groups are "
                "carved from them)")
    if dp > cfg.num_prompts:
        return f"DP={dp} replicas need at least as many sequences (--num-prompts {cfg.num_prompts})"
    if trainer_ranks(cfg) == 1:
        return ""
    if cfg.quantization:
        from ..conversion.fp8 import fp8_tp_refusal

        reason = fp8_tp_refusal(arch, tp, method_formats(cfg.quantization)[0])
        if reason:
            return f"--quantization {cfg.quantization} with trainer model parallelism: {reason}"
    if cfg.kv_cache_dtype != "auto":
        return (f"--kv-cache-dtype {cfg.kv_cache_dtype} with trainer model parallelism: the trainer's FP8 KV round trip "
                "(layers.fp8.enable_fp8_kv) is not applied in the parallel recompute's ranks")
    return ""


MAMBA_SPLIT = ("mixer heads and groups split: in_proj z|x|B|C|dt and conv1d x|B|C per block, dt_bias / A_log / D per "
               "head, gated-norm weight per group; out_proj row-parallel tree")  # a hybrid's Mamba mixers at TP > 1


def _hf_layout(method: str):
    """The HF layout (``conversion.fp8.HF_QUANT_LAYOUTS``) of ``--quantization`` ``method``'s weight format."""
    from ..conversion.fp8 import hf_layout

    return hf_layout(method_formats(method)[0])


def quantized_split(method: str) -> str:
    """The report's line on a quantized model at TP > 1 (``method`` ``fp8`` or ``nvfp4``; docs/fp8.md, "Tensor
    parallelism")."""
    return (f"{_hf_layout(method).name} at TP > 1: scale blocks whole per rank (MoE: the rank's experts whole, with "
            "their scales); o_proj / down (linear_proj / linear_fc2): the FP8 linear's float32 subtrees of the "
            "row-parallel tree")


def _engine_scales(method: str) -> str:
    """What an engine rank at TP > 1 loads its part of, in the HF names of ``method``'s format (the report's words)."""
    layout = _hf_layout(method)
    return f"every {layout.values} weight and of its " + " and its ".join(f"{dtype} {suffix}" for suffix, dtype in layout.scales)


def cpu_fp8_kv_cache_supported() -> bool:
    """Whether vLLM's CPU engine can hold an FP8 KV cache here: x86 with AVX-512 or AMX (vLLM 0.32's CPU attention
    refuses the cache elsewhere, whichever attention backend computes)."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def check_layouts(cfg: CheckConfig, arch: ArchConfig) -> dict:
    """Refuse, before any work, an engine / trainer tensor-parallel layout this build cannot run, or an FP8 KV cache
    the CPU engine cannot hold (one-line ``ValueError`` naming the flag); returns the layouts the report states."""
    from ..config import UnsupportedConfigError
    from ..layers.context_parallel import sequence_multiple
    from ..layers.parallel import check_rank_devices, rank_backend
    from ..vllm_plugin.parallel import tp_refusal

    if cfg.quantization:  # at any TP: a model the format cannot quantize (e.g. NVFP4 with an odd K)
        from ..conversion.fp8 import fp8_arch_refusal

        reason = fp8_arch_refusal(arch, method_formats(cfg.quantization)[0])
        if reason:
            raise ValueError(f"--quantization {cfg.quantization}: {reason}")
    reason = tp_refusal(arch, cfg.engine_tp, method_formats(cfg.quantization)[0] if cfg.quantization else None)
    if reason:
        raise ValueError(f"--engine-tp {cfg.engine_tp}: {reason}")
    if cfg.engine_tp > 1:  # vLLM's tensor-parallel workers: one GPU each, like the trainer's ranks
        try:
            check_rank_devices(cfg.resolved_device(), cfg.engine_tp)
        except UnsupportedConfigError as e:
            raise ValueError(f"--engine-tp {cfg.engine_tp}: {e}") from None
    reason = trainer_refusal(cfg, arch)
    if reason:
        raise UnsupportedConfigError(f"{trainer_flags(cfg)}: {reason}")
    if cfg.kv_cache_dtype == "fp8" and cfg.resolved_device() == "cpu" and not cpu_fp8_kv_cache_supported():
        raise ValueError("--kv-cache-dtype fp8 on the CPU: vLLM's CPU engine keeps an FP8 KV cache only on x86 with "
                         "AVX-512 or AMX, and this CPU has neither")
    engine = {"tensor_parallel_size": cfg.engine_tp}
    if cfg.engine_tp > 1:
        engine.update(column="q|k|v, gate|up: heads / MLP columns split", row="o_proj, down: K subtrees all-gathered in rank "
                      f"order, adjacent tree of S = {arch.row_parallel_segments} segments",
                      vocab="embedding / lm head vocab-parallel, all-gathered")
        if arch.is_moe:
            engine["moe"] = ("experts sharded over the TP ranks, each rank's (token, slot) outputs all-gathered in rank "
                             "order and summed (one value and zeros: exact), router and shared expert replicated")
        if arch.is_hybrid:
            engine["mamba"] = MAMBA_SPLIT + "; the state cache holds the rank's heads and groups"
        if cfg.quantization:
            engine["fp8"] = (quantized_split(cfg.quantization) + "; each rank loads its part of "
                             + _engine_scales(cfg.quantization))
    trainer = {"tensor_parallel_size": cfg.trainer_tp, "pipeline_model_parallel_size": cfg.trainer_pp}
    if cfg.trainer_sp:
        trainer["sequence_parallel"] = True
    if cfg.trainer_cp != 1:
        trainer.update(context_parallel_size=cfg.trainer_cp, context=(
            f"each sequence (right-padded to a multiple of {sequence_multiple(cfg.trainer_cp, cfg.trainer_tp, cfg.trainer_sp)}) "
            f"in {2 * cfg.trainer_cp} chunks, CP rank r holding chunks r and {2 * cfg.trainer_cp - 1}-r (Megatron's "
            "load-balanced layout); rotary at absolute positions; keys / values all-gathered in position order, each rank "
            "attending its rows over the whole sequence; log-probs gathered in token order"))
    if cfg.trainer_dp != 1:
        trainer.update(data_parallel_size=cfg.trainer_dp, data="each replica recomputes its contiguous share of the "
                       "sequences (layers.distributed.data_parallel_chunks)")
    if trainer_parallel(cfg):
        device = cfg.resolved_device()
        trainer.update(ranks=f"{trainer_ranks(cfg)} {rank_backend(device)} processes"
                       + (" (rank r on cuda:r)" if device == "cuda" else "") + " (layers.recompute_logprobs_parallel) on the "
                       + ("bf16 masters of the quantized checkpoint the engines serve, FP8 forward (layers.fp8.enable_fp8)"
                          if cfg.quantization else "HF folder the engines serve"),
                       applies_to="the consistent row (the stock baseline trainer runs at TP = PP = 1)")
        if cfg.trainer_tp > 1:
            trainer.update(column="linear_qkv, linear_fc1: heads / MLP columns split", row="linear_proj, linear_fc2: fp32 "
                           f"subtrees all-gathered in rank order, top of the tree of S = {arch.row_parallel_segments} "
                           "segments", vocab="embedding / output layer vocab-parallel, vocab-segmented log-softmax")
            if arch.is_hybrid:
                trainer["mamba"] = MAMBA_SPLIT
            if cfg.quantization:
                trainer["fp8"] = (quantized_split(cfg.quantization) + "; each rank quantizes the full HF tensors (bf16 "
                                  "masters all-gathered) and keeps its part")
        if arch.is_moe:
            trainer["moe"] = ("ConsistentMoELayer: experts sharded over the TP ranks, each rank's (token, slot) outputs "
                              "summed (one value and zeros: exact), router and shared expert replicated"
                              if cfg.trainer_tp > 1 else "ConsistentMoELayer, all experts on each stage")
        if cfg.trainer_ep > 1:
            trainer.update(expert_model_parallel_size=cfg.trainer_ep, moe=(
                f"ConsistentMoELayer: experts sharded over EP groups of {cfg.trainer_ep} ranks; each rank routes its "
                "own tokens, sends each (token, slot) pair's row to the rank holding its expert and gets its output back "
                "(layers.moe.pairs_through_expert_ranks: bytes only), then combines in slot order"
                + ("; block-FP8: each EP rank quantizes its whole experts on their own grids (the TP = 1 values and "
                   "scales), the FP8 shared expert whole on every rank" if cfg.quantization else "")))
    return {"engine": engine, "trainer": trainer}


def kernel_switches(device: torch.device) -> dict:
    """The ``MC_*`` variables of this process (the engine processes inherit them, so both sides read the same:
    docs/gpu.md, the switches) and, on CUDA, whether the Gluon kernels take the calls measured ahead on them (a Hopper
    GPU with ``MC_GLUON`` unset or ``1``): what a report's numbers ran on."""
    out = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MC_")}
    if device.type == "cuda":
        from ..kernels.triton._common import GLUON, on_hopper

        out["gluon_kernels"] = bool(GLUON and on_hopper(torch.empty(0, device=device)))
    return out


def trainer_logprobs(cfg: CheckConfig, model, model_dir: Path, prompts, responses, temperature: float, route_sink=None) -> torch.Tensor:
    """The consistent trainer's log-prob of every response token at ``cfg.trainer_tp`` x ``cfg.trainer_pp`` x
    ``cfg.trainer_dp`` (EP ``cfg.trainer_ep``, CP ``cfg.trainer_cp``; 1-D float32,
    response by response, in prompt order — what :func:`recompute` returns).

    TP = PP = 1: :func:`recompute` of ``model`` in this process.  Otherwise one call of
    :func:`~megatron_consistent.layers.recompute_logprobs_parallel` (one spawn of ``tp * cp * pp * dp`` ranks for all the
    sequences, forwarded in row chunks of ``cfg.recompute_batch``; gloo on the CPU, NCCL on ``cfg``'s CUDA device,
    one GPU per rank) that builds the consistent Megatron model from the HF
    folder ``model_dir`` (the weights the engines serve).  Sequences are right-padded to the longest, rounded up to
    what sequence / context parallelism split (causal: never seen).  ``route_sink`` (MoE): called as
    :func:`recompute` calls it, with the ranks' routes."""
    if not trainer_parallel(cfg):
        return recompute(model, prompts, responses, temperature, cfg.recompute_batch, stock=False, route_sink=route_sink)
    from ..layers import recompute_logprobs_parallel
    from ..layers.context_parallel import sequence_multiple

    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    # sequence / context parallelism split the positions over the TP / CP ranks (padding at the end: never seen)
    multiple = sequence_multiple(cfg.trainer_cp, cfg.trainer_tp, cfg.trainer_sp)
    width = -(-width // multiple) * multiple
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.int64)
    if cfg.quantization:  # the ranks quantize the bf16 masters in their forward (layers.fp8.enable_fp8), as this process
        model_dir = Path(cfg.out_dir) / "model_bf16"
    lp, routes = recompute_logprobs_parallel(str(model_dir), str(model_dir), ids, tp=cfg.trainer_tp, pp=cfg.trainer_pp,
                                             dp=cfg.trainer_dp, ep=cfg.trainer_ep, cp=cfg.trainer_cp,
                                             sequence_parallel=cfg.trainer_sp,
                                             temperature=temperature, workdir=Path(cfg.out_dir) / "trainer_ranks",
                                             batch=cfg.recompute_batch, return_routes=True, device=cfg.resolved_device(),
                                             quantization=method_formats(cfg.quantization) if cfg.quantization else None)
    if route_sink is not None:
        for b0, layers in sorted(routes.items()):
            rows = next(iter(layers.values())).shape[0] // width  # routes [s * b_chunk, k]
            route_sink(b0, [len(s) for s in seqs[b0 : b0 + rows]], layers)
    return torch.cat([lp[i, len(p) - 1 : len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))])


def load_check_config(yaml_path: str | None = None, **overrides) -> CheckConfig:
    """Defaults <- YAML file <- keyword overrides (None values ignored)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.structured(CheckConfig)
        if yaml_path:
            from .inputs import input_file

            cfg = OmegaConf.merge(cfg, OmegaConf.load(input_file("--config", yaml_path)))
        cfg = OmegaConf.merge(cfg, {k: v for k, v in overrides.items() if v is not None})
        out = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, TypeError) as e:  # unknown key, wrong type, not YAML: one line
        raise ValueError(f"check settings: {str(e).splitlines()[0]}") from None
    out.validate()
    return out


def make_prompts(cfg: CheckConfig, vocab_size: int) -> list[list[int]]:
    """Seeded prompts of varied length; groups share a prefix so prefix caching hits."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    low = 3  # keep clear of special ids 0..2
    prefixes = [torch.randint(low, vocab_size, (cfg.shared_prefix_len,), generator=g).tolist() for _ in range(cfg.prefix_groups)]
    prompts = []
    for i in range(cfg.num_prompts):
        n = int(torch.randint(cfg.min_prompt_len, cfg.max_prompt_len + 1, (1,), generator=g))
        tail = torch.randint(low, vocab_size, (n,), generator=g).tolist()
        prompts.append((prefixes[i % cfg.prefix_groups] + tail)[: cfg.max_prompt_len] if i % 4 else tail)
    return prompts


def recompute(model, prompts, responses, temperature: float, batch: int, stock: bool, route_sink=None, replay=None) -> torch.Tensor:
    """Trainer log-probs of every response token (Megatron model in training mode), concatenated.

    ``replay`` (stock MoE model only): ``replay(first, lengths, width)`` -> the forced routes of the batch
    (:class:`~megatron_consistent.verify.routing.ReplayRoutes`), applied by ``layers.moe.replay_routes``."""
    from contextlib import nullcontext

    from ..layers import compute_stock_token_logprobs, compute_token_logprobs

    fn = compute_stock_token_logprobs if stock else compute_token_logprobs
    device = next(model.parameters()).device
    model.train()
    out = []
    for b0 in tqdm(range(0, len(prompts), batch), desc=f"recompute ({'stock' if stock else 'consistent'})", leave=False):
        seqs = [p + r for p, r in zip(prompts[b0 : b0 + batch], responses[b0 : b0 + batch])]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)  # right padding: causal, never seen
        if replay is not None:
            from ..layers.moe import replay_routes

            ctx = replay_routes(model, replay(b0, [len(s) for s in seqs], width))
        else:
            ctx = nullcontext()
        with ctx:
            lp = fn(model, ids, temperature).detach()
        if route_sink is not None:  # MoE: the routes of this forward (verify/routing.py)
            from ..layers.moe import collect_routes

            route_sink(b0, [len(s) for s in seqs], collect_routes(model))
        for i, (p, r) in enumerate(zip(prompts[b0 : b0 + batch], responses[b0 : b0 + batch])):
            out.append(lp[i, len(p) - 1 : len(p) - 1 + len(r)].cpu())
    return torch.cat(out)


def routing_replay(trainer, arch, prompts, roll, engine_routes, temperature, cfg, rollout_lp) -> dict:
    """Mismatch of the stock rollout vs the stock recompute with the stock engine's routes replayed (MoE baseline)."""
    from .routing import ReplayRoutes, TrainerRoutes, routing_agreement

    replay = ReplayRoutes(engine_routes, [p + r for p, r in zip(prompts, roll["tokens"])], arch.moe_layers)
    sink = TrainerRoutes()
    lp = recompute(trainer, prompts, roll["tokens"], temperature, cfg.recompute_batch, stock=True, route_sink=sink, replay=replay)
    return {**mismatch_metrics(lp, rollout_lp), **routing_agreement(engine_routes, sink, as_sets=True, moe_layers=arch.moe_layers),
            "route_source": roll.get("stock_route_source"),
            "replayed_from_prefix": replay.from_prefix, "unrouted_positions": replay.missing}


def run_check(cfg: CheckConfig, report: dict | None = None, before_engine=None) -> dict:
    """Run the check; returns the JSON-able report (``report``: filled in place as stages finish, so a caller keeps
    what was measured when a later stage raises; ``before_engine()``: called before each engine starts, when the
    rows measured so far are in ``report`` — the CLI writes the JSON then, so a run killed mid-way keeps them)."""
    from ..conversion import export_hf, import_hf
    from ..layers import build_consistent_gpt_model, build_stock_gpt_model

    hf_path = cfg.checkpoint or cfg.hf_config or str(builtin_model_dir())
    arch = ArchConfig.from_hf(load_hf_config(hf_path))  # refuses unsupported configs before any work
    layouts = check_layouts(cfg, arch)  # engine / trainer TP refused by name before any work
    report = {} if report is None else report
    report["stage"] = "prepare"  # until the first engine starts: failures here are bad input (exit 2 in the CLI)
    out = Path(cfg.out_dir)
    model_dir = out / "model"
    device = torch.device(cfg.resolved_device())
    model = build_consistent_gpt_model(arch, seed=cfg.seed)
    prompt_source = "seeded token-id prompts"
    if cfg.checkpoint:  # the user's weights: validated completely (import_hf) and the prompts too, before any engine
        from .user_prompts import checkpoint_prompts

        model_dir = Path(cfg.checkpoint)
        import_hf(model, arch, model_dir)
        prompts, prompt_source = checkpoint_prompts(model_dir, cfg.prompts, arch.vocab_size, cfg.num_prompts, cfg.max_tokens,
                                                    cfg.max_model_len, lambda: make_prompts(cfg, arch.vocab_size))
    elif cfg.quantization:  # trainer: FP8 / NVFP4 forward on the bf16 masters; engines: the quantized export of them
        from ..layers.fp8 import quantize_and_export

        quantize_and_export(model, arch, model_dir, cfg.quantization)
        export_hf(model, arch, out / "model_bf16")  # the stock trainer's weights (bf16 masters); the stock FP8 engine's too
    else:
        export_hf(model, arch, model_dir)
    if cfg.kv_cache_dtype == "fp8":  # the trainer reproduces the engine's FP8 KV round trip
        from ..layers.fp8 import enable_fp8_kv

        enable_fp8_kv(model)
    if not cfg.checkpoint:
        prompts = make_prompts(cfg, arch.vocab_size)
    temperature = cfg.temperature if cfg.logprobs_mode == "processed" else 1.0
    report["settings"] = {**asdict(cfg), "hf_config": hf_path, "arch": arch.as_dict(), "prompt_source": prompt_source,
                          "num_prompts": len(prompts)}
    if arch.is_hybrid:
        report["settings"]["prefix_caching"] = "off: hybrid Mamba model (the consistent plugin refuses enable_prefix_caching for it)"
        report["settings"]["baseline_trainer"] = "HF transformers torch path (Megatron's stock Mamba mixer needs mamba_ssm)"
    report["settings"]["device"] = device.type
    report["settings"]["layouts"] = layouts
    report["settings"]["kernel_switches"] = kernel_switches(device)
    model.to(device)
    modes = ["consistent", "baseline"] if cfg.mode == "both" else [cfg.mode]
    if device.type == "cuda" and cfg.mode in ("both", "baseline"):
        modes.append(BATCH_INVARIANT_ROW)
    report["stage"] = "engines"
    for mode in tqdm(modes, desc="check"):
        if before_engine is not None:
            before_engine()
        req = RolloutRequest(
            model_dir=str(model_dir), prompts=prompts, consistent=mode == "consistent", dtype=arch.dtype,
            temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed, logprobs_mode=cfg.logprobs_mode,
            max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
            enable_prefix_caching=not arch.is_hybrid, gpu_memory_utilization=cfg.gpu_memory_utilization,
            batch_invariant=mode == BATCH_INVARIANT_ROW, tensor_parallel_size=cfg.engine_tp)
        if mode == BATCH_INVARIANT_ROW and (cfg.quantization or cfg.kv_cache_dtype != "auto" or arch.is_hybrid):
            report[mode] = {"unavailable": "the batch-invariant row is run for bf16 dense / MoE models only"}
            continue
        if mode == "baseline" and cfg.quantization == "nvfp4":
            report[mode] = {"unavailable": "stock vLLM has no NVFP4 linear on CPU (its ModelOpt NVFP4 kernels are CUDA-only)"}
            continue
        if mode == "baseline" and cfg.quantization == "fp8":  # stock vLLM CPU's FP8 path: online per-channel (docs/fp8.md)
            from ..layers.fp8 import STOCK_FP8_QUANTIZATION

            req.model_dir = str(out / "model_bf16")
            req.engine_kwargs = {**req.engine_kwargs, "quantization": STOCK_FP8_QUANTIZATION}
        if cfg.kv_cache_dtype != "auto":
            req.engine_kwargs = {**req.engine_kwargs, "kv_cache_dtype": cfg.kv_cache_dtype}
        req.engine_kwargs = {**req.engine_kwargs, **cfg.engine_arg_dict()}
        routes_dir = None
        # MoE routes: the consistent plugin records them in fixed buffers (compiled engines too: vllm_plugin/moe.py); the
        # stock engine gives them through vLLM's routed-experts output on CUDA, a capture hook on CPU (verify/stock_routes.py)
        consistent_capture = mode == "consistent"
        stock_capture = mode == "baseline" and not arch.is_hybrid
        if arch.is_moe and (consistent_capture or stock_capture):
            import shutil

            routes_dir = out / "routes" / mode
            shutil.rmtree(routes_dir, ignore_errors=True)
            if mode == "consistent":
                req.routes_dir = str(routes_dir.resolve())
            else:
                req.stock_routes_dir = str(routes_dir.resolve())
        report["settings"].setdefault("engine_modes", {})[mode] = "eager" if eager(req) else "compiled + CUDA graphs (vLLM default)"
        roll = run_in_subprocess(req, out / "engines", mode, cfg.engine_timeout_s)
        if "error" in roll:
            report[mode] = {"unavailable": roll["error"], "log": roll["log"]}
            continue
        if mode == "consistent" and not roll["plugin_active"]:
            raise RuntimeError(f"the consistent engine did not load the plugin; see {roll['log']}")
        if mode == "consistent":
            trainer = model
        elif arch.is_hybrid:  # stock trainer: HF transformers' torch path on the exported checkpoint (verify/hf_baseline.py)
            from .hf_baseline import hf_recompute, load_hf_model

            train_lp = hf_recompute(load_hf_model(str(model_dir), arch.torch_dtype), prompts, roll["tokens"], temperature,
                                    cfg.recompute_batch)
            rollout_lp = torch.tensor([x for lps in roll["logprobs"] for x in lps], dtype=torch.float32)
            report[mode] = {**mismatch_metrics(train_lp, rollout_lp), "gen_tokens_per_s": roll["gen_tokens_per_s"],
                            "trainer": "HF transformers (torch path)"}
            continue
        else:
            trainer = build_stock_gpt_model(arch, seed=cfg.seed)
            import_hf(trainer, arch, out / "model_bf16" if cfg.quantization else model_dir)
            trainer.to(device)
            if cfg.quantization == "fp8":  # stock kernels + the stock engine's per-channel / per-token FP8 fake quant
                from ..layers.fp8 import enable_stock_fp8_fake_quant

                enable_stock_fp8_fake_quant(trainer)
            if cfg.kv_cache_dtype == "fp8":  # stock core attention on E4M3 round-tripped K/V
                from ..layers.fp8 import enable_stock_fp8_kv

                enable_stock_fp8_kv(trainer)
        sink = None
        if routes_dir is not None:
            from .routing import TrainerRoutes

            sink = TrainerRoutes()
        if mode == "consistent":
            train_lp = trainer_logprobs(cfg, trainer, model_dir, prompts, roll["tokens"], temperature, route_sink=sink)
        else:
            train_lp = recompute(trainer, prompts, roll["tokens"], temperature, cfg.recompute_batch, stock=mode != "consistent",
                                 route_sink=sink)
        rollout_lp = torch.tensor([x for lps in roll["logprobs"] for x in lps], dtype=torch.float32)
        report[mode] = {**mismatch_metrics(train_lp, rollout_lp), "gen_tokens_per_s": roll["gen_tokens_per_s"]}
        if mode == "consistent" and not is_zero_mismatch(report[mode]):
            report[mode]["first_divergence"] = first_divergence(train_lp, rollout_lp, [len(t) for t in roll["tokens"]],
                                                                [len(p) for p in prompts])
        if sink is not None:
            from .routing import load_engine_routes, routing_agreement

            engine_routes = load_engine_routes(routes_dir)
            report[mode].update(routing_agreement(engine_routes, sink, as_sets=mode == "baseline", moe_layers=arch.moe_layers))
            if mode == "baseline":  # routing replay: the stock recompute with the stock engine's routes forced
                report["routing_replay"] = routing_replay(trainer, arch, prompts, roll, engine_routes, temperature, cfg, rollout_lp)
    c, b = report.get("consistent", {}), report.get("baseline", {})
    if "gen_tokens_per_s" in c and "gen_tokens_per_s" in b:
        report["throughput_ratio"] = c["gen_tokens_per_s"] / b["gen_tokens_per_s"]
    bi = report.get(BATCH_INVARIANT_ROW, {})
    if "gen_tokens_per_s" in c and "gen_tokens_per_s" in bi:
        report["batch_invariant_throughput_ratio"] = c["gen_tokens_per_s"] / bi["gen_tokens_per_s"]
    report["zero_mismatch"] = bool(c) and "tokens" in c and is_zero_mismatch(c)
    report.pop("stage", None)
    return report


def render(report: dict) -> str:
    """The readable table of a report."""
    rows, unavailable = [], []
    for mode in ("consistent", "baseline", BATCH_INVARIANT_ROW, "routing_replay"):
        if mode not in report:
            continue
        r = report[mode]
        rows.append({"path": mode, **r} if "tokens" in r else {"path": mode, "tokens": "unavailable"})
        if "tokens" not in r:
            unavailable.append(f"{mode} unavailable: {r['unavailable']}")
    s = report["settings"]
    title = (f"megatron-consistent check  model={s['arch']['architecture']} ({Path(s['hf_config']).name})  prompts={s['num_prompts']} "
             f"max_tokens={s['max_tokens']} temperature={s['temperature']} logprobs={s['logprobs_mode']} "
             f"max_num_batched_tokens={s['max_num_batched_tokens']}  engine TP={s.get('engine_tp', 1)} trainer TP={s.get('trainer_tp', 1)}"
             + "".join(f" {k}={s[key]}" for k, key in (("PP", "trainer_pp"), ("DP", "trainer_dp"), ("EP", "trainer_ep"),
                                                        ("CP", "trainer_cp"))
                       if s.get(key, 1) != 1) + (" SP" if s.get("trainer_sp") else ""))
    text = "\n".join([format_table(rows, METRIC_COLUMNS, title), *unavailable])
    if s.get("kernel_switches"):
        text += "\nkernel switches: " + "  ".join(f"{k}={v}" for k, v in s["kernel_switches"].items())
    if "throughput_ratio" in report:
        text += f"\nthroughput ratio (consistent / stock vLLM, same run): {report['throughput_ratio']:.3f}"
    if "batch_invariant_throughput_ratio" in report:
        text += f"\nthroughput ratio (consistent / stock vLLM with VLLM_BATCH_INVARIANT=1): {report['batch_invariant_throughput_ratio']:.3f}"
    for mode in ("consistent", "baseline", "routing_replay"):
        d = report.get(mode, {}).get("first_route_divergence")
        if d:
            text += (f"\n{mode}: routes first differ at layer {d['layer']} (request {d['request']}, position {d['position']}): "
                     f"engine experts {d['engine']}, trainer {d['trainer']}")
    if "consistent" in report and "tokens" in report["consistent"]:
        text += "\nconsistent: " + ("ZERO MISMATCH (every token bitwise equal)" if report["zero_mismatch"] else "MISMATCH")
        fd = report["consistent"].get("first_divergence")
        if fd and fd.get("requests_differing"):
            text += (f" — {fd['requests_differing']}/{fd['requests']} requests differ; first differing response token: "
                     f"earliest {fd['first_index_min']}, median {fd['first_index_median']}, "
                     f"{fd['first_at_prefill_token']} at the prefill's token (index 0)")
        if not report["zero_mismatch"] and report.get("settings", {}).get("out_dir"):
            text += (f"\nnext: megatron-consistent diagnose --check-dir {report['settings']['out_dir']} "
                     "(the first divergent layer / op of the first mismatching request)")
    return text


def write_report(report: dict, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2))
