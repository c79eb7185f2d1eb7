"""The warm-start cache: computed once per key, restored exactly, refused when it does not fit."""

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
        return {"w": jnp.full((2, 3), 1.0 / 3, jnp.bfloat16), "layers": {"b": jnp.arange(3, dtype=jnp.float32) / 7}}, 0.25

    first, loss = cached_warm_start(str(tmp_path), {"seed": 0}, template, compute)
    again, loss_again = cached_warm_start(str(tmp_path), {"seed": 0}, template, compute)
    assert len(calls) == 1 and loss == loss_again == 0.25
    assert again["w"].dtype == jnp.bfloat16
    for a, b in zip(np.asarray(first["w"], np.float32).ravel(), np.asarray(again["w"], np.float32).ravel()):
        assert a == b
    np.testing.assert_array_equal(first["layers"]["b"], again["layers"]["b"])
    cached_warm_start(str(tmp_path), {"seed": 1}, template, compute)
    assert len(calls) == 2
    cached_warm_start("", {"seed": 0}, template, compute)  # "" disables the cache
    assert len(calls) == 3
    with pytest.raises(ValueError, match="does not match this model"):
        cached_warm_start(str(tmp_path), {"seed": 0}, {"other": jnp.zeros(1)}, compute)
