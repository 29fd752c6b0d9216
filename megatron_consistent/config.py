"""Architecture description shared by the Megatron layers, the vLLM plugin and conversion.

:class:`ArchConfig` is read from an HF ``config.json`` and validated up front:
anything the consistent path does not implement (another architecture,
sliding-window attention, a rope scaling type, biases in the MLP, another
activation) is refused by name before any work is done.
"""

from __future__ import annotations

import json
from importlib import resources
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .kernels.rotary import RopeConfig, rope_scaling_items

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", *MOE_ARCHITECTURES)
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
                "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral"}
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
    # MoE (num_experts == 0: dense).  moe_layers: indices of the layers whose MLP is the MoE block.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, i: int) -> bool:
        return i in self.moe_layers

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
        if hf.get("sliding_window") is not None and (arch in ("MistralForCausalLM", "MixtralForCausalLM") or hf.get("use_sliding_window")):
            raise UnsupportedConfigError(f"unsupported feature: sliding_window={hf['sliding_window']}")
        if hf.get("attention_bias") and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
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
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
            **_moe_fields(arch, hf),
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
            "model_type": _MODEL_TYPES[self.architecture],
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
        if self.architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
            hf["attention_bias"] = False
        if self.architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
            hf["sliding_window"] = None
        if self.is_moe:
            hf.update(_moe_to_hf(self))
        return hf

    def as_dict(self) -> dict:
        return asdict(self)


_MOE_REFUSED = ("n_group", "topk_group", "topk_method", "scoring_func", "e_score_correction_bias", "routed_scaling_factor",
                "first_k_dense_replace", "moe_layer_freq", "n_shared_experts")


def _moe_fields(arch: str, hf: dict) -> dict:
    """The MoE fields of :class:`ArchConfig` for ``arch`` (empty for dense architectures); refuses unknown options by name."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    for key in _MOE_REFUSED:
        if hf.get(key) not in (None, 1, 1.0, "softmax") or (key in ("e_score_correction_bias", "n_shared_experts") and hf.get(key)):
            raise UnsupportedConfigError(f"unsupported MoE feature: {key}={hf[key]!r} for {arch}")
    if hf.get("router_jitter_noise"):
        raise UnsupportedConfigError(f"unsupported MoE feature: router_jitter_noise={hf['router_jitter_noise']} (must be 0)")
    layers = hf["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        experts, inter, norm, shared, moe_layers = hf.get("num_local_experts", 8), hf["intermediate_size"], True, 0, tuple(range(layers))
    else:
        # transformers 5 writes Qwen-MoE's num_experts as num_local_experts in to_dict()
        experts, inter = hf.get("num_experts") or hf.get("num_local_experts", 0), hf.get("moe_intermediate_size", 0)
        norm = bool(hf.get("norm_topk_prob", False))
        shared = int(hf.get("shared_expert_intermediate_size", 0) or 0) if arch == "Qwen2MoeForCausalLM" else 0
        step, dense_only = int(hf.get("decoder_sparse_step", 1) or 1), set(hf.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(layers) if experts > 0 and i not in dense_only and (i + 1) % step == 0)
    top_k = hf.get("num_experts_per_tok", 2 if arch == "MixtralForCausalLM" else 0)
    if experts <= 0 or not moe_layers:
        raise UnsupportedConfigError(f"{arch} config without MoE layers (num_experts={experts}); use the dense architecture")
    if not 1 <= top_k <= experts:
        raise UnsupportedConfigError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    if inter <= 0:
        raise UnsupportedConfigError(f"{arch}: expert intermediate size must be > 0")
    return {"num_experts": int(experts), "num_experts_per_tok": int(top_k), "moe_intermediate_size": int(inter),
            "norm_topk_prob": norm, "shared_expert_intermediate_size": shared, "moe_layers": moe_layers,
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0) or 0.0)}


def _moe_to_hf(a: "ArchConfig") -> dict:
    if a.architecture == "MixtralForCausalLM":
        if a.moe_intermediate_size != a.intermediate_size or a.moe_layers != tuple(range(a.num_layers)):
            raise UnsupportedConfigError("Mixtral: every layer is MoE and experts use intermediate_size")
        return {"num_local_experts": a.num_experts, "num_experts_per_tok": a.num_experts_per_tok,
                "router_aux_loss_coef": a.router_aux_loss_coef, "router_jitter_noise": 0.0}
    out = {"num_experts": a.num_experts, "num_experts_per_tok": a.num_experts_per_tok, "moe_intermediate_size": a.moe_intermediate_size,
           "norm_topk_prob": a.norm_topk_prob, "decoder_sparse_step": 1,
           "mlp_only_layers": [i for i in range(a.num_layers) if i not in a.moe_layers], "router_aux_loss_coef": a.router_aux_loss_coef}
    if a.architecture == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = a.shared_expert_intermediate_size
        out["qkv_bias"] = a.qkv_bias
    return out


DEFAULT_MODEL = "tiny-llama"


def builtin_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Folder of a tiny model config shipped with the package (``configs/models/<name>``)."""
    return Path(str(resources.files("megatron_consistent") / "configs" / "models" / name))


def load_hf_config(path: str | Path) -> dict:
    """An HF config dict from a folder holding ``config.json`` or from the file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no HF config at {path} (expected a folder with config.json, or the file)")
    return json.loads(p.read_text())
