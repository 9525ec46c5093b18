"""ModelConfig: the one typed description of a llama / qwen2 / qwen3 (/ mistral) decoder.

It reads and writes Hugging Face `config.json` dictionaries so that checkpoints move freely
between this project, transformers and vLLM. Anything the native decoder cannot represent
(sliding windows, biased MLPs, other activations, unknown RoPE types) is refused with a
ConfigError instead of being silently ignored, because a silently different architecture
produces plausible-looking but wrong log-probs. Mistral is Llama with a sliding window: it is
native only where the window never binds (none, or at least max_position_embeddings);
`models/hf_causal.py` sends the others, and every other family, to transformers' modeling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from pipeline.errors import ConfigError

ModelType = Literal["llama", "qwen2", "qwen3", "mistral"]

_ARCH_PREFIX: dict[str, str] = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
}
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# HF keys that are fully described by ModelConfig fields (or by the fixed architecture) and
# therefore are not carried through `extra`.
_MANAGED_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "torch_dtype",
        "dtype",
        "hidden_act",
        "mlp_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "partial_rotary_factor",
        "pretraining_tp",
        "transformers_version",
        "attention_dropout",
        "id2label",
        "label2id",
        "num_labels",
    }
)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; only the types the native rotary embedding implements."""

    rope_type: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ConfigError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; use None (plain "
                "RoPE), 'llama3' or 'linear'"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            missing = [
                name
                for name in (
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                )
                if getattr(self, name) is None
            ]
            if missing:
                raise ConfigError(f"rope_scaling of type 'llama3' needs {', '.join(missing)}")
            assert self.low_freq_factor is not None and self.high_freq_factor is not None
            if self.high_freq_factor <= self.low_freq_factor:
                raise ConfigError(
                    "rope_scaling.high_freq_factor must be > low_freq_factor, got "
                    f"{self.high_freq_factor} <= {self.low_freq_factor}"
                )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> RopeScaling | None:
        """Parse HF `rope_scaling` / `rope_parameters`; 'default' type means no scaling."""
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ("llama3", "linear"):
            raise ConfigError(
                f"rope scaling type {rope_type!r} is not supported by the native decoder; "
                "supported: none/'default', 'llama3', 'linear'"
            )
        if "factor" not in raw:
            raise ConfigError(f"rope scaling of type {rope_type!r} has no 'factor'")
        omp = raw.get("original_max_position_embeddings")
        return cls(
            rope_type=rope_type,
            factor=float(raw["factor"]),
            low_freq_factor=_opt_float(raw.get("low_freq_factor")),
            high_freq_factor=_opt_float(raw.get("high_freq_factor")),
            original_max_position_embeddings=None if omp is None else int(omp),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out


def dtype_name(dtype: torch.dtype) -> str:
    """HF config spelling of a torch dtype ("bfloat16")."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters; validated on construction.

    `attention_bias` means bias on q/k/v. Qwen2 always has it (and never on o_proj); for
    llama and qwen3 HF applies `attention_bias` to o_proj too, which `o_proj_bias` mirrors.
    `extra` carries HF keys that do not change the computation (token ids, initializer range)
    so that a load/save round trip keeps them.
    """

    model_type: ModelType
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in _ARCH_PREFIX:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; use one of "
                f"{sorted(_ARCH_PREFIX)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.torch_dtype not in _DTYPES:
            raise ConfigError(
                f"torch_dtype={self.torch_dtype!r} is not supported; use one of {sorted(_DTYPES)}"
            )
        if self.model_type == "qwen2":
            if not self.attention_bias:
                raise ConfigError(
                    "qwen2 always has q/k/v projection bias; set attention_bias=True "
                    "(or use model_type='llama' for a bias-free decoder)"
                )
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ConfigError(
                    f"qwen2 requires head_dim == hidden_size // num_attention_heads "
                    f"({self.hidden_size // self.num_attention_heads}), got {self.head_dim}"
                )
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ConfigError(
                f"qk_norm={self.qk_norm} does not match model_type={self.model_type!r}: "
                "qwen3 always has per-head q/k RMSNorm, llama and qwen2 never do"
            )

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @property
    def architecture(self) -> str:
        return f"{_ARCH_PREFIX[self.model_type]}ForCausalLM"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a HF `config.json` dict (transformers 4.x or 5.x layout)."""
        model_type = raw.get("model_type")
        if model_type is None:
            model_type = _model_type_from_architectures(raw.get("architectures") or [])
        if model_type not in _ARCH_PREFIX:
            raise ConfigError(
                f"config.json model_type={model_type!r} is not supported; use one of "
                f"{sorted(_ARCH_PREFIX)}"
            )
        _refuse_unsupported_hf_features(raw)
        if model_type == "mistral":
            _refuse_binding_window(raw)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in raw:
                raise ConfigError(f"config.json has no {key!r}")
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or int(raw["hidden_size"]) // heads
        rope_theta, rope_scaling = _rope_from_hf(raw)
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            model_type=cast(ModelType, model_type),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(model_type, raw),
            qk_norm=model_type == "qwen3",
            torch_dtype=str(dtype).removeprefix("torch."),
            extra={k: v for k, v in raw.items() if k not in _MANAGED_KEYS},
        )

    def to_hf_dict(self, architecture: str | None = None) -> dict[str, Any]:
        """HF `config.json` content; writes both the 4.x and 5.x RoPE/dtype keys."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling.to_hf_dict())
        out: dict[str, Any] = dict(self.extra)
        out.update(
            {
                "architectures": [architecture or self.architecture],
                "model_type": self.model_type,
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "hidden_act": "silu",
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                # transformers 4.x / vLLM spelling; 5.x reads rope_parameters
                "rope_scaling": None
                if self.rope_scaling is None
                else self.rope_scaling.to_hf_dict(),
                "rope_parameters": rope_parameters,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": self.tie_word_embeddings,
                "torch_dtype": self.torch_dtype,
                "dtype": self.torch_dtype,
            }
        )
        if self.model_type != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        elif self.model_type == "mistral":
            out["sliding_window"] = None  # native: the window never binds (from_hf_dict)
            out.pop("attention_bias")  # MistralAttention has no bias, nor this key
        else:
            out["use_sliding_window"] = False
        return out


def _attention_bias(model_type: str, raw: dict[str, Any]) -> bool:
    if model_type == "qwen2":
        return True
    if model_type == "mistral":
        return False  # transformers' MistralAttention has bias-free projections
    return bool(raw.get("attention_bias"))


def _refuse_binding_window(raw: dict[str, Any]) -> None:
    """Mistral attends within a sliding window, which the native decoder does not have: it
    runs natively only where the window covers every position the model takes."""
    window = raw.get("sliding_window")
    longest = int(raw.get("max_position_embeddings", 4096))
    if window is not None and int(window) < longest:
        raise ConfigError(
            f"mistral sliding_window={window} is shorter than max_position_embeddings "
            f"({longest}): the native decoder has no sliding window; this model runs "
            "through transformers' modeling (models/hf_causal.py)"
        )


def _model_type_from_architectures(architectures: list[str]) -> str | None:
    for arch in architectures:
        for model_type, prefix in _ARCH_PREFIX.items():
            if arch.startswith(prefix + "For"):
                return model_type
    return None


def _refuse_unsupported_hf_features(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported; the native MLP is SwiGLU (silu)")
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported by the native decoder")
    if raw.get("use_sliding_window"):
        raise ConfigError(
            "use_sliding_window=true is not supported by the native decoder; "
            "set use_sliding_window=false (full attention in every layer)"
        )
    prf = raw.get("partial_rotary_factor", 1.0)
    if prf not in (None, 1.0):
        raise ConfigError(f"partial_rotary_factor={prf} is not supported (only 1.0)")
    tp = raw.get("pretraining_tp", 1)
    if tp not in (None, 1):
        raise ConfigError(f"pretraining_tp={tp} is not supported (only 1)")


def _rope_from_hf(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and not isinstance(next(iter(params.values())), dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        return float(theta), RopeScaling.from_hf_dict(params)
    if isinstance(params, dict) and params:
        raise ConfigError("per-layer-type rope_parameters are not supported by the native decoder")
    scaling = raw.get("rope_scaling")
    theta = float(raw.get("rope_theta", 10000.0))
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be a dict or null, got {scaling!r}")
    return theta, RopeScaling.from_hf_dict(scaling)
