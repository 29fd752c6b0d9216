"""Per-op captures inside a vLLM engine, for ``megatron-consistent diagnose``.

Engine side (runs in vLLM's worker process):

* :class:`EngineCapture` is the plugin's op probe (:mod:`megatron_consistent.vllm_plugin.probe`):
  :func:`run_capture_engine` names :func:`engine_capture_from_env` in ``MEGATRON_CONSISTENT_PROBE`` and
  the folder in ``MEGATRON_CONSISTENT_CAPTURE``, and the plugin model installs it in the worker.  Every model forward (a prefill chunk or a decode
  step) becomes one file ``step<NNNNN>.safetensors`` holding each op's output
  rows (names as in :data:`OP_ORDER`), the rows' absolute positions
  (``__positions``) and token ids (``__input_ids``); every ``compute_logits``
  call becomes ``step<NNNNN>.logits<K>.safetensors`` (``logits`` and the
  positions of its rows, found by matching the hidden rows bitwise against
  that step's ``final_norm`` rows).  Forwards without attention metadata
  (vLLM's profile / warm-up runs) are not recorded.  safetensors only, no pickle.
* :class:`ForceTokensProcessor` (a vLLM logits processor, built lazily so
  this module imports without vLLM): a request whose
  ``SamplingParams.extra_args["force_tokens"]`` is a token list samples
  exactly those tokens (all other logits set to -inf *after* the raw
  log-probs were computed), so a given response is replayed through the real
  prefill-chunk / decode-step path.

Driver side: :func:`run_capture_engine` runs ``python -m
megatron_consistent.verify.capture REQUEST.json RESULT.json`` in a fresh
process (JSON in/out), and :func:`load_engine_capture` concatenates the
captured rows per token position.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..vllm_plugin.probe import FAULT_ENV, PROBE_ENV
from .rollout import RolloutRequest, cpu_engine_in_process, engine, run_module, sample

CAPTURE_ENV = "MEGATRON_CONSISTENT_CAPTURE"  # the folder engine_capture_from_env records into
MODULE = "megatron_consistent.verify.capture"  # not __name__: this file also runs as __main__
ATTENTION_OPS = ("input_norm", "qkv", "q_norm", "k_norm", "rope_q", "rope_k", "attention", "o_proj", "residual_attn",
                 "post_norm")
DENSE_MLP_OPS = ("gate_up", "act", "down")  # SwiGLU: gate|up projection, silu(gate) * up, down projection
MOE_MLP_OPS = ("router_logits", "routes", "moe_out")  # float32 router logits, routed experts [T, k], the block's output
# a hybrid layer: its norm, inside a Mamba mixer in_proj (z|xBC|dt), float32 dt, the SSD output (conv + scan + D) and
# the gated norm, then the mixer's output (any kind) and the residual sum
MAMBA_MIXER_OPS = ("in_proj", "dt", "ssd", "gated_norm")


def layer_ops(arch, i: int) -> tuple[str, ...]:
    """The op names of layer ``i`` in execution order (q/k norms where ``arch`` has them, its MLP dense or MoE; a
    hybrid model's layers by their norm, mixer and residual)."""
    if arch.is_hybrid:
        return ("norm", *(MAMBA_MIXER_OPS if arch.layer_types[i] == "mamba" else ()), "mixer", "residual")
    attention = ATTENTION_OPS if arch.qk_norm else tuple(op for op in ATTENTION_OPS if op not in ("q_norm", "k_norm"))
    return (*attention, *(MOE_MLP_OPS if arch.layer_is_moe(i) else DENSE_MLP_OPS), "residual_mlp")


def op_order(arch) -> list[str]:
    """Every op name in execution order: embed, layer{i}.<op> for :func:`layer_ops`, final_norm, logits, logprobs."""
    return ["embed", *(f"layer{i}.{op}" for i in range(arch.num_layers) for op in layer_ops(arch, i)), "final_norm",
            "logits", "logprobs"]


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


class EngineCapture:
    """Recorder called by the plugin model: ``begin(ids, pos)``, ``cap(name, tensor)`` per op, ``end()``, ``logits(h, l)``."""

    def __init__(self, folder: str | os.PathLike):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.step = -1
        self.cur: dict | None = None
        self.last: dict | None = None
        self.n = 0
        self.k = 0

    @staticmethod
    def _num_actual_tokens(default: int) -> int | None:
        try:
            from vllm.forward_context import get_forward_context

            meta = get_forward_context().attn_metadata
        except Exception:  # no forward context: not inside the engine
            return default
        if not meta:
            return None  # profile / dummy run
        first = next(iter(meta.values())) if isinstance(meta, dict) else meta
        if isinstance(first, list):
            first = first[0]
        return int(getattr(first, "num_actual_tokens", default))

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        n = self._num_actual_tokens(positions.shape[0])
        if n is None:
            self.cur = None
            return
        self.n = n
        self.cur = {"__positions": positions[:n].to(torch.int64).clone(), "__input_ids": input_ids[:n].to(torch.int64).clone()}

    def __call__(self, name: str, t: torch.Tensor) -> None:
        if self.cur is not None:
            self.cur[name] = t[: self.n].detach().clone().contiguous()

    def end(self) -> None:
        if self.cur is None:
            return
        self.step += 1
        self.k = 0
        save_file(self.cur, str(self.dir / f"step{self.step:05d}.safetensors"))
        self.last, self.cur = self.cur, None

    def logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        if self.last is None or hidden.shape[0] == 0:
            return
        fn = _row_bytes(self.last["final_norm"])
        rows = _row_bytes(hidden.detach())
        pos = []
        for r in rows:
            hit = torch.nonzero((fn == r).all(-1)).flatten()
            pos.append(int(self.last["__positions"][hit[-1]]) if hit.numel() else -1)
        save_file({"logits": logits.detach().clone().contiguous(), "__positions": torch.tensor(pos, dtype=torch.int64)},
                  str(self.dir / f"step{self.step:05d}.logits{self.k}.safetensors"))
        self.k += 1


def load_engine_capture(folder: str | os.PathLike) -> tuple[dict[str, dict[int, torch.Tensor]], list[str]]:
    """``{op: {position: row}}`` from a capture folder (steps in order; first occurrence kept) and notes on conflicts."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    notes = []
    for f in sorted(Path(folder).glob("step*.safetensors")):
        data = load_file(str(f))
        pos = data.pop("__positions").tolist()
        ids = data.pop("__input_ids", None)
        if ids is not None:
            data["__input_ids"] = ids
        for name, t in data.items():
            rows = out.setdefault(name, {})
            for j, p in enumerate(pos):
                if p < 0:
                    continue
                if p in rows:
                    if not torch.equal(_row_bytes(rows[p][None]), _row_bytes(t[j : j + 1])):
                        notes.append(f"{name}: position {p} captured twice with different bits ({f.name})")
                    continue
                rows[p] = t[j]
    return out, notes


def stack_rows(rows: dict[int, torch.Tensor], positions: list[int]) -> torch.Tensor:
    """Rows at ``positions`` (all must be present), stacked tokens-first."""
    return torch.stack([rows[p] for p in positions])


# ------------------------------------------------------------------------------------------------ force tokens
_FORCE_CLS = None


def _force_tokens_class():
    global _FORCE_CLS
    if _FORCE_CLS is not None:
        return _FORCE_CLS
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class ForceTokensProcessor(LogitsProcessor):
        """Samples ``extra_args["force_tokens"]`` in order (other logits -> -inf); raw log-probs are untouched."""

        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows: dict[int, tuple[list[int], list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def new_state(params, prompt_ids, output_ids):
                forced = (params.extra_args or {}).get("force_tokens")
                return None if forced is None else (list(forced), output_ids)

            process_dict_updates(self.rows, batch_update, new_state)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for idx, (forced, out) in self.rows.items():
                n = len(out)
                if n < len(forced):
                    logits[idx] = float("-inf")
                    logits[idx, forced[n]] = 0.0
            return logits

    ForceTokensProcessor.__module__ = MODULE
    ForceTokensProcessor.__qualname__ = "ForceTokensProcessor"
    _FORCE_CLS = ForceTokensProcessor
    return _FORCE_CLS


def __getattr__(name: str):
    if name == "ForceTokensProcessor":
        return _force_tokens_class()
    raise AttributeError(name)


FORCE_TOKENS_PROCESSOR = f"{MODULE}:ForceTokensProcessor"


# ------------------------------------------------------------------------------------------------ engine process
@dataclass
class CaptureRequest:
    """One request replayed through a consistent engine with captures on."""

    model_dir: str
    dtype: str
    prompt: list[int]
    response: list[int]
    capture_dir: str
    max_num_batched_tokens: int = 32
    block_size: int = 32
    max_model_len: int = 512
    seed: int = 0
    fault: str = ""  # MEGATRON_CONSISTENT_FAULT for the engine only (testing)
    engine_kwargs: dict = field(default_factory=dict)


def engine_capture_from_env() -> EngineCapture:
    """The probe factory named in the engine's environment: an :class:`EngineCapture` recording into :data:`CAPTURE_ENV`."""
    return EngineCapture(os.environ[CAPTURE_ENV])


def _engine_main(req: CaptureRequest) -> dict:
    from vllm import SamplingParams

    llm = engine(RolloutRequest(model_dir=req.model_dir, prompts=[req.prompt], consistent=True, dtype=req.dtype, seed=req.seed,
                                logprobs_mode="raw", max_num_batched_tokens=req.max_num_batched_tokens, block_size=req.block_size,
                                max_model_len=req.max_model_len, enable_prefix_caching=False, enforce_eager=True,
                                engine_kwargs={"logits_processors": [FORCE_TOKENS_PROCESSOR], **req.engine_kwargs}))
    for f in Path(req.capture_dir).glob("step*.safetensors"):  # anything recorded while the engine started
        f.unlink()
    params = SamplingParams(temperature=0.0, max_tokens=len(req.response), logprobs=0, ignore_eos=True,
                            extra_args={"force_tokens": list(req.response)})
    (tokens,), (logprobs,) = sample(llm, [req.prompt], params)
    return {"tokens": tokens, "logprobs": logprobs}


def run_capture_engine(req: CaptureRequest, work_dir: Path, name: str = "capture") -> dict:
    """Replay ``req.prompt`` + forced ``req.response`` in a consistent engine with captures written to ``req.capture_dir``."""
    Path(req.capture_dir).mkdir(parents=True, exist_ok=True)
    env = {"MEGATRON_CONSISTENT_VLLM": "1", PROBE_ENV: f"{MODULE}:engine_capture_from_env", CAPTURE_ENV: str(Path(req.capture_dir).resolve()),
           FAULT_ENV: req.fault, **cpu_engine_in_process(1)}
    return run_module(MODULE, asdict(req), work_dir, name, env)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    req = CaptureRequest(**json.loads(Path(args[0]).read_text()))
    Path(args[1]).write_text(json.dumps(_engine_main(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
