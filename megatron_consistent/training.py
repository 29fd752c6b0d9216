"""A small optimizer interface and GRPO helpers for the RL lifecycle on CPU.

:func:`make_optimizer` is the CPU stand-in for Megatron's CUDA-only
``get_megatron_optimizer``: AdamW over **float32 main (master) copies** of the
model's (bf16/fp16/fp32) parameters, as Megatron's mixed-precision optimizer
does.  ``step()`` takes the gradients of the model parameters to float32,
updates the main copies and writes them back into the model parameters **in
place** (``param.data.copy_``), so the model's parameter storage never moves —
the property the in-place weight sync relies on.

GRPO helpers: :func:`group_advantages` (reward minus the group mean, over the
group std) and :func:`grpo_loss` (the clipped importance-ratio surrogate of
PPO/GRPO, with the *rollout* log-probs as the behaviour policy).  With
bitwise-consistent log-probs and one update per step the ratio is exactly 1
before the update.
"""

from __future__ import annotations

import torch

__all__ = ["MainParamAdamW", "ModTask", "TINY_RL_HF_CONFIG", "make_optimizer", "group_advantages", "grpo_loss"]


class MainParamAdamW:
    """AdamW on float32 main copies of ``params``; results copied back into the params in place.

    Interface (the part of Megatron's ``MegatronOptimizer`` the loop uses):
    ``zero_grad()``, ``step() -> bool``, ``state_dict()`` / ``load_state_dict()``
    (tensors only, names ``main.<i>``, ``exp_avg.<i>``, ``exp_avg_sq.<i>`` plus
    a scalar ``step``), ``param_names``.
    """

    def __init__(self, named_params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("no trainable parameters")
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.main = [p.detach().to(torch.float32).clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.main, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.steps = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.main:
            m.grad = None

    @torch.no_grad()
    def step(self) -> bool:
        """One AdamW step; returns False (and changes nothing) when any gradient is missing or not finite."""
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads) or not all(torch.isfinite(g).all() for g in grads):
            return False
        for m, g in zip(self.main, grads):
            m.grad = g.to(torch.float32)
        self.opt.step()
        for p, m in zip(self.params, self.main):
            p.data.copy_(m)  # in place: the model's parameter storage never moves
        self.steps += 1
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` (safetensors-ready): main params, Adam moments, step count."""
        out: dict[str, torch.Tensor] = {"step": torch.tensor([self.steps], dtype=torch.int64)}
        for i, m in enumerate(self.main):
            out[f"main.{i}"] = m.detach().clone()
            st = self.opt.state.get(m, {})
            if st:
                out[f"exp_avg.{i}"] = st["exp_avg"].clone()
                out[f"exp_avg_sq.{i}"] = st["exp_avg_sq"].clone()
                out[f"adam_step.{i}"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).clone()
        return out

    def check_state_dict(self, sd: dict[str, torch.Tensor], *, allow_nonfinite: bool = False) -> list[str]:
        """Every problem that would prevent :meth:`load_state_dict` (empty list when it fits entirely).

        Keys must be ``step`` or ``main.<i>`` / ``exp_avg.<i>`` / ``exp_avg_sq.<i>`` / ``adam_step.<i>`` with ``i`` a
        parameter index; ``main.<i>`` for every parameter; the three Adam entries of a parameter all present or all
        absent; shapes and dtypes exact; values finite unless ``allow_nonfinite``.
        """
        problems = []
        n = len(self.main)
        step = sd.get("step")
        if step is None:
            problems.append("optimizer state lacks 'step'")
        elif tuple(step.shape) != (1,) or step.dtype != torch.int64 or int(step.item()) < 0:
            problems.append(f"step: expected one int64 >= 0, got {tuple(step.shape)} {step.dtype}")
        by_index: dict[int, set[str]] = {}
        extra = []
        for k in sd:
            if k == "step":
                continue
            kind, _, idx = k.rpartition(".")
            if kind not in ("main", "exp_avg", "exp_avg_sq", "adam_step") or not idx.isdecimal():
                problems.append(f"unknown optimizer state key {k!r} (expected step, main.<i>, exp_avg.<i>, exp_avg_sq.<i>, adam_step.<i>)")
            elif int(idx) >= n:
                extra.append(k)
            else:
                by_index.setdefault(int(idx), set()).add(kind)
        if extra:
            problems.append(f"optimizer state has entries for parameters this model lacks (it has {n}): {sorted(extra)[:6]}")
        adam = {"exp_avg", "exp_avg_sq", "adam_step"}
        for i, m in enumerate(self.main):
            kinds, name = by_index.get(i, set()), self.param_names[i]
            if "main" not in kinds:
                problems.append(f"optimizer state lacks main.{i} ({name})")
            if kinds & adam and not adam <= kinds:
                problems.append(f"partial Adam state for parameter {i} ({name}): has {sorted(kinds & adam)}, lacks {sorted(adam - kinds)}")
            for kind in sorted(kinds):
                t = sd[f"{kind}.{i}"]
                shape = (1,) if kind == "adam_step" else tuple(m.shape)
                if tuple(t.shape) != shape or t.dtype != torch.float32:
                    problems.append(f"{kind}.{i} ({name}): {tuple(t.shape)} {t.dtype}, expected {shape} float32")
                elif not allow_nonfinite and not bool(torch.isfinite(t).all()):
                    problems.append(f"{kind}.{i} ({name}): non-finite values (NaN/Inf)")
        return problems

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor], *, copy_to_model: bool = False, allow_nonfinite: bool = False) -> None:
        """Restore main params and moments (all or nothing: :meth:`check_state_dict` first); ``copy_to_model`` also writes
        main -> params."""
        problems = self.check_state_dict(sd, allow_nonfinite=allow_nonfinite)
        if problems:
            raise ValueError("optimizer state does not fit:\n  " + "\n  ".join(problems))
        self.steps = int(sd["step"].item())
        for i, m in enumerate(self.main):
            m.copy_(sd[f"main.{i}"])
            if f"exp_avg.{i}" in sd:
                self.opt.state[m] = {
                    "step": torch.tensor(float(sd[f"adam_step.{i}"].item())),
                    "exp_avg": sd[f"exp_avg.{i}"].clone(),
                    "exp_avg_sq": sd[f"exp_avg_sq.{i}"].clone(),
                }
            else:
                self.opt.state.pop(m, None)
            if copy_to_model:
                self.params[i].data.copy_(m)


def make_optimizer(model, lr: float, **kwargs) -> MainParamAdamW:
    """The CPU optimizer for a Megatron ``GPTModel`` (stand-in for ``get_megatron_optimizer``): see :class:`MainParamAdamW`."""
    return MainParamAdamW(model.named_parameters(), lr, **kwargs)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: rewards ``[n]`` in consecutive groups of ``group_size``; (r - mean) / (std + eps) per group."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
    r = rewards.double().reshape(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(-1).to(torch.float32)


def grpo_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor, clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO surrogate over response tokens.

    ``logp`` ``[n, t]`` (differentiable trainer log-probs), ``rollout_logp``
    ``[n, t]`` (behaviour policy, from the engine), ``advantages`` ``[n]``.
    Returns ``(loss, stats)``; ``stats['ratio_max_dev']`` is ``max |ratio - 1|``
    (0 exactly when trainer and engine agree bit for bit).
    """
    ratio = torch.exp(logp - rollout_logp)
    a = advantages[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    loss = -surrogate.mean()
    with torch.no_grad():
        stats = {"ratio_max_dev": (ratio - 1).abs().max().item(), "loss": loss.item()}
    return loss, stats


# ---------------------------------------------------------------------------------------------- the tiny RL task
#: A Llama-shaped model small enough to learn the task below in a few CPU steps (vocab 64).
TINY_RL_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
}


class ModTask:
    """Verifiable toy task: answer with tokens congruent to the prompt's last token modulo ``k``.

    Prompts come from a fixed pool of ``pool`` random prompts (ids 3..vocab-1,
    length ``prompt_len``); the reward of a response is the fraction of its
    tokens ``t`` with ``t % k == prompt[-1] % k`` (a uniform policy scores 1/k).
    """

    def __init__(self, vocab_size: int, *, k: int = 4, pool: int = 8, prompt_len: int = 8, seed: int = 0):
        self.k = k
        self.g = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(3, vocab_size, (pool, prompt_len), generator=self.g).tolist()

    def prompts(self, n: int) -> list[list[int]]:
        """``n`` prompts drawn from the pool (seeded stream)."""
        return [self.pool[i] for i in torch.randint(0, len(self.pool), (n,), generator=self.g).tolist()]

    def reward(self, prompt: list[int], response: list[int]) -> float:
        return sum(t % self.k == prompt[-1] % self.k for t in response) / max(len(response), 1)
