"""LoRA adapters beside the frozen base: fresh ones compute the base, merged and unmerged forwards
agree, the decode engine reads them, the split / join round-trips and the sharding follows the base."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import right_padded_batch

from comppo_jax import sharding
from comppo_jax.models import ModelConfig, forward, init_params, lora

CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    lora_alpha=16.0,
)
ALL = lora.LoraConfig(rank=4, alpha=16.0)


def trained_adapters(config=CONFIG, spec=ALL, seed=1):
    """Adapters with a non-zero B, as after some training."""
    adapters = lora.init_adapters(config, spec, jax.random.PRNGKey(seed))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 100))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            0.3 * jax.random.normal(next(keys), x.shape) if jax.tree_util.keystr(path).endswith("_lora_b']") else x
        ),
        adapters,
    )


def logits(params, config=CONFIG):
    tokens, mask = right_padded_batch()
    return np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)).logits)


@pytest.fixture(scope="module")
def base():
    return init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.2)


def test_fresh_adapters_give_exactly_the_base_logits(base):
    fresh = lora.join(base, lora.init_adapters(CONFIG, ALL, jax.random.PRNGKey(1)))
    assert lora.has_adapters(fresh) and not lora.has_adapters(base)
    with jax.disable_jit():  # op by op: x @ W + 0 is x @ W
        np.testing.assert_array_equal(logits(fresh), logits(base))
    # Compiled, XLA may fuse the (zero) adapter term into the base matmul's accumulation: rounding only.
    np.testing.assert_allclose(logits(fresh), logits(base), atol=1e-5, rtol=1e-5)


# Every target, and a subset: part of the fused q/k/v projection (k without an adapter), none of the
# fused gate/up, and an unfused projection (down) with one.
@pytest.mark.parametrize("targets", [tuple(lora.TARGETS), ("q", "v", "down")])
def test_merged_and_unmerged_forwards_agree_in_float32(base, targets):
    spec = lora.LoraConfig(rank=4, alpha=16.0, targets=targets)
    adapted = lora.join(base, trained_adapters(spec=spec))
    merged = lora.merged(adapted, CONFIG)
    assert not lora.has_adapters(merged) and jax.tree.structure(merged) == jax.tree.structure(base)
    unmerged, folded = logits(adapted), logits(merged)
    assert np.abs(unmerged - logits(base)).max() > 1e-2  # the adapters change the function
    np.testing.assert_allclose(unmerged, folded, atol=1e-5, rtol=1e-5)


def test_adapters_add_alpha_over_r_times_x_a_b(base):
    """PEFT's scaling alpha / r (here 16 / 4 = 4; alpha / sqrt(r) would be 8): the adapted forward is the
    base's with each W replaced by W + (alpha / r) A @ B, folded here by hand in float64, and so is `merged`."""
    assert (CONFIG.lora_alpha, ALL.rank) == (16.0, 4)
    adapted = lora.join(base, trained_adapters())
    by_hand = dict(base["layers"])
    for weight in ALL.weights:
        a, b = (np.asarray(adapted["layers"][weight + suffix], np.float64) for suffix in ("_lora_a", "_lora_b"))
        by_hand[weight] = (np.asarray(base["layers"][weight], np.float64) + 16.0 / 4 * a @ b).astype(np.float32)
        np.testing.assert_allclose(
            lora.merged(adapted, CONFIG)["layers"][weight], by_hand[weight], rtol=1e-6, atol=1e-6
        )
    folded = logits({**base, "layers": by_hand})
    assert np.abs(folded - logits(base)).max() > 1e-2
    np.testing.assert_allclose(logits(adapted), folded, atol=1e-5, rtol=1e-5)


def test_split_join_and_base_share_the_base_arrays(base):
    adapted = lora.join(base, trained_adapters())
    trainable, frozen = lora.split(adapted)
    assert set(trainable["layers"]) == {w + s for w in ALL.weights for s in ("_lora_a", "_lora_b")} and set(
        trainable
    ) == {"layers"}
    assert all(a is b for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)))
    assert all(a is b for a, b in zip(jax.tree.leaves(lora.base(adapted)), jax.tree.leaves(base)))
    assert jax.tree.structure(lora.join(frozen, trainable)) == jax.tree.structure(adapted)
    assert lora.split(base) == (base, None) and lora.join(None, base) is base


def test_adapter_shapes_and_init():
    adapters = lora.init_adapters(CONFIG, lora.LoraConfig(rank=3, targets=("q", "down")), jax.random.PRNGKey(0))[
        "layers"
    ]
    assert {name: x.shape for name, x in adapters.items()} == {
        "q_proj_lora_a": (2, 32, 3),
        "q_proj_lora_b": (2, 3, 32),
        "down_proj_lora_a": (2, 48, 3),
        "down_proj_lora_b": (2, 3, 32),
    }
    assert not np.any(adapters["q_proj_lora_b"]) and 0 < np.abs(adapters["q_proj_lora_a"]).max() <= 1 / np.sqrt(32)


def test_adapters_follow_their_base_weights_sharding_rule():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
    specs = jax.tree.map(
        lambda s: s.spec, sharding.tree_shardings(mesh, lora.init_adapters(CONFIG, ALL, jax.random.PRNGKey(0)))
    )
    for weight in ALL.weights:
        _, fan_in, fan_out = sharding.PARAM_RULES[weight]
        assert specs["layers"][weight + "_lora_a"] == sharding.P(None, fan_in, None)
        assert specs["layers"][weight + "_lora_b"] == sharding.P(None, None, fan_out)


def test_lora_config_of_a_model_section():
    from ml_collections import config_dict

    section = config_dict.ConfigDict({"lora": {"rank": 8, "alpha": 32.0, "targets": "q, v"}})
    assert lora.LoraConfig.of(section) == lora.LoraConfig(8, 32.0, ("q", "v"))
    assert not lora.LoraConfig.of(config_dict.ConfigDict({})).enabled
    with pytest.raises(Exception, match="'qkv' is not one of"):
        lora.LoraConfig.of(config_dict.ConfigDict({"lora": {"rank": 8, "alpha": 32.0, "targets": "qkv"}}))
