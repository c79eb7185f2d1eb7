"""Architecture description of the policy and its mapping to Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

from comppo_jax.errors import ConfigError as ConfigError  # re-exported: callers import it from comppo_jax.models

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
DTYPES = ("float32", "bfloat16")
ATTENTION = (
    "auto",
    "xla",
    "chunked",
    "splash",
    "splash_interpret",
    "packed_flash",
    "packed_flash_interpret",
    "cudnn",
)  # comppo_jax.models.attention
REMAT = ("none", "full", "dots", "dots_no_batch")  # per-layer jax.checkpoint policy (transformer.REMAT_POLICIES)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """The `llama3` RoPE frequency rescaling (Llama-3.1 and later)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Qwen3 or Llama-3.x decoder. Frozen, hence hashable: pass it to jit as a static argument."""

    architecture: str  # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"  # params and activations; softmax and norms accumulate in float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # How to run it, not what it is (config `model.attention` / `model.remat` / `model.logits_chunk`):
    # the training attention implementation, the per-layer remat policy, and response tokens per
    # chunk of the vocabulary projection in log-prob / entropy passes (0 = all at once).
    attention: str = "auto"
    remat: str = "none"
    logits_chunk: int = 0
    # LoRA adapters in the params (comppo_jax.models.lora) add (lora_alpha / rank) * x @ A @ B
    # (config `model.lora.alpha`).
    lora_alpha: float = 64.0

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ConfigError(
                f"architecture={self.architecture!r} is not supported; expected one of {sorted(ARCHITECTURES.values())}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                "(grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; expected one of {DTYPES}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention={self.attention!r} is not supported; expected one of {ATTENTION}")
        if self.remat not in REMAT:
            raise ConfigError(f"remat={self.remat!r} is not supported; expected one of {REMAT}")
        if not isinstance(self.logits_chunk, int) or isinstance(self.logits_chunk, bool) or self.logits_chunk < 0:
            raise ConfigError(
                f"logits_chunk must be a non-negative integer (0 = no chunking), got {self.logits_chunk!r}"
            )
        if isinstance(self.rope_scaling, Mapping):  # from ml_collections / JSON
            object.__setattr__(self, "rope_scaling", Llama3RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalizes each query/key head before RoPE."""
        return self.architecture == "qwen3"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from its field names (e.g. an ml_collections `model.arch` section)."""
        fields = dict(fields)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], dtype: str | None = None) -> ModelConfig:
        """Maps a Hugging Face `config.json` dict (transformers 4.x or 5.x layout) to a ModelConfig.

        4.x writes top-level `rope_theta` / `rope_scaling`; 5.x writes `rope_parameters`
        holding `rope_theta`, `rope_type` and the llama3 fields. `dtype=None` keeps the
        checkpoint's declared dtype when it is bfloat16, else float32.
        """
        architecture = _architecture(hf)

        def required(name: str) -> Any:
            if name not in hf or hf[name] is None:
                raise ConfigError(f"config.json field {name!r} is missing")
            return hf[name]

        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json field 'hidden_act'={hf['hidden_act']!r} is not supported (only 'silu')")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if hf.get(flag):
                raise ConfigError(f"config.json field {flag!r}=true is not supported")
        rope_theta, rope_scaling = _rope(hf)
        num_heads = required("num_attention_heads")
        hidden_size = required("hidden_size")
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        if dtype is None:
            declared = hf.get("dtype") or hf.get("torch_dtype")
            dtype = "bfloat16" if declared == "bfloat16" else "float32"
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            architecture=architecture,
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=required("intermediate_size"),
            num_layers=required("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the transformers config class (both 4.x and 5.x accept these)."""
        rope_scaling = None
        if self.rope_scaling is not None:
            rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (self.eos_token_ids or (None,))[0]
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            attention_bias=False,
            bos_token_id=self.bos_token_id,
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
        )

    @property
    def hf_architecture(self) -> str:
        return {v: k for k, v in ARCHITECTURES.items()}[self.architecture]


def _architecture(hf: Mapping[str, Any]) -> str:
    architectures = hf.get("architectures")
    if architectures:
        if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            raise ConfigError(
                f"config.json field 'architectures'={architectures!r} is not supported; "
                f"expected one of {sorted(ARCHITECTURES)}"
            )
        return ARCHITECTURES[architectures[0]]
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES.values():
        raise ConfigError(
            f"config.json field 'model_type'={model_type!r} is not supported; "
            f"expected one of {sorted(ARCHITECTURES.values())}"
        )
    return cast(str, model_type)  # one of ARCHITECTURES' values


def _rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Reads RoPE settings from either config layout; returns (theta, llama3 scaling or None)."""
    if hf.get("rope_parameters") is not None:
        params, where = hf["rope_parameters"], "rope_parameters"
        theta = params.get("rope_theta", hf.get("rope_theta"))
    else:
        params, where = hf.get("rope_scaling") or {}, "rope_scaling"
        theta = hf.get("rope_theta")
    if theta is None:
        raise ConfigError("config.json field 'rope_theta' (top level or in 'rope_parameters') is missing")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(
            f"config.json field '{where}.rope_type'={rope_type!r} is not supported (only 'default', 'llama3')"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ConfigError(f"config.json field '{where}.{missing.args[0]}' is missing for rope_type 'llama3'") from None
    return theta, scaling
