"""The tiny verifiable RL task of ``examples/grpo_tiny.py`` and the lifecycle checks, and the model that learns it."""

from __future__ import annotations

import torch

__all__ = ["TINY_RL_HF_CONFIG", "ModTask"]

#: A Llama-shaped model small enough to learn the task below in a few CPU steps (vocab 64).
TINY_RL_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
}


class ModTask:
    """Verifiable toy task: answer with tokens congruent to the prompt's last token modulo ``k``.

    Prompts come from a fixed pool of ``pool`` random prompts (ids 3..vocab-1,
    length ``prompt_len``); the reward of a response is the fraction of its
    tokens ``t`` with ``t % k == prompt[-1] % k`` (a uniform policy scores 1/k).
    """

    def __init__(self, vocab_size: int, *, k: int = 4, pool: int = 8, prompt_len: int = 8, seed: int = 0):
        self.k = k
        self.g = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(3, vocab_size, (pool, prompt_len), generator=self.g).tolist()

    def prompts(self, n: int) -> list[list[int]]:
        """``n`` prompts drawn from the pool (seeded stream)."""
        return [self.pool[i] for i in torch.randint(0, len(self.pool), (n,), generator=self.g).tolist()]

    def reward(self, prompt: list[int], response: list[int]) -> float:
        return sum(t % self.k == prompt[-1] % self.k for t in response) / max(len(response), 1)
