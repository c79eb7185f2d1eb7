"""Decode throughput of our KV-cache sampler against transformers' `generate` (torch CPU).

The same random tiny model (`configs/tiny.py` architecture) on both sides, the same batch of
random prompts, greedy decoding of exactly `length` new tokens (no EOS), KV cache on both. Our
side is the jitted `generate` (prefill + `lax.while_loop` decode); theirs is
`model.generate(do_sample=False, use_cache=True)`. Tokens/s counts generated tokens; the
agreement column is the fraction of generated tokens equal on both sides (fp32 greedy).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import tiny_hf_model_and_params
from benchmarks.timing import interleaved_medians, print_table
from comppo_jax.rollout import generate

PROMPT_LENGTH = 32


def run(batch: int = 16, length: int = 128, repeats: int = 3) -> list[dict]:
    import torch

    hf_model, config, params = tiny_hf_model_and_params()
    prompts = np.random.default_rng(0).integers(3, config.vocab_size, (batch, PROMPT_LENGTH)).astype(np.int32)
    prompt_mask = np.ones_like(prompts, bool)
    torch_prompts = torch.from_numpy(prompts.astype(np.int64))

    def ours():
        out = generate(params, config, jnp.asarray(prompts), jnp.asarray(prompt_mask), jax.random.PRNGKey(0),
                       max_new_tokens=length, temperature=0.0, eos_token_ids=())
        return np.asarray(out.response_tokens)

    def theirs():
        with torch.no_grad():
            out = hf_model.generate(torch_prompts, attention_mask=torch.ones_like(torch_prompts), do_sample=False,
                                    max_new_tokens=length, min_new_tokens=length, use_cache=True, pad_token_id=0)
        return out[:, PROMPT_LENGTH:].numpy()

    agreement = float((ours() == theirs()).mean())
    names = {"comppo_jax generate (jit, KV cache)": ours, f"transformers {__import__('transformers').__version__} generate (torch CPU)": theirs}
    medians = interleaved_medians(names, repeats)
    reference = medians[list(names)[1]]
    rows = [{
        "implementation": name, "ms": f"{seconds * 1e3:.1f}", "new tokens/s": f"{batch * length / seconds:,.0f}",
        "speed vs transformers": f"{reference / seconds:.2f}x",
    } for name, seconds in medians.items()]
    print(f"sampler: configs/tiny.py, batch {batch}, prompt {PROMPT_LENGTH}, {length} new tokens greedy; token agreement "
          f"{agreement:.3f}; median of {repeats} interleaved rounds; jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"{os.cpu_count()} CPU cores")
    print_table(rows, ["implementation", "ms", "new tokens/s", "speed vs transformers"])
    return rows
