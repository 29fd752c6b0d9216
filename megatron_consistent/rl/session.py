"""One RL session: a Megatron trainer and a LIVE vLLM engine kept in sync in place, step after step.

:class:`RLSession` owns

* the trainer: a Megatron ``GPTModel`` (consistent spec in ``consistent``
  mode, Megatron's stock local spec in ``baseline`` mode) on ``device`` and its optimizer:
  on ``"cuda"`` Megatron-Core's own (:class:`megatron_consistent.training.MegatronOptimizer`: DDP +
  ``get_megatron_optimizer``, distributed optimizer, one NCCL rank; checkpoints and restores go through
  ``dist_checkpointing``), on ``"cpu"`` the stand-in :func:`megatron_consistent.training.make_optimizer`;
* the engine: one vLLM ``LLM`` (default multiprocess engine core, built by
  :func:`megatron_consistent.verify.rollout.engine`) started once from an HF export
  of the trainer's weights, with the worker extension of
  :mod:`megatron_consistent.sync.worker`; the consistent plugin is on in ``consistent`` mode and off in
  ``baseline`` mode (stock vLLM);
* a :class:`~megatron_consistent.sync.channel.WeightSyncChannel` pushing the weights after every
  optimizer step (weight version +1 each time); on a GPU the engine shares the trainer's GPU
  (``gpu_memory_utilization`` 0.3) and runs compiled with CUDA graphs where the plugin allows it.

:meth:`RLSession.grpo_step` is one GRPO iteration with one update: sample ->
reward -> trainer log-probs of the sampled tokens (same weight version as the
engine) -> mismatch metrics -> clipped-ratio loss -> optimizer step -> push.
One process runs one mode: the plugin switch is process-wide (environment
variable read when vLLM starts), so a ``both`` run uses one process per mode.

Quantized rollouts (``quantization="fp8"`` block-FP8 W8A8 or ``"nvfp4"`` NVFP4 W4A16, consistent mode): the trainer
keeps its bf16 masters (the optimizer steps them; checkpoints hold them) and runs its quantized forward on them
(``layers.fp8.enable_fp8`` with ``conversion.fp8.method_formats``), the engine starts from the quantized HF export
of the initial (or restored) masters (``layers.fp8.quantize_and_export``, as ``check --quantization``), and
every push sends the quantized values and scales of the current masters
(``conversion.fp8.fp8_hf_state_dict``, bitwise the trainer forward's), copied in place into the engine's value and
scale storage; :meth:`RLSession.weights_match_engine` compares those tensors with the engine's.  Refused by name
before any work: an unknown format, ``baseline`` mode (:data:`BASELINE_QUANTIZATION_REFUSAL`: the stock engine's sync
reloads model-dtype weights only, and stock vLLM CPU cannot serve these exports) and the architectures the formats
cannot quantize (``conversion.fp8.fp8_arch_refusal``: hybrid Mamba, non-gated experts, NVFP4 with an odd K).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..config import ArchConfig
from ..sync.channel import WORKER_EXTENSION, WeightSyncChannel, model_update_tensors
from ..verify.metrics import is_zero_mismatch, mismatch_metrics
from ..verify.rollout import RolloutRequest, engine
from ..verify.rollout import sample as sample_tokens
from ..vllm_plugin import ENV_VAR
from .grpo import group_advantages, grpo_loss

__all__ = ["DEVICES", "MODES", "RLSession", "start_engine", "sample"]

MODES = ("consistent", "baseline")
DEVICES = ("cpu", "cuda")
BASELINE_QUANTIZATION_REFUSAL = ("quantization needs mode 'consistent': the baseline's stock vLLM engine is kept in sync "
                                 "through vLLM's reload of model-dtype weights (no quantized push), and stock vLLM CPU "
                                 "cannot serve the block-FP8 / NVFP4 export (block-FP8 needs AMX, NVFP4 is CUDA-only: "
                                 "docs/fp8.md, Baseline)")


def start_engine(model_dir, arch: ArchConfig, *, consistent: bool, seed: int = 0, max_num_batched_tokens: int = 256,
                 max_model_len: int = 256, block_size: int = 32, enable_prefix_caching: bool = True,
                 enforce_eager: bool | None = None, **kwargs):
    """A live vLLM ``LLM`` on ``model_dir`` with the weight-sync worker extension (call under ``if __name__ == "__main__"``);
    ``enforce_eager`` None: eager on CPU, compiled + CUDA graphs on CUDA where the plugin allows (``verify.rollout.eager``)."""
    want = "1" if consistent else "0"
    if _ENGINES and _ENGINES[0] != want:
        raise RuntimeError(f"this process already started an engine with {ENV_VAR}={_ENGINES[0]}; one mode per process")
    os.environ[ENV_VAR] = want
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _ENGINES.append(want)
    return engine(RolloutRequest(model_dir=str(model_dir), prompts=[], consistent=consistent, dtype=arch.dtype, seed=seed,
                                 logprobs_mode="processed", max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                 max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                                 engine_kwargs={"worker_extension_cls": WORKER_EXTENSION, **kwargs}))


_ENGINES: list[str] = []  # plugin switch of the engines started by this process


def sample(llm, prompts: list[list[int]], max_tokens: int, temperature: float = 1.0) -> tuple[list[list[int]], list[list[float]]]:
    """Sampled tokens and their (processed) log-probs, one list per prompt."""
    from vllm import SamplingParams

    return sample_tokens(llm, prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, ignore_eos=True))


class RLSession:
    """Trainer + live engine + sync channel for one mode (see the module docstring)."""

    def __init__(self, arch: ArchConfig, mode: str, work_dir, *, seed: int = 0, lr: float = 1e-2, init_hf_dir=None,
                 restore_dir=None, restore_source: str = "hf", engine_dir=None, temperature: float = 1.0,
                 engine_kwargs: dict | None = None, device: str = "cpu", quantization: str | None = None):
        """Build the trainer on ``device`` (seeded; or from ``init_hf_dir``; or restored from the checkpoint
        ``restore_dir`` with its optimizer state — on ``"cuda"`` always from its dist checkpoint), export it (or use the
        HF folder ``engine_dir``), start the engine from it, open the channel.  ``quantization`` (``"fp8"`` /
        ``"nvfp4"``): the trainer's quantized forward and a quantized engine (module docstring); an ``engine_dir`` must
        then hold that format's export (``conversion.fp8.export_hf_fp8``)."""
        from ..conversion import export_hf, import_hf
        from ..conversion.fp8 import check_fp8_arch, method_formats
        from ..layers import build_consistent_model, build_stock_gpt_model
        from ..layers.fp8 import enable_fp8, quantize_and_export
        from ..training import MEGATRON_OPTIMIZER_NEEDS_CUDA, MegatronOptimizer, init_single_rank, make_optimizer

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device 'cuda': {MEGATRON_OPTIMIZER_NEEDS_CUDA}")
        if quantization is not None:
            formats = method_formats(quantization)  # ValueError naming the formats
            if mode != "consistent":
                raise ValueError(BASELINE_QUANTIZATION_REFUSAL)
            # UnsupportedConfigError: hybrid, non-gated experts, NVFP4 with an odd K, scale blocks cut by the engine's TP
            check_fp8_arch(arch, formats[0], (engine_kwargs or {}).get("tensor_parallel_size", 1))
        self.arch, self.mode, self.temperature, self.device = arch, mode, temperature, torch.device(device)
        self.quantization = quantization
        self.work_dir = Path(work_dir)
        if device == "cuda":
            init_single_rank()  # before the build, which would otherwise start a gloo group
        build = build_consistent_model if mode == "consistent" else build_stock_gpt_model
        self.model = build(arch, seed=seed)
        if init_hf_dir is not None:
            import_hf(self.model, arch, init_hf_dir)
        if device == "cuda":
            self.optimizer = MegatronOptimizer(self.model.cuda(), lr)
            restore_source = "dist"
        else:
            self.optimizer = make_optimizer(self.model, lr)
        self.manifest = None
        if restore_dir is not None:
            from ..checkpoint import load_checkpoint

            self.manifest = load_checkpoint(restore_dir, self.model, self.optimizer, arch=arch, source=restore_source)
        self.start_step = self.manifest["step"] if self.manifest else 0
        self.version_base = self.manifest["weight_version"] if self.manifest else 0
        self.trainer_pointers = self._trainer_pointers()
        if engine_dir:
            self.engine_dir = Path(engine_dir)
            if quantization is not None:
                enable_fp8(self.model, *formats)
        elif quantization is not None:
            self.engine_dir = quantize_and_export(self.model, arch, self.work_dir / f"engine_start_{mode}_{quantization}",
                                                  quantization)
        else:
            self.engine_dir = export_hf(self.model, arch, self.work_dir / f"engine_start_{mode}")
        t0 = time.perf_counter()
        self.llm = start_engine(self.engine_dir, arch, consistent=mode == "consistent", seed=seed, **(engine_kwargs or {}))
        self.engine_start_seconds = time.perf_counter() - t0
        self.channel = WeightSyncChannel(self.llm)
        self.start_pointers = self.channel.engine_pointers()

    @property
    def weight_version(self) -> int:
        """Global weight version: the restored checkpoint's version + pushes into this engine."""
        return self.version_base + self.channel.version

    def save(self, ckpt_dir, step: int, extra: dict | None = None, dist: bool = True):
        """Checkpoint trainer + optimizer (see :mod:`megatron_consistent.checkpoint`)."""
        from ..checkpoint import save_checkpoint

        return save_checkpoint(ckpt_dir, self.model, self.optimizer, arch=self.arch, step=step,
                               weight_version=self.weight_version, extra=extra, dist=dist)

    # ------------------------------------------------------------------ pieces
    def _trainer_pointers(self) -> dict[str, int]:
        return {n: p.data_ptr() for n, p in self.model.named_parameters()}

    def trainer_logprobs(self, prompts: list[list[int]], responses: list[list[int]], grad: bool = False) -> torch.Tensor:
        """``[n, t]`` float32 trainer log-probs of each response token (train mode, on the trainer's device);
        equal-length responses."""
        from ..layers import compute_stock_token_logprobs, compute_token_logprobs

        fn = compute_token_logprobs if self.mode == "consistent" else compute_stock_token_logprobs
        seqs = [p + r for p, r in zip(prompts, responses)]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=self.device)  # right padding: never seen (causal)
        self.model.train()
        with torch.set_grad_enabled(grad):
            lp = fn(self.model, ids, self.temperature)
        rows = [lp[i, len(p) - 1 : len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))]
        return torch.stack(rows)

    def check_rollout(self, prompts, max_tokens: int) -> dict:
        """Sample once and compare with the trainer (no update): the mismatch metrics at the current version."""
        tokens, lps = sample(self.llm, prompts, max_tokens, self.temperature)
        train = self.trainer_logprobs(prompts, tokens).reshape(-1).cpu()
        roll = torch.tensor([x for r in lps for x in r], dtype=torch.float32)
        m = mismatch_metrics(train, roll)
        return {**m, "zero_mismatch": is_zero_mismatch(m), "bitwise_equal": bool(torch.equal(train, roll)),
                "tokens_sampled": tokens, "rollout_logprobs": lps, "version": self.channel.version}

    def weights_match_engine(self) -> dict:
        """Compare SHA-256 digests of what :meth:`push` sends (the trainer's HF tensors; quantized: the values and
        scales of its FP8 / NVFP4 forward) with every engine rank's part of them (consistent engine only;
        :meth:`WeightSyncChannel.engine_matches`)."""
        return self.channel.engine_matches(model_update_tensors(self.model, self.arch))

    def weights_match_hf(self, hf_dir) -> dict:
        """Compare the trainer's HF tensors bitwise with an HF folder's ``model.safetensors`` (e.g. a checkpoint's ``hf/``,
        written from the trainer when it was saved)."""
        from safetensors.torch import load_file

        from ..conversion import hf_state_dict

        mine, saved = hf_state_dict(self.model, self.arch), load_file(str(Path(hf_dir) / "model.safetensors"))
        differ = sorted(n for n in mine.keys() | saved.keys() if n not in mine or n not in saved or not torch.equal(mine[n], saved[n]))
        return {"equal": not differ, "differ": differ[:16], "tensors": len(mine)}

    def push(self) -> dict:
        """Push the trainer's weights (quantized: the values and scales its forward runs) as the next version; checks
        pointers on both sides."""
        report = self.channel.push_model(self.model, self.arch).as_dict()
        after = self.channel.engine_pointers()
        report["engine_pointers_unchanged"] = after == self.start_pointers
        report["trainer_pointers_unchanged"] = self._trainer_pointers() == self.trainer_pointers
        report["engine_version"] = self.channel.engine_version()
        return report

    # ------------------------------------------------------------------ one GRPO step
    def grpo_step(self, prompts: list[list[int]], group_size: int, max_tokens: int, reward_fn, clip: float = 0.2) -> dict:
        """Sample ``group_size`` answers per prompt, update once, push; returns the step's record.

        ``reward_fn(prompt, response) -> float``.  The mismatch is measured on
        the sampled tokens before the update, trainer and engine at the same
        weight version.
        """
        batch = [p for p in prompts for _ in range(group_size)]
        version = self.channel.version
        t0 = time.perf_counter()
        tokens, lps = sample(self.llm, batch, max_tokens, self.temperature)
        t_sample = time.perf_counter() - t0
        rewards = torch.tensor([reward_fn(p, r) for p, r in zip(batch, tokens)], dtype=torch.float32)
        t1 = time.perf_counter()
        self.optimizer.zero_grad()
        logp = self.trainer_logprobs(batch, tokens, grad=True)
        rollout = torch.tensor(lps, dtype=torch.float32)
        m = mismatch_metrics(logp.detach().reshape(-1).cpu(), rollout.reshape(-1))
        bitwise = bool(torch.equal(logp.detach().cpu(), rollout))
        rollout, advantages = rollout.to(self.device), group_advantages(rewards, group_size).to(self.device)
        loss, stats = grpo_loss(logp, rollout, advantages, clip)
        loss.backward()
        stepped = self.optimizer.step()
        t_train = time.perf_counter() - t1
        sync = self.push()
        return {
            "mode": self.mode, "quantization": self.quantization, "version": self.version_base + version,
            "reward": rewards.mean().item(),
            "max_abs": m["max_abs"], "mean_abs": m["mean_abs"], "std": m["std"], "k3": m["k3"],
            "exact_fraction": m["exact_fraction"], "bitwise_equal": bitwise, "tokens": m["tokens"],
            "ratio_max_dev": stats["ratio_max_dev"], "loss": stats["loss"], "optimizer_stepped": stepped,
            "sync_version": self.version_base + sync["version"], "engine_version": sync["engine_version"], "sync_bytes": sync["bytes"],
            "sync_seconds": sync["seconds"], "sync_rpc_seconds": sync["rpc_seconds"], "sync_gbytes_per_s": sync["gbytes_per_s"],
            "pointers_unchanged": bool(sync["pointers_unchanged"] and sync["engine_pointers_unchanged"]),
            "trainer_pointers_unchanged": sync["trainer_pointers_unchanged"],
            "sample_seconds": t_sample, "train_seconds": t_train,
        }

    def close(self) -> None:
        """Shut the engine down (best effort)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            engine = llm.llm_engine
            if hasattr(engine, "engine_core") and hasattr(engine.engine_core, "shutdown"):
                engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - shutdown is best effort
            pass
