"""One CUDA-graph capture for the GPU tests: warm up on a side stream (Triton compiles before the capture), then
capture ``fn(static_input)`` once; a host read inside ``fn`` fails the capture."""

from __future__ import annotations

import torch


def capture(fn, static_input: torch.Tensor):
    """``(graph, static output)``: replay the graph after copying new values into ``static_input``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static_input)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_input)
    return graph, static_out
