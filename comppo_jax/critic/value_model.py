"""The full-copy critic: PPO's value model as tunix and verl run it, for comparison with TAC.

A second Transformer, initialised as a copy of the starting policy (embedding, every decoder
layer, final norm; no vocabulary projection), with a zero-initialised linear value head on its
final hidden state. Unlike TAC and the standard head, it reads the tokens, not the actor's
activations, and every weight trains: its parameters and AdamW moments are the policy's size
again, and each value pass is a full forward (`launch/plan.py` shows what that costs at scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from comppo_jax.critic.tac import init_standard_value_head
from comppo_jax.models import ModelConfig, forward

TRUNK = ("embed", "layers", "final_norm")  # the policy's params the value model copies


def init_value_model(policy: dict, master_dtype) -> dict:
    """{"trunk": a copy of `policy`'s trunk in `master_dtype`, "head": a zero linear value head}.
    The trunk's arrays are fresh (never the policy's own), so donating one never frees the other."""
    trunk = jax.tree.map(lambda p: jnp.array(p, dtype=master_dtype, copy=True), {name: policy[name] for name in TRUNK})
    return {"trunk": trunk, "head": init_standard_value_head(policy["final_norm"].shape[-1])}


def value_model_values(params: dict, config: ModelConfig, tokens, attention_mask) -> jax.Array:
    """V_t = clip(w . h_t + b, -1, 1) [B, L] on the value model's own final hidden state h_t
    (tokens [B, L]; the trunk runs in `config.dtype`, the head in float32; gradients reach every weight)."""
    trunk = jax.tree.map(lambda p: p.astype(config.dtype), params["trunk"])
    out = forward(trunk, config, tokens, attention_mask, hidden_layers=(config.num_layers,), compute_logits=False)
    head = params["head"]
    return jnp.clip(out.hidden_states[0].astype(jnp.float32) @ head["weight"] + head["bias"], -1.0, 1.0)
