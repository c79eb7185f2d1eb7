"""Greedy decoding with tunix's vanilla `Sampler`, driven over stdin/stdout by a benchmark.

    /tmp/tunix_venv/bin/python launch/benchmarks/tunix_worker.py MODEL_DIR

This runs under its own virtualenv, never the project's: tunix pins its own jax/flax, which
differ from the ones comppo_jax is built against, so the two cannot share an interpreter. For
the same reason this file imports nothing from comppo_jax; the parent talks to it in JSON lines.

MODEL_DIR is a Hugging Face Qwen3 checkpoint (config.json + *.safetensors). The model is built
from config.json field by field and loaded with tunix's own safetensors loader, in float32.

Protocol (one JSON object per line):
  out: {"ready": true, "jax": ..., "tunix": ...}               once the model is loaded
  in:  {"prompts": [[id, ...], ...], "max_new_tokens": N}      equal-length, unpadded prompts
  out: {"seconds": s, "tokens": [[id, ...], ...]}              exactly N greedy ids per row
`seconds` is the wall time of the `Sampler` call alone (it ends with a device-to-host copy of
the tokens, so the result is ready). Compilation is included, so the parent should warm up
with one call of the same shape. EOF ends the worker; any error goes to stderr, exit status 1.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import sys
import time

# Any stray print from a library would corrupt the protocol: keep the real stdout for our
# JSON lines only and send everything else to stderr.
PROTOCOL_OUT, sys.stdout = sys.stdout, sys.stderr

import jax
import jax.numpy as jnp
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params

# No real token has id -1. As pad id, it marks the not-yet-generated tail of the Sampler's
# token buffer (which the Sampler masks out) without ever colliding with a prompt or generated
# token; as EOS id, greedy argmax can never produce it, so no row stops early and the Sampler's
# while-loop always runs to prompt length + max_new_tokens.
NO_TOKEN = -1


class TokenIdTokenizer:
    """Stand-in tokenizer for prompts that arrive as token ids.

    The Sampler only calls `encode` on each prompt (then prepends `bos_id()` if truthy), reads
    `pad_id()`/`eos_id()`, and `decode`s each output into `SamplerOutput.text`, which we ignore:
    the ids come back in `SamplerOutput.tokens`.
    """

    def encode(self, ids, **_):
        return list(ids)

    def decode(self, ids, **_):
        return ""

    def bos_id(self):
        return None  # falsy: the prompt is sent as is, with no BOS prepended

    def eos_id(self):
        return NO_TOKEN

    def pad_id(self):
        return NO_TOKEN


def fail(message: str) -> None:
    print(f"tunix_worker: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def tunix_config(hf: dict) -> qwen3_model.ModelConfig:
    """Maps a transformers Qwen3 config.json (4.x or 5.x layout) to tunix's ModelConfig."""

    def field(name):
        if hf.get(name) is None:
            fail(f"config.json field {name!r} is missing")
        return hf[name]

    if hf.get("model_type") != "qwen3":
        fail(f"config.json field 'model_type'={hf.get('model_type')!r}: only 'qwen3' is supported")
    if hf.get("hidden_act", "silu") != "silu":
        fail(f"config.json field 'hidden_act'={hf['hidden_act']!r}: tunix's Qwen3 uses silu")
    for flag in ("attention_bias", "use_sliding_window"):
        if hf.get(flag):
            fail(f"config.json field {flag!r}=true is not supported by tunix's Qwen3")
    # transformers 5.x nests rope_theta in `rope_parameters`; 4.x has it (and `rope_scaling`) on top.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        fail(f"config.json RoPE scaling {rope!r} is not supported by tunix's Qwen3")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta"))
    if rope_theta is None:
        fail("config.json field 'rope_theta' (top level or in 'rope_parameters') is missing")

    return qwen3_model.ModelConfig(
        num_layers=field("num_hidden_layers"),
        vocab_size=field("vocab_size"),
        embed_dim=field("hidden_size"),
        hidden_dim=field("intermediate_size"),
        num_heads=field("num_attention_heads"),
        head_dim=field("head_dim"),
        num_kv_heads=field("num_key_value_heads"),
        rope_theta=rope_theta,
        norm_eps=field("rms_norm_eps"),
        use_tied_embedding=bool(field("tie_word_embeddings")),
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )


def reply(obj: dict) -> None:
    PROTOCOL_OUT.write(json.dumps(obj) + "\n")
    PROTOCOL_OUT.flush()


def load_model(model_dir: str, mesh=None):
    """(tunix ModelConfig, float32 tunix Qwen3) of the checkpoint in `model_dir`."""
    with open(f"{model_dir}/config.json") as f:
        config = tunix_config(json.load(f))
    # tunix 0.1.7's Qwen3 attention calls `apply_rope` without `rope_theta`, so it always uses the
    # function's default of 1e6 and ignores `ModelConfig.rope_theta`. Bind the checkpoint's theta
    # (a compile-time constant: no cost) so checkpoints with another theta decode correctly.
    qwen3_model.apply_rope = functools.partial(qwen3_model.apply_rope, rope_theta=config.rope_theta)
    return config, qwen3_params.create_model_from_safe_tensors(model_dir, config, mesh=mesh, dtype=jnp.float32)


def check_request(request: dict, vocab_size: int) -> tuple[list, int, int]:
    """(prompts, max_new_tokens, prompt length) of a request, or exit naming what is wrong."""
    prompts, max_new_tokens = request["prompts"], int(request["max_new_tokens"])
    prompt_length = len(prompts[0]) if prompts else 0
    if max_new_tokens < 1 or prompt_length < 1 or any(len(p) != prompt_length for p in prompts):
        fail(f"need max_new_tokens >= 1 and non-empty prompts of one length, got {request!r:.200}")
    if any(not 0 <= t < vocab_size for p in prompts for t in p):
        fail(f"prompt token ids must lie in [0, {vocab_size})")
    return prompts, max_new_tokens, prompt_length


def main(model_dir: str) -> None:
    config, model = load_model(model_dir)
    tokenizer = TokenIdTokenizer()
    # The cache size is part of every compiled shape, so keep one Sampler (and its jit cache) per
    # size; each request gets a cache of exactly prompt length + max_new_tokens.
    samplers: dict[int, sampler_lib.Sampler] = {}
    reply({"ready": True, "jax": jax.__version__, "tunix": importlib.metadata.version("google-tunix")})

    for line in sys.stdin:
        if not line.strip():
            continue
        prompts, max_new_tokens, prompt_length = check_request(json.loads(line), config.vocab_size)

        cache_size = prompt_length + max_new_tokens
        if cache_size not in samplers:
            samplers[cache_size] = sampler_lib.Sampler(
                model,
                tokenizer,
                sampler_lib.CacheConfig(
                    cache_size=cache_size,
                    num_layers=config.num_layers,
                    num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim,
                ),
            )
        start = time.perf_counter()
        # The Sampler's "strings" go through `tokenizer.encode`, so id lists pass straight through.
        # max_prompt_length = the prompt length avoids its default left-padding to a power of two;
        # temperature 0 with no top_p/top_k/beam_size selects greedy (argmax) sampling.
        out = samplers[cache_size](
            prompts,
            max_generation_steps=max_new_tokens,
            max_prompt_length=prompt_length,
            temperature=0.0,
        )
        seconds = time.perf_counter() - start
        tokens = [[int(t) for t in row] for row in out.tokens]
        if any(len(row) != max_new_tokens for row in tokens):
            fail(f"sampler returned {[len(r) for r in tokens]} tokens per row, expected {max_new_tokens}")
        reply({"seconds": seconds, "tokens": tokens})


def run_worker(main, script: str) -> None:
    """`main(MODEL_DIR)` from the command line; any error is printed and exits with status 1."""
    if len(sys.argv) != 2:
        fail(f"usage: {script} MODEL_DIR")
    try:
        main(sys.argv[1])
    except SystemExit:
        raise
    except Exception as error:  # report anything, then exit nonzero
        import traceback

        traceback.print_exc()
        fail(f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    run_worker(main, "tunix_worker.py")
