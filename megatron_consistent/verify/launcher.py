"""Engine processes forked from a warm launcher: a CPU engine that runs entirely inside its process starts without
re-importing vLLM and this package (measured on 2 cores: a tiny-llama rollout process 17-19 s instead of 43-49 s,
after the launcher's own start).  Not used where CUDA is visible (a fork must not inherit a CUDA context).

The launcher is multiprocessing's fork server with vLLM's ``LLM`` and the engine modules imported once (nothing is
computed there: no thread pool started, no device touched). Each run is a fresh process forked from it, which takes
the caller's environment and working directory in full, sends stdout and stderr to the run's log, calls the module's
``main([request, result])``, runs the exit handlers the module registered (vLLM's engine shutdown) and exits with its
code: what ``python -m module REQUEST RESULT`` does, without the imports. The kernels are the same, so the bits are.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import sys

from .processes import kill_group

PRELOAD = ["vllm.entrypoints.llm", "megatron_consistent.verify.rollout", "megatron_consistent.verify.capture",
           "megatron_consistent.verify.gates", "megatron_consistent.verify.soak_engine"]
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _run(module: str, argv: list[str], env: dict, cwd: str, log_path: str) -> None:
    os.setsid()  # its own process group: run_forked kills what is left of it (verify/processes.py)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        code = importlib.import_module(module).main(argv) or 0
    finally:
        atexit._run_exitfuncs()  # a forked child leaves through os._exit: vLLM's shutdown hooks would not run
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run_forked(module: str, argv: list[str], env: dict, log_path: str, timeout_s: float | None) -> int | None:
    """``module.main(argv)`` in a process forked from the warm launcher: its exit code, or None when it ran past
    ``timeout_s`` seconds.  Either way, every process still in its group afterwards is killed."""
    proc = _context().Process(target=_run, args=(module, argv, dict(env), os.getcwd(), str(log_path)))
    proc.start()
    proc.join(timeout_s)
    timed_out = proc.exitcode is None
    kill_group(proc.pid)
    proc.join()
    return None if timed_out else proc.exitcode
