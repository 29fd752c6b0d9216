"""Architecture description shared by the Megatron layers, the vLLM plugin and conversion.

:class:`ArchConfig` is read from an HF ``config.json`` and validated up front:
anything the consistent path does not implement (another architecture,
sliding-window attention, a rope scaling type, biases in the MLP, another
activation) is refused by name before any work is done.

Hybrid Mamba-2 models (``NemotronHForCausalLM``, ``Mamba2ForCausalLM``) carry a
per-layer ``layer_types`` tuple (``"mamba" | "attention" | "mlp" | "moe"``) and an
:class:`SSMConfig`; ``ArchConfig.is_hybrid`` tells them apart.  Their attention
layers use no rotary embedding (``use_rope=False``), their MLPs / experts are
non-gated ``relu2`` (``hidden_act``), their MoE routing is sigmoid + selection
bias (``moe_scoring``, ``moe_n_group``, ``moe_topk_group``, ``routed_scaling_factor``).

Every model also carries the segment count S of its row-parallel K tree (``row_parallel_segments``, HF key
``consistent_row_parallel_segments``, :mod:`.kernels.linear`): the bits depend on S, never on the TP degree.
"""

from __future__ import annotations

import json
from importlib import resources
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .kernels.linear import SEGMENT_COUNTS
from .kernels.rotary import RopeConfig, rope_scaling_items

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
HYBRID_ARCHITECTURES = ("NemotronHForCausalLM", "Mamba2ForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", *MOE_ARCHITECTURES,
                           *HYBRID_ARCHITECTURES)
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
                "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
                "NemotronHForCausalLM": "nemotron_h", "Mamba2ForCausalLM": "mamba2"}
SUPPORTED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ROW_PARALLEL_SEGMENTS_KEY = "consistent_row_parallel_segments"  # HF config key (and Megatron config attribute) of S


class UnsupportedConfigError(ValueError):
    """A model or run configuration the consistent path refuses (named in the message)."""


def row_parallel_refusal(segments, tp: int = 1) -> str:
    """Why a model whose row-parallel K tree has ``segments`` segments cannot run at tensor-parallel degree ``tp``
    ('' when it can): S must be one of :data:`.kernels.linear.SEGMENT_COUNTS` and ``tp`` must divide it (each rank
    holds ``S / tp`` whole segments)."""
    if isinstance(segments, bool) or not isinstance(segments, int) or segments not in SEGMENT_COUNTS:
        return (f"{ROW_PARALLEL_SEGMENTS_KEY}={segments!r}: the row-parallel K tree's segment count must be one of "
                f"{SEGMENT_COUNTS}")
    if tp < 1 or segments % tp:
        return (f"{ROW_PARALLEL_SEGMENTS_KEY}={segments}: the row-parallel K tree has {segments} segments, so TP must "
                f"divide {segments} (one of {tuple(c for c in SEGMENT_COUNTS if c <= segments)}), got TP={tp}")
    return ""


@dataclass(frozen=True)
class SSMConfig:
    """The Mamba-2 mixer of a hybrid model (HF NemotronH / Mamba2 field meanings).

    ``time_step_limit`` clamps ``softplus(dt + dt_bias)`` (``(0, inf)``: no clamp);
    the gated RMSNorm normalizes each of the ``n_groups`` groups of
    ``d_inner // n_groups`` channels (``norm_before_gate=False``) with ``norm_eps``.
    """

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    use_conv_bias: bool = True
    norm_eps: float = 1e-5

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B, C."""
        return self.d_inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """Rows of ``in_proj``: z, xBC, dt (in that order)."""
        return self.d_inner + self.conv_dim + self.num_heads

    @property
    def group_size(self) -> int:
        return self.d_inner // self.n_groups

    @property
    def in_proj_blocks(self) -> tuple[int, ...]:
        """Rows of ``in_proj`` by block: z, x, B, C, dt (B and C: ``n_groups * state_size`` each).  At TP = t each
        block is cut into t equal runs, rank r holding the r-th of each: its heads and the groups they read."""
        gn = self.n_groups * self.state_size
        return (self.d_inner, self.d_inner, gn, gn, self.num_heads)

    @property
    def conv_blocks(self) -> tuple[int, ...]:
        """Channels of the causal conv by block: x, B, C (cut over the TP ranks as :attr:`in_proj_blocks`)."""
        return self.in_proj_blocks[1:4]

    def per_rank(self, size: int) -> "SSMConfig":
        """The mixer one of ``size`` tensor-parallel ranks holds: ``num_heads / size`` heads and ``n_groups / size``
        groups (``size`` must divide both; ``head_dim``, ``state_size`` and the group size unchanged)."""
        if self.num_heads % size or self.n_groups % size:
            raise UnsupportedConfigError(f"Mamba mixer at TP={size}: TP must divide num_heads {self.num_heads} and n_groups "
                                         f"{self.n_groups} (each rank holds whole heads and groups)")
        return replace(self, num_heads=self.num_heads // size, n_groups=self.n_groups // size)


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
    # Hybrid (Mamba-2 / Nemotron-H); defaults = the dense decoders above.
    layer_types: tuple[str, ...] = ()  # empty: every layer is attention + MLP
    ssm: SSMConfig | None = None
    use_rope: bool = True
    hidden_act: str = "silu"  # "silu": gated SwiGLU MLP / experts; "relu2": non-gated relu(x)^2 (Nemotron-H)
    moe_scoring: str = "softmax"  # "sigmoid": Nemotron-H router (with e_score_correction_bias)
    moe_n_group: int = 1
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # S: the number of K segments of every row-parallel linear's tree (o_proj / linear_proj, down / linear_fc2, the
    # Mamba out_proj; kernels/linear.py), 1, 2, 4 or 8 -- the largest tensor-parallel degree this model's trainer or
    # engine will use.  The bits depend on S and never on the TP degree t (t must divide S).  HF key
    # ``consistent_row_parallel_segments`` (absent: 8).
    row_parallel_segments: int = 8

    def __post_init__(self):
        reason = row_parallel_refusal(self.row_parallel_segments)
        if reason:
            raise UnsupportedConfigError(reason)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_types)

    @property
    def hybrid_pattern(self) -> str:
        """The layer pattern in HF ``hybrid_override_pattern`` / Megatron symbols (``M * - E``); ``""`` for non-hybrids."""
        return "".join(_PATTERN_SYMBOLS[t] for t in self.layer_types)

    @property
    def mlp_gated(self) -> bool:
        return self.hidden_act == "silu"

    @property
    def moe_score_bias(self) -> bool:
        """Whether the router carries a float32 selection bias (``e_score_correction_bias``)."""
        return self.moe_scoring == "sigmoid"

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
        if arch in HYBRID_ARCHITECTURES:
            return _hybrid_from_hf(cls, arch, hf)
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
        _require(arch, hf, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
                 optional=("num_key_value_heads", "head_dim", "max_position_embeddings"))
        _require_float(hf, ("rms_norm_eps",), theta=theta)
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
            row_parallel_segments=_row_parallel_segments(hf),
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
        """The HF ``config.json`` dict this architecture is exported as (``consistent_row_parallel_segments`` only when
        S is not the default 8)."""
        hf = _hybrid_to_hf(self) if self.is_hybrid else self._dense_to_hf()
        if self.row_parallel_segments != ArchConfig.row_parallel_segments:
            hf[ROW_PARALLEL_SEGMENTS_KEY] = self.row_parallel_segments
        return hf

    def _dense_to_hf(self) -> dict:
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

    @classmethod
    def from_dict(cls, d: dict) -> "ArchConfig":
        """Inverse of :meth:`as_dict` (also after a JSON round trip: lists back to tuples)."""
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = tuple(tuple(x) for x in d["rope_scaling"])
        for key in ("moe_layers", "layer_types"):
            if key in d:
                d[key] = tuple(d[key])
        if d.get("ssm") is not None:
            ssm = dict(d["ssm"])
            ssm["time_step_limit"] = tuple(float(x) for x in ssm["time_step_limit"])
            d["ssm"] = SSMConfig(**ssm)
        return cls(**d)


def _row_parallel_segments(hf: dict):
    """S from the HF config (absent: ArchConfig's default); validated by ArchConfig itself."""
    return hf.get(ROW_PARALLEL_SEGMENTS_KEY, ArchConfig.row_parallel_segments)


def _require(arch: str, hf: dict, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """One-line structured errors instead of ``KeyError`` / ``ZeroDivisionError``: ``fields`` must be present and every
    present size (``fields`` + ``optional``; None = unset) an integer > 0."""
    for key in fields:
        if hf.get(key) is None:
            raise UnsupportedConfigError(f"{arch} config: missing field {key}")
    for key in (*fields, *optional):
        v = hf.get(key)
        if v is None or key == "intermediate_size" and isinstance(v, list):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
            raise UnsupportedConfigError(f"{arch} config: field {key} must be an integer, got {v!r}")
        if v <= 0:
            raise UnsupportedConfigError(f"{arch} config: field {key} must be > 0, got {v!r}")


def _require_float(hf: dict, fields: tuple[str, ...], **values) -> None:
    """Present float fields (and ``values``) must be finite numbers > 0."""
    import math

    for key, v in [(k, hf.get(k)) for k in fields] + list(values.items()):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise UnsupportedConfigError(f"config field {key} must be a finite number > 0, got {v!r}")


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


# ---------------------------------------------------------------------------------------------- hybrid (Mamba-2)
_PATTERN_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_PATTERN_SYMBOLS = {t: c for c, t in _PATTERN_CHARS.items()}
_HF_BLOCK_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
                   "mlp": "mlp", "moe": "moe"}
_HF_BLOCK_NAMES = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}


def _first(hf: dict, *keys, default=None):
    """The value of the first key present (HF NemotronH accepts legacy ``mamba_*`` aliases)."""
    for k in keys:
        if k in hf:
            return hf[k]
    return default


def _refuse_set(arch: str, hf: dict, keys_ok: dict) -> None:
    """Refuse every ``key`` whose value is set and differs from the implemented value ``keys_ok[key]``."""
    for key, ok in keys_ok.items():
        if key in hf and hf[key] not in (ok if isinstance(ok, tuple) else (ok,)):
            raise UnsupportedConfigError(f"unsupported {arch} feature: {key}={hf[key]!r} (implemented: {ok!r})")


def _nemotronh_layer_types(hf: dict) -> tuple[str, ...]:
    pattern = hf.get("hybrid_override_pattern")
    listed = hf.get("layers_block_type", hf.get("layer_types"))
    from_pattern = from_list = None
    if pattern is not None:
        bad = sorted(set(pattern) - set(_PATTERN_CHARS))
        if bad:
            raise UnsupportedConfigError(f"unsupported hybrid_override_pattern characters {bad} (supported: M * - E)")
        from_pattern = tuple(_PATTERN_CHARS[c] for c in pattern)
    if listed is not None:
        bad = sorted({t for t in listed if t not in _HF_BLOCK_TYPES})
        if bad:
            raise UnsupportedConfigError(f"unsupported layers_block_type entries {bad} (supported: {', '.join(_HF_BLOCK_TYPES)})")
        from_list = tuple(_HF_BLOCK_TYPES[t] for t in listed)
    if from_pattern is not None and from_list is not None and from_pattern != from_list:
        raise UnsupportedConfigError(f"hybrid_override_pattern {pattern!r} disagrees with layers_block_type {listed!r}")
    types = from_list or from_pattern
    if not types:
        raise UnsupportedConfigError("NemotronHForCausalLM config without hybrid_override_pattern / layers_block_type")
    return types


def _ssm_from_hf(arch: str, hf: dict, hidden: int, eps: float) -> SSMConfig:
    if arch == "NemotronHForCausalLM":
        heads, head_dim = hf.get("mamba_num_heads", 128), hf.get("mamba_head_dim", 64)
        state = hf.get("ssm_state_size", 128)
    else:
        heads, head_dim, state = hf.get("num_heads", 128), hf.get("head_dim", 64), hf.get("state_size", 128)
        expand = hf.get("expand", 2)
        if expand * hidden != heads * head_dim:
            raise UnsupportedConfigError(f"Mamba2: hidden_size*expand ({hidden}*{expand}) != num_heads*head_dim ({heads}*{head_dim})")
    limit = _first(hf, "time_step_limit", "mamba_dt_limit", default=(0.0, float("inf")))
    if not isinstance(limit, (list, tuple)) or len(limit) != 2 or not 0.0 <= float(limit[0]) <= float(limit[1]):
        raise UnsupportedConfigError(f"unsupported time_step_limit={limit!r} (expected [low, high] with 0 <= low <= high)")
    ssm = SSMConfig(num_heads=int(heads), head_dim=int(head_dim), state_size=int(state),
                    n_groups=int(_first(hf, "n_groups", "mamba_n_groups", default=8)),
                    conv_kernel=int(_first(hf, "conv_kernel", "mamba_d_conv", default=4)),
                    chunk_size=int(_first(hf, "chunk_size", "mamba_chunk_size", default=128 if arch == "NemotronHForCausalLM" else 256)),
                    time_step_limit=(float(limit[0]), float(limit[1])),
                    use_conv_bias=bool(_first(hf, "use_conv_bias", "mamba_conv_bias", default=True)), norm_eps=eps)
    if min(ssm.num_heads, ssm.head_dim, ssm.state_size, ssm.n_groups, ssm.conv_kernel, ssm.chunk_size) < 1:
        raise UnsupportedConfigError(f"{arch}: Mamba sizes must be >= 1 ({ssm})")
    if ssm.num_heads % ssm.n_groups:
        raise UnsupportedConfigError(f"{arch}: Mamba num_heads {ssm.num_heads} not divisible by n_groups {ssm.n_groups}")
    if ssm.conv_kernel < 2:
        raise UnsupportedConfigError(f"{arch}: conv_kernel={ssm.conv_kernel} (must be >= 2)")
    return ssm


def _hybrid_from_hf(cls, arch: str, hf: dict) -> ArchConfig:
    """NemotronH / Mamba2 HF config -> :class:`ArchConfig`; every unimplemented option refused by name."""
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").replace("torch.", "")
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    # residual_in_fp32 (HF Mamba2 default True): accepted and, as in vLLM, not applied.  vLLM's mamba2.py / nemotron_h.py never
    # read it; their RMSNorm adds the residual and stores it in the model dtype.  Trainer and plugin do exactly that
    # (docs/robustness.md), so a checkpoint that sets it runs as vLLM serves it.
    _require(arch, hf, ("vocab_size", "hidden_size") + (("num_hidden_layers",) if arch == "Mamba2ForCausalLM" else ()),
             optional=("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "intermediate_size",
                       "num_heads", "state_size", "expand", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                       "mamba_n_groups", "chunk_size", "mamba_chunk_size", "conv_kernel", "mamba_d_conv"))
    _require_float(hf, ("layer_norm_epsilon",))
    hidden, eps = int(hf["hidden_size"]), float(hf.get("layer_norm_epsilon", 1e-5))
    common = dict(architecture=arch, vocab_size=int(hf["vocab_size"]), hidden_size=hidden, rms_norm_eps=eps,
                  rope_theta=10000.0, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
                  use_rope=False, row_parallel_segments=_row_parallel_segments(hf))
    if arch == "Mamba2ForCausalLM":
        _refuse_set(arch, hf, {"hidden_act": "silu", "use_bias": False})
        layers = int(hf.get("num_hidden_layers", 64))
        return cls(intermediate_size=0, num_layers=layers, num_heads=0, num_kv_heads=0, head_dim=0,
                   max_position_embeddings=int(hf.get("max_position_embeddings", 4096)), layer_types=("mamba",) * layers,
                   ssm=_ssm_from_hf(arch, hf, hidden, eps), hidden_act="silu", **common)
    _refuse_set(arch, hf, {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_bias": False, "mamba_proj_bias": False,
                           "mlp_bias": False, "attention_bias": False, "attention_dropout": (0, 0.0), "hidden_dropout": (0, 0.0),
                           "sliding_window": None, "moe_latent_size": None, "num_nextn_predict_layers": (0, None),
                           "mamba_ssm_cache_dtype": ("float32", None), "block_configs": None, "tie_word_embeddings": False})
    types = _nemotronh_layer_types(hf)
    inter = hf.get("intermediate_size", 21504)
    if isinstance(inter, list):
        if len(set(inter)) != 1:
            raise UnsupportedConfigError(f"unsupported NemotronH feature: per-layer intermediate_size {inter}")
        inter = inter[0]
    heads = int(hf.get("num_attention_heads", 32))
    kv = int(hf.get("num_key_value_heads") or heads)
    if "attention" in types and heads % kv:
        raise UnsupportedConfigError(f"num_attention_heads {heads} not divisible by num_key_value_heads {kv}")
    moe = {}
    if "moe" in types:
        experts, top_k = int(_first(hf, "n_routed_experts", "num_local_experts", default=8)), int(hf.get("num_experts_per_tok", 2))
        n_group, topk_group = int(hf.get("n_group", 1) or 1), int(hf.get("topk_group", 1) or 1)
        if int(hf.get("n_shared_experts", 1) or 0) != 1:
            raise UnsupportedConfigError(f"unsupported NemotronH feature: n_shared_experts={hf.get('n_shared_experts')!r} (only 1: HF and "
                                         "vLLM size the shared expert differently otherwise)")
        if experts <= 0 or not 1 <= top_k <= experts:
            raise UnsupportedConfigError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={experts}]")
        if experts % n_group or not 1 <= topk_group <= n_group:
            raise UnsupportedConfigError(f"n_group={n_group}, topk_group={topk_group} invalid for n_routed_experts={experts}")
        moe = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(hf.get("moe_intermediate_size", 7688)),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   shared_expert_intermediate_size=int(hf.get("moe_shared_expert_intermediate_size", 7688)),
                   moe_layers=tuple(i for i, t in enumerate(types) if t == "moe"), moe_scoring="sigmoid", moe_n_group=n_group,
                   moe_topk_group=topk_group, routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
        if min(moe["moe_intermediate_size"], moe["shared_expert_intermediate_size"]) <= 0:
            raise UnsupportedConfigError("NemotronH: moe_intermediate_size and moe_shared_expert_intermediate_size must be > 0")
    return cls(intermediate_size=int(inter), num_layers=len(types), num_heads=heads, num_kv_heads=kv,
               head_dim=int(hf.get("head_dim") or hidden // heads), max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
               layer_types=types, ssm=_ssm_from_hf(arch, hf, hidden, eps) if "mamba" in types else None, hidden_act="relu2",
               **moe, **common)


def _hybrid_to_hf(a: ArchConfig) -> dict:
    hf = {"architectures": [a.architecture], "model_type": _MODEL_TYPES[a.architecture], "vocab_size": a.vocab_size,
          "hidden_size": a.hidden_size, "num_hidden_layers": a.num_layers, "layer_norm_epsilon": a.rms_norm_eps,
          "max_position_embeddings": a.max_position_embeddings, "tie_word_embeddings": a.tie_word_embeddings,
          "torch_dtype": a.dtype, "residual_in_fp32": False, "bos_token_id": 1, "eos_token_id": 2}
    s = a.ssm
    ssm = {} if s is None else {"n_groups": s.n_groups, "conv_kernel": s.conv_kernel, "chunk_size": s.chunk_size,
                                "time_step_limit": list(s.time_step_limit), "use_conv_bias": s.use_conv_bias}
    if a.architecture == "Mamba2ForCausalLM":
        hf.update(ssm, num_heads=s.num_heads, head_dim=s.head_dim, state_size=s.state_size, expand=s.d_inner // a.hidden_size,
                  hidden_act="silu", use_bias=False)
        return hf
    hf.update(ssm, hybrid_override_pattern=a.hybrid_pattern,
              layers_block_type=[_HF_BLOCK_NAMES[t] for t in a.layer_types], intermediate_size=a.intermediate_size,
              num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, mlp_hidden_act="relu2",
              mamba_hidden_act="silu", use_bias=False, mlp_bias=False, attention_bias=False, mamba_proj_bias=False)
    if s is not None:
        hf.update(mamba_num_heads=s.num_heads, mamba_head_dim=s.head_dim, ssm_state_size=s.state_size)
    if a.is_moe:
        hf.update(n_routed_experts=a.num_experts, num_experts_per_tok=a.num_experts_per_tok, moe_intermediate_size=a.moe_intermediate_size,
                  moe_shared_expert_intermediate_size=a.shared_expert_intermediate_size, n_shared_experts=1,
                  norm_topk_prob=a.norm_topk_prob, routed_scaling_factor=a.routed_scaling_factor, n_group=a.moe_n_group,
                  topk_group=a.moe_topk_group)
    return hf


DEFAULT_MODEL = "tiny-llama"


def builtin_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Folder of a tiny model config shipped with the package (``configs/models/<name>``)."""
    return Path(str(resources.files("megatron_consistent") / "configs" / "models" / name))


def load_hf_config(path: str | Path) -> dict:
    """An HF config dict from a folder holding ``config.json`` or from the file itself, read as vLLM reads it.

    The file goes through transformers' ``AutoConfig`` (so every encoding transformers writes, e.g.
    ``{"__float__": "Infinity"}``, is understood, and defaults are those vLLM sees); the result is its ``to_dict()``.
    Fields the file itself must carry (sizes) are checked on the file: a missing one is named
    (:class:`UnsupportedConfigError`), never a ``KeyError``.  A file without ``model_type`` is read with the model type of
    its (supported) architecture.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no HF config at {path} (expected a folder with config.json, or the file)")
    try:
        raw = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnsupportedConfigError(f"{p}: not a JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise UnsupportedConfigError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedConfigError(f"{p}: unsupported architecture {archs[0] if isinstance(archs, list) and archs else None!r}; "
                                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    from transformers import AutoConfig, PretrainedConfig

    decoded = PretrainedConfig._decode_special_floats(raw)
    # the file's own fields first: AutoConfig would fill a default (e.g. hidden_size 4096) for a missing size
    ArchConfig.from_hf(decoded)
    try:
        if "model_type" in decoded:
            cfg = AutoConfig.from_pretrained(str(p.parent) if p.name == "config.json" else str(p))
        else:
            cfg = AutoConfig.for_model(_MODEL_TYPES[archs[0]], **decoded)
    except (ValueError, TypeError, KeyError) as e:
        raise UnsupportedConfigError(f"{p}: transformers cannot read this config ({type(e).__name__}: {e})") from None
    return cfg.to_dict()
