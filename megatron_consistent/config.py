"""Architecture description shared by the Megatron layers, the vLLM plugin and conversion.

:class:`ArchConfig` is read from an HF ``config.json`` and validated up front:
anything the consistent path does not implement (another architecture,
sliding-window attention, a rope scaling type, biases in the MLP, another
activation) is refused by name before any work is done.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .kernels.rotary import RopeConfig, rope_scaling_items

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
SUPPORTED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class UnsupportedConfigError(ValueError):
    """A model or run configuration the consistent path refuses (named in the message)."""


@dataclass(frozen=True)
class ArchConfig:
    """The dense decoder features the consistent kernels implement."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def rope(self) -> RopeConfig:
        return RopeConfig(self.head_dim, self.max_position_embeddings, self.rope_theta, "neox", self.rope_scaling)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_hf(cls, hf: dict) -> "ArchConfig":
        """Validate an HF config dict and map it; raises :class:`UnsupportedConfigError`."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedConfigError(f"unsupported activation {hf['hidden_act']!r} (only silu)")
        if hf.get("mlp_bias"):
            raise UnsupportedConfigError("unsupported feature: mlp_bias")
        if hf.get("sliding_window") is not None and (arch == "MistralForCausalLM" or hf.get("use_sliding_window")):
            raise UnsupportedConfigError(f"unsupported feature: sliding_window={hf['sliding_window']}")
        if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":
            raise UnsupportedConfigError(f"unsupported feature: attention_bias (o_proj bias) for {arch}")
        if hf.get("attention_dropout", 0.0):
            raise UnsupportedConfigError("unsupported feature: attention_dropout > 0")
        rope_params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").replace("torch.", "")
        if dtype not in SUPPORTED_DTYPES:
            raise UnsupportedConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
        cfg = cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_scaling=rope_scaling_items(scaling),
            qkv_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise UnsupportedConfigError(f"num_attention_heads {heads} not divisible by num_key_value_heads {cfg.num_kv_heads}")
        try:
            cfg.rope  # validates the rope scaling type
        except ValueError as e:
            raise UnsupportedConfigError(str(e)) from None
        return cfg

    def to_hf(self) -> dict:
        """The HF ``config.json`` dict this architecture is exported as."""
        hf = {
            "architectures": [self.architecture],
            "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
        if self.architecture != "Qwen2ForCausalLM":
            hf["attention_bias"] = False
        if self.architecture == "MistralForCausalLM":
            hf["sliding_window"] = None
        return hf

    def as_dict(self) -> dict:
        return asdict(self)


def load_hf_config(path: str | Path) -> dict:
    """An HF config dict from a folder holding ``config.json`` or from the file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no HF config at {path} (expected a folder with config.json, or the file)")
    return json.loads(p.read_text())
