"""Session 34's probe of tests/test_gpu_vllm.py::test_moe_and_hybrid_bits_same_eager_and_graphs[tiny-qwen3moe-top1]
as it ran before session 34 (sampled from the engine's global generator; it failed twice with the Gluon default, passed
once with MC_GLUON=0: request 12's first sampled token differed eager vs graphs): the same engines sampled from the global
generator, sampled with a generator per request (the test since), and greedy; each request's first token difference and
the log-prob differences up to it -- numerics (log-probs differ) or the sampler's draw (tokens differ, log-probs equal)."""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_gpu_vllm import _engine_runs  # noqa: E402

CASES = (("global generator", 1.0, False), ("generator per request", 1.0, True), ("greedy", 0.0, False))
wanted = sys.argv[1:] or [label for label, _, _ in CASES]  # e.g. `probe_moe_graphs.py "global generator"`
out = {}
for label, temperature, request_seeds in (case for case in CASES if case[0] in wanted):
    with tempfile.TemporaryDirectory() as tmp:
        runs = _engine_runs(Path(tmp), "tiny-qwen3moe-top1", {"eager": (True, {}), "graphs": (False, {})},
                            enable_prefix_caching=True, temperature=temperature, request_seeds=request_seeds)
    a, b = runs["eager"], runs["graphs"]
    rows = []
    for r, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        first = next((t for t, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        upto = len(ta) if first is None else first + 1
        lp_diff = [t for t in range(upto) if a["logprobs"][r][t] != b["logprobs"][r][t]]
        if first is not None or lp_diff:
            rows.append({"request": r, "first_token_diff": first, "logprob_diffs_upto_it": lp_diff,
                         "eager": [ta[first], a["logprobs"][r][first]] if first is not None else None,
                         "graphs": [tb[first], b["logprobs"][r][first]] if first is not None else None})
    out[label] = rows
    print(f"{label}: {len(rows)} of {len(a['tokens'])} requests differ", flush=True)
    for row in rows:
        print("  ", row, flush=True)
print(json.dumps(out))
