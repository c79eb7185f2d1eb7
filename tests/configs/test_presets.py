"""The config presets load, override from the command line, and carry the real architectures."""

from __future__ import annotations

import math

import jax
import pytest

from comppo_jax.models import ConfigError, ModelConfig, init_params, load_config_file, preset_model_config


def parameter_count(config: ModelConfig) -> int:
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


@pytest.mark.parametrize(
    "name,expected_billions",
    # Published sizes: Qwen3-4B 4.02B (tied embeddings), Llama-3.1-8B 8.03B.
    [("qwen3_4b", 4.02), ("llama3_8b", 8.03)],
)
def test_presets_have_the_published_parameter_counts(name, expected_billions):
    config = preset_model_config(name)
    assert config.dtype == "bfloat16"
    assert abs(parameter_count(config) / 1e9 - expected_billions) < 0.01


def test_tiny_preset_is_small_and_float32():
    config = preset_model_config("tiny")
    assert config.dtype == "float32" and config.architecture == "qwen3"
    assert parameter_count(config) < 2_000_000


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.py does not exist"):
        load_config_file(tmp_path / "nope.py")
