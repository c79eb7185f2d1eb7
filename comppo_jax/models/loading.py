"""Builds the policy from a config's `model` section: random init or an HF checkpoint (a local directory, a
gs:// one or a hub id: `comppo_jax.hub`)."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Mapping
from typing import Any

import jax

from comppo_jax import hub
from comppo_jax.models.config import ConfigError, ModelConfig
from comppo_jax.models.hf import from_hf
from comppo_jax.models.transformer import init_params

# The repository's ml_collections presets (configs/*.py), for benchmarks and tests run from a checkout.
PRESET_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"

# Fields that decide the parameter shapes and the function the model computes.
_ARCHITECTURE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
)


# The `model` section's execution fields, copied onto the ModelConfig (absent: the defaults).
EXECUTION_FIELDS = ("attention", "remat", "logits_chunk")


def _section_dict(model_section: Mapping[str, Any]) -> dict[str, Any]:
    return model_section.to_dict() if hasattr(model_section, "to_dict") else dict(model_section)


def model_config(model_section: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a config's `model` section: `model.arch` plus the execution fields."""
    section = _section_dict(model_section)
    execution = {name: section[name] for name in EXECUTION_FIELDS if name in section}
    if "lora" in section:
        execution["lora_alpha"] = float(section["lora"]["alpha"])
    return ModelConfig.from_dict({**section["arch"], **execution})


def load_policy(model_section: Mapping[str, Any], rng: jax.Array) -> tuple[ModelConfig, dict]:
    """(config, params) from `model.path` (an HF checkpoint: a local or gs:// directory, or a hub id) or, when it
    is empty, `model.arch` at random.

    A checkpoint whose architecture differs from `model.arch` is refused, naming the field,
    so a wrong path fails before any training starts.
    """
    section = _section_dict(model_section)
    arch = model_config(section)
    if not section.get("path"):
        return arch, init_params(arch, rng)
    config, params = from_hf(hub.resolve_model(section["path"]), dtype=arch.dtype)
    config = config.replace(**{name: getattr(arch, name) for name in (*EXECUTION_FIELDS, "lora_alpha")})
    for field in _ARCHITECTURE_FIELDS:
        if getattr(config, field) != getattr(arch, field):
            raise ConfigError(
                f"checkpoint {section['path']} has {field}={getattr(config, field)!r} but config model.arch.{field}="
                f"{getattr(arch, field)!r}; use the config preset for this checkpoint or override model.arch.{field}"
            )
    return config, params


def load_config_file(path: str | pathlib.Path) -> Any:
    """`get_config()` of an ml_collections config file, as `--config=path` loads it (by convention an
    `ml_collections.ConfigDict`)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"config_{path.stem}", path)
    # spec is None for a file with no import loader (not .py): module_from_spec raises AttributeError then.
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.get_config()


def preset_model_config(name: str) -> ModelConfig:
    """The architecture (`model.arch`) of the preset `configs/{name}.py`, e.g. "tiny" or "qwen3_4b"."""
    return ModelConfig.from_dict(load_config_file(PRESET_DIR / f"{name}.py").model.arch.to_dict())
