"""The trainer's small optimizer interface (the RL loop of :mod:`megatron_consistent.rl` uses it).

:func:`make_optimizer` is the CPU stand-in for Megatron's CUDA-only
``get_megatron_optimizer``: AdamW over **float32 main (master) copies** of the
model's (bf16/fp16/fp32) parameters, as Megatron's mixed-precision optimizer
does.  ``step()`` takes the gradients of the model parameters to float32,
updates the main copies and writes them back into the model parameters **in
place** (``param.data.copy_``), so the model's parameter storage never moves —
the property the in-place weight sync relies on.  It is what the RL session uses
on every device; Megatron's own optimizer steps the consistent model on the GPU
in ``examples/megatron_optimizer_step_gpu.py``.
"""

from __future__ import annotations

import torch

__all__ = ["MainParamAdamW", "make_optimizer"]


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
    """The optimizer for a Megatron model (stand-in for ``get_megatron_optimizer``): see :class:`MainParamAdamW`."""
    return MainParamAdamW(model.named_parameters(), lr, **kwargs)
