"""LoRA beside full fine-tuning, measured side by side in one run: the actor update and decoding.

Each shape runs twice, full fine-tuning and LoRA (rank 8, alpha 16, every projection), through
the programs train() runs (`planner.train_step_programs`, compiled for this machine; random
weights): `--model=tiny` (default) runs `tiny`, configs/tiny.py, and `wide`, the same with 4x its
width and 2x its depth; `--model=qwen3_0.6b` runs the step suite's Qwen3-0.6B shapes (bf16, full
remat, 512-token prompts + `length` - 512 new tokens; meant for a GPU); `--shapes=tiny,...` runs
those shapes alone (launch/gpu_validation.sh's SMOKE check runs `tiny`). Per
shape and mode: the bytes a device holds for the actor (its params, AdamW moments and, under
full fine-tuning, the separate frozen reference; LoRA's reference is its base), the actor update
program's temporaries (`memory_analysis`), and the times of one actor update (forward + backward
+ AdamW on a minibatch) and of decoding a rollout, with the adapters merged into their base
(train()'s sampler) and with the adapter matmuls instead. Times are interleaved medians.
"""

from __future__ import annotations

import jax
import numpy as np

from benchmarks.step import on_device, step_config
from benchmarks.timing import interleaved_medians, print_table
from comppo_jax import sharding
from comppo_jax.models import lora

WIDE = dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64)
SHAPES = {"tiny": ("tiny", "wide"), "qwen3_0.6b": ("qwen3_0.6b",)}  # per --model
RANK = 8


def shape_config(shape: str, rank: int, length: int):
    cfg, prompt_length = step_config("qwen3_0.6b" if shape == "qwen3_0.6b" else "tiny", length)
    if shape == "wide":
        cfg.model.arch.update(WIDE)
    cfg.model.lora.update(rank=rank, alpha=2.0 * rank)
    return cfg, prompt_length


def run(model: str = "tiny", length: int = 4096, repeats: int = 3, shapes: str | None = None) -> None:
    if model not in SHAPES:
        raise ValueError(f"--model={model!r}: expected one of {sorted(SHAPES)}")
    names = tuple(shapes.split(",")) if shapes else SHAPES[model]
    known = {shape for each in SHAPES.values() for shape in each}
    if not set(names) <= known:
        raise ValueError(f"--shapes={shapes!r}: expected some of {sorted(known)}")
    described = shape_config(names[0], 0, length)
    mesh = sharding.make_mesh(described[0].mesh, jax.devices())
    calls, rows = {}, {}
    for shape in names:
        for rank in (0, RANK):
            cfg, prompt_length = shape_config(shape, rank, length)
            programs = on_device(cfg, prompt_length, mesh, np.random.default_rng(0))
            name = f"{shape} {'LoRA' if rank else 'full'}"
            bytes_of = programs.step.state_bytes
            memory = programs.compiled["actor"].memory_analysis()
            trained = sum(x.size for x in jax.tree.leaves(lora.trainable(programs.state["actor"])))
            rows[name] = {
                "shape": shape,
                "mode": f"LoRA r{rank}" if rank else "full",
                "trained params": f"{trained / 1e6:.3g} M",
                "actor + AdamW + reference MB": (bytes_of["actor"] + bytes_of["actor_opt"] + bytes_of["reference"])
                / 2**20,
                "update temporaries MB": memory.temp_size_in_bytes / 2**20,
            }
            calls[f"{name} update"], calls[f"{name} decode"] = programs.calls["actor"], programs.calls["sample"]
            if rank:  # the same sampler on the unmerged params: the adapter matmuls at every token
                sample, (_, prompts, mask, key), _ = programs.step.programs["sample"]
                prompts = jax.device_put(programs.prompts, prompts.sharding)
                mask = jax.device_put(np.ones(prompts.shape, bool), mask.sharding)
                key = jax.device_put(np.asarray(jax.random.PRNGKey(0)), key.sharding)
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    unmerged = sample.lower(programs.state["policy"], prompts, mask, key).compile()
                policy = programs.state["policy"]
                calls[f"{name} decode unmerged"] = (
                    lambda unmerged=unmerged, policy=policy, prompts=prompts, mask=mask, key=key: jax.block_until_ready(
                        unmerged(policy, prompts, mask, key)
                    )
                )
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        seconds = interleaved_medians(calls, repeats)
    table = []
    for name, row in rows.items():
        full = rows[f"{row['shape']} full"]
        table.append(
            {
                **row,
                "actor + AdamW + reference MB": f"{row['actor + AdamW + reference MB']:.3g}",
                "update temporaries MB": f"{row['update temporaries MB']:.3g}",
                "state / full": f"{row['actor + AdamW + reference MB'] / full['actor + AdamW + reference MB']:.2f}",
                "update ms": f"{seconds[f'{name} update'] * 1e3:.3g}",
                "update / full": f"{seconds[f'{name} update'] / seconds[row['shape'] + ' full update']:.2f}",
                "decode ms (merged)": f"{seconds[f'{name} decode'] * 1e3:.3g}",
                "decode ms (adapter matmuls)": f"{seconds[f'{name} decode unmerged'] * 1e3:.3g}"
                if f"{name} decode unmerged" in seconds
                else "-",
            }
        )
    cfg, prompt_length = described
    print(
        f"{cfg.rollout.prompts_per_step} x {cfg.rollout.samples_per_prompt} rows of {prompt_length} + "
        f"{cfg.rollout.max_new_tokens} tokens, minibatch {cfg.train.minibatch_size}, {cfg.model.arch.dtype}, on "
        f"{jax.devices()[0].device_kind} ({len(jax.devices())} device(s))"
    )
    print_table(
        table,
        [
            "shape",
            "mode",
            "trained params",
            "actor + AdamW + reference MB",
            "state / full",
            "update temporaries MB",
            "update ms",
            "update / full",
            "decode ms (merged)",
            "decode ms (adapter matmuls)",
        ],
    )
