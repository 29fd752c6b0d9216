"""Verification: mismatch metrics, the check command, first-divergence and gates."""

from .metrics import format_table, is_zero_mismatch, mismatch_metrics

__all__ = ["format_table", "is_zero_mismatch", "mismatch_metrics"]
