"""The JAX policy against transformers' torch implementation on the same random weights."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rewrite_config, right_padded_batch

from comppo_jax.models import ModelConfig, forward, from_hf, to_hf

# Each architecture and each of tied / untied embeddings once: the loader and the forward handle
# the head the same way for either architecture (as the export round trip below assumes too).
CASES = [("qwen3", True), ("llama", False)]


def torch_outputs(model, tokens, mask):
    import torch  # here, not at collection, where every worker would import it

    with torch.no_grad():
        return model(
            torch.from_numpy(tokens.astype(np.int64)),
            attention_mask=torch.from_numpy(mask.astype(np.int64)),
            output_attentions=True,
            output_hidden_states=True,
        )


def max_relative_error(ours, reference, mask):
    return float(np.abs(ours[mask] - reference[mask]).max() / np.abs(reference[mask]).max())


def windowed_herfindahl(attentions, mask, window_start):
    """H and n from transformers' final-layer attention probabilities [B, Hq, L, L]."""
    head_mean = attentions.mean(axis=1)
    batch, length = mask.shape
    herfindahl = np.zeros((batch, length))
    window_size = np.zeros((batch, length), np.int64)
    for b in range(batch):
        for p in range(length):
            keys = [i for i in range(window_start[b], p + 1) if mask[b, i]]
            if keys:
                weights = head_mean[b, p, keys] / head_mean[b, p, keys].sum()
                herfindahl[b, p] = np.square(weights).sum()
                window_size[b, p] = len(keys)
    return herfindahl, window_size


@pytest.mark.parametrize("architecture,tie", CASES)
def test_logits_hidden_states_and_herfindahl_match_transformers(hf_checkpoint, architecture, tie):
    path, model = hf_checkpoint(architecture, tie)
    config, params = from_hf(path)
    assert config.architecture == architecture and config.tie_word_embeddings == tie
    tokens, mask = right_padded_batch()
    window_start = np.array([5, 0, 3, 17], np.int32)  # a prompt length, the full window, ...
    reference = torch_outputs(model, tokens, mask)
    out = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(window_start))

    assert out.logits.dtype == jnp.float32
    assert max_relative_error(np.asarray(out.logits), reference.logits.numpy(), mask) <= 1e-4
    assert out.hidden_states.shape[0] == config.num_layers + 1
    for index, hidden in enumerate(reference.hidden_states):
        assert max_relative_error(np.asarray(out.hidden_states[index]), hidden.numpy(), mask) <= 1e-4, index

    herfindahl, window_size = windowed_herfindahl(reference.attentions[-1].numpy(), mask, window_start)
    valid = mask & (window_size > 0)
    np.testing.assert_array_equal(np.asarray(out.window_size)[mask], window_size[mask])
    np.testing.assert_allclose(np.asarray(out.herfindahl)[valid], herfindahl[valid], rtol=0, atol=1e-5)
    assert valid.sum() == 15 + 14 + 6  # row 3's window starts after its last real token: empty everywhere


def test_selected_hidden_layers(hf_checkpoint):
    path, model = hf_checkpoint("qwen3", True)
    config, params = from_hf(path)
    tokens, mask = right_padded_batch()
    reference = torch_outputs(model, tokens, mask)
    selected = (3, 0, 2)
    out = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask), hidden_layers=selected)
    assert out.hidden_states.shape == (3, *tokens.shape, config.hidden_size)
    assert out.herfindahl is None and out.window_size is None
    for slot, index in enumerate(selected):
        assert (
            max_relative_error(np.asarray(out.hidden_states[slot]), reference.hidden_states[index].numpy(), mask)
            <= 1e-4
        )


def to_transformers_4_layout(config):
    """Rewrites a transformers 5.x config.json into the 4.x hub layout (top-level rope fields)."""
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    config["torch_dtype"] = config.pop("dtype", "float32")
    config["transformers_version"] = "4.51.0"


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_both_config_layouts_give_the_same_model(hf_checkpoint, tmp_path, architecture):
    path, _ = hf_checkpoint(architecture, architecture == "qwen3")
    config_5x, params = from_hf(path)
    legacy = tmp_path / "legacy"
    to_hf(config_5x, params, str(legacy))
    rewrite_config(str(legacy), to_transformers_4_layout)
    with open(legacy / "config.json") as f:
        assert "rope_parameters" not in f.read()
    config_4x, params_4x = from_hf(str(legacy))
    assert config_4x == config_5x
    if architecture == "llama":
        assert config_4x.rope_scaling.original_max_position_embeddings == 16


# Each architecture and each layout (one file; shards, here without the tied head) once: the
# sharding is by bytes, whatever the tensors.
@pytest.mark.parametrize("architecture,tie,max_shard_bytes", [("qwen3", True, 40_000), ("llama", False, None)])
def test_to_hf_round_trip_reloads_in_transformers(hf_checkpoint, tmp_path, architecture, tie, max_shard_bytes):
    path, model = hf_checkpoint(architecture, tie)
    config, params = from_hf(path)
    to_hf(config, params, str(tmp_path), max_shard_bytes=max_shard_bytes)
    files = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in files) == (max_shard_bytes is not None)
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens, mask = right_padded_batch(seed=1)
    expected = torch_outputs(model, tokens, mask).logits.numpy()
    np.testing.assert_array_equal(torch_outputs(reloaded, tokens, mask).logits.numpy()[mask], expected[mask])
    # And the sharded / single-file export loads back into JAX identically.
    config_again, params_again = from_hf(str(tmp_path))
    assert config_again == config
    for path_key, leaf in jax.tree_util.tree_leaves_with_path(params):
        again = params_again
        for key in path_key:
            again = again[key.key]
        np.testing.assert_array_equal(np.asarray(again), np.asarray(leaf), err_msg=jax.tree_util.keystr(path_key))


def test_bfloat16_params_compute_close_to_float32(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3", True)
    config32, params32 = from_hf(path)
    config16, params16 = from_hf(path, dtype="bfloat16")
    assert config16.dtype == "bfloat16" and params16["layers"]["q_proj"].dtype == jnp.bfloat16
    tokens, mask = right_padded_batch()
    window_start = jnp.zeros((tokens.shape[0],), jnp.int32)
    out32 = forward(params32, config32, jnp.asarray(tokens), jnp.asarray(mask), window_start)
    out16 = forward(params16, config16, jnp.asarray(tokens), jnp.asarray(mask), window_start)
    assert out16.logits.dtype == jnp.float32 and out16.herfindahl.dtype == jnp.float32
    assert out16.hidden_states.dtype == jnp.bfloat16
    # bf16 weights and activations: a few percent of the logit scale.
    assert max_relative_error(np.asarray(out16.logits), np.asarray(out32.logits), mask) < 5e-2
    assert np.abs(np.asarray(out16.herfindahl) - np.asarray(out32.herfindahl))[mask].max() < 2e-2


def test_model_config_matches_hf_field_mapping(hf_checkpoint):
    path, model = hf_checkpoint("llama", False)
    config, _ = from_hf(path)
    hf = model.config
    assert isinstance(config, ModelConfig)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.hidden_size // hf.num_attention_heads,
    )
    assert config.eos_token_ids == (2,)
