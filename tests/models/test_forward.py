"""Properties of `forward` and `init_params` on random tiny configs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import nested_jaxprs, right_padded_batch

import pallas_kernels
from comppo_jax import sharding
from comppo_jax.models import ModelConfig, forward, init_params, param_shapes

CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=8,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def params():
    # Larger-than-default init so attention is far from uniform and the checks have teeth.
    return init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)


def run(params, tokens, mask, window_start=None, config=CONFIG):
    window_start = None if window_start is None else jnp.asarray(window_start, jnp.int32)
    return forward(params, config, jnp.asarray(tokens), jnp.asarray(mask), window_start)


def test_init_params_matches_param_shapes_and_dtype():
    for config in (CONFIG, CONFIG.replace(tie_word_embeddings=True, dtype="bfloat16", architecture="llama")):
        params = init_params(config, jax.random.PRNGKey(1))
        assert jax.tree.map(lambda a: tuple(a.shape), params) == param_shapes(config)
        assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(config.dtype)}
        assert ("lm_head" in params) != config.tie_word_embeddings
        assert ("q_norm" in params["layers"]) == (config.architecture == "qwen3")


def test_causality_later_tokens_do_not_change_earlier_outputs(params):
    tokens, mask = right_padded_batch(lengths=(16, 16), length=16, vocab=CONFIG.vocab_size)
    changed = tokens.copy()
    changed[:, 10:] = (changed[:, 10:] + 7) % CONFIG.vocab_size
    window_start = [3, 0]
    before, after = run(params, tokens, mask, window_start), run(params, changed, mask, window_start)
    np.testing.assert_allclose(before.logits[:, :10], after.logits[:, :10], atol=1e-5)
    np.testing.assert_allclose(before.herfindahl[:, :10], after.herfindahl[:, :10], atol=1e-6)
    assert np.abs(np.asarray(before.logits[:, 10:] - after.logits[:, 10:])).max() > 1e-3


def test_padding_tokens_do_not_leak(params):
    tokens, mask = right_padded_batch(lengths=(16, 9, 5), length=16, vocab=CONFIG.vocab_size)
    scrambled = np.where(mask, tokens, (tokens * 3 + 1) % CONFIG.vocab_size)
    a, b = run(params, tokens, mask, [2, 2, 2]), run(params, scrambled, mask, [2, 2, 2])
    np.testing.assert_allclose(np.asarray(a.logits)[mask], np.asarray(b.logits)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.herfindahl)[mask], np.asarray(b.herfindahl)[mask], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(a.window_size)[mask], np.asarray(b.window_size)[mask])


def test_left_padded_row_equals_unpadded_row(params):
    tokens, _ = right_padded_batch(lengths=(12,), length=12, vocab=CONFIG.vocab_size)
    unpadded = run(params, tokens, np.ones_like(tokens, bool), [0])
    shifted = np.concatenate([np.zeros((1, 4), np.int32), tokens], axis=1)
    left_mask = np.arange(16)[None] >= 4
    padded = run(params, shifted, left_mask, [4])
    np.testing.assert_allclose(np.asarray(padded.logits[:, 4:]), np.asarray(unpadded.logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(padded.herfindahl[:, 4:]), np.asarray(unpadded.herfindahl), atol=1e-6)
    assert np.isfinite(np.asarray(padded.logits)).all()


def test_window_size_follows_the_design_convention(params):
    """Response window starting at P: the state before y_t (position P + t - 2) sees n_t = t - 1 keys."""
    prompt, response = 6, 8
    tokens, mask = right_padded_batch(lengths=(prompt + response,), length=prompt + response, vocab=CONFIG.vocab_size)
    out = run(params, tokens, mask, [prompt])
    per_token = np.asarray(out.window_size[0, prompt - 1 : prompt + response - 1])
    np.testing.assert_array_equal(per_token, np.arange(response))
    full = run(params, tokens, mask, [0])
    np.testing.assert_array_equal(np.asarray(full.window_size[0]), np.arange(1, prompt + response + 1))


def test_forward_is_differentiable_and_concentration_is_detached(params):
    tokens, mask = right_padded_batch(lengths=(10, 7), length=10, vocab=CONFIG.vocab_size)

    def loss(p, use_herfindahl):
        out = run(p, tokens, mask, [0, 0])
        return out.herfindahl.sum() if use_herfindahl else jnp.mean(out.logits**2)

    grads = jax.grad(loss)(params, False)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["layers"]["q_proj"]).max()) > 0
    herfindahl_grads = jax.grad(loss)(params, True)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(herfindahl_grads))


def test_unrolled_fused_layers_on_cpu_equal_the_scanned_layers_of_an_accelerator(params, monkeypatch):
    tokens, mask = right_padded_batch(lengths=(10, 7), length=10, vocab=CONFIG.vocab_size)
    window_start = jnp.asarray([3, 0], jnp.int32)

    def logits_and_grads():
        jax.clear_caches()  # the layer loop is chosen at trace time
        loss = lambda p: jnp.mean(run(p, tokens, mask, window_start).logits ** 2)
        return run(params, tokens, mask, window_start), jax.grad(loss)(params)

    cpu_out, cpu_grads = logits_and_grads()
    lowered = jax.jit(lambda p: run(p, tokens, mask)).lower(params).compile().as_text()
    assert " while(" not in lowered  # unrolled: no layer loop on CPU (the kernel, interpreted, would bring its own)
    monkeypatch.setattr(sharding, "context_platform", lambda: "tpu")
    scanned_out, scanned_grads = logits_and_grads()
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(cpu_out.logits)[real], np.asarray(scanned_out.logits)[real], atol=1e-5)
    np.testing.assert_allclose(cpu_out.herfindahl, scanned_out.herfindahl, atol=1e-6)
    for path, cpu, scanned in zip(
        jax.tree_util.tree_leaves_with_path(cpu_grads), jax.tree.leaves(cpu_grads), jax.tree.leaves(scanned_grads)
    ):
        np.testing.assert_allclose(cpu, scanned, atol=1e-5, err_msg=jax.tree_util.keystr(path[0]))


def count_pallas_calls(jaxpr):
    return sum(eqn.primitive.name == "pallas_call" for inner in nested_jaxprs(jaxpr) for eqn in inner.eqns)


def test_only_the_final_layer_runs_the_kernel_and_it_matches_the_reference(params):
    tokens, mask = right_padded_batch(lengths=(12, 9), length=12, vocab=CONFIG.vocab_size)
    args = (params, CONFIG, jnp.asarray(tokens), jnp.asarray(mask))
    window_start = jnp.asarray([3, 0], jnp.int32)
    # One kernel in the layer scan, selected by lax.cond at the last index; none without a window.
    assert (
        count_pallas_calls(
            jax.make_jaxpr(lambda *a: forward(*a, window_start, concentration_backend="interpret"), static_argnums=1)(
                *args
            ).jaxpr
        )
        == 1
    )
    assert count_pallas_calls(jax.make_jaxpr(lambda *a: forward(*a), static_argnums=1)(*args).jaxpr) == 0

    kernel = forward(*args, window_start, concentration_backend="interpret")
    reference = forward(*args, window_start, concentration_backend="reference")
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(kernel.logits)[real], np.asarray(reference.logits)[real], atol=1e-5)
    np.testing.assert_allclose(kernel.herfindahl, reference.herfindahl, atol=1e-5)
    np.testing.assert_array_equal(kernel.window_size, reference.window_size)


def test_final_attention_inputs_reproduce_the_final_layer_lse(params):
    tokens, mask = right_padded_batch(lengths=(11, 8), length=11, vocab=CONFIG.vocab_size)
    window_start = jnp.asarray([2, 4], jnp.int32)
    out = forward(params, CONFIG, jnp.asarray(tokens), jnp.asarray(mask), window_start, return_final_attention=True)
    q, k, lse = out.final_attention
    assert q.shape == (2, 11, CONFIG.num_heads, CONFIG.head_dim) and k.shape == (
        2,
        11,
        CONFIG.num_kv_heads,
        CONFIG.head_dim,
    )
    *_, expected = pallas_kernels.attention_with_concentration(
        q, k, k, jnp.asarray(mask), window_start, backend="reference", return_lse=True
    )
    np.testing.assert_allclose(lse, expected, atol=1e-5)
    assert run(params, tokens, mask, [2, 4]).final_attention is None
    with pytest.raises(ValueError, match="return_final_attention and concentration_statistics need window_start"):
        forward(params, CONFIG, jnp.asarray(tokens), jnp.asarray(mask), return_final_attention=True)


@pytest.mark.parametrize(
    "tokens,mask,window_start,hidden_layers,message",
    [
        (np.zeros((2, 4), np.float32), np.ones((2, 4), bool), None, None, r"tokens must be int \[B, L\]"),
        (np.zeros((2, 4), np.int32), np.ones((2, 4), np.int32), None, None, r"attention_mask must be bool \(2, 4\)"),
        (
            np.zeros((2, 4), np.int32),
            np.ones((2, 4), bool),
            np.zeros((3,), np.int32),
            None,
            r"window_start must be int \[B\] = \[2\]",
        ),
        (np.zeros((2, 4), np.int32), np.ones((2, 4), bool), None, (0, 3), r"hidden_layers \[3\] out of range \[0, 2\]"),
    ],
)
def test_bad_inputs_are_named(params, tokens, mask, window_start, hidden_layers, message):
    with pytest.raises(ValueError, match=message):
        forward(
            params,
            CONFIG,
            jnp.asarray(tokens),
            jnp.asarray(mask),
            None if window_start is None else jnp.asarray(window_start),
            hidden_layers=hidden_layers,
        )
