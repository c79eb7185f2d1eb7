"""Jitted JAX forward of the tiny policy against transformers' torch forward on the same weights.

Needs the `test` extra (torch CPU). Both sides score the same right-padded batch; the JAX
side is timed with and without the final-layer concentration.
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import interleaved_medians, print_table
from comppo_jax.models import forward, from_hf, preset_model_config


def tiny_hf_model_and_params(seed: int = 0):
    """A random transformers model of the `configs/tiny.py` architecture and the same weights
    loaded with `from_hf`: (hf_model, config, params)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tiny = preset_model_config("tiny")
    hf_config = transformers.AutoConfig.for_model(tiny.architecture, **tiny.to_hf_kwargs())
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        config, params = from_hf(path)
    return hf_model, config, params


def run(batch: int = 16, length: int = 256, repeats: int = 5) -> list[dict]:
    import torch

    hf_model, config, params = tiny_hf_model_and_params()

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length + 1, batch)
    mask = np.arange(length)[None] < lengths[:, None]
    window_start = np.full((batch,), length // 4, np.int32)
    jax_args = (jnp.asarray(tokens), jnp.asarray(mask))
    torch_tokens, torch_mask = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def jax_plain():
        forward(params, config, *jax_args, hidden_layers=()).logits.block_until_ready()

    def jax_concentration():
        out = forward(params, config, *jax_args, jnp.asarray(window_start), hidden_layers=())
        out.herfindahl.block_until_ready()

    def torch_forward():
        with torch.no_grad():
            hf_model(torch_tokens, attention_mask=torch_mask)

    tokens_scored = batch * length
    timings = interleaved_medians(
        {
            "jax forward (jit)": jax_plain,
            "jax forward + concentration (jit)": jax_concentration,
            f"torch {torch.__version__} forward ({hf_model.config._attn_implementation})": torch_forward,
        },
        repeats,
    )
    torch_time = list(timings.values())[-1]
    rows = [
        {
            "implementation": name,
            "ms": f"{seconds * 1e3:.2f}",
            "tokens/s": f"{tokens_scored / seconds:,.0f}",
            "speed vs torch": f"{torch_time / seconds:.2f}x",
        }
        for name, seconds in timings.items()
    ]
    print(
        f"forward: configs/tiny.py {config.architecture} ({config.num_layers} layers, hidden {config.hidden_size}), "
        f"batch {batch} x {length} tokens, median of {repeats} interleaved rounds; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, {os.cpu_count()} CPU cores"
    )
    print_table(rows, ["implementation", "ms", "tokens/s", "speed vs torch"])
    return rows
