"""A line per binary specialisation of this package's Triton kernels, as the process meets it (``MC_LOG_SPECIALIZATIONS=1``).

Triton compiles (or loads from its disk cache) one binary per kernel for each new combination of constexpr values and
argument specialisations (an integer ``== 1`` or ``% 16 == 0``, a pointer's 16-byte alignment).  A rollout pass that
meets one the warm-up did not pays a compile inside the pass (``bench_rollout_gpu.py``'s ``pass_new_kernels`` names
the kernel only); with this switch on, every process that imports the CUDA kernels prints, to stderr, the kernel, its
launch options, its arguments' specialisation and its constexpr values when Triton first builds that binary in the
process -- so a log shows *which* specialisation a pass met.  Diagnostics only: no launch, argument or bit changes,
and off by default.  Other packages' kernels are not logged; a hook installed before is still called.
"""

from __future__ import annotations

import sys

import triton

from ..dispatch import env_switch

LOG_SPECIALIZATIONS = env_switch("MC_LOG_SPECIALIZATIONS", False)
PREFIX = "[megatron-consistent] specialised"
_PACKAGE = __name__.split(".")[0]


def specialization_line(*, repr: str, fn, compile: dict, **_) -> str | None:  # noqa: A002  (Triton's keyword)
    """The log line of one new binary (``None`` for a kernel outside this package)."""
    named = specialization_constexprs(fn=fn, compile=compile)
    return None if named is None else f"{PREFIX} {fn.module}.{repr} constexprs {named}"


def specialization_constexprs(*, fn, compile: dict, **_) -> dict | None:
    """The constexpr values of one new binary by parameter name (``None`` for a kernel outside this package)."""
    module = getattr(fn, "module", "") or ""
    if not module.startswith(_PACKAGE + "."):
        return None
    params = getattr(getattr(fn, "jit_function", None), "params", None) or []
    return {_param_name(k, params): v for k, v in (compile.get("constants") or {}).items()}


def _param_name(key, params) -> str:
    """Triton keys a constexpr by its path of argument indices (``(5,)``); the kernel's parameter gives the name."""
    if isinstance(key, tuple) and key and isinstance(key[0], int) and key[0] < len(params):
        return getattr(params[key[0]], "name", str(key[0])) + "".join(f"[{i}]" for i in key[1:])
    return str(key)


def install() -> None:
    """Chain the logging hook onto Triton's post-compile hook (idempotent)."""
    runtime = triton.knobs.runtime
    previous = runtime.jit_post_compile_hook
    if getattr(previous, "_megatron_consistent", False):
        return

    def hook(**kwargs):
        line = specialization_line(**kwargs)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return previous(**kwargs) if previous is not None else None

    hook._megatron_consistent = True
    runtime.jit_post_compile_hook = hook


if LOG_SPECIALIZATIONS:
    install()
