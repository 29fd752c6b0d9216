"""Diagnostic hooks of the plugin's models: an op probe and a deliberate fault (both off by default).

The plugin imports nothing from the tools that use these hooks (``megatron_consistent.verify``);
a tool installs a probe itself:

* in this process: :func:`install` (``None`` removes it);
* in vLLM's engine / worker processes (which inherit the environment): ``MEGATRON_CONSISTENT_PROBE=<module>:<callable>``
  names a factory, called with no arguments when a model class is built (:func:`install_from_env`).

A probe is called as ``begin(input_ids, positions)`` at the start of a model forward, ``probe(op_name, tensor)`` for
every op output (names: ``embed``, ``layer<i>.<op>``, ``final_norm``), ``end()`` after the final norm, and
``logits(hidden_states, logits)`` from ``compute_logits``.  With no probe each op costs one ``is None`` test.

``MEGATRON_CONSISTENT_FAULT=layer<i>.<op>`` (op: qkv, o_proj, gate_up, down; router_logits in an MoE layer; in a
hybrid model qkv / o_proj of an attention layer, down of an MLP layer) replaces that one linear of the layer by a
split-K matmul: outside the contract on purpose, for testing a diagnosis.

This module imports neither vLLM nor torch, so a tool can read the names without starting either.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["FAULT_ENV", "PROBE", "PROBE_ENV", "install", "install_from_env"]

PROBE_ENV, FAULT_ENV = "MEGATRON_CONSISTENT_PROBE", "MEGATRON_CONSISTENT_FAULT"
PROBE = None  # the installed probe (read by the model classes as ``probe.PROBE``)


def install(probe) -> None:
    """Make ``probe`` this process's op probe (``None``: no probe)."""
    global PROBE
    PROBE = probe


def install_from_env() -> None:
    """Install the probe the factory named by :data:`PROBE_ENV` returns, unless one is installed already."""
    spec = os.environ.get(PROBE_ENV, "")
    if spec and PROBE is None:
        module, _, factory = spec.partition(":")
        install(getattr(importlib.import_module(module), factory)())
