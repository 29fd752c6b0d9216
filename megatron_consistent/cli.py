"""Command line ``megatron-consistent``: one subcommand per module in ``COMMANDS``.

Each command module provides ``add_arguments(parser)`` and ``run(args) -> int``.
Each ``run`` validates all of its input first (numbers, paths, the JSON output
path, configs: :mod:`megatron_consistent.verify.inputs`); bad input
(``ValueError``, ``OSError``) is reported as one line on stderr with exit code 2,
before any engine starts.  A failure after that point is recorded in the JSON
report (``"error"``), which is written anyway, and exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "check": ("megatron_consistent.verify.check_command", "rollout (vLLM) vs recompute (Megatron) log-probs: zero mismatch end to end"),
    "diagnose": ("megatron_consistent.verify.diagnose_command", "first divergent layer/op and token between vLLM and Megatron for one request"),
    "gates": ("megatron_consistent.verify.gates_command", "release gates C0-C10 in order, stopping at the first failure"),
    "soak": ("megatron_consistent.verify.soak", "randomized request stream (preemption, aborts, n=1/2) vs trainer recompute"),
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="megatron-consistent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (path, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the invoked command's module is imported
            module = importlib.import_module(path)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    from .verify.inputs import one_line

    try:
        return module.run(args)
    except (ValueError, OSError) as e:  # bad input, found before any work (each command validates first)
        print(f"megatron-consistent {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
