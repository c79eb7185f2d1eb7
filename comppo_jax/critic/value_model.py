"""The full-copy critic: PPO's value model as tunix and verl run it, for comparison with TAC.

A second Transformer, initialised as a copy of the starting policy (embedding, every decoder
layer, final norm; no vocabulary projection), with a linear value head on its final hidden state:
verl's (`AutoModelForTokenClassification`'s score head: weight ~ N(0, 0.02), zero bias; tunix's
is bias-free with a lecun-normal kernel), and, as in both, no clamp on its output: the paper's
clip to [-1, 1] belongs to its own critics (TAC, the standard head). Unlike those, it reads the
tokens, not the actor's activations, and every weight trains: its parameters and AdamW moments are
the policy's size again, and each value pass is a full forward (`launch/plan.py` shows what that
costs at scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from comppo_jax.models import ModelConfig, forward

TRUNK = ("embed", "layers", "final_norm")  # the policy's params the value model copies
HEAD_INIT_STD = 0.02  # verl's score head: HF's initializer_range


def init_value_model(policy: dict, master_dtype, rng) -> dict:
    """{"trunk": a copy of `policy`'s trunk in `master_dtype`, "head": verl's value head, weight ~
    N(0, 0.02) from `rng` and zero bias}. The trunk's arrays are fresh (never the policy's own), so
    donating one never frees the other."""
    trunk = jax.tree.map(lambda p: jnp.array(p, dtype=master_dtype, copy=True), {name: policy[name] for name in TRUNK})
    hidden_size = policy["final_norm"].shape[-1]
    weight = HEAD_INIT_STD * jax.random.normal(rng, (hidden_size,), jnp.float32)
    return {"trunk": trunk, "head": {"weight": weight, "bias": jnp.zeros((), jnp.float32)}}


def value_model_values(
    params: dict, config: ModelConfig, tokens, attention_mask, *, segment_ids=None, positions=None
) -> jax.Array:
    """V_t = w . h_t + b [B, L], unclamped as in tunix and verl, on the value model's own final hidden
    state h_t (tokens [B, L]; the trunk runs in `config.dtype`, the head in float32; gradients reach
    every weight). Packed rows: `segment_ids` and `positions` as `forward` takes them."""
    trunk = jax.tree.map(lambda p: p.astype(config.dtype), params["trunk"])
    out = forward(
        trunk,
        config,
        tokens,
        attention_mask,
        hidden_layers=(config.num_layers,),
        compute_logits=False,
        segment_ids=segment_ids,
        positions=positions,
    )
    head = params["head"]
    return out.hidden_states[0].astype(jnp.float32) @ head["weight"] + head["bias"]
