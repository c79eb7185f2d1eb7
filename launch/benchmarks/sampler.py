"""The rollout engine against the dense reference sampler, tunix's vanilla sampler and transformers.

Every table is measured side by side in one run; jitted programs are compiled before timing.

1. tiny: `configs/tiny.py` random weights, `batch` rows x 32-token prompts, `length // 64` new
   tokens (at least 8), greedy: our `generate` vs transformers' `generate` (torch CPU).
2. plain decode: a decode-heavy random Qwen3 (2 layers, hidden 512, 8 query / 2 kv heads of 64,
   vocab 16384), `batch` rows x 128-token prompts, every row to 256 and to min(2048, length) new
   tokens: our engine, the dense reference, tunix (`--tunix_python`, its own venv), and
   transformers (at 256 only: it runs at ~0.1 s a step here).
3. uniform: the same model, every row to `length` new tokens: engine vs dense, per-step time
   beside two lower bounds measured here: memory (weight + live KV bytes per step over the read
   bandwidth of a streaming sum; a copy is printed too) and compute (the step's flops over the
   rate of a decode-shaped matmul). On this CPU, 16 rows of decode are compute-bound.
4. long-tailed: `batch` prompts x 4 samples, `batch` decode slots (4x more rows than slots),
   lengths up to `length // 2` (most rows stop early, one prompt reaches the limit): engine vs
   dense, time and compiled memory (page pool or dense cache, plus activations).

The decode-heavy model is a counter: its embeddings are random unit directions and its head maps
each token's direction to the next token id, so greedy (and sampled) decoding emits t+1 after t
whatever the random layers add. Every engine then emits the same tokens, and a row stops exactly
when it reaches the EOS id: the stopping each workload imposes is the same for every engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import tiny_hf_model_and_params
from benchmarks.timing import interleaved_medians, print_table
from comppo_jax.models import ModelConfig, init_params, to_hf
from comppo_jax.rollout import generate
from comppo_jax.rollout.dense import generate_dense

TINY_PROMPT = 32
PROMPT = 128
SAMPLES = 4  # long-tailed rows per prompt
EOS = 0
TRANSFORMERS_STEPS = 256  # transformers runs at ~0.1 s a step here: timed at the short length only
COUNTER = ModelConfig(
    architecture="qwen3",
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
    eos_token_ids=(EOS,),
    pad_token_id=EOS,
)


def counter_params(config: ModelConfig = COUNTER, seed: int = 0, sharpness: float = 40.0) -> dict:
    """Random layers; unit-RMS random embeddings e_t and a head with column t+1 = sharpness * e_t / D."""
    params = init_params(config, jax.random.PRNGKey(seed))
    embed = np.random.default_rng(seed).normal(size=(config.vocab_size, config.hidden_size)).astype(np.float32)
    embed /= np.sqrt((embed**2).mean(axis=1, keepdims=True))
    params["embed"] = jnp.asarray(embed)
    params["lm_head"] = jnp.asarray(np.roll(embed.T, 1, axis=1) * (sharpness / config.hidden_size))
    return params


def counter_prompts(rows: int, lengths, seed: int = 0) -> np.ndarray:
    """Prompts [rows, PROMPT] whose last token is EOS - length, so the counter emits EOS as token `length`."""
    prompts = np.random.default_rng(seed).integers(1, COUNTER.vocab_size, (rows, PROMPT)).astype(np.int32)
    prompts[:, -1] = (EOS - np.asarray(lengths)) % COUNTER.vocab_size
    return prompts


class Machine(NamedTuple):
    """This machine's limits, measured in the same run as the samplers."""

    copy_bandwidth: float  # bytes/s of a jitted array copy (read + write)
    read_bandwidth: float  # bytes/s of a jitted sum (read only, what a decode step mostly does)
    matmul_flops: float  # flop/s of the decode-shaped matmul [rows, D] x [D, V]


def head_matmul(rows: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The decode-shaped `[rows, D] x [D, V]` matmul whose rate bounds the samplers: (lhs, rhs, flop)."""
    lhs = np.ones((rows, COUNTER.hidden_size), np.float32)
    rhs = np.ones((COUNTER.hidden_size, COUNTER.vocab_size), np.float32)
    return lhs, rhs, 2 * lhs.size * rhs.shape[1]


def measure_machine(rows: int, megabytes: int = 256) -> Machine:
    x = jnp.ones((megabytes << 18,), jnp.float32)
    copy, total = jax.jit(lambda x: x * 1.0001), jax.jit(jnp.sum)
    lhs, rhs, flop = head_matmul(rows)
    lhs, rhs, matmul = jnp.asarray(lhs), jnp.asarray(rhs), jax.jit(jnp.matmul)
    seconds = interleaved_medians(
        {
            "copy": lambda: copy(x).block_until_ready(),
            "sum": lambda: total(x).block_until_ready(),
            "matmul": lambda: matmul(lhs, rhs).block_until_ready(),
        },
        5,
    )
    return Machine(2 * x.nbytes / seconds["copy"], x.nbytes / seconds["sum"], flop / seconds["matmul"])


def matmul_floor_line(params, rows: int) -> str:
    """The part of a plain-decode step no sampler avoids: its weight matmuls at the `head_matmul`
    rate of XLA (the engine, tunix) and of torch (transformers), timed side by side."""
    import torch

    lhs, rhs, flop = head_matmul(rows)
    xla_lhs, xla_rhs, matmul = jnp.asarray(lhs), jnp.asarray(rhs), jax.jit(jnp.matmul)
    torch_lhs, torch_rhs = torch.from_numpy(lhs), torch.from_numpy(rhs)
    seconds = interleaved_medians(
        {"XLA": lambda: matmul(xla_lhs, xla_rhs).block_until_ready(), "torch": lambda: torch_lhs @ torch_rhs}, 5
    )
    rates = {name: flop / s for name, s in seconds.items()}
    return (
        "matmul floor per step: "
        + ", ".join(
            f"{name} {weight_flops(params, rows) / rate * 1e3:.2f} ms ({rate / 1e9:.0f} GFLOP/s)"
            for name, rate in rates.items()
        )
        + f", at the rate of a {list(lhs.shape)} x {list(rhs.shape)} matmul"
    )


def weight_bytes(params) -> int:
    """Bytes read per decode step: every matrix but the embedding table (one row per token)."""
    return sum(
        x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(params) if "embed" not in jax.tree_util.keystr(path)
    )


def weight_flops(params, rows: int) -> int:
    """A decode step's weight matmuls: 2 flop per weight (`weight_bytes`) per row."""
    return 2 * rows * weight_bytes(params) // jnp.dtype(COUNTER.dtype).itemsize


def step_bounds(params, rows: int, live_tokens: float, machine: Machine) -> tuple[float, float]:
    """(memory, compute) lower bounds on one decode step's seconds: weights + live KV over the read
    bandwidth; 2 flop per weight per row plus attention's 4 flop per query head dim per live token
    over the matmul rate."""
    memory = (weight_bytes(params) + live_tokens * kv_bytes_per_token(COUNTER)) / machine.read_bandwidth
    attention = 4 * COUNTER.num_layers * COUNTER.num_heads * COUNTER.head_dim * live_tokens
    return memory, (weight_flops(params, rows) + attention) / machine.matmul_flops


def bound_columns(seconds_per_step: float, bounds: tuple[float, float]) -> dict:
    memory, compute = bounds
    return {
        "memory bound ms": f"{memory * 1e3:.2f}",
        "compute bound ms": f"{compute * 1e3:.2f}",
        "x bound": f"{seconds_per_step / max(memory, compute):.2f}",
    }


def kv_bytes_per_token(config: ModelConfig) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * jnp.dtype(config.dtype).itemsize


def slot_schedule(lengths, slots: int) -> tuple[int, float]:
    """(decode iterations, mean live tokens per iteration) when rows in order take the first free
    of `slots` slots and hold it for their length (the engine's schedule)."""
    free_at = np.zeros(slots, np.int64)
    live = {}
    for length in lengths:
        slot = int(np.argmin(free_at))
        for step in range(free_at[slot], free_at[slot] + length):
            live[step] = live.get(step, 0) + PROMPT + step - free_at[slot]
        free_at[slot] += length
    return int(free_at.max()), float(np.mean(list(live.values())))


def _compiled(fn, *args, **kwargs):
    return jax.jit(lambda *a: fn(*a, **kwargs)).lower(*args).compile()


def _time_calls(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of an already compiled `fn` (each blocks on its result)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


class TunixWorker:
    """A tunix worker script of launch/benchmarks/ in tunix's own venv, over JSON-line pipes: the
    vanilla sampler (tunix_worker.py) or a GRPO step (tunix_grpo_worker.py)."""

    def __init__(self, python: str, model_dir: str, script: str = "tunix_worker.py"):
        worker = os.path.join(os.path.dirname(__file__), script)
        self.process = subprocess.Popen(
            [python, worker, model_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the tunix worker exited with code {self.process.wait()} (its stderr is above)")
        return json.loads(line)

    def call(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def generate(self, prompts: np.ndarray, max_new_tokens: int) -> tuple[float, np.ndarray]:
        reply = self.call({"prompts": prompts.tolist(), "max_new_tokens": max_new_tokens})
        return reply["seconds"], np.asarray(reply["tokens"])

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def tiny_table(batch: int, length: int, repeats: int) -> None:
    import torch

    hf_model, config, params = tiny_hf_model_and_params()
    prompts = np.random.default_rng(0).integers(3, config.vocab_size, (batch, TINY_PROMPT)).astype(np.int32)
    torch_prompts = torch.from_numpy(prompts.astype(np.int64))
    steps = max(8, length // 64)
    args = (params, jnp.asarray(prompts), jnp.ones(prompts.shape, bool), jax.random.PRNGKey(0))
    ours = _compiled(
        lambda p, t, m, r: generate(p, config, t, m, r, max_new_tokens=steps, temperature=0.0, eos_token_ids=()), *args
    )

    def theirs():
        with torch.no_grad():
            out = hf_model.generate(
                torch_prompts,
                attention_mask=torch.ones_like(torch_prompts),
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                use_cache=True,
                pad_token_id=0,
            )
        return out[:, TINY_PROMPT:].numpy()

    agreement = float((np.asarray(ours(*args).response_tokens) == theirs()).mean())
    names = {
        "comppo_jax generate": lambda: ours(*args).response_tokens.block_until_ready(),
        f"transformers {__import__('transformers').__version__} generate (torch CPU)": theirs,
    }
    medians = interleaved_medians(names, repeats)
    reference = medians[list(names)[1]]
    print(
        f"tiny: configs/tiny.py, batch {batch}, prompt {TINY_PROMPT}, {steps} new tokens greedy; "
        f"token agreement {agreement:.3f}"
    )
    print_table(
        [
            {
                "implementation": name,
                "ms": f"{s * 1e3:.1f}",
                "new tokens/s": f"{batch * steps / s:,.0f}",
                "speed vs transformers": f"{reference / s:.2f}x",
            }
            for name, s in medians.items()
        ],
        ["implementation", "ms", "new tokens/s", "speed vs transformers"],
    )


def plain_decode_table(params, batch: int, lengths: list[int], repeats: int, tunix_python: str | None) -> None:
    """Every row to each of `lengths` new tokens, on every engine; ratios against our engine."""
    import torch
    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        to_hf(COUNTER, params, model_dir)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tunix = TunixWorker(tunix_python, model_dir) if tunix_python else None
        try:
            for steps in lengths:
                prompts = counter_prompts(batch, [steps + 1] * batch)  # EOS never reached
                args = (params, jnp.asarray(prompts), jnp.ones(prompts.shape, bool), jax.random.PRNGKey(0))
                kwargs = dict(max_new_tokens=steps, temperature=0.0, eos_token_ids=())
                ours = _compiled(lambda p, t, m, r: generate(p, COUNTER, t, m, r, **kwargs), *args)
                dense = _compiled(lambda p, t, m, r: generate_dense(p, COUNTER, t, m, r, **kwargs), *args)
                expected = np.asarray(ours(*args).response_tokens)
                torch_prompts = torch.from_numpy(prompts.astype(np.int64))

                def hf():
                    with torch.no_grad():
                        out = hf_model.generate(
                            torch_prompts,
                            attention_mask=torch.ones_like(torch_prompts),
                            do_sample=False,
                            max_new_tokens=steps,
                            min_new_tokens=steps,
                            use_cache=True,
                            pad_token_id=EOS,
                        )
                    return out[:, PROMPT:].numpy()

                candidates = {
                    "comppo_jax engine": lambda: ours(*args).response_tokens.block_until_ready(),
                    "dense reference": lambda: dense(*args).response_tokens.block_until_ready(),
                }
                agree = {"dense reference": np.asarray(dense(*args).response_tokens)}
                if steps <= TRANSFORMERS_STEPS:
                    candidates["transformers"], agree["transformers"] = hf, hf()
                medians = {name: _time_calls(fn, repeats) for name, fn in candidates.items()}
                if tunix is not None:
                    tunix.generate(prompts, steps)  # compiles
                    samples = [tunix.generate(prompts, steps) for _ in range(repeats)]
                    medians["tunix vanilla sampler"] = float(np.median([s for s, _ in samples]))
                    agree["tunix vanilla sampler"] = samples[0][1]
                for name, seconds in medians.items():
                    same = 1.0 if name == "comppo_jax engine" else float((agree[name] == expected).mean())
                    rows.append(
                        {
                            "new tokens": steps,
                            "implementation": name,
                            "ms/step": f"{seconds / steps * 1e3:.2f}",
                            "token agreement": f"{same:.3f}",
                            "engine speed-up": f"{seconds / medians['comppo_jax engine']:.2f}x",
                        }
                    )
        finally:
            if tunix is not None:
                tunix.close()
    versions = f"transformers {transformers.__version__}" + (
        f", tunix {tunix.ready['tunix']} (jax {tunix.ready['jax']})" if tunix else ""
    )
    print(
        f"\nplain decode: decode-heavy counter model, {batch} rows x {PROMPT}-token prompts, every row to N new "
        f"tokens, greedy; {versions}"
        + ("" if tunix_python else "; tunix skipped (pass --tunix_python=<its venv's python>)")
    )
    print_table(rows, ["new tokens", "implementation", "ms/step", "token agreement", "engine speed-up"])
    print("\n" + matmul_floor_line(params, batch))


def uniform_table(params, batch: int, length: int, machine: Machine) -> None:
    prompts = counter_prompts(batch, [length + 1] * batch)
    args = (params, jnp.asarray(prompts), jnp.ones(prompts.shape, bool), jax.random.PRNGKey(0))
    kwargs = dict(max_new_tokens=length, temperature=0.0, eos_token_ids=())
    engines = {
        "comppo_jax engine": _compiled(lambda p, t, m, r: generate(p, COUNTER, t, m, r, **kwargs), *args),
        "dense reference": _compiled(lambda p, t, m, r: generate_dense(p, COUNTER, t, m, r, **kwargs), *args),
    }
    seconds = {
        name: _time_calls(lambda: fn(*args).response_tokens.block_until_ready(), 1) for name, fn in engines.items()
    }
    live = {
        "comppo_jax engine": batch * (PROMPT + length / 2),
        "dense reference": batch * (PROMPT + length),
    }  # KV tokens read per step
    rows = [
        {
            "implementation": name,
            "s": f"{s:.1f}",
            "ms/step": f"{s / length * 1e3:.2f}",
            **bound_columns(s / length, step_bounds(params, batch, live[name], machine)),
            "engine speed-up": f"{s / seconds['comppo_jax engine']:.2f}x",
        }
        for name, s in seconds.items()
    ]
    print(
        f"\nuniform: {batch} rows x {PROMPT}-token prompts, every row to {length} new tokens; bounds from weights "
        f"{weight_bytes(params) / 2**20:.0f} MiB + live KV at {machine.read_bandwidth / 1e9:.1f} GB/s read "
        f"(a copy runs at {machine.copy_bandwidth / 1e9:.1f} GB/s) and matmuls at "
        f"{machine.matmul_flops / 1e9:.0f} GFLOP/s"
    )
    print_table(
        rows, ["implementation", "s", "ms/step", "memory bound ms", "compute bound ms", "x bound", "engine speed-up"]
    )


def long_tailed_lengths(prompts: int, longest: int) -> np.ndarray:
    """Per-prompt lengths: 10/16 at longest/16, 3/16 at longest/8, 2/16 at longest/2, the rest at longest."""
    fractions = np.asarray([1 / 16] * 10 + [1 / 8] * 3 + [1 / 2] * 2 + [1])
    return np.maximum(1, (fractions[np.arange(prompts) * len(fractions) // prompts] * longest).astype(int))


def long_tailed_table(params, batch: int, longest: int, machine: Machine) -> None:
    lengths = long_tailed_lengths(batch, longest)
    prompts = counter_prompts(batch, lengths)
    args = (params, jnp.asarray(prompts), jnp.ones(prompts.shape, bool), jax.random.PRNGKey(0))
    kwargs = dict(max_new_tokens=longest, temperature=1.0, num_samples=SAMPLES)
    engines = {
        "comppo_jax engine": _compiled(
            lambda p, t, m, r: generate(p, COUNTER, t, m, r, decode_slots=batch, **kwargs), *args
        ),
        "dense reference": _compiled(lambda p, t, m, r: generate_dense(p, COUNTER, t, m, r, **kwargs), *args),
    }
    outputs = {name: fn(*args) for name, fn in engines.items()}
    row_lengths = np.repeat(lengths, SAMPLES)
    for name, out in outputs.items():
        np.testing.assert_array_equal(np.asarray(out.response_mask).sum(axis=1), row_lengths, err_msg=name)
    seconds = {
        name: _time_calls(lambda: fn(*args).response_tokens.block_until_ready(), 1) for name, fn in engines.items()
    }
    memory = {name: fn.memory_analysis().temp_size_in_bytes for name, fn in engines.items()}
    iterations, live = slot_schedule(row_lengths, batch)
    schedule = {
        "comppo_jax engine": (iterations, batch, live),
        "dense reference": (longest, batch * SAMPLES, batch * SAMPLES * (PROMPT + longest)),
    }
    rows = []
    for name, s in seconds.items():
        steps, step_rows, live_tokens = schedule[name]
        rows.append(
            {
                "implementation": name,
                "s": f"{s:.1f}",
                "steps": steps,
                "ms/step": f"{s / steps * 1e3:.2f}",
                **bound_columns(s / steps, step_bounds(params, step_rows, live_tokens, machine)),
                "memory MiB": f"{memory[name] / 2**20:.0f}",
                "memory vs dense": f"{memory[name] / memory['dense reference']:.2f}",
                "engine speed-up": f"{s / seconds['comppo_jax engine']:.2f}x",
            }
        )
    print(
        f"\nlong-tailed: {batch} prompts x {SAMPLES} samples = {batch * SAMPLES} rows, {batch} decode slots, "
        f"lengths up to {longest} (mean {row_lengths.mean():.0f}), sampled at temperature 1; memory = compiled "
        f"temporaries (cache or page pool + activations)"
    )
    print_table(
        rows,
        [
            "implementation",
            "s",
            "steps",
            "ms/step",
            "memory bound ms",
            "compute bound ms",
            "x bound",
            "memory MiB",
            "memory vs dense",
            "engine speed-up",
        ],
    )


TABLES = ("tiny", "plain", "uniform", "long_tailed")


def run(
    batch: int = 16,
    length: int = 8192,
    repeats: int = 3,
    tunix_python: str | None = None,
    tables: str = ",".join(TABLES),
) -> None:
    chosen = tables.split(",")
    unknown = sorted(set(chosen) - set(TABLES))
    if unknown:
        raise ValueError(f"unknown sampler tables {unknown}; expected a comma-separated subset of {TABLES}")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPU cores")
    if "tiny" in chosen:
        tiny_table(batch, length, repeats)
    params = counter_params()
    if "plain" in chosen:
        plain_decode_table(params, batch, sorted({min(256, length), min(2048, length)}), repeats, tunix_python)
    if "uniform" in chosen:
        uniform_table(params, batch, length, measure_machine(batch))
    if "long_tailed" in chosen:
        long_tailed_table(params, batch, max(1, length // 2), measure_machine(batch))
