"""TAC cost against the policy forward it rides on, at growing sequence length.

For each model shape and length T (batch 1, one prompt of T/8 tokens, response window):
- policy forward: `forward` with the final layer's concentration and attention inputs;
- top-K routing: `window_topk` (streams over key blocks: O(T^2) compute like attention itself,
  O(T * K) memory);
- critic fwd+bwd: the gradient of a value loss w.r.t. the TAC parameters, i.e. fusion,
  projections and the routed pooling, which is O(T * K) in time and memory.
"per 1K tokens" divides by T / 1024: flat for an O(T * K) stage, growing for O(T^2) ones.
Shapes: configs/tiny.py with its critic section, and a Qwen3-0.6B-like model with Qwen3-4B's
(hidden 1024, 16/8 heads, head dim 128, critic section (2 layers, vocab cut to 4096 so the CPU
LM head does not dominate).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from benchmarks.timing import interleaved_medians, print_table
from comppo_jax.critic import critic_from_config, fused_hidden_layers, window_topk
from comppo_jax.models import ModelConfig, forward, init_params, load_config_file, preset_model_config
from comppo_jax.models.loading import PRESET_DIR

QWEN3_06B_LIKE = ModelConfig(
    architecture="qwen3",
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)
LENGTHS = {"tiny": (1024, 4096, 16384), "qwen3-0.6b-like": (1024, 4096)}


def _stages(config: ModelConfig, section, length: int, batch: int):
    fused = fused_hidden_layers(config.num_layers, min(section.fused_layers, config.num_layers + 1))
    params = init_params(config, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 0, config.vocab_size)
    mask = jnp.ones((batch, length), bool)
    window_start = jnp.full((batch,), length // 8, jnp.int32)
    kappa = jnp.full((batch, length), 0.5)

    policy = jax.jit(
        lambda p: forward(p, config, tokens, mask, window_start, hidden_layers=fused, return_final_attention=True)
    )
    out = policy(params)
    routing_fn = jax.jit(lambda q, k, lse: window_topk(q, k, lse, mask, window_start, top_k=section.top_k))
    routing = routing_fn(*out.final_attention)
    critic = critic_from_config(section)
    critic_params = critic.init(jax.random.PRNGKey(2), out.hidden_states, routing, kappa)["params"]

    @jax.jit
    def critic_step(critic_params):
        def loss(p):
            return jnp.mean((critic.apply({"params": p}, out.hidden_states, routing, kappa).value - 0.5) ** 2)

        return jax.grad(loss)(critic_params)

    return {
        "policy forward": lambda: jax.block_until_ready(policy(params).logits),
        "top-K routing": lambda: jax.block_until_ready(routing_fn(*out.final_attention)),
        "critic fwd+bwd": lambda: jax.block_until_ready(critic_step(critic_params)),
    }


def run(batch: int = 1, length: int | None = None, repeats: int = 3) -> list[dict]:
    # (model, critic section): each shape with its preset's critic (bottleneck 32 tiny, 128 Qwen3).
    shapes = {
        "tiny": (preset_model_config("tiny"), load_config_file(PRESET_DIR / "tiny.py").critic),
        "qwen3-0.6b-like": (QWEN3_06B_LIKE, load_config_file(PRESET_DIR / "qwen3_4b.py").critic),
    }
    rows = []
    for shape, (config, section) in shapes.items():
        for seq in (length,) if length else LENGTHS[shape]:
            medians = interleaved_medians(_stages(config, section, seq, batch), repeats, min_round_seconds=0.0)
            for stage, seconds in medians.items():
                rows.append(
                    {
                        "model": shape,
                        "T": str(seq),
                        "stage": stage,
                        "ms": f"{seconds * 1e3:.1f}",
                        "ms per 1K tokens": f"{seconds * 1e3 / (seq / 1024):.2f}",
                        "vs policy": f"{seconds / medians['policy forward']:.3f}x",
                    }
                )
    print(
        f"batch {batch}, top-K 64, median of {repeats} interleaved rounds; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} CPU cores"
    )
    print_table(rows, ["model", "T", "stage", "ms", "ms per 1K tokens", "vs policy"])
    return rows
