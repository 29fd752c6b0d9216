"""The plugin's MoE route recorder (vllm_plugin/moe.py): fixed buffers written by a custom op, one file per step.

* a step's rows land in ``routes<NNNNNN>.safetensors`` with their requests (runner batch order), positions and every
  MoE layer's experts, bit for bit what the forward routed;
* the forward with recording compiles whole (``torch.compile(fullgraph=True)``) into a graph whose only recording
  nodes are ``record_rows`` and that reads nothing back to the host (what CUDA-graph replay needs), and the compiled
  forward writes the same files as the eager one, at any step size;
* a step whose forward did not record (a graph compiled without the recorder) raises instead of writing stale routes.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

LAYERS, TOP_K, MAX_TOKENS, EXPERTS = (1, 3), 2, 16, 8


@pytest.fixture
def recorder(tmp_path):
    from megatron_consistent.vllm_plugin import moe as pmoe

    rec = pmoe.RouteRecorder(str(tmp_path), LAYERS, TOP_K, MAX_TOKENS, torch.device("cpu"))
    pmoe.set_recorder(rec)
    yield rec
    pmoe.set_recorder(None)


def _forward(positions: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two MoE layers' routing (top-k of a linear router), each recorded as the plugin's layers do."""
    from megatron_consistent.vllm_plugin import moe as pmoe

    for layer in LAYERS:
        experts = torch.topk(h @ w[layer], TOP_K, dim=-1).indices
        pmoe.RECORDER.record(layer, positions, experts)
        h = h + torch.tanh(h)
    return h


def _step(fwd, rows, h, w, start=0):
    """One runner step: the runner notes its rows, runs the forward, then the step hook flushes."""
    from megatron_consistent.vllm_plugin import moe as pmoe

    n = sum(c for _, c in rows)
    pmoe._note_batch(rows)
    positions = torch.arange(start, start + h.shape[0])
    fwd(positions, h, w)
    pmoe._flush_recorder()
    expected = []
    for layer in LAYERS:
        expected.append(torch.topk(h[:n] @ w[layer], TOP_K, dim=-1).indices)
        h = h + torch.tanh(h)
    return positions[:n], torch.stack(expected)


@pytest.mark.parametrize("compiled", [False, True])
def test_each_step_writes_its_rows_requests_positions_and_experts(recorder, tmp_path, compiled):
    torch.manual_seed(0)
    w = torch.randn(4, 32, EXPERTS)
    graphs = []

    def keep_graph(gm, example_inputs):  # a backend that runs the traced graph as it is
        graphs.append(gm)
        return gm.forward

    fwd = torch.compile(_forward, fullgraph=True, backend=keep_graph, dynamic=True) if compiled else _forward
    steps = [([("0-a", 5), ("3-b", 2)], 7), ([("0-a", 1), ("3-b", 1), ("7-c", 9)], 16), ([("7-c", 1)], 4)]
    for i, (rows, padded) in enumerate(steps):  # padded: the rows a CUDA graph of that size runs (beyond n: padding)
        positions, experts = _step(fwd, rows, torch.randn(padded, 32), w, start=10 * i)
        got = load_file(str(tmp_path / f"routes{i:06d}.safetensors"))
        req = torch.cat([torch.full((c,), int(r.split("-")[0])) for r, c in rows])
        assert torch.equal(got["request"], req)
        assert torch.equal(got["positions"], positions)
        assert torch.equal(got["experts"], experts)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"routes{i:06d}.safetensors" for i in range(len(steps))]
    if compiled:
        nodes = [(n.op, str(n.target)) for g in graphs for n in g.graph.nodes]
        assert sum("record_rows" in t for _, t in nodes) == len(graphs) * (len(LAYERS) + 1)
        host_reads = [t for op, t in nodes if t in ("item", "tolist", "cpu") or "local_scalar" in t or "sym_constrain" in t]
        assert not host_reads, host_reads


def test_a_step_whose_forward_did_not_record_raises(recorder):
    from megatron_consistent.vllm_plugin import moe as pmoe

    torch.manual_seed(0)
    w = torch.randn(4, 32, EXPERTS)
    _step(_forward, [("0-a", 4)], torch.randn(4, 32), w)
    pmoe._note_batch([("0-a", 1)])  # a step prepared, its forward (a graph without the recorder) wrote nothing
    with pytest.raises(RuntimeError, match="did not record its routes"):
        pmoe._flush_recorder()


def test_forwards_the_runner_did_not_prepare_write_nothing(recorder, tmp_path):
    """Profile / warm-up / capture runs are not runner steps: no rows noted, no file, and the next step is intact."""
    from megatron_consistent.vllm_plugin import moe as pmoe

    torch.manual_seed(0)
    w = torch.randn(4, 32, EXPERTS)
    _forward(torch.arange(MAX_TOKENS), torch.randn(MAX_TOKENS, 32), w)  # a dummy run of the largest size
    pmoe._flush_recorder()
    assert not list(tmp_path.iterdir())
    positions, experts = _step(_forward, [("2-x", 3)], torch.randn(3, 32), w)
    got = load_file(str(tmp_path / "routes000000.safetensors"))
    assert torch.equal(got["experts"], experts) and torch.equal(got["positions"], positions)


def test_vllms_warmup_batch_prepared_by_the_runner_writes_nothing(recorder, tmp_path):
    """vLLM 0.26's GPU runner warms its kernels with a real runner step of requests ``_warmup_<i>_...`` (no request
    index): that step is not recorded (it raised ``ValueError: invalid literal for int()`` on an H100, session 39),
    and the next generate step is."""
    torch.manual_seed(0)
    w = torch.randn(4, 32, EXPERTS)
    _step(_forward, [("_warmup_0_", 4), ("_warmup_1_", 3)], torch.randn(7, 32), w)
    assert not list(tmp_path.iterdir())
    positions, experts = _step(_forward, [("5-y", 2), ("6-z", 1)], torch.randn(3, 32), w)
    got = load_file(str(tmp_path / "routes000000.safetensors"))
    assert torch.equal(got["request"], torch.tensor([5, 5, 6]))
    assert torch.equal(got["experts"], experts) and torch.equal(got["positions"], positions)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph replay needs a CUDA device")
def test_cuda_graph_replay_records_each_steps_routes(tmp_path):
    """The recorder inside a captured CUDA graph: every replay with new inputs writes that step's routes (the
    buffers are fixed addresses; nothing is read back during the forward)."""
    from megatron_consistent.vllm_plugin import moe as pmoe

    dev = torch.device("cuda")
    pmoe.set_recorder(pmoe.RouteRecorder(str(tmp_path), LAYERS, TOP_K, MAX_TOKENS, dev))
    try:
        torch.manual_seed(0)
        w = torch.randn(4, 32, EXPERTS, device=dev)
        positions, h = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev), torch.zeros(MAX_TOKENS, 32, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _forward(positions, h, w)  # warm-up outside the graph (not a runner step: nothing noted)
        torch.cuda.current_stream().wait_stream(side)
        pmoe._flush_recorder()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _forward(positions, h, w)
        for step, n in enumerate((MAX_TOKENS, 5, 1)):
            x = torch.randn(MAX_TOKENS, 32, device=dev)
            h.copy_(x)
            positions.copy_(torch.arange(100 * step, 100 * step + MAX_TOKENS, device=dev))
            pmoe._note_batch([("4-r", n)])
            graph.replay()
            pmoe._flush_recorder()
            got = load_file(str(tmp_path / f"routes{step:06d}.safetensors"))
            expected, y = [], x  # all rows, as the graph computes them (same matmul shape), then the step's n
            for layer in LAYERS:
                expected.append(torch.topk(y @ w[layer], TOP_K, dim=-1).indices[:n].cpu())
                y = y + torch.tanh(y)
            assert torch.equal(got["experts"], torch.stack(expected))
            assert torch.equal(got["positions"], torch.arange(100 * step, 100 * step + n))
    finally:
        pmoe.set_recorder(None)
