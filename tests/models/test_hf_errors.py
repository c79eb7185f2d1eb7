"""Bad checkpoints and configs give errors that name the offending file, tensor or field."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from conftest import rewrite_config
from ml_collections import config_dict
from safetensors.numpy import load_file, save_file

from comppo_jax.models import CheckpointError, ConfigError, ModelConfig, from_hf, load_policy


@pytest.fixture
def checkpoint_copy(hf_checkpoint, tmp_path):
    source, _ = hf_checkpoint("qwen3", True)
    target = tmp_path / "checkpoint"
    shutil.copytree(source, target)
    return str(target)


def edit_tensors(path, edit):
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint_copy):
    edit_tensors(checkpoint_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        from_hf(checkpoint_copy)


def test_mis_shaped_tensor_is_named_with_both_shapes(checkpoint_copy):
    def shrink(tensors):
        tensors["model.layers.2.self_attn.k_proj.weight"] = tensors["model.layers.2.self_attn.k_proj.weight"][:-1]

    edit_tensors(checkpoint_copy, shrink)
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.2\.self_attn\.k_proj\.weight'.*shape \(31, 64\), expected \(32, 64\)"
    ):
        from_hf(checkpoint_copy)


def test_unexpected_tensor_is_named(checkpoint_copy):
    edit_tensors(checkpoint_copy, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": t["model.norm.weight"]}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        from_hf(checkpoint_copy)


def test_unsupported_architecture_is_named(checkpoint_copy):
    rewrite_config(checkpoint_copy, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError, match=r"'architectures'=\['GPT2LMHeadModel'\] is not supported"):
        from_hf(checkpoint_copy)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(hidden_act="gelu"), r"'hidden_act'='gelu' is not supported"),
        (lambda c: c.update(attention_bias=True), r"'attention_bias'=true is not supported"),
        (lambda c: c.pop("num_hidden_layers"), r"'num_hidden_layers' is missing"),
        (
            lambda c: c.update(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}),
            r"'rope_parameters\.rope_type'='yarn'",
        ),
        (
            lambda c: c.update(rope_parameters={"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}),
            r"'rope_parameters\.low_freq_factor' is missing",
        ),
    ],
)
def test_unsupported_or_missing_config_fields_are_named(checkpoint_copy, edit, message):
    rewrite_config(checkpoint_copy, edit)
    with pytest.raises(ConfigError, match=message):
        from_hf(checkpoint_copy)


def test_missing_files_name_the_path(tmp_path, checkpoint_copy):
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        from_hf(str(tmp_path / "nowhere"))
    os.remove(os.path.join(checkpoint_copy, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no weights in .*model\.safetensors or model\.safetensors\.index\.json"):
        from_hf(checkpoint_copy)


def test_index_pointing_at_a_missing_shard(checkpoint_copy):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    with open(os.path.join(checkpoint_copy, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00002\.safetensors \(listed in .*index\.json\) not found"
    ):
        from_hf(checkpoint_copy)


def test_model_config_rejects_bad_fields():
    with pytest.raises(ConfigError, match=r"num_heads=6 must be a multiple of num_kv_heads=4"):
        ModelConfig("qwen3", 10, 8, 8, 1, 6, 4, 4)
    with pytest.raises(ConfigError, match=r"unknown model config field\(s\) \['hidden'\]"):
        ModelConfig.from_dict({"architecture": "qwen3", "hidden": 3})
    with pytest.raises(ConfigError, match=r"dtype='float16' is not supported"):
        ModelConfig("llama", 10, 8, 8, 1, 2, 2, 4, dtype="float16")


def test_load_policy_refuses_a_checkpoint_of_another_architecture(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3", True)
    config, _ = from_hf(path)
    section = config_dict.ConfigDict({"path": path, "arch": config.replace(hidden_size=128).to_dict()})
    with pytest.raises(ConfigError, match=r"hidden_size=64 but config model\.arch\.hidden_size=128"):
        load_policy(section, rng=None)
    section.arch.hidden_size = 64
    loaded, params = load_policy(section, rng=None)
    assert loaded == config and params["embed"].shape == (config.vocab_size, 64)


@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_a_damaged_safetensors_file_is_a_checkpoint_error_naming_it(checkpoint_copy, damage):
    weights = os.path.join(checkpoint_copy, "model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncated" else b"")
    with pytest.raises(CheckpointError, match=re.escape(weights) + " is not a readable safetensors file"):
        from_hf(checkpoint_copy)
