"""TAC, the transport-aligned critic (paper section 4.3, eqs. fusion, valuegate, relevance,
globalpool, value_mix), and the standard value head of the factorial's control cells.

Gradient convention: the critic trains only its own parameters. The actor's hidden states, the
native-attention routing and kappa enter through `stop_gradient`, so a critic loss never moves
the policy (the paper's "reuse actor activations" without a second Transformer).

Shapes: per-position arrays are over the sequence, [B, L]; the caller reads V_t at the
position before y_t (docs/conventions.md, "Index conventions"), where kappa_t is placed too.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from comppo_jax import sharding
from comppo_jax.critic.routing import Routing
from comppo_jax.models.transformer import rms_norm


class CriticOutput(NamedTuple):
    value: jax.Array  # [B, L] V_t = clip(kappa V^G + (1 - kappa) V^L, -1, 1)
    value_local: jax.Array  # [B, L] V^L(h_bar_t), before mixing and clipping
    value_routed: jax.Array  # [B, L] V^G(h^G_t), before mixing and clipping


def fuse_layers(hidden_states, eta):
    """Paper eq. (fusion): h_bar_t = sum_l softmax(eta)_l h_t^(l).

    hidden_states [L', B, L, D] (the selected upper layers); eta [L'] logits. Each layer is
    RMS-normalized (no learned scale) before the weighted sum: residual streams at different
    depths differ in scale by orders of magnitude, and the final-norm output is already unit
    scale, so without it the deepest unnormalized layer would dominate whatever eta says.
    """
    normalized = rms_norm(hidden_states, jnp.ones(hidden_states.shape[-1], jnp.float32), 1e-6)
    return jnp.einsum("l,lbtd->btd", jax.nn.softmax(eta), normalized)


def value_refined_routing(weights, beta_query, beta_keys):
    """Paper eq. (valuegate): a~_ti = a_ti * sigmoid(<W_bq h_t, W_bk h_i> / sqrt(d)).

    weights [..., K] native a_ti; beta_query [..., d]; beta_keys [..., K, d] (gathered at the
    routed positions).
    """
    beta = jnp.einsum("...d,...kd->...k", beta_query, beta_keys) / math.sqrt(beta_query.shape[-1])
    return weights * jax.nn.sigmoid(beta)


def token_relevance(relevance_query, relevance_keys):
    """Paper eq. (relevance): m_ti = relu(<W_rq h_t, W_rk h_i> / sqrt(d))."""
    return jax.nn.relu(
        jnp.einsum("...d,...kd->...k", relevance_query, relevance_keys) / math.sqrt(relevance_query.shape[-1])
    )


def pool_history(scores, valid, keys, eps):
    """Paper eq. (globalpool): h^G_t = sum_i s_ti h_i / (sum_j s_tj + eps) over the routed i.

    scores [..., K] = a~_ti m_ti; valid [..., K] (i in I_t); keys [..., K, d].
    """
    scores = jnp.where(valid, scores, 0.0)
    return jnp.einsum("...k,...kd->...d", scores, keys) / (scores.sum(-1, keepdims=True) + eps)


def mix_values(kappa, value_routed, value_local):
    """Paper eq. (value_mix): V_t = clip(kappa_t V^G + (1 - kappa_t) V^L, -1, 1)."""
    return jnp.clip(kappa * value_routed + (1.0 - kappa) * value_local, -1.0, 1.0)


def _pool_gathered(gathered, block_inputs, eps):
    """One query block from its gathered keys: eqs. (valuegate, relevance, globalpool)."""
    beta_keys, relevance_keys, value_keys = gathered
    weights, valid, beta_q, relevance_q = block_inputs
    scores = value_refined_routing(weights, beta_q, beta_keys) * token_relevance(relevance_q, relevance_keys)
    return pool_history(scores, valid, value_keys, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pool_blocks(keys, indices, block_inputs, eps):
    """Pooled history of query blocks. keys: three [N, d] tables; indices [nb, bq, K] into them."""

    def one_block(inputs):
        block_indices, block = inputs
        return _pool_gathered(tuple(key[block_indices] for key in keys), block, eps)

    return jax.lax.map(one_block, (indices, block_inputs))


def _pool_blocks_forward(keys, indices, block_inputs, eps):
    return _pool_blocks(keys, indices, block_inputs, eps), (keys, indices, block_inputs)


def _pool_blocks_backward(eps, residuals, pooled_cotangent):
    # The keys' cotangents are scatter-added into one carried [N, d] buffer per block, so the
    # backward pass costs O(L K d) like the forward (the default scan transpose would add a full
    # [N, d] cotangent per block, O(L^2 d / block)).
    keys, indices, block_inputs = residuals

    def step(key_cotangents, inputs):
        block_indices, block, cotangent = inputs
        gathered = tuple(key[block_indices] for key in keys)
        _, pullback = jax.vjp(lambda g, b: _pool_gathered(g, b, eps), gathered, block)
        gathered_cotangent, block_cotangent = pullback(cotangent)
        key_cotangents = tuple(acc.at[block_indices].add(ct) for acc, ct in zip(key_cotangents, gathered_cotangent))
        return key_cotangents, block_cotangent

    zeros = tuple(jnp.zeros_like(key) for key in keys)
    key_cotangents, block_cotangents = jax.lax.scan(step, zeros, (indices, block_inputs, pooled_cotangent))
    return key_cotangents, None, block_cotangents


_pool_blocks.defvjp(_pool_blocks_forward, _pool_blocks_backward)


def routed_pool(routing: Routing, beta_query, beta_key, relevance_query, relevance_key, values, *, eps, block):
    """eqs. (valuegate, relevance, globalpool) for every position, `block` queries at a time.

    Per-position projections are [B, L, d]; each query block gathers its K routed keys, so time
    is O(L K d) forward and backward and memory O(L (K + d)) plus one [block, K, d] tile: never
    [L, L] nor [L, K, d]. The rows' keys form one [B L, d] table that every row's blocks gather
    from in one loop (a gather with a batch dimension, as vmap makes it, runs several times
    slower on CPU); under a mesh each batch shard pools its own rows (`sharding.per_shard`), so
    no gather crosses devices.
    """

    def local(routing, beta_query, beta_key, relevance_query, relevance_key, values):
        batch, length, _ = routing.indices.shape
        padded = -(-length // block) * block

        def blocks(x):  # [B, L, ...] -> [B * nb, block, ...]
            x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
            return x.reshape(batch * (padded // block), block, *x.shape[2:])

        table = lambda x: x.reshape(batch * length, x.shape[-1])
        indices = (
            routing.indices + (jnp.arange(batch, dtype=routing.indices.dtype) * length)[:, None, None]
        )  # into the table
        pooled = _pool_blocks(
            (table(beta_key), table(relevance_key), table(values)),
            blocks(indices),
            tuple(blocks(x) for x in (routing.weights, routing.valid, beta_query, relevance_query)),
            eps,
        )
        return pooled.reshape(batch, padded, -1)[:, :length]

    rows = P(sharding.BATCH)
    return sharding.per_shard(local, in_specs=(Routing(rows, rows, rows),) + (rows,) * 5, out_specs=rows)(
        routing, beta_query, beta_key, relevance_query, relevance_key, values
    )


class TransportAlignedCritic(nn.Module):
    """TAC: fused actor features, native-attention top-K routed history, kappa-mixed value heads.

    Attributes:
      bottleneck: d, the width of the bilinear gates and of the value heads' hidden layer.
      eps: the pooling denominator's epsilon (eq. globalpool).
      query_block: queries pooled per step (memory only; results do not depend on it).

    Call with hidden_states [L', B, L, D] (the actor's selected upper layers, any float dtype),
    routing (`window_topk` of the final layer: K routed keys per position) and kappa [B, L].
    The value heads' output layers start at zero, so an untrained critic predicts V = 0 (the
    paper's zero-output initialization). V^G's first layer is linear, so it is applied to each
    h_bar_i before pooling: pooling commutes with it, and no [L, K, D] array is gathered.
    """

    bottleneck: int = 128
    eps: float = 1e-6
    query_block: int = 128

    @nn.compact
    def __call__(self, hidden_states, routing: Routing, kappa) -> CriticOutput:
        hidden_states, routing, kappa = jax.lax.stop_gradient((hidden_states, routing, kappa))
        eta = self.param("eta", nn.initializers.zeros, (hidden_states.shape[0],), jnp.float32)
        fused = fuse_layers(hidden_states.astype(jnp.float32), eta)  # [B, L, D]

        def projection(name):
            return nn.Dense(self.bottleneck, use_bias=False, name=name)(fused)

        def value_output(name, features):
            zero = nn.initializers.zeros
            return nn.Dense(1, kernel_init=zero, bias_init=zero, name=name)(nn.gelu(features))[..., 0]

        pooled = routed_pool(
            routing,
            projection("beta_query"),
            projection("beta_key"),
            projection("relevance_query"),
            projection("relevance_key"),
            projection("routed_hidden"),
            eps=self.eps,
            block=self.query_block,
        )
        routed_bias = self.param("routed_hidden_bias", nn.initializers.zeros, (self.bottleneck,), jnp.float32)
        value_routed = value_output("routed_output", pooled + routed_bias)
        value_local = value_output("local_output", nn.Dense(self.bottleneck, name="local_hidden")(fused))
        return CriticOutput(mix_values(kappa.astype(jnp.float32), value_routed, value_local), value_local, value_routed)


def fused_hidden_layers(num_layers: int, fused_layers: int) -> tuple[int, ...]:
    """HF hidden-state indices of the last `fused_layers` (num_layers = after the final norm),
    to pass to `forward(..., hidden_layers=...)`."""
    if not 1 <= fused_layers <= num_layers + 1:
        raise ValueError(
            f"critic.fused_layers={fused_layers} must be in [1, {num_layers + 1}] for a {num_layers}-layer model"
        )
    return tuple(range(num_layers + 1 - fused_layers, num_layers + 1))


def critic_from_config(section) -> TransportAlignedCritic:
    """The TAC module of a config's `critic` section (kind "tac")."""
    if section.kind != "tac":
        raise ValueError(
            f"critic.kind={section.kind!r} has no TAC module; the standard critic is `standard_value_head`"
        )
    return TransportAlignedCritic(bottleneck=section.bottleneck, eps=section.eps, query_block=section.query_block)


def init_tac(module: TransportAlignedCritic, rng, num_fused_layers: int, hidden_size: int, top_k: int) -> dict:
    """TAC params (they depend only on L', D and K, so a one-token dummy batch suffices)."""
    slots = (1, 1, top_k)
    routing = Routing(jnp.zeros(slots, jnp.int32), jnp.zeros(slots, jnp.float32), jnp.zeros(slots, bool))
    hidden_states = jnp.zeros((num_fused_layers, 1, 1, hidden_size), jnp.float32)
    init = jax.jit(module.init)  # one program, not an eager op per layer of the module
    return init(rng, hidden_states, routing, jnp.zeros((1, 1), jnp.float32))["params"]


def init_standard_value_head(hidden_size: int) -> dict:
    """Zero-initialized linear value head (the standard critic of the paper's factorial)."""
    return {"weight": jnp.zeros((hidden_size,), jnp.float32), "bias": jnp.zeros((), jnp.float32)}


def standard_value_head(params: dict, final_hidden) -> jax.Array:
    """V_t = clip(w . h_t + b, -1, 1) on the actor's final hidden state [B, L, D], detached."""
    final_hidden = jax.lax.stop_gradient(final_hidden).astype(jnp.float32)
    return jnp.clip(final_hidden @ params["weight"] + params["bias"], -1.0, 1.0)
