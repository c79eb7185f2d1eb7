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
