"""Engine process for tests/test_parallel_engine.py: ``python tests/_tp_sync_engine.py REQUEST.json PUSHED_DIR RESULT.json
[MISFIT]``.

A consistent engine at the request's ``tensor_parallel_size`` started on the request's weights, then an in-place push
of ``PUSHED_DIR/model.safetensors`` through :class:`WeightSyncChannel` (every rank keeps its part), the weight check
(``engine_matches``: every rank's part against the pushed tensors, and against them with the last element of
``MISFIT`` -- a rank-1 part -- changed), a push that does not fit (HF tensor ``MISFIT``, default layer 0's
``down_proj``, cut to half its columns: refused whole), and a rollout.  Writes tokens, log-probs and the sync outcomes
as JSON.  :func:`synced_engine` runs it (the tests import it).
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

PROMPTS = [[5 + i, 6, 7, 8] + list(range(10 + i, 40 + 3 * i)) for i in range(6)]  # the rollout's prompts


def synced_engine(a: Path, b: Path, work: Path, misfit: str = "") -> dict:
    """A TP=2 engine started on weights A, pushed weights B in place, then a push with ``misfit`` cut in half: this
    script's result (12 tokens for each of :data:`PROMPTS`)."""
    from megatron_consistent.verify.rollout import RolloutRequest, cpu_tp_binding

    req = RolloutRequest(model_dir=str(a), prompts=PROMPTS, consistent=True, dtype="bfloat16", max_tokens=12,
                         max_num_batched_tokens=32, max_model_len=256, tensor_parallel_size=2)
    work.mkdir(parents=True, exist_ok=True)
    (work / "req.json").write_text(json.dumps(asdict(req)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", MEGATRON_CONSISTENT_VLLM="1", **cpu_tp_binding(2))
    subprocess.run([sys.executable, __file__, str(work / "req.json"), str(b), str(work / "res.json"),
                    *([misfit] if misfit else [])], env=env, check=True)
    return json.loads((work / "res.json").read_text())


if __name__ == "__main__":
    import torch
    from safetensors.torch import load_file

    from megatron_consistent.sync import WORKER_EXTENSION, WeightSyncChannel, WeightSyncError
    from megatron_consistent.verify.rollout import RolloutRequest, engine, generate

    req = RolloutRequest(**json.loads(Path(sys.argv[1]).read_text()))
    req.engine_kwargs = {"worker_extension_cls": WORKER_EXTENSION}
    llm = engine(req)
    channel = WeightSyncChannel(llm, watch_parent=False)
    pushed = load_file(str(Path(sys.argv[2]) / "model.safetensors"))
    before = channel.engine_pointers()
    report = channel.push_tensors(pushed)
    name = sys.argv[4] if len(sys.argv) > 4 else "model.layers.0.mlp.down_proj.weight"
    changed = pushed[name].clone()
    changed.view(torch.uint8).view(-1)[-1] ^= 1  # a bit of the last element (column / expert): rank 1's part; any dtype
    matches = channel.engine_matches(pushed), channel.engine_matches({**pushed, name: changed})
    bad = dict(pushed)
    bad[name] = bad[name][:, : bad[name].shape[1] // 2].contiguous()
    try:
        channel.push_tensors(bad)
        refused = ""
    except WeightSyncError as e:
        refused = str(e)
    result = generate(llm, req)
    result.update(pushed_version=report.version, pointers_unchanged=report.pointers_unchanged and before == channel.engine_pointers(),
                  refused=refused, version_after=channel.engine_version(), matches=matches)
    Path(sys.argv[3]).write_text(json.dumps(result))
