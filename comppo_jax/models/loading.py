"""Builds the policy from a config's `model` section: random init or a local HF checkpoint."""

from __future__ import annotations

from typing import Any, Mapping

import jax

from comppo_jax.models.config import ConfigError, ModelConfig
from comppo_jax.models.hf import from_hf
from comppo_jax.models.transformer import init_params

# Fields that decide the parameter shapes and the function the model computes.
_ARCHITECTURE_FIELDS = (
    "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "tie_word_embeddings", "rope_theta", "rope_scaling",
)


def load_policy(model_section: Mapping[str, Any], rng: jax.Array) -> tuple[ModelConfig, dict]:
    """(config, params) from `model.path` (HF directory) or, when it is empty, `model.arch` at random.

    A checkpoint whose architecture differs from `model.arch` is refused, naming the field,
    so a wrong path fails before any training starts.
    """
    section = model_section.to_dict() if hasattr(model_section, "to_dict") else dict(model_section)
    arch = ModelConfig.from_dict(section["arch"])
    if not section.get("path"):
        return arch, init_params(arch, rng)
    config, params = from_hf(section["path"], dtype=arch.dtype)
    for field in _ARCHITECTURE_FIELDS:
        if getattr(config, field) != getattr(arch, field):
            raise ConfigError(
                f"checkpoint {section['path']} has {field}={getattr(config, field)!r} but config model.arch.{field}="
                f"{getattr(arch, field)!r}; use the config preset for this checkpoint or override model.arch.{field}"
            )
    return config, params
