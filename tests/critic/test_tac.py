"""TAC routing, pooling, value mixing and the standard head, against dense computations."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_shapes, square

from comppo_jax.critic import (
    TransportAlignedCritic,
    critic_from_config,
    fuse_layers,
    fused_hidden_layers,
    init_standard_value_head,
    mix_values,
    standard_value_head,
    window_topk,
)
from comppo_jax.critic.routing import BLOCK_K, BLOCK_Q, row_blocks
from comppo_jax.models import ModelConfig, forward, init_params, load_config_file, preset_model_config
from comppo_jax.models.loading import PRESET_DIR
from pallas_kernels import attention_with_concentration

CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
)
FUSED = fused_hidden_layers(CONFIG.num_layers, 4)


def random_attention_inputs(seed, lengths=(37, 25), num_heads=4, num_kv_heads=2, head_dim=8):
    rng = np.random.default_rng(seed)
    batch, length = len(lengths), max(lengths)
    q = jnp.asarray(rng.normal(size=(batch, length, num_heads, head_dim)) * 1.5, jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, length, num_kv_heads, head_dim)), jnp.float32)
    mask = jnp.asarray(np.arange(length)[None] < np.asarray(lengths)[:, None])
    return q, k, mask


@jax.jit  # one compile (eagerly, every op would compile on its own)
def dense_window_attention(q, k, mask, window_start):
    """a [B, L, L]: head-mean causal attention restricted to the window and renormalized."""
    length = q.shape[1]
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    positions = jnp.arange(length)
    allowed = (positions[:, None] >= positions[None, :])[None] & mask[:, None, :]
    probs = jax.nn.softmax(jnp.where(allowed[:, None], logits, -jnp.inf), axis=-1)
    head_mean = jnp.nan_to_num(probs).mean(axis=1)
    in_window = allowed & (positions[None, None, :] >= window_start[:, None, None])
    head_mean = jnp.where(in_window, head_mean, 0.0)
    total = head_mean.sum(-1, keepdims=True)
    return jnp.where(total > 0, head_mean / jnp.where(total > 0, total, 1.0), 0.0), in_window


@jax.jit
def lse_of(q, k, mask, window_start):
    return attention_with_concentration(q, k, k, mask, window_start, backend="reference", return_lse=True)[3]


@pytest.mark.parametrize("top_k,blocks", [(4, (8, 8)), (6, (16, 8)), (64, (8, 16))])
def test_blockwise_top_k_equals_dense_top_k(top_k, blocks):
    q, k, mask = random_attention_inputs(0)
    window_start = jnp.asarray([3, 11], jnp.int32)
    routing = window_topk(
        q, k, lse_of(q, k, mask, window_start), mask, window_start, top_k=top_k, block_q=blocks[0], block_k=blocks[1]
    )
    dense, in_window = dense_window_attention(q, k, mask, window_start)
    expected, expected_index = jax.lax.top_k(jnp.where(in_window, dense, -1.0), min(top_k, q.shape[1]))
    n = in_window.sum(-1)
    slots = jnp.arange(top_k)[None, None]
    np.testing.assert_array_equal(routing.valid, slots < n[..., None])
    width = expected.shape[-1]
    np.testing.assert_allclose(
        routing.weights[..., :width], jnp.where(routing.valid[..., :width], expected, 0.0), atol=1e-6
    )
    np.testing.assert_array_equal(
        jnp.where(routing.valid[..., :width], routing.indices[..., :width], -1),
        jnp.where(routing.valid[..., :width], expected_index, -1),
    )


@pytest.mark.parametrize("length", [30, 200, 230, 511, 513, 1000, 4097])
def test_a_row_pads_to_less_than_one_key_block(length):
    # The blocks' least common multiple once padded a 230-token row to 3712 (16x the work).
    block_q, block_k, padded = row_blocks(length, BLOCK_Q, BLOCK_K)
    assert padded % block_q == padded % block_k == 0 and padded - length < block_k


def test_blockwise_top_k_at_a_length_no_block_divides_equals_dense_top_k():
    q, k, mask = random_attention_inputs(1, lengths=(230, 141))
    window_start = jnp.asarray([48, 20], jnp.int32)
    routing = window_topk(q, k, lse_of(q, k, mask, window_start), mask, window_start, top_k=16)
    dense, in_window = dense_window_attention(q, k, mask, window_start)
    expected, expected_index = jax.lax.top_k(jnp.where(in_window, dense, -1.0), 16)
    np.testing.assert_allclose(routing.weights, jnp.where(routing.valid, expected, 0.0), atol=1e-6)
    np.testing.assert_array_equal(
        jnp.where(routing.valid, routing.indices, -1), jnp.where(routing.valid, expected_index, -1)
    )


@pytest.fixture(scope="module")
def model():
    params = init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 30)), jnp.int32)
    mask = jnp.asarray(np.arange(30)[None] < np.asarray([30, 22])[:, None])
    window_start = jnp.asarray([6, 4], jnp.int32)
    return params, tokens, mask, window_start


def critic_inputs(params, tokens, mask, window_start, top_k=64):
    # The reference backend's final-layer LSE: the kernel's equals it (tests/models/test_forward.py),
    # and it compiles in half the time of the interpreted kernel.
    out = forward(
        params,
        CONFIG,
        tokens,
        mask,
        window_start,
        hidden_layers=FUSED,
        return_final_attention=True,
        concentration_backend="reference",
    )
    attention = out.final_attention
    routing = window_topk(
        attention.q, attention.k, attention.lse, mask, window_start, top_k=top_k, block_q=8, block_k=8
    )
    return out, routing


@pytest.fixture(scope="module")
def routed(model):
    """`critic_inputs` of the model (top_k=64, at least every n_t) and a fresh critic's params."""
    out, routing = critic_inputs(*model)
    critic = TransportAlignedCritic(bottleneck=16, query_block=8)
    kappa = jnp.zeros(model[1].shape)
    params = jax.jit(lambda h, r, k: critic.init(jax.random.PRNGKey(0), h, r, k)["params"])(
        out.hidden_states, routing, kappa
    )
    return out, routing, params


def trained_like(params, seed=3, scale=0.3):
    """Zero-initialized output layers replaced by random ones, so V^L and V^G are not zero."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
    params = jax.tree.map(lambda x: x, params)
    for name in ("local_output", "routed_output"):
        params[name] = {key: scale * jax.random.normal(next(keys), value.shape) for key, value in params[name].items()}
    params["eta"] = jax.random.normal(next(keys), params["eta"].shape)
    return params


def test_zero_initialization_gives_zero_value(model, routed):
    out, routing, params = routed
    kappa = jnp.full(model[1].shape, 0.7)
    critic = TransportAlignedCritic(bottleneck=16, query_block=8)
    assert isinstance(params, dict)
    values = jax.jit(critic.apply)({"params": params}, out.hidden_states, routing, kappa)
    assert all(float(jnp.abs(v).max()) == 0.0 for v in values)


def test_top_k_pooling_with_k_at_least_n_equals_dense_pooling_over_the_window(model, routed):
    params, tokens, mask, window_start = model
    out, routing, fresh = routed  # top_k=64 >= every n_t
    critic = TransportAlignedCritic(bottleneck=16, query_block=8, eps=1e-6)
    kappa = jnp.full(tokens.shape, 0.5)
    tac = trained_like(fresh)
    routed_value = lambda p: critic.apply({"params": p}, out.hidden_states, routing, kappa).value_routed

    attention = out.final_attention
    a, in_window = dense_window_attention(
        attention.q.astype(jnp.float32), attention.k.astype(jnp.float32), mask, window_start
    )

    def dense_routed_value(tac):
        fused = fuse_layers(out.hidden_states, tac["eta"])
        project = lambda name: fused @ tac[name]["kernel"]
        d = 16
        beta = jnp.einsum("btd,bid->bti", project("beta_query"), project("beta_key")) / math.sqrt(d)
        relevance = jax.nn.relu(
            jnp.einsum("btd,bid->bti", project("relevance_query"), project("relevance_key")) / math.sqrt(d)
        )
        scores = jnp.where(in_window, a * jax.nn.sigmoid(beta) * relevance, 0.0)
        history = scores @ project("routed_hidden") / (scores.sum(-1, keepdims=True) + 1e-6) + tac["routed_hidden_bias"]
        return (jax.nn.gelu(history) @ tac["routed_output"]["kernel"])[..., 0] + tac["routed_output"]["bias"][0]

    # The values and the gradients of a weighted sum of them, blockwise and dense: one compile.
    weights = jnp.linspace(-1.0, 1.0, tokens.size).reshape(tokens.shape)
    gradient = lambda value: jax.grad(lambda p: jnp.sum(weights * value(p)))
    got, expected, got_grads, expected_grads = jax.jit(
        lambda p: (routed_value(p), dense_routed_value(p), gradient(routed_value)(p), gradient(dense_routed_value)(p))
    )(tac)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert float(jnp.abs(expected).max()) > 1e-3

    # The blockwise pooling's custom VJP gives the dense gradient.
    for name in (
        "beta_query",
        "beta_key",
        "relevance_query",
        "relevance_key",
        "routed_hidden",
        "eta",
        "routed_hidden_bias",
    ):
        for got_leaf, want_leaf in zip(jax.tree.leaves(got_grads[name]), jax.tree.leaves(expected_grads[name])):
            largest = float(jnp.abs(want_leaf).max())
            assert largest > 0, name
            # float32 rounding of sums over the window, which XLA orders by CPU (2e-5 of 2.5 seen): 1e-5 of the largest.
            np.testing.assert_allclose(got_leaf, want_leaf, atol=1e-5 * max(largest, 1.0), rtol=1e-4, err_msg=name)


def test_kappa_one_gives_routed_value_and_kappa_zero_gives_local_value(model, routed):
    out, routing, fresh = routed
    critic = TransportAlignedCritic(bottleneck=16, query_block=8)
    shape = model[1].shape
    tac = trained_like(fresh, scale=0.05)
    apply = jax.jit(lambda kappa: critic.apply({"params": tac}, out.hidden_states, routing, kappa))
    for kappa, field in ((1.0, "value_routed"), (0.0, "value_local")):
        values = apply(jnp.full(shape, kappa))
        assert float(jnp.abs(getattr(values, field)).max()) < 1.0  # inside the clamp
        np.testing.assert_array_equal(values.value, getattr(values, field))
    np.testing.assert_allclose(
        mix_values(jnp.asarray([0.25]), jnp.asarray([3.0]), jnp.asarray([-1.0])), [0.0], atol=1e-7
    )
    np.testing.assert_allclose(mix_values(jnp.asarray([1.0]), jnp.asarray([3.0]), jnp.asarray([0.0])), [1.0])


def test_value_at_t_does_not_depend_on_later_tokens(model, routed):
    params, tokens, mask, window_start = model
    cut = 15
    changed = tokens.at[:, cut + 1 :].set((tokens[:, cut + 1 :] + 7) % CONFIG.vocab_size)
    critic = TransportAlignedCritic(bottleneck=16, query_block=8)
    kappa = jnp.full(tokens.shape, 0.6)
    tac = trained_like(routed[2])  # the params do not depend on top_k
    value = jax.jit(lambda out, routing: critic.apply({"params": tac}, out.hidden_states, routing, kappa).value)
    before = value(*critic_inputs(params, tokens, mask, window_start, top_k=4))
    after = value(*critic_inputs(params, changed, mask, window_start, top_k=4))
    np.testing.assert_allclose(before[:, : cut + 1], after[:, : cut + 1], atol=1e-6)
    assert float(jnp.abs(before[:, cut + 2 :] - after[:, cut + 2 :]).max()) > 0


def test_jit_and_grad_train_only_the_critic(model, routed):
    out, routing, fresh = routed
    critic = TransportAlignedCritic(bottleneck=16, query_block=8)
    kappa = jnp.full(model[1].shape, 0.4)
    tac = trained_like(fresh)
    targets = jnp.linspace(-0.5, 0.5, kappa.size).reshape(kappa.shape)

    @jax.jit
    def loss(tac, hidden_states):
        return jnp.mean((critic.apply({"params": tac}, hidden_states, routing, kappa).value - targets) ** 2)

    grads, hidden_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(tac, out.hidden_states)  # one compile
    assert all(bool(jnp.isfinite(g).all()) and float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    assert float(jnp.abs(hidden_grads).max()) == 0.0  # actor features are detached


def test_parameter_count_is_under_half_a_percent_of_qwen3_4b():
    config = preset_model_config("qwen3_4b")
    backbone = sum(
        math.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0))))
    )
    hidden = jax.ShapeDtypeStruct((4, 1, 8, config.hidden_size), jnp.bfloat16)
    routing = jax.eval_shape(
        lambda: window_topk(
            jnp.zeros((1, 8, config.num_heads, config.head_dim)),
            jnp.zeros((1, 8, config.num_kv_heads, config.head_dim)),
            jnp.zeros((1, config.num_heads, 8)),
            jnp.ones((1, 8), bool),
            jnp.zeros((1,), jnp.int32),
            top_k=64,
        )
    )
    shapes = jax.eval_shape(
        lambda: critic_from_config(load_config_file(PRESET_DIR / "qwen3_4b.py").critic).init(
            jax.random.PRNGKey(0),
            jnp.zeros(hidden.shape, hidden.dtype),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), routing),
            jnp.zeros((1, 8)),
        )
    )
    critic = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert critic / backbone < 0.005, (critic, backbone)


def test_standard_value_head_starts_at_zero_clamps_and_is_detached():
    params = init_standard_value_head(6)
    hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 6)) * 10
    assert float(jnp.abs(standard_value_head(params, hidden)).max()) == 0.0
    params = {"weight": jnp.ones(6), "bias": jnp.zeros(())}
    values = standard_value_head(params, hidden)
    # The paper's clip to [-1, 1] (unlike the full value model's unclamped head): w . h reaches +-10s here.
    assert float(jnp.abs(hidden.sum(-1)).max()) > 5.0
    assert float(values.max()) == 1.0 and float(values.min()) == -1.0
    assert float(jnp.abs(jax.grad(lambda h: standard_value_head(params, h).sum())(hidden)).max()) == 0.0


def test_bad_routing_inputs_are_named():
    q, k, mask = random_attention_inputs(1)
    with pytest.raises(ValueError, match=r"lse must be \[B, Hq, L\]"):
        window_topk(q, k, jnp.zeros((2, 4, 5)), mask, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"window_start must be \[B\]"):
        window_topk(q, k, jnp.zeros((2, 4, 37)), mask, jnp.zeros((3,), jnp.int32))


def test_config_sections_build_the_critic_and_bad_values_are_named():
    section = load_config_file(PRESET_DIR / "qwen3_4b.py").critic
    critic = critic_from_config(section)
    assert (critic.bottleneck, critic.eps) == (section.bottleneck, section.eps)
    assert fused_hidden_layers(36, section.fused_layers) == (33, 34, 35, 36)
    with pytest.raises(ValueError, match=r"critic.fused_layers=6 must be in \[1, 5\]"):
        fused_hidden_layers(4, 6)
    section.kind = "standard"
    with pytest.raises(ValueError, match=r"critic.kind='standard' has no TAC module"):
        critic_from_config(section)


def test_routing_and_the_critic_gradient_build_no_l_by_l_array():
    length, critic = 4096, TransportAlignedCritic(bottleneck=16)
    shapes = dict(
        q=jax.ShapeDtypeStruct((1, length, 4, 8), jnp.float32),
        k=jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32),
        lse=jax.ShapeDtypeStruct((1, 4, length), jnp.float32),
        mask=jax.ShapeDtypeStruct((1, length), jnp.bool_),
        window_start=jax.ShapeDtypeStruct((1,), jnp.int32),
        hidden=jax.ShapeDtypeStruct((4, 1, length, 32), jnp.float32),
        kappa=jax.ShapeDtypeStruct((1, length), jnp.float32),
    )

    def critic_gradient(q, k, lse, mask, window_start, hidden, kappa, tac):
        routing = window_topk(q, k, lse, mask, window_start, top_k=64)
        return jax.grad(lambda p: critic.apply({"params": p}, hidden, routing, kappa).value.sum())(tac)

    def init(q, k, lse, mask, window_start, hidden, kappa):
        return critic.init(jax.random.PRNGKey(0), hidden, window_topk(q, k, lse, mask, window_start, top_k=64), kappa)[
            "params"
        ]

    tac = jax.eval_shape(init, *shapes.values())
    jaxpr = jax.make_jaxpr(critic_gradient)(*shapes.values(), tac).jaxpr
    assert square(jaxpr_shapes(jaxpr), length) == []
