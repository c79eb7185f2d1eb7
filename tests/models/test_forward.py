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


# Most tests run [2, 16] batches with a window: one compiled forward between them.
LENGTH = 16


def test_init_params_matches_param_shapes_and_dtype():
    for config in (CONFIG, CONFIG.replace(tie_word_embeddings=True, dtype="bfloat16", architecture="llama")):
        # Traced for the shapes and dtypes, nothing computed (the `params` fixture runs it).
        params = jax.eval_shape(lambda key: init_params(config, key), jax.random.PRNGKey(1))
        assert jax.tree.map(lambda a: tuple(a.shape), params) == param_shapes(config)
        assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(config.dtype)}
        assert ("lm_head" in params) != config.tie_word_embeddings
        assert ("q_norm" in params["layers"]) == (config.architecture == "qwen3")


def test_causality_later_tokens_do_not_change_earlier_outputs(params):
    tokens, mask = right_padded_batch(lengths=(LENGTH, LENGTH), length=LENGTH, vocab=CONFIG.vocab_size)
    changed = tokens.copy()
    changed[:, 10:] = (changed[:, 10:] + 7) % CONFIG.vocab_size
    window_start = [3, 0]
    before, after = run(params, tokens, mask, window_start), run(params, changed, mask, window_start)
    np.testing.assert_allclose(before.logits[:, :10], after.logits[:, :10], atol=1e-5)
    np.testing.assert_allclose(before.herfindahl[:, :10], after.herfindahl[:, :10], atol=1e-6)
    assert np.abs(np.asarray(before.logits[:, 10:] - after.logits[:, 10:])).max() > 1e-3


def test_padding_tokens_do_not_leak(params):
    tokens, mask = right_padded_batch(lengths=(9, 5), length=LENGTH, vocab=CONFIG.vocab_size)
    scrambled = np.where(mask, tokens, (tokens * 3 + 1) % CONFIG.vocab_size)
    a, b = run(params, tokens, mask, [2, 2]), run(params, scrambled, mask, [2, 2])
    np.testing.assert_allclose(np.asarray(a.logits)[mask], np.asarray(b.logits)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.herfindahl)[mask], np.asarray(b.herfindahl)[mask], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(a.window_size)[mask], np.asarray(b.window_size)[mask])


def test_left_padded_row_equals_unpadded_row(params):
    # Row 0: 12 tokens left-padded by 4. Row 1: unpadded, the same 12 tokens then 4 more, which
    # (causality, tested above) its first 12 outputs do not see: one [2, 16] forward for both.
    (tokens,), _ = right_padded_batch(lengths=(LENGTH,), length=LENGTH, vocab=CONFIG.vocab_size)
    rows = np.stack([np.concatenate([np.zeros(4, np.int32), tokens[:12]]), tokens])
    mask = np.stack([np.arange(LENGTH) >= 4, np.ones(LENGTH, bool)])
    out = run(params, rows, mask, [4, 0])
    logits, herfindahl = np.asarray(out.logits), np.asarray(out.herfindahl)
    np.testing.assert_allclose(logits[0, 4:], logits[1, :12], atol=1e-5)
    np.testing.assert_allclose(herfindahl[0, 4:], herfindahl[1, :12], atol=1e-6)
    assert np.isfinite(logits[0]).all()


def test_window_size_follows_the_design_convention(params):
    """Response window starting at P: the state before y_t (position P + t - 2) sees n_t = t - 1 keys."""
    prompt, response = 6, LENGTH - 6
    tokens, mask = right_padded_batch(lengths=(LENGTH, LENGTH), length=LENGTH, vocab=CONFIG.vocab_size)
    out = run(params, tokens, mask, [prompt, 0])  # row 0: the response window; row 1: the full window
    per_token = np.asarray(out.window_size[0, prompt - 1 : prompt + response - 1])
    np.testing.assert_array_equal(per_token, np.arange(response))
    np.testing.assert_array_equal(np.asarray(out.window_size[1]), np.arange(1, prompt + response + 1))


def squared_logits_gradient(forward):
    """Jitted params, tokens, mask, window_start -> (gradient of the mean squared logits, the output):
    one compile (eagerly, every piece of the forward and its VJP would compile on its own)."""

    def loss(params, tokens, mask, window_start):
        out = forward(params, CONFIG, tokens, mask, window_start)
        return jnp.mean(out.logits**2), out

    return jax.jit(jax.grad(loss, has_aux=True))


unrolled_gradient = squared_logits_gradient(forward)  # shared by the two tests below


def test_forward_is_differentiable_and_concentration_is_detached(params):
    tokens, mask = right_padded_batch(lengths=(LENGTH, 9), length=LENGTH, vocab=CONFIG.vocab_size)
    args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray([0, 0], jnp.int32))
    grads, _ = unrolled_gradient(params, *args)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["layers"]["q_proj"]).max()) > 0
    herfindahl_grads = jax.jit(jax.grad(lambda p: forward(p, CONFIG, *args).herfindahl.sum()))(params)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(herfindahl_grads))


def layer_scan_unrolls(forward, *args):
    """The `unroll` of the scans over the layers in `forward`'s trace."""
    jaxpr = jax.make_jaxpr(forward, static_argnums=1)(*args).jaxpr
    return {
        eqn.params["unroll"]
        for inner in nested_jaxprs(jaxpr)
        for eqn in inner.eqns
        if eqn.primitive.name == "scan" and eqn.params["length"] == CONFIG.num_layers
    }


def test_unrolled_fused_layers_on_cpu_equal_the_scanned_layers_of_an_accelerator(params, monkeypatch):
    tokens, mask = right_padded_batch(lengths=(LENGTH, 9), length=LENGTH, vocab=CONFIG.vocab_size)
    args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray([3, 0], jnp.int32))
    cpu_grads, cpu_out = unrolled_gradient(params, *args)
    lowered = jax.jit(lambda p: run(p, tokens, mask)).lower(params).compile().as_text()
    assert " while(" not in lowered  # unrolled: no layer loop on CPU (the kernel, interpreted, would bring its own)
    monkeypatch.setattr(sharding, "context_platform", lambda: "tpu")
    # The layer loop is chosen at trace time, and jit caches traces by function: a new function
    # traces forward afresh, leaving `forward`'s own cache (shared with the other tests) unrolled.
    scanned = jax.jit(lambda p, c, t, m, w: forward.__wrapped__(p, c, t, m, w), static_argnums=1)
    assert layer_scan_unrolls(scanned, params, CONFIG, *args) == {1}
    scanned_grads, scanned_out = squared_logits_gradient(scanned)(params, *args)
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
    tokens, mask = right_padded_batch(lengths=(12, 9), length=LENGTH, vocab=CONFIG.vocab_size)
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

    # The default backend (the kernel interpreted, on CPU): the [2, 16] forward the other tests compiled.
    kernel = forward(*args, window_start)
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
    *_, expected = jax.jit(
        lambda q, k: pallas_kernels.attention_with_concentration(
            q, k, k, jnp.asarray(mask), window_start, backend="reference", return_lse=True
        )
    )(q, k)
    np.testing.assert_allclose(lse, expected, atol=1e-5)
    # Decided at trace time: the traced forward (nothing compiled) shows it.
    assert jax.eval_shape(lambda p: run(p, tokens, mask, [2, 4]), params).final_attention is None
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
