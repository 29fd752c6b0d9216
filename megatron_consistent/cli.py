"""Command line ``megatron-consistent``: one subcommand per module in ``COMMANDS``.

Each command module provides ``add_arguments(parser)`` and ``run(args) -> int``.
Bad input (``ValueError``, ``FileNotFoundError``) is reported as one line on
stderr with exit code 2, before any work.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "check": ("megatron_consistent.verify.check_command", "rollout (vLLM) vs recompute (Megatron) log-probs: zero mismatch end to end"),
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="megatron-consistent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        modules[name] = importlib.import_module(module)
        modules[name].add_arguments(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-consistent {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
