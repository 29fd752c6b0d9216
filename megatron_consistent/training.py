"""The trainer's optimizers, behind the small interface the RL loop of :mod:`megatron_consistent.rl` uses.

* :class:`MegatronOptimizer` (GPU): Megatron-Core's own optimizer — the model wrapped in Megatron's
  ``DistributedDataParallel`` (``use_distributed_optimizer=True``, float32 gradient buffers) and
  ``get_megatron_optimizer`` (Adam, bf16 model params, float32 main params sharded by the distributed
  optimizer) over a one-rank NCCL group (:func:`init_single_rank`).  Its state is checkpointed through
  ``dist_checkpointing`` (``optimizer.sharded_state_dict(model_sharded_state_dict)``,
  :mod:`megatron_consistent.checkpoint`).  Every megatron-core API difference this package meets here
  (0.16.1 on CPU, 0.19.x on the GPU) is absorbed by ``layers.builder.filter_kwargs`` and the few
  ``getattr`` s below.
* :class:`MainParamAdamW` (:func:`make_optimizer`, CPU): the stand-in for it.  Megatron's optimizers cannot be
  built without CUDA in either release: ``MixedPrecisionOptimizer.__init__`` allocates its loss-scale tensors
  with ``device='cuda'`` (optimizer.py), the distributed optimizer accepts only parameters whose ``type()`` is
  ``torch.cuda.*Tensor`` (distrib_optimizer.py) and the grad buffers are allocated on
  ``torch.cuda.current_device()`` (param_and_grad_buffer.py).  The stand-in has the same structure: AdamW over
  **float32 main (master) copies** of the model's parameters; ``step()`` writes them back into the model
  parameters **in place** (``param.data.copy_``), so the model's parameter storage never moves — the property
  the in-place weight sync relies on.
"""

from __future__ import annotations

import torch

__all__ = ["MEGATRON_OPTIMIZER_NEEDS_CUDA", "MainParamAdamW", "MegatronOptimizer", "init_single_rank", "make_optimizer"]

MEGATRON_OPTIMIZER_NEEDS_CUDA = ("Megatron-Core's optimizer (get_megatron_optimizer) needs a CUDA device and this machine has none; "
                                 "on CPU the trainer steps with the stand-in MainParamAdamW (--device cpu)")


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


def init_single_rank() -> None:
    """``torch.distributed`` with one rank on NCCL (in-process ``HashStore``: no port, no environment variables that a
    vLLM engine started later would inherit) and Megatron's ``parallel_state``; call before building the model."""
    import torch.distributed as dist

    from .layers.parallel import init_cpu_process_group

    if not torch.cuda.is_available():
        raise RuntimeError(MEGATRON_OPTIMIZER_NEEDS_CUDA)
    if not dist.is_initialized():
        torch.cuda.set_device(torch.cuda.current_device())
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_backend() != "nccl" or dist.get_world_size() != 1:
        raise RuntimeError(f"torch.distributed is already initialized ({dist.get_backend()}, world size {dist.get_world_size()}); "
                           "Megatron's optimizer here needs one NCCL rank: call init_single_rank() before building the model")
    init_cpu_process_group()  # parallel_state (TP = PP = 1) and the model-parallel CUDA RNG tracker


def initial_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a torch Adam / AdamW without state the state Adam creates on its first step (``step``
    0, zero moments), so that the next step computes exactly what it would have from no state.

    Megatron-Core's distributed optimizer (0.16.1 and 0.19.2) reads ``step`` from every parameter's state when it
    builds the sharded state dict to load into (``DistributedOptimizer.state_dict``, torch optimizers without Apex / TE); a freshly
    built optimizer has none and fails ``assert len(steps) == 1``.  The loaded checkpoint then overwrites all of it.
    Other optimizers (Apex / TE fused Adam keep ``step`` in the param groups) are left alone."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        on_param = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            if optimizer.state[p]:
                continue
            state = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_param else "cpu"),
                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


class MegatronOptimizer:
    """Megatron-Core's ``DistributedDataParallel`` + ``get_megatron_optimizer`` (distributed optimizer) on one GPU.

    Interface of :class:`MainParamAdamW` the loop uses: ``zero_grad()``, ``step() -> bool``; checkpoints go through
    :meth:`sharded_state_dict` / :meth:`load_state_dict` (Megatron's ``fully_reshardable`` format; its
    ``fully_sharded_model_space`` is deprecated and fails to save in 0.19.2: "flattened_range is not supported").
    Wrapping moves every parameter into DDP's contiguous buffer, once, here; from then on the optimizer writes the
    updated bf16 values into that buffer in place, so record parameter pointers after construction.  The model is
    still called directly (DDP's gradient hooks sit on the parameters).
    """

    SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}

    def __init__(self, model, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        import torch.distributed as dist
        from megatron.core import optimizer as mopt
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from .layers.builder import filter_kwargs

        param = next(model.parameters())
        if not param.is_cuda:
            raise ValueError("MegatronOptimizer: move the model to the GPU first (model.cuda())")
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            raise RuntimeError("MegatronOptimizer: call init_single_rank() before building the model (one NCCL rank)")
        dtype = param.dtype
        ddp_config = DistributedDataParallelConfig(**filter_kwargs(DistributedDataParallelConfig, {
            "grad_reduce_in_fp32": True, "overlap_grad_reduce": False, "use_distributed_optimizer": True,
            "check_for_nan_in_grad": True, "bucket_size": None}))
        self.model = model
        self.ddp = DistributedDataParallel(**filter_kwargs(DistributedDataParallel, {
            "config": model.config, "ddp_config": ddp_config, "module": model}))
        cfg_cls = getattr(mopt, "AdamOptimizerConfig", None) or mopt.OptimizerConfig
        self.config = cfg_cls(**filter_kwargs(cfg_cls, {
            "optimizer": "adam", "lr": lr, "min_lr": lr, "weight_decay": weight_decay, "adam_beta1": betas[0],
            "adam_beta2": betas[1], "adam_eps": eps, "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16,
            "params_dtype": dtype, "use_distributed_optimizer": True, "clip_grad": 0.0,
            "loss_scale": 1.0 if dtype == torch.float16 else None}))
        self.optimizer = mopt.get_megatron_optimizer(**filter_kwargs(mopt.get_megatron_optimizer, {
            "config": self.config, "model_chunks": [self.ddp]}))

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> bool:
        """Reduce the gradients into the float32 buffers, one Adam step on the main params, bf16 copies into the model
        parameters (in place); whether Megatron applied the update."""
        self.ddp.finish_grad_sync()
        ret = self.optimizer.step()  # (update_successful, grad_norm, num_zeros) in 0.16.1 and 0.19.x
        return bool(ret[0] if isinstance(ret, tuple) else ret)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """Megatron's sharded optimizer state (main params, Adam moments: ShardedTensors keyed by the model's keys;
        param groups: common state) for ``dist_checkpointing``."""
        from .layers.builder import filter_kwargs

        if is_loading:
            initial_adam_state(self._distributed().optimizer)
        fn = self.optimizer.sharded_state_dict
        return fn(model_sharded_state_dict, **filter_kwargs(fn, {"is_loading": is_loading, "metadata": self.SHARDING}))

    def _distributed(self):
        """The one ``DistributedOptimizer`` (0.19 wraps it in a ``ChainedOptimizer``)."""
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        if len(inner) != 1:
            raise RuntimeError(f"MegatronOptimizer: expected one distributed optimizer, Megatron built {len(inner)}")
        return inner[0]

    def load_state_dict(self, state: dict) -> None:
        """Restore from what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict` (``is_loading=True``).

        Megatron's own loading in its two parts, with two repairs for torch's Adam (no Apex / TE), where Megatron-Core
        0.16.1 and 0.19.2 both fail: the common state first (param groups; Megatron gives every param's Adam state
        one *shared* ``step`` tensor, which Adam would then advance once per param per step, so each param gets its
        own copy); then the parameter state with ``step`` set aside, because Megatron copies every tensor of a
        param's state from the checkpoint's, which holds no ``step`` (``KeyError: 'step'``)."""
        state = dict(state)
        param_state = state.pop("param_state")
        sharding = state.pop("param_state_sharding_type")
        if sharding != self.SHARDING["distrib_optim_sharding_type"]:
            raise ValueError(f"MegatronOptimizer: optimizer state saved as {sharding!r}, "
                             f"expected {self.SHARDING['distrib_optim_sharding_type']!r}")
        dist_opt = self._distributed()
        dist_opt.load_state_dict(state)
        adam = dist_opt.optimizer
        steps = {p: st.pop("step").clone() for p, st in adam.state.items() if "step" in st}
        try:
            dist_opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                adam.state[p]["step"] = step
