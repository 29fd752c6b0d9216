"""Mismatch metrics between trainer and rollout log-probs, and a plain-text table.

``d = train_logp - rollout_logp`` over valid response tokens, both float32:

* ``max_abs``, ``mean_abs``, ``std`` of ``d`` (population std);
* ``k3``: mean of ``exp(d) - 1 - d`` — the k3 estimator of KL(rollout || train)
  on tokens sampled by the rollout policy;
* ``token_mult_prob_error`` (NeMo-RL's name): mean of ``exp(|d|)``, 1.0 is perfect;
* ``exact_fraction``: share of tokens whose float32 bits are equal.

Statistics are computed in float64 from the float32 values, so a zero mismatch
reports exactly 0.0.
"""

from __future__ import annotations

import torch


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor) -> dict:
    """Metrics of ``train_logp - rollout_logp`` (1-D float32 tensors of equal length)."""
    if train_logp.shape != rollout_logp.shape:
        raise ValueError(f"shape mismatch: train {tuple(train_logp.shape)} vs rollout {tuple(rollout_logp.shape)}")
    t, r = train_logp.to(torch.float32), rollout_logp.to(torch.float32)
    d = t.double() - r.double()
    n = d.numel()
    if n == 0:
        raise ValueError("no tokens to compare")
    exact = (t.view(torch.int32) == r.view(torch.int32)).double().mean().item()
    return {
        "tokens": n,
        "max_abs": d.abs().max().item(),
        "mean_abs": d.abs().mean().item(),
        "std": d.std(unbiased=False).item(),
        "k3": (torch.expm1(d) - d).mean().item(),
        "token_mult_prob_error": torch.exp(d.abs()).mean().item(),
        "exact_fraction": exact,
    }


def first_divergence(train_logp: torch.Tensor, rollout_logp: torch.Tensor, lengths: list[int], prompt_lengths: list[int]) -> dict:
    """Where each request's log-probs first differ in bits (response token index; the position in the sequence is
    ``prompt length + index``): how many requests differ, and the earliest / median first index — to tell a
    prefill fault (index 0) from a decode fault (later) before any per-op diagnosis."""
    t, r = train_logp.to(torch.float32).view(torch.int32), rollout_logp.to(torch.float32).view(torch.int32)
    firsts, start = [], 0
    for i, n in enumerate(lengths):
        bad = (t[start:start + n] != r[start:start + n]).nonzero()
        if bad.numel():
            firsts.append((int(bad[0, 0]), i, prompt_lengths[i]))
        start += n
    if not firsts:
        return {"requests_differing": 0}
    idx = sorted(f[0] for f in firsts)
    return {"requests_differing": len(firsts), "requests": len(lengths), "first_index_min": idx[0],
            "first_index_median": idx[len(idx) // 2], "first_at_prefill_token": sum(1 for f in firsts if f[0] == 0),
            "examples": [{"request": i, "prompt_len": pl, "first_index": f} for f, i, pl in sorted(firsts)[:8]]}


def is_zero_mismatch(m: dict) -> bool:
    """True when every token's log-prob matched bit for bit."""
    return m["exact_fraction"] == 1.0 and m["max_abs"] == 0.0


def format_table(rows: list[dict], columns: list[str], title: str | None = None) -> str:
    """A fixed-width text table; floats in compact scientific notation."""

    def cell(v):
        if isinstance(v, float):
            return "0" if v == 0 else f"{v:.3e}"
        return str(v)

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [title] if title else []
    out += [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(out)
