"""Route capture in the STOCK vLLM engine (no plugin) for the routing-replay baseline.

vLLM 0.32's own route output (``enable_return_routed_experts`` /
``AuxOutputConfig``, ``CompletionOutput.routed_experts``) needs Model Runner V2,
which needs Triton; on the CPU platform the engine refuses it ("Model Runner V2
requires Triton").  So the baseline records the stock engine's routes itself:

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
  written after each step by the plugin's :class:`~megatron_consistent.vllm_plugin.moe.RouteRecorder`
  (``routes<NNNNNN>.safetensors``, the same format as the consistent engine's,
  read by :func:`megatron_consistent.verify.routing.load_engine_routes`).

Nothing of the plugin's model, attention or sampler is used: the engine runs
stock vLLM kernels.  Note: the stock CPU router's top-k is ``torch.topk(...,
sorted=False)``, so its slot order is unspecified; compare stock routes as
per-token expert sets (``routing_agreement(..., as_sets=True)``).
"""

from __future__ import annotations

EXTENSION = "megatron_consistent.verify.stock_routes.StockRouteCapture"
RPC = "mc_capture_routes"


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
