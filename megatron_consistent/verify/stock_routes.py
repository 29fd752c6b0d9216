"""Route capture in the STOCK vLLM engine (no plugin) for the routing-replay baseline.

Two sources, one file format (``routes<NNNNNN>.safetensors``: ``positions [T]``, ``request [T]``,
``experts [num_moe_layers, T, k]``, read by :func:`megatron_consistent.verify.routing.load_engine_routes`):

**CUDA: vLLM's own route output.**  The engine is built with ``enable_return_routed_experts=True`` (vLLM 0.26's GPU
runner binds a capturer to every MoE router that writes a fixed device buffer inside the forward, so it works under
CUDA graphs, and the scheduler keeps prompt routes by KV slot, so prefix-cache hits keep theirs);
``CompletionOutput.routed_experts`` is ``[prompt + generated - 1, num_hidden_layers, k]``, position-ordered.
:func:`write_output_routes` writes one file per request from it.

**CPU: a capture hook.**  vLLM 0.32's route output (``enable_return_routed_experts`` /
``AuxOutputConfig``) needs Model Runner V2, which needs Triton; on the CPU platform the engine refuses it ("Model
Runner V2 requires Triton").  So the baseline records the stock engine's routes itself:

* :class:`StockRouteCapture` is passed as vLLM's ``worker_extension_cls``
  (a documented vLLM hook: its methods are mixed into the worker class); the
  rollout process calls ``llm.collective_rpc("mc_capture_routes", ...)`` after
  the engine is built;
* the method sets the ``capture_fn`` of every stock MoE router
  (``MoERunner.router``, on CPU a ``CPURouter``: ``BaseRouter._select_experts``
  calls ``capture_fn(topk_ids)`` with the logical expert ids before any EPLB
  mapping; the same hook vLLM's own ``RoutedExpertsCapturer`` binds) and a
  forward pre-hook on the model that notes the forward's ``positions``;
* rows -> requests come from the runner's batch order, and the files are
  written after each step by the plugin's :class:`~megatron_consistent.vllm_plugin.moe.RouteRecorder`.

Nothing of the plugin's model, attention or sampler is used: the engine runs
stock vLLM kernels.  Note: the stock CPU router's top-k is ``torch.topk(...,
sorted=False)``, so its slot order is unspecified; compare stock routes as
per-token expert sets (``routing_agreement(..., as_sets=True)``).
"""

from __future__ import annotations

from pathlib import Path

EXTENSION = "megatron_consistent.verify.stock_routes.StockRouteCapture"
RPC = "mc_capture_routes"
ROUTE_SOURCES = {"cuda": "stock vLLM's routed-experts output (enable_return_routed_experts)",
                 "cpu": "stock vLLM CPURouter capture_fn (verify/stock_routes.py)"}


def write_output_routes(folder: str, routed: list, moe_layers: tuple[int, ...]) -> None:
    """One routes file per request from vLLM's ``CompletionOutput.routed_experts`` (``routed[i]``: request ``i``'s
    ``[positions, num_hidden_layers, k]`` array, position 0 first): the MoE layers' rows, positions ``0 .. n-1``.
    Refuses a request without routes (an engine built without ``enable_return_routed_experts``) before writing."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    missing = [i for i, r in enumerate(routed) if r is None]
    if missing:
        raise RuntimeError(f"the stock engine returned no routed experts for {len(missing)} of {len(routed)} requests "
                           f"(first: {missing[0]}); build it with enable_return_routed_experts=True")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(routed):
        experts = torch.from_numpy(np.ascontiguousarray(np.asarray(r)[:, list(moe_layers), :].transpose(1, 0, 2)))
        n = experts.shape[1]
        save_file({"positions": torch.arange(n, dtype=torch.int64), "request": torch.full((n,), i, dtype=torch.int64),
                   "experts": experts.to(torch.int64).contiguous()}, str(out / f"routes{i:06d}.safetensors"))


class StockRouteCapture:
    """vLLM worker extension: ``mc_capture_routes(folder)`` -> the MoE layer indices bound."""

    def mc_capture_routes(self, folder: str) -> list[int]:
        import torch
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        from ..vllm_plugin.moe import RouteRecorder, set_recorder

        model = self.model_runner.model
        runners = [(m.layer_id, m) for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
        if not runners:
            raise RuntimeError("no stock MoE router (MoERunner with a BaseRouter) found in the model")
        layers = tuple(sorted(i for i, _ in runners))
        cfg = self.vllm_config
        recorder = RouteRecorder(folder, layers, cfg.model_config.hf_config.num_experts_per_tok,
                                 cfg.scheduler_config.max_num_batched_tokens, torch.device(cfg.device_config.device))
        set_recorder(recorder)
        state = {"positions": None}

        def note_positions(module, args, kwargs):
            state["positions"] = kwargs["positions"] if "positions" in kwargs else args[1]

        model.register_forward_pre_hook(note_positions, with_kwargs=True)
        for idx, runner in runners:
            runner.router.set_capture_fn(lambda ids, idx=idx: recorder.record(idx, state["positions"], ids))
        return list(layers)
