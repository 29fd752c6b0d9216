"""Checkpoint conversion between the Megatron models of :mod:`megatron_consistent.layers` and HF safetensors."""

from .hf import CheckpointMismatchError, export_hf, hf_state_dict, import_hf, megatron_to_hf_names

__all__ = ["CheckpointMismatchError", "export_hf", "hf_state_dict", "import_hf", "megatron_to_hf_names"]
