"""Scores a batch with the policy and prints per-token final-layer attention concentration.

    python launch/score.py --config=configs/tiny.py

Builds the model from the config's `model` section (random init, or `--config.model.path`
for an HF checkpoint), makes `batch_size` rows of random prompt + response tokens (responses
right-padded to different lengths), runs one teacher-forced forward with the response
window, and prints H_t, n_t, c_t and kappa_t per response token (DESIGN.md positions:
the state before y_t is read at sequence position P + t - 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from comppo_jax import cli, normalized_concentration, retention_gate
from comppo_jax.models import forward, load_policy

_CONFIG = cli.define_config_file("config", "configs/tiny.py", "ml_collections config file.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Rows to score.")
_PROMPT = flags.DEFINE_integer("prompt_length", 24, "Prompt tokens P per row.")
_RESPONSE = flags.DEFINE_integer("response_length", 40, "Maximum response tokens T.")
_SHOW = flags.DEFINE_integer("show_tokens", 12, "Response tokens of row 0 to print.")


def main(argv):
    del argv
    config = _CONFIG.value
    rng = jax.random.PRNGKey(config.seed)
    model_config, params = load_policy(config.model, rng)
    batch, prompt, response = _BATCH.value, _PROMPT.value, _RESPONSE.value
    data_rng = np.random.default_rng(config.seed)
    tokens = data_rng.integers(0, model_config.vocab_size, (batch, prompt + response)).astype(np.int32)
    response_lengths = np.linspace(response, max(response // 4, 2), batch).astype(np.int32)
    attention_mask = np.arange(prompt + response)[None] < (prompt + response_lengths)[:, None]
    window_start = np.full((batch,), prompt, np.int32)

    out = forward(params, model_config, jnp.asarray(tokens), jnp.asarray(attention_mask), jnp.asarray(window_start))
    # Per-token statistics for y_1..y_T live at positions [P-1, P+T-1).
    herfindahl = np.asarray(out.herfindahl[:, prompt - 1 : prompt + response - 1])
    window_size = np.asarray(out.window_size[:, prompt - 1 : prompt + response - 1])
    mask = np.arange(response)[None] < response_lengths[:, None]
    concentration = np.asarray(normalized_concentration(herfindahl, window_size))
    kappa = np.asarray(retention_gate(concentration))

    print(
        f"model: {model_config.architecture}, {model_config.num_layers} layers, vocab {model_config.vocab_size}, "
        f"{sum(x.size for x in jax.tree.leaves(params)):,} params"
    )
    print(f"batch: {batch} rows, prompt {prompt} tokens, response lengths {response_lengths.tolist()}")
    print(f"row 0, first {_SHOW.value} response tokens (window = response positions):")
    print(f"{'t':>4} {'token':>6} {'n_t':>5} {'H_t':>8} {'c_t':>8} {'kappa_t':>8}")
    for t in range(min(_SHOW.value, response_lengths[0])):
        print(
            f"{t + 1:>4} {tokens[0, prompt + t]:>6} {window_size[0, t]:>5} {herfindahl[0, t]:>8.4f} "
            f"{concentration[0, t]:>8.4f} {kappa[0, t]:>8.4f}"
        )
    valid = mask & (window_size >= 2)
    print(
        f"mean H_t over {valid.sum()} valid tokens with n_t >= 2: {herfindahl[valid].mean():.4f} "
        f"(uniform attention would give {np.mean(1.0 / window_size[valid]):.4f}); "
        f"mean kappa_t {kappa[mask].mean():.4f}"
    )


if __name__ == "__main__":
    cli.run(main)
