"""megatron-consistent: bitwise-consistent log-probs between Megatron-Core and vLLM."""

__version__ = "0.1.0"
