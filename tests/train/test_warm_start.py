"""The warm-start cache: computed once per key, restored exactly; a damaged file is named, set aside and recomputed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from comppo_jax.train.warm_start import cached_warm_start


def test_cache_computes_once_per_key_and_restores_exactly(tmp_path):
    template = {"w": jnp.zeros((2, 3), jnp.bfloat16), "layers": {"b": jnp.zeros(3, jnp.float32)}}
    calls = []

    def compute():
        calls.append(1)
        return {
            "w": jnp.full((2, 3), 1.0 / 3, jnp.bfloat16),
            "layers": {"b": jnp.arange(3, dtype=jnp.float32) / 7},
        }, 0.25

    first, loss = cached_warm_start(str(tmp_path), {"seed": 0}, template, compute)
    again, loss_again = cached_warm_start(str(tmp_path), {"seed": 0}, template, compute)
    assert len(calls) == 1 and loss == loss_again == 0.25
    assert again["w"].dtype == jnp.bfloat16
    for a, b in zip(np.asarray(first["w"], np.float32).ravel(), np.asarray(again["w"], np.float32).ravel()):
        assert a == b
    np.testing.assert_array_equal(first["layers"]["b"], again["layers"]["b"])
    cached_warm_start(str(tmp_path), {"seed": 1}, template, compute)
    assert len(calls) == 2


@pytest.mark.parametrize("damage", ["bytes overwritten", "truncated", "another model's leaves"])
def test_a_damaged_cache_is_named_set_aside_and_recomputed(tmp_path, damage, caplog):
    template = {"w": jnp.zeros((64, 64), jnp.float32)}
    calls = []

    def compute():
        calls.append(1)
        return {"w": jnp.full((64, 64), 0.5, jnp.float32)}, 0.5

    cached_warm_start(str(tmp_path), {"seed": 0}, template, compute)
    (path,) = tmp_path.glob("warm_start_*.npz")
    data = path.read_bytes()
    if damage == "bytes overwritten":  # a bad CRC inside the zip
        path.write_bytes(data[:200] + b"\xff" * 4096 + data[4296:])
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        np.savez(path, loss=np.float64(0.1), other=np.zeros(1))
    params, loss = cached_warm_start(str(tmp_path), {"seed": 0}, template, compute)
    assert len(calls) == 2 and loss == 0.5
    np.testing.assert_array_equal(params["w"], 0.5)
    (aside,) = tmp_path.glob("warm_start_*.npz.damaged-*")
    assert f"warm-start cache {path} cannot be read" in caplog.text and str(aside) in caplog.text
    cached_warm_start(str(tmp_path), {"seed": 0}, template, compute)  # the recomputed file is whole again
    assert len(calls) == 2


def test_the_warm_start_compiles_one_program_for_batches_of_many_lengths(tmp_path):
    """The tiny task's batches have many longest rows; padded to buckets they share fewer programs."""
    import jax
    from conftest import small_train_config

    from comppo_jax.data.tokenizers import load_tokenizer
    from comppo_jax.models import ModelConfig, init_params
    from comppo_jax.train import warm_start as module
    from comppo_jax.train.start import load_encodable_problems

    cfg = small_train_config(str(tmp_path))
    tokenizer = load_tokenizer("")
    problems, _ = load_encodable_problems(cfg, tokenizer)
    steps, batch_size = 12, 4
    rng = np.random.default_rng(cfg.seed)
    batches = [module.supervised_batch(tokenizer, problems, rng, batch_size) for _ in range(steps)]
    # Without the buckets each longest (row, response) pair would be a program of its own.
    longest = {tuple(int(np.asarray(batch[i]).sum(axis=1).max()) for i in (1, 4)) for batch in batches}
    buckets = {(batch[0].shape[1], batch[3].shape[1]) for batch in batches}
    assert all(length % module.LENGTH_BUCKET == 0 for bucket in buckets for length in bucket), buckets
    assert len(buckets) < len(longest), (buckets, longest)

    config = ModelConfig(
        architecture="qwen3",
        vocab_size=tokenizer.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
    )
    params = init_params(config, jax.random.PRNGKey(0))
    module.supervised_step.clear_cache()
    module.warm_start(
        params, config, tokenizer, problems, steps=steps, batch_size=batch_size, learning_rate=1e-3, seed=cfg.seed
    )
    assert module.supervised_step._cache_size() == len(buckets)
