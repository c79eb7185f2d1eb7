"""Ahead-of-time memory planning: the real train steps compiled for a TPU topology, from any host.

With `libtpu` installed, `jax.experimental.topologies` describes a TPU slice without one. The
run's mesh is built on those abstract devices, the state as sharded `ShapeDtypeStruct`s (nothing
is allocated), and the programs of a train step are lowered and compiled by the real TPU
compiler as `train()` jits them, with the kernels a TPU run picks (splash attention, the Mosaic
concentration kernel):

- `sample`: `rollout.generate` (the rollout engine: one prefill per prompt, then decoding over
  the paged KV cache with the ragged paged attention kernel; the page pool is reported apart);
- `actor`: `update.actor_step` (clipped PPO + reference KL, AdamW on the fp32 master params);
- `critic`: `update.critic_step` (TAC or the standard head);
- `score`: `rollout.score_rollout` on the whole rollout batch (behaviour and reference policies,
  the concentration kernel, the critic's features).

Per chip, `compiled.memory_analysis()` gives arguments, outputs (those not aliased to donated
arguments), temporaries, generated code and the compiler's peak; "args+out+temp+code" is their
sum, the conservative bound next to the peak. State a step does not take but that stays in HBM meanwhile (e.g. the reference
params and the critic during the actor step) is added as "resident", so each step's total is
what the chip must hold.
"""

from __future__ import annotations

import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from comppo_jax import sharding
from comppo_jax.models import init_params, model_config
from comppo_jax.models.attention import resolve_implementation
from comppo_jax.models.paged_cache import resolve_paged_attention
from comppo_jax.rollout import engine, engine_options, generate, score_rollout
from comppo_jax.rollout.sampler import Generation
from comppo_jax.train.loop import check_batch, init_critic, run_parts
from comppo_jax.train.update import Minibatch, adamw, cast_params, jit_update_steps, minibatch_shardings

GIB = 2**30
# Per-chip HBM (GiB) and the chip configuration `get_topology_desc` needs, per TPU family.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}
STEPS = ("sample", "score", "actor", "critic")


def topology_devices(topology: str) -> list:
    """Abstract TPU devices of `topology` ("v5p:2x2x2", "v5e:4x4", ...), one per chip."""
    from jax.experimental import topologies

    family = topology.split(":")[0]
    if family not in HBM_GIB:
        raise ValueError(f"--topology={topology!r}: unknown TPU family {family!r}; expected one of {sorted(HBM_GIB)}, "
                         "e.g. v5p:2x2x2, v5e:4x4, v4:2x2x1, v6e:4x4")
    try:
        return topologies.get_topology_desc(topology, "tpu", chip_config_name=CHIP_CONFIG[family]).devices
    except Exception as error:  # libtpu missing or the layout refused: say which
        raise ValueError(f"--topology={topology!r} was not accepted by libtpu: {error}") from error


def tree_bytes_per_chip(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (None leaves: 0)."""
    leaves = [x for x in jax.tree.leaves(tree) if x is not None]
    return int(sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves))


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings,
                        is_leaf=lambda x: x is None)


class StepPlan(NamedTuple):
    """One compiled program's per-chip bytes (None fields when it did not compile)."""

    step: str
    arguments: int | None
    outputs: int | None  # not aliased to (donated) arguments
    temp: int | None
    code: int | None
    peak: int | None  # the compiler's peak plus the resident state
    conservative: int | None  # arguments + outputs + resident + temp + code
    resident: int  # state held in HBM that the step does not take
    compile_seconds: float
    error: str | None = None  # "does not fit (needs ...)" or the compiler's message


class Plan(NamedTuple):
    topology: str
    chips: int
    hbm: int  # bytes per chip
    mesh: dict
    attention: str  # the training attention compiled ("auto" resolved for TPU)
    length: int  # prompt + response tokens per row
    state: dict  # bytes per chip of each piece of state
    steps: list[StepPlan]
    page_pool: int  # bytes per chip of the rollout engine's KV page pool (in the sample step's temp)


# The TPU compiler's out-of-memory reports, as (pattern, one-line summary of its groups).
_OUT_OF_MEMORY = (
    (r"required for (.+?) \(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)", "needs {1} for {0} alone, {2} HBM"),
    (r"Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) hbm", "needs {0} of {1} HBM"),
    (r"[Ee]xceeded .*? by ([\d.]+[KMGT]?)", "exceeds HBM by {0}"),
)


def _does_not_fit(message: str) -> str:
    """The compiler's out-of-memory report as one line."""
    for pattern, summary in _OUT_OF_MEMORY:
        found = re.search(pattern, message)
        if found:
            return f"does not fit ({summary.format(*found.groups())})"
    return "does not fit (RESOURCE_EXHAUSTED)"


def _compile(name, jitted, args, resident, log) -> StepPlan:
    """Compiles `jitted(*args)`. `resident`: bytes of the state held meanwhile; arguments the
    program does not read (jit drops them) are placed all the same, so they are added to it."""
    log(f"compiling {name} ...")
    started = time.time()
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as error:
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
            raise
        return StepPlan(name, None, None, None, None, None, None, resident, time.time() - started, _does_not_fit(message))
    seconds = time.time() - started
    stats = compiled.memory_analysis()
    arguments, temp, code = stats.argument_size_in_bytes, stats.temp_size_in_bytes, stats.generated_code_size_in_bytes
    resident += max(0, tree_bytes_per_chip(args) - arguments)
    outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
    return StepPlan(name, arguments, outputs, temp, code, stats.peak_memory_in_bytes + resident,
                    arguments + outputs + resident + temp + code, resident, seconds)


def plan(cfg, topology: str, *, prompt_length: int, steps=STEPS, log=print) -> Plan:
    """Compiles `steps` of `cfg`'s train step for `topology`; see the module docstring."""
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; expected a subset of {STEPS}")
    devices = topology_devices(topology)
    mesh = sharding.make_mesh(cfg.mesh, devices)
    check_batch(cfg, mesh)
    family = topology.split(":")[0]
    config = model_config(cfg.model)
    # "auto" means what a TPU run would pick, not this host's platform.
    config = config.replace(attention=resolve_implementation(config.attention, config.dtype, platform="tpu"))
    parts = run_parts(cfg, config)
    key = jax.random.PRNGKey(0)
    abstract = lambda make: sharding.abstract_sharded(mesh, make)
    actor_tx, critic_tx = adamw(cfg.train.actor_lr), adamw(cfg.train.critic_lr)
    master = lambda: cast_params(init_params(config, key), cfg.train.master_dtype)
    state = {
        "actor": abstract(master),
        "actor_opt": abstract(lambda: actor_tx.init(master())),
        "policy": abstract(lambda: init_params(config, key)),  # the compute-dtype copy the rollout uses
        "reference": abstract(lambda: init_params(config, key)),
        "critic": abstract(lambda: init_critic(parts, config, key)),
    }
    state["critic_opt"] = None if state["critic"] is None else abstract(lambda: critic_tx.init(init_critic(parts, config, key)))

    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    response = cfg.rollout.max_new_tokens
    length = prompt_length + response
    batch_sharding = sharding.batch_sharding(mesh)

    def generation(batch):
        shapes = Generation(jax.ShapeDtypeStruct((batch, length), jnp.int32), jax.ShapeDtypeStruct((batch, length), jnp.bool_),
                            jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch, response), jnp.int32),
                            jax.ShapeDtypeStruct((batch, response), jnp.bool_), jax.ShapeDtypeStruct((batch, response), jnp.float32))
        return _with_shardings(shapes, Generation(*[batch_sharding] * len(Generation._fields)))

    score = jax.jit(lambda policy, reference, generation: score_rollout(
        policy, reference, config, generation, window=cfg.rollout.window, temperature=cfg.rollout.temperature,
        hidden_layers=parts.hidden_layers, top_k=parts.top_k, backend="tpu", **cfg.gate_envelope.to_dict()))

    def minibatch(batch):
        """The Minibatch of `batch` rows, shaped as score_and_credit builds it."""
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            rollout = jax.eval_shape(score, state["policy"], state["reference"], generation(batch))
        per_token = jax.ShapeDtypeStruct((batch, response), jnp.float32)
        fields = Minibatch(rollout.tokens, rollout.attention_mask, rollout.prompt_lengths, generation(batch).response_tokens,
                           rollout.response_mask, rollout.log_probs, rollout.ref_log_probs, per_token, per_token, per_token,
                           jax.ShapeDtypeStruct((batch, length), jnp.float32), rollout.hidden_states, rollout.routing)
        return _with_shardings(fields, minibatch_shardings(mesh, with_routing=parts.recipe.critic == "tac"))

    state["rollout_batch"] = minibatch(rows)
    update = jit_update_steps(mesh, model_config=config, temperature=cfg.rollout.temperature, actor=state["actor"],
                              actor_opt=state["actor_opt"], actor_tx=actor_tx, critic=state["critic"], critic_opt=state["critic_opt"],
                              critic_tx=critic_tx, critic_module=parts.critic_module, critic_kind=parts.recipe.critic)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    bytes_of = {name: tree_bytes_per_chip(tree) for name, tree in state.items()}
    held = lambda *names: sum(bytes_of[name] for name in names)
    train_rows = minibatch(cfg.train.minibatch_size)
    prompts = jax.ShapeDtypeStruct((cfg.rollout.prompts_per_step, prompt_length), jnp.int32, sharding=batch_sharding)
    options = engine_options(cfg.rollout)
    options["paged_attention"] = resolve_paged_attention(options["paged_attention"], config.head_dim, platform="tpu")
    sample = jax.jit(lambda policy, prompts, prompt_mask, rng: generate(
        policy, config, prompts, prompt_mask, rng, max_new_tokens=response, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, num_samples=cfg.rollout.samples_per_prompt, eos_token_ids=config.eos_token_ids or (0,),
        **options))
    # The actor and its optimizer, the reference and the critic stay on device all step; during
    # the update so does the whole rollout batch (train() frees the compute copy `policy` first).
    # With equal master and compute dtypes `policy` is the actor itself (the cast is a no-op).
    beside_policy = ("actor",) if jnp.dtype(cfg.train.master_dtype) != jnp.dtype(config.dtype) else ()
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
    programs = {
        "sample": (sample, (state["policy"], prompts, prompts.update(dtype=jnp.bool_), rng),
                   held(*beside_policy, "actor_opt", "reference", "critic", "critic_opt")),
        "score": (score, (state["policy"], state["reference"], generation(rows)),
                  held(*beside_policy, "actor_opt", "critic", "critic_opt")),
        "actor": (update.actor, (state["actor"], state["actor_opt"], train_rows,
                                 dict.fromkeys(("learning_rate", "clip", "kl_coef", "grad_clip"), scalar)),
                  held("reference", "critic", "critic_opt", "rollout_batch")),
        "critic": None if update.critic is None else (
            update.critic, (state["critic"], state["critic_opt"], train_rows,
                            dict.fromkeys(("learning_rate", "value_clip", "grad_clip"), scalar)),
            held("actor", "actor_opt", "reference", "rollout_batch")),
    }
    compiled = []
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for name in steps:
            if programs[name] is not None:
                compiled.append(_compile(name, *programs[name], log))
    layout = engine.make_layout(cfg.rollout.prompts_per_step, prompt_length, num_samples=cfg.rollout.samples_per_prompt,
                                max_new_tokens=response, page_size=options["page_size"], decode_slots=options["decode_slots"],
                                shards=sharding.batch_size_multiple(mesh))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        heads_split = mesh.shape["tensor"] if sharding.heads_axis(config.num_heads, engine.pool_kv_heads(config)) else 1
        pool_bytes = engine.pool_bytes(config, layout) // heads_split
    return Plan(topology, len(devices), HBM_GIB[family] * GIB, dict(mesh.shape), config.attention, length, bytes_of, compiled,
                pool_bytes)


def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def verdict(step: StepPlan, hbm: int) -> str:
    """"fits", "fits by peak only" (args + outputs + temp + code exceeds HBM) or "does not fit ..."."""
    if step.error:
        return step.error
    if step.peak > hbm:
        return f"does not fit (needs {step.peak / GIB:.1f} GiB)"
    return "fits" if step.conservative <= hbm else "fits by peak only"


TABLE_COLUMNS = ("step", "arguments", "outputs", "resident", "temp", "code", "peak", "args+out+temp+code", "HBM", "verdict",
                 "compile s")


def table_rows(result: Plan) -> list[list[str]]:
    """One row per compiled step, GiB per chip (peak and args+out+temp+code include the resident state)."""
    return [[step.step, _gib(step.arguments), _gib(step.outputs), _gib(step.resident), _gib(step.temp), _gib(step.code), _gib(step.peak),
             _gib(step.conservative), f"{result.hbm / GIB:.0f}", verdict(step, result.hbm), f"{step.compile_seconds:.0f}"]
            for step in result.steps]


def format_plan(result: Plan) -> str:
    """The per-chip table as text."""
    state = ", ".join(f"{name} {_gib(value)}" for name, value in result.state.items())
    rows = [list(TABLE_COLUMNS)] + table_rows(result)
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    lines = [f"{result.topology}: {result.chips} chips, mesh {result.mesh}, {result.attention} attention, {result.length} tokens "
             "per row; GiB per chip",
             f"state: {state}; sample's KV page pool {_gib(result.page_pool)}"]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)
