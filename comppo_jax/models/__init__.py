"""The policy: a pure-functional Qwen3 / Llama-3.x decoder and its Hugging Face interop."""

from comppo_jax.models import lora
from comppo_jax.models.config import ConfigError, Llama3RopeScaling, ModelConfig
from comppo_jax.models.hf import CheckpointError, from_hf, to_hf
from comppo_jax.models.loading import load_config_file, load_policy, model_config, preset_model_config
from comppo_jax.models.transformer import FinalAttention, ForwardOutput, forward, init_params, param_shapes

__all__ = [
    "CheckpointError",
    "ConfigError",
    "FinalAttention",
    "ForwardOutput",
    "Llama3RopeScaling",
    "ModelConfig",
    "forward",
    "from_hf",
    "init_params",
    "load_config_file",
    "load_policy",
    "lora",
    "model_config",
    "param_shapes",
    "preset_model_config",
    "to_hf",
]
