"""Ahead-of-time memory planning: the real train steps compiled for a TPU topology, from any host.

With `libtpu` installed, `jax.experimental.topologies` describes a TPU slice without one. The
run's mesh is built on those abstract devices, the state as sharded `ShapeDtypeStruct`s (nothing
is allocated), and the programs of a train step are lowered and compiled by the real TPU
compiler as `train()` jits them, with the kernels a TPU run picks (splash attention, the Mosaic
concentration kernel):

- `reshard`: the actor cast to the compute dtype and moved into the sampler's decode layout
  (`comppo_jax.train.decode_layout`; rollout.mesh.tensor, auto chosen from the decode floor on the
  topology's chip), once per step;
- `sample`: `rollout.generate` in that layout (the rollout engine: one prefill per prompt, then
  decoding over the paged KV cache with the ragged paged attention kernel; the page pool is
  reported apart, the collectives of its decode loop listed);
- `actor`: `update.actor_step` (clipped PPO + reference KL, AdamW on the fp32 master params);
- `values`: `update.critic_values` over the whole rollout batch, the critic's V_t for the credit
  (TAC, the standard head, or the full value model's forward);
- `critic`: `update.critic_step` (TAC, the standard head or the full value model);
- `score`: `rollout.score_rollout` on the whole rollout batch (behaviour and reference policies,
  the concentration kernel, the critic's features).

Per chip, `compiled.memory_analysis()` gives arguments, outputs (those not aliased to donated
arguments), temporaries, generated code and the compiler's peak; "args+out+temp+code" is their
sum, the conservative bound next to the peak. State a step does not take but that stays in HBM
meanwhile (e.g. the reference params and the critic during the actor step) is added as
"resident", so each step's total is what the chip must hold; with `train.offload_idle` the state
`OFFLOADED` names waits in host memory instead, and the plan counts its bytes and transfers.

The same compiled programs give the step time: `comppo_jax.costs.hlo_cost` reads each one's FLOPs,
HBM and collective bytes per chip from its optimized HLO, `step_times` takes their roofline time
on the chip's peaks times the runs per step (the sampler split into prefill and decode), and
`step_summary` the total and MFU (`model_flops`). `with_decode_layout` compiles the sampler again
in another layout, the other programs kept, so layouts compare side by side; `summary_row` sets
the decode loop's prediction beside its floor.
"""

from __future__ import annotations

import functools
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from comppo_jax import sharding
from comppo_jax.costs import chips, hlo_cost
from comppo_jax.critic import routing
from comppo_jax.models import init_params, lora, model_config, paged_cache
from comppo_jax.models.attention import resolve_implementation
from comppo_jax.models.lora import LoraConfig
from comppo_jax.models.packing import Packing
from comppo_jax.models.paged_cache import resolve_paged_attention
from comppo_jax.planning import overlap
from comppo_jax.planning.overlap import matmul_params
from comppo_jax.rollout import engine, engine_options, generate, score_rollout
from comppo_jax.rollout.sampler import Generation
from comppo_jax.train import controller, decode_layout
from comppo_jax.train.learner import without_features
from comppo_jax.train.loop import check_batch
from comppo_jax.train.methods import init_critic
from comppo_jax.train.specs import resolve
from comppo_jax.train.update import Minibatch, adamw, cast_params, jit_update_steps, minibatch_shardings
from pallas_kernels import PLATFORM_BACKENDS

GIB = 2**30
# Per-chip HBM (GiB) and the chip configuration `get_topology_desc` needs, per TPU family.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}
STEPS = ("reshard", "sample", "resume", "score", "values", "actor", "critic")


def topology_devices(topology: str) -> list:
    """Abstract TPU devices of `topology` ("v5p:2x2x2", "v5e:4x4", ...), one per chip."""
    from jax.experimental import topologies

    family = topology.split(":")[0]
    if family not in HBM_GIB:
        raise ValueError(
            f"--topology={topology!r}: unknown TPU family {family!r}; expected one of {sorted(HBM_GIB)}, "
            "e.g. v5p:2x2x2, v5e:4x4, v4:2x2x1, v6e:4x4"
        )
    try:
        return topologies.get_topology_desc(topology, "tpu", chip_config_name=CHIP_CONFIG[family]).devices
    except Exception as error:  # libtpu missing or the layout refused: say which
        raise ValueError(f"--topology={topology!r} was not accepted by libtpu: {error}") from error


def tree_bytes_per_chip(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (None leaves: 0)."""
    leaves = [x for x in jax.tree.leaves(tree) if x is not None]
    return int(sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves))


def _with_shardings(tree, shardings):
    return jax.tree.map(
        lambda x, s: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


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
    cost: hlo_cost.ProgramCost | None = None  # per chip, one run (comppo_jax.costs.hlo_cost)
    parts: dict | None = None  # the sampler's cost split: {"prefill": outside the decode loop, "decode": the loop}
    decode_collectives: tuple = ()  # the sampler's: `hlo_cost.loop_collectives` of its decode loop


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
    runs: dict  # program -> runs per train step
    model_flops: float  # one train step's model FLOPs, all chips (`model_flops`)
    generated_tokens: int  # response tokens per train step
    dtype: str = "bfloat16"  # the model's compute dtype
    host_bytes: int = 0  # per chip, parked in host memory (train.offload_idle)
    transfer_bytes: int = 0  # per chip and step, host <-> device (train.offload_idle)
    decode: decode_layout.DecodeLayout | None = None  # the sampler's layout, its floor and the candidates auto compared
    # The learner's programs (score, values, actor, critic): program -> (rows computed, real tokens / computed
    # tokens, the real tokens' FLOPs split over the batch shards whole sequences at a time / computed FLOPs:
    # `LearnerBatch.balanced_real_flops`) of the long-tailed lengths a 16K run has, as train.packing lays them
    learner_rows: dict = {}
    engine_layout: engine.Layout | None = None  # the rollout engine's static sizes (its slots, pages per slot)


# The TPU compiler's out-of-memory reports, as (pattern, one-line summary of its groups).
_OUT_OF_MEMORY = (
    (
        r"required for (.+?) \(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)",
        "needs {1} for {0} alone, {2} HBM",
    ),
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


def _compile(name, jitted, args, resident, log, cost_options) -> StepPlan:
    """Compiles `jitted(*args)`. `resident`: bytes of the state held meanwhile; arguments the
    program does not read (jit drops them) are placed all the same, so they are added to it.
    `cost_options`: `hlo_cost.program_cost`'s keywords for this program."""
    log(f"compiling {name} ...")
    started = time.time()
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as error:
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
            raise
        return StepPlan(
            name, None, None, None, None, None, None, resident, time.time() - started, _does_not_fit(message)
        )
    seconds = time.time() - started
    text = compiled.as_text()
    cost = hlo_cost.program_cost(text, **cost_options)
    parts, in_loop = None, ()
    if name == "sample":
        outside = hlo_cost.program_cost(
            text, **{**cost_options, "loop_trips": {**cost_options["loop_trips"], engine.DECODE_SCOPE: 0}}
        )
        parts = {"prefill": outside, "decode": cost + outside.scaled(-1)}
        in_loop = tuple(hlo_cost.loop_collectives(text, engine.DECODE_SCOPE, cost_options["devices"]))
    stats = compiled.memory_analysis()
    arguments, temp, code = stats.argument_size_in_bytes, stats.temp_size_in_bytes, stats.generated_code_size_in_bytes
    resident += max(0, tree_bytes_per_chip(args) - arguments)
    outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
    return StepPlan(
        name,
        arguments,
        outputs,
        temp,
        code,
        stats.peak_memory_in_bytes + resident,
        arguments + outputs + resident + temp + code,
        resident,
        seconds,
        cost=cost,
        parts=parts,
        decode_collectives=in_loop,
    )


class TrainStepPrograms(NamedTuple):
    """The programs of one train step as `train()` jits them, with their (sharded, abstract) arguments."""

    config: object  # ModelConfig, attention resolved for the platform
    state: dict  # name -> sharded ShapeDtypeStructs of each piece of state
    state_bytes: dict  # name -> bytes per chip of each piece of state
    programs: dict  # name -> (jitted, abstract args, bytes per chip held meanwhile) or None (no critic; no reshard)
    meshes: dict  # name -> the mesh a program is traced under (the sampler's is its decode layout's)
    decode: decode_layout.DecodeLayout  # where the sampler decodes (rollout.mesh)
    layout: engine.Layout  # the rollout engine's
    rows: int  # rollout rows per step
    runs: dict  # program -> runs per train step
    # train.packing: program -> the LearnerBatch its rows are (the long-tailed lengths a 16K run has, packed)
    batches: dict
    model_flops: float  # one train step's, all chips (`model_flops`)
    host_bytes: int  # per chip, the most parked in host memory at once (train.offload_idle)
    transfer_bytes: int  # per chip and step, between host and device memory (train.offload_idle)
    kv_dtype: str = "auto"  # the page pool's (rollout.kv_dtype)


# train.offload_idle: the state each program leaves in host memory. The moments wait there outside
# the update, the reference between scoring passes, the rollout batch during the update.
OFFLOADED = {
    "reshard": ("actor_opt", "reference"),
    "sample": ("actor_opt", "reference"),
    "score": ("actor_opt",),
    "values": ("actor_opt", "reference"),
    "actor": ("reference", "actor_batch"),
    "critic": ("reference", "rollout_batch"),
}


def train_step_programs(
    cfg, mesh, *, prompt_length: int, platform: str, chip: chips.Chip | None = None, hbm: int | None = None
) -> TrainStepPrograms:
    """The resharding into the decode layout, the sampler, scoring pass, actor and critic updates of
    `cfg` on `mesh`, with the kernels a `platform` run picks; `chip` and `hbm` (bytes per chip)
    settle rollout.mesh.tensor=auto. Trace and compile each under its mesh (`meshes`)."""
    check_batch(cfg, mesh)
    config = model_config(cfg.model)
    config = config.replace(attention=resolve_implementation(config.attention, config.dtype, platform=platform))
    spec = resolve(cfg, config)
    credit = spec.learner.credit
    key = jax.random.PRNGKey(0)
    abstract = lambda make: sharding.abstract_sharded(mesh, make)
    actor_tx, critic_tx = adamw(cfg.train.actor_lr), adamw(cfg.train.critic_lr)
    adapters = LoraConfig.of(cfg.model)
    if adapters.enabled:  # the frozen base in the compute dtype, the adapters in the master dtype
        master = lambda: lora.join(
            init_params(config, key), lora.init_adapters(config, adapters, key, cfg.train.master_dtype)
        )
    else:
        master = lambda: cast_params(init_params(config, key), cfg.train.master_dtype)
    new_critic = lambda: init_critic(
        credit, config, key, policy=init_params(config, key), master_dtype=cfg.train.master_dtype
    )
    state = {
        "actor": abstract(master),
        "actor_opt": abstract(lambda: actor_tx.init(lora.trainable(master()))),
        "policy": abstract(lambda: cast_params(master(), config.dtype)),  # the compute-dtype copy the scoring pass uses
        "reference": abstract(lambda: init_params(config, key)),  # a LoRA run's: the actor's own base
        "critic": abstract(new_critic),
    }
    state["critic_opt"] = None if state["critic"] is None else abstract(lambda: critic_tx.init(new_critic()))

    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    response = cfg.rollout.max_new_tokens
    length = prompt_length + response
    batch_sharding = sharding.batch_sharding(mesh)
    # The learner's layout of a batch: with train.packing, the long-tailed lengths of a real run packed.
    packed = cfg.train.get("packing", False)
    learner_batch = lambda batch: overlap.LearnerBatch.of(
        overlap.long_tail_lengths(batch, response),
        prompt_length,
        response,
        packed=packed,
        multiple=sharding.batch_size_multiple(mesh),
        segment_skip=packed and config.attention not in ("xla", "cudnn"),  # the kernels that skip other segments
        min_saving=cfg.train.get("packing_min_saving", 0.0),
    )

    def packing(batch):
        """The packed rows' index arrays of a `batch`-row batch (None: padded), as sharded shapes."""
        host = learner_batch(batch).packing()
        if host is None:
            return None
        return Packing(*(jax.ShapeDtypeStruct(x.shape, jnp.int32, sharding=batch_sharding) for x in host))

    def generation(batch):
        shapes = Generation(
            jax.ShapeDtypeStruct((batch, length), jnp.int32),
            jax.ShapeDtypeStruct((batch, length), jnp.bool_),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, response), jnp.int32),
            jax.ShapeDtypeStruct((batch, response), jnp.bool_),
            jax.ShapeDtypeStruct((batch, response), jnp.float32),
        )
        return _with_shardings(shapes, Generation(*[batch_sharding] * len(Generation._fields)))

    # Without a KL term the scoring pass runs no reference forward (train() passes None). A LoRA
    # run's reference is the policy's own base: the same arrays, not a second argument.
    frozen_reference = lambda policy, reference: lora.base(policy) if adapters.enabled else reference
    score = jax.jit(
        lambda policy, reference, generation, packing=None: score_rollout(
            policy,
            frozen_reference(policy, reference) if spec.learner.actor_loss.kl_term else None,
            config,
            generation,
            backend=PLATFORM_BACKENDS[platform],
            packing=packing,
            **spec.rollout.experience.scoring.options(),
        )
    )

    def minibatch(batch):
        """The Minibatch of `batch` rows, shaped as score_and_credit builds it."""
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            rollout = jax.eval_shape(score, state["policy"], state["reference"], generation(batch), None)
        per_token = jax.ShapeDtypeStruct((batch, response), jnp.float32)
        reference_log_probs = per_token if rollout.ref_log_probs is None else rollout.ref_log_probs
        fields = Minibatch(
            rollout.tokens,
            rollout.attention_mask,
            rollout.prompt_lengths,
            generation(batch).response_tokens,
            rollout.response_mask,
            rollout.log_probs,
            reference_log_probs,
            per_token,
            per_token,
            per_token,
            jax.ShapeDtypeStruct((batch, length), jnp.float32),
            rollout.hidden_states,
            rollout.routing,
        )
        laid_out = _with_shardings(
            fields,
            minibatch_shardings(mesh, with_routing=credit.recipe.critic == "tac", hidden_size=config.hidden_size),
        )
        return laid_out._replace(packing=packing(batch))

    state["rollout_batch"] = minibatch(rows)
    update = jit_update_steps(
        mesh,
        state,
        model_config=config,
        actor_tx=actor_tx,
        critic_tx=critic_tx,
        critic_module=credit.critic_module,
        critic_kind=credit.recipe.critic,
        actor_loss=spec.learner.actor_loss,
    )
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    bytes_of = {name: tree_bytes_per_chip(tree) for name, tree in state.items()}
    if (
        adapters.enabled
    ):  # the reference is the actor's base, and the scoring copy shares it too (beside it: the adapters)
        bytes_of.update(
            reference=0,
            policy=tree_bytes_per_chip(lora.trainable(state["policy"])),
            adapters=tree_bytes_per_chip(lora.trainable(state["actor"])),
        )
    # train.offload_idle: what each program does not read waits in host memory (train() moves it).
    on_host = OFFLOADED if cfg.train.get("offload_idle", False) else {}
    held = lambda program, *names: sum(bytes_of[name] for name in names if name not in on_host.get(program, ()))
    train_rows = minibatch(cfg.train.minibatch_size)
    # The learner runs the critic's epochs first where it can and then frees the critic's
    # features: the actor's epochs hold the rollout batch and read minibatches without them.
    critic_first = spec.learner.critic_first
    lean = lambda batch: _with_shardings(
        jax.eval_shape(without_features, batch), jax.tree.map(lambda x: x.sharding, batch)
    )
    actor_rows = lean(train_rows) if critic_first else train_rows
    bytes_of["actor_batch"] = tree_bytes_per_chip(
        lean(state["rollout_batch"]) if critic_first else state["rollout_batch"]
    )
    # The sampler's weights in its decode layout: auto picks the fastest that fits beside the state it holds.
    beside_sampler = held("sample", "actor", "actor_opt", "reference", "critic", "critic_opt")
    decode = decode_layout.make_decode_layout(
        spec.rollout.decode_tensor,
        mesh,
        config,
        state["actor"],
        target=(chip, None if hbm is None else 0.9 * (hbm - beside_sampler)),
        rollout=decode_layout.rollout_shapes(spec.rollout, prompt_length),
    )
    # Prompts are a few KB: replicated, each replica takes its own rows' (the engine's shard_prompts).
    prompts = jax.ShapeDtypeStruct(
        (cfg.rollout.prompts_per_step, prompt_length),
        jnp.int32,
        sharding=NamedSharding(decode.mesh, P()) if decode.resharded else batch_sharding,
    )
    options = engine_options(cfg.rollout)
    options["paged_attention"] = resolve_paged_attention(options["paged_attention"], config.head_dim, platform=platform)
    layout = engine.make_layout(
        cfg.rollout.prompts_per_step,
        prompt_length,
        num_samples=cfg.rollout.samples_per_prompt,
        max_new_tokens=response,
        page_size=options["page_size"],
        decode_slots=options["decode_slots"],
        shards=sharding.batch_size_multiple(decode.mesh),
    )
    sample = jax.jit(
        lambda policy, prompts, prompt_mask, rng: generate(
            policy,
            config,
            prompts,
            prompt_mask,
            rng,
            max_new_tokens=response,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            num_samples=cfg.rollout.samples_per_prompt,
            eos_token_ids=config.eos_token_ids or (0,),
            **options,
        )
    )
    tools = spec.rollout.experience.rollout
    if tools.environment:  # multi-turn rollouts: the sampler's first round, then the host's answers
        sample, resume, state_shardings = conversation_programs(
            config, layout, options, cfg.rollout.temperature, cfg.rollout.top_p, tools.max_turns, decode.mesh
        )
    # The actor and its optimizer, the reference and the critic stay on device all step; during
    # the update so does the whole rollout batch (train() frees the compute copy `policy` first).
    # With equal master and compute dtypes `policy` is the actor itself (the cast is a no-op); a
    # LoRA policy shares the actor's base, so only the actor's master-dtype adapters lie beside it.
    if adapters.enabled:
        beside_policy = ("adapters",)
    else:
        beside_policy = ("actor",) if jnp.dtype(cfg.train.master_dtype) != jnp.dtype(config.dtype) else ()
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(decode.mesh, P()))
    weights = jax.eval_shape(  # a LoRA actor's merged, in rollout.weight_dtype
        functools.partial(
            decode_layout.decode_weights, config=config, weight_dtype=spec.rollout.experience.rollout.weight_dtype
        ),
        state["actor"],
    )
    # The training-layout compute copy is made after sampling, for the scoring pass.
    if decode.resharded or decode.compute_reshard is not None:
        state["sampler"] = _with_shardings(weights, sharding.tree_shardings(decode.mesh, weights))
        bytes_of["sampler"] = tree_bytes_per_chip(state["sampler"])
        sampling = (sample, (state["sampler"], prompts, prompts.update(dtype=jnp.bool_), rng), beside_sampler)
    elif adapters.enabled:  # the merged weights, a copy beside the actor's base
        sampling = (
            sample,
            (
                _with_shardings(weights, sharding.tree_shardings(mesh, weights)),
                prompts,
                prompts.update(dtype=jnp.bool_),
                rng,
            ),
            beside_sampler,
        )
    else:
        sampling = (
            sample,
            (state["policy"], prompts, prompts.update(dtype=jnp.bool_), rng),
            held("sample", *beside_policy, "actor_opt", "reference", "critic", "critic_opt"),
        )
    programs = {
        "reshard": (
            decode.reshard,
            (state["actor"],),
            held("reshard", "actor_opt", "reference", "critic", "critic_opt"),
        )
        if decode.resharded
        else None,
        "sample": sampling,
        "resume": None
        if not tools.environment
        else (
            resume,
            conversation_state(sampling[0], sampling[1], state_shardings, tools.max_reply_tokens, decode.mesh),
            sampling[2],
        ),
        "score": (
            score,
            (state["policy"], state["reference"], generation(rows), packing(rows)),
            held("score", *beside_policy, "actor_opt", "critic", "critic_opt"),
        ),
        "actor": (
            update.actor,
            (
                lora.trainable(state["actor"]),
                state["actor_opt"],
                actor_rows,
                dict.fromkeys(("learning_rate", "clip", "kl_coef", "grad_clip"), scalar),
                lora.split(state["actor"])[1],
            ),
            held("actor", "reference", "critic", "critic_opt", "actor_batch"),
        ),
        "values": None
        if update.values is None
        else (
            update.values,
            (state["critic"], state["rollout_batch"]),
            held("values", "actor", "actor_opt", "reference", "critic_opt"),
        ),
        "critic": None
        if update.critic is None
        else (
            update.critic,
            (
                state["critic"],
                state["critic_opt"],
                train_rows,
                dict.fromkeys(("learning_rate", "value_clip", "grad_clip"), scalar),
            ),
            held("critic", "actor", "actor_opt", "reference", "rollout_batch"),
        ),
    }
    epochs = int(controller.KNOBS["actor_epochs"][0])
    updates = epochs * rows // cfg.train.minibatch_size
    flops = model_flops(
        config,
        prompts=cfg.rollout.prompts_per_step,
        rows=rows,
        prompt_length=prompt_length,
        response=response,
        epochs=epochs,
        reference=spec.learner.actor_loss.kl_term,
        behaviour=spec.rollout.experience.scoring.behaviour_pass,
        gate_refreshes=epochs - 1 if cfg.gate_refresh == "epoch" else 0,
        frozen_base=adapters.enabled,
        value_model=credit.recipe.critic == "full",
    )
    host = max((sum(bytes_of[name] for name in names) for names in on_host.values()), default=0)
    # Each step the moments and the reference go to the device and back; the rollout batch goes
    # to the host once and comes back a minibatch at a time, once per epoch.
    # With the critic's epochs first, the actor's epochs fetch the minibatches again, without the features.
    fetched = (
        epochs * (bytes_of["rollout_batch"] + bytes_of["actor_batch"])
        if critic_first
        else epochs * bytes_of["rollout_batch"]
    )
    moved = 2 * (bytes_of["actor_opt"] + bytes_of["reference"]) + bytes_of["rollout_batch"] + fetched if on_host else 0
    return TrainStepPrograms(
        config,
        state,
        bytes_of,
        programs,
        {"sample": decode.mesh, "resume": decode.mesh},
        decode,
        layout,
        rows,
        {
            "reshard": 1,
            "sample": 1,
            "resume": tools.max_turns - 1 if tools.environment else 0,
            "score": 1,
            "values": 1,
            "actor": updates,
            "critic": updates,
        },
        {
            name: learner_batch(batch)
            for name, batch in (
                ("score", rows),
                ("values", rows),
                ("actor", cfg.train.minibatch_size),
                ("critic", cfg.train.minibatch_size),
            )
        },
        flops,
        host,
        moved,
        spec.rollout.experience.rollout.kv_dtype,
    )


def conversation_programs(config, layout: engine.Layout, options: dict, temperature, top_p, max_turns: int, mesh):
    """The sampler of multi-turn rollouts (rollout.environment) as a train step runs it on device: the
    prefill and the decode loop up to the rows' calls (`sample`; its output, the engine state with the page
    pool, stays on device between turns), and the host's answer (`resume`), run max_turns - 1 times a step;
    with the state's shardings. A reply's tokens are fed one per decode iteration like sampled ones; a
    round runs until every running row waits, so the decode loop runs between one turn's iterations (rows
    that call together) and max_turns times as many (the cost model's, `cost_options_for`)."""
    backend, kv_dtype = options["paged_attention"], options["kv_dtype"]
    calls = jnp.zeros((1,), jnp.int32)  # a call token: which one changes no shape

    def first_round(policy, prompts, prompt_mask, rng):
        prefilled, state = engine.start_engine(
            policy, config, prompts, prompt_mask, layout, pad=0, backend=backend, kv_dtype=kv_dtype, multi_turn=True
        )
        eos = jnp.asarray(config.eos_token_ids or (0,), jnp.int32)
        return engine.decode(
            policy,
            config,
            prefilled,
            state,
            layout,
            rng,
            temperature=temperature,
            top_p=top_p,
            eos=eos,
            backend=backend,
            calls=calls,
            max_turns=max_turns,
        )

    def state_shardings(state):
        rows = NamedSharding(mesh, P(sharding.BATCH))
        placed = jax.tree.map(lambda _: rows, state)
        pool = state.pool
        pool_shardings = pool.with_arrays(
            *(NamedSharding(mesh, spec) for spec in paged_cache.pool_specs(pool, config.num_heads)),
            scales=tuple(NamedSharding(mesh, spec) for spec in paged_cache.scale_specs(pool, config.num_heads)),
        )
        return placed._replace(pool=pool_shardings)

    resume = jax.jit(
        lambda state, replies, lengths, end: engine.resume(state, layout, replies, lengths, end), donate_argnums=0
    )
    return jax.jit(first_round), resume, state_shardings


def conversation_state(first_round, arguments, shardings, max_reply_tokens: int, mesh) -> tuple:
    """`resume`'s arguments as sharded shapes: the engine state `first_round` leaves, the replies."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        state = jax.eval_shape(first_round, *arguments)
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings(state))
    slots = state.row.shape
    rows = NamedSharding(mesh, P(sharding.BATCH))
    replies = jax.ShapeDtypeStruct(slots + (max_reply_tokens,), jnp.int32, sharding=rows)
    lengths = jax.ShapeDtypeStruct(slots, jnp.int32, sharding=rows)
    return placed, replies, lengths, jax.ShapeDtypeStruct(slots, jnp.bool_, sharding=rows)


def _compile_steps(cfg, step: TrainStepPrograms, mesh, names, *, prompt_length: int, log) -> list[StepPlan]:
    """Compiles the programs `names` of `step`, each under its mesh."""
    cost_options = cost_options_for(
        step.layout,
        window_start=prompt_length if cfg.rollout.window == "response" else 0,
        devices=mesh.devices.size,
        rounds=step.runs["resume"] + 1,
    )
    compiled = []
    for name in names:
        if step.programs[name] is not None:
            options = dict(cost_options)
            if name in step.batches:  # packed rows: the skipping kernels visit a share of the causal blocks
                options["attention_visited"] = step.batches[name].attention_visited()
            with jax.sharding.use_abstract_mesh(step.meshes.get(name, mesh).abstract_mesh):
                compiled.append(_compile(name, *step.programs[name], log, options))
    return compiled


def _pool_bytes(step: TrainStepPrograms) -> int:
    """Bytes per chip of the sampler's KV page pool in its decode layout."""
    decode_mesh, config = step.decode.mesh, step.config
    with jax.sharding.use_abstract_mesh(decode_mesh.abstract_mesh):
        heads_split = (
            decode_mesh.shape["tensor"] if sharding.heads_axis(config.num_heads, engine.pool_kv_heads(config)) else 1
        )
        return engine.pool_bytes(config, step.layout, step.kv_dtype) // heads_split


def _programs_for(cfg, topology: str, *, prompt_length: int):
    """(mesh, TrainStepPrograms) of `cfg` on `topology`; "auto" means what a TPU run would pick,
    not this host's platform."""
    devices = topology_devices(topology)
    mesh = sharding.make_mesh(cfg.mesh, devices)
    family = topology.split(":")[0]
    return mesh, train_step_programs(
        cfg, mesh, prompt_length=prompt_length, platform="tpu", chip=chips.CHIPS[family], hbm=HBM_GIB[family] * GIB
    )


def plan(cfg, topology: str, *, prompt_length: int, steps=STEPS, log=print) -> Plan:
    """Compiles `steps` of `cfg`'s train step for `topology`; see the module docstring."""
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; expected a subset of {STEPS}")
    mesh, step = _programs_for(cfg, topology, prompt_length=prompt_length)
    config, layout = step.config, step.layout
    compiled = _compile_steps(cfg, step, mesh, steps, prompt_length=prompt_length, log=log)
    family = topology.split(":")[0]
    return Plan(
        topology,
        mesh.devices.size,
        HBM_GIB[family] * GIB,
        dict(mesh.shape),
        config.attention,
        layout.prompt_width + layout.max_new_tokens,
        step.state_bytes,
        compiled,
        _pool_bytes(step),
        step.runs,
        step.model_flops,
        step.rows * layout.max_new_tokens,
        str(config.dtype),
        step.host_bytes,
        step.transfer_bytes,
        step.decode,
        {
            name: (
                batch.rows(),
                float(batch.lengths.sum()) / (batch.rows() * batch.row_length),
                batch.balanced_real_flops(config) / batch.forward_flops(config),
            )
            for name, batch in step.batches.items()
        },
        layout,
    )


SAMPLER_STEPS = ("reshard", "sample")


def with_decode_layout(cfg, result: Plan, tensor: str, *, prompt_length: int, log=print) -> Plan:
    """`result` (a `plan` of `cfg`) with its sampler compiled again in the decode layout
    rollout.mesh.tensor=`tensor` ("train", "auto" or a group size): the programs a layout changes
    are recompiled, the others kept, so layouts compare side by side in one run."""
    cfg = cfg.copy_and_resolve_references()
    cfg.rollout.mesh.tensor = str(tensor)
    mesh, step = _programs_for(cfg, result.topology, prompt_length=prompt_length)
    compiled = _compile_steps(cfg, step, mesh, SAMPLER_STEPS, prompt_length=prompt_length, log=log)
    kept = [s for s in result.steps if s.step not in SAMPLER_STEPS]
    return result._replace(
        steps=compiled + kept, decode=step.decode, page_pool=_pool_bytes(step), state=step.state_bytes
    )


def cost_options_for(layout: engine.Layout, *, window_start: int, devices: int, rounds: int = 1) -> dict:
    """`hlo_cost.program_cost`'s keywords for a train step's programs: every row runs to
    `max_new_tokens`, so decoding attends to the prompt and half the response on average. `rounds`: a
    conversation's decode rounds (rollout.max_turns), each of which, at worst, runs as long as one turn's
    whole loop (a row that waits for its environment idles while another runs to the end)."""
    steps = layout.decode_steps * rounds
    length = layout.prompt_width + layout.max_new_tokens
    return dict(
        devices=devices,
        context=layout.prompt_width + layout.max_new_tokens / 2,
        decode_rows=layout.slots,
        loop_trips={
            engine.DECODE_SCOPE: steps,
            routing.KEY_BLOCKS_SCOPE: routing.mean_key_blocks(length, window_start),
        },
        branch_rates={engine.ADMIT_SCOPE: -(-layout.shard_rows // layout.slots) / steps},
    )


def model_flops(
    config,
    *,
    prompts: int,
    rows: int,
    prompt_length: int,
    response: int,
    epochs: int,
    reference: bool,
    behaviour: bool = True,
    gate_refreshes: int = 0,
    frozen_base: bool = False,
    value_model: bool = False,
) -> float:
    """One train step's model FLOPs, the numerator of MFU: a forward pass costs 2N per token plus
    causal attention 4 x layers x heads x head_dim x (mean keys, half the row) per token, a
    forward and backward 3x that. Prefill (each prompt once) and decoding (each response token,
    with the prompt and half the response as mean context), the scoring pass (the behaviour policy
    unless skipped, `methods.behaviour_pass`, and with a KL term the reference) and the actor's
    `epochs` passes over the rollout, and gate_refresh=epoch's forward before each later epoch
    (`gate_refreshes`; no vocabulary projection). With a `frozen_base` (LoRA) the backward pass
    computes no weight gradients: 2x a forward instead of 3x (the adapters' own FLOPs are
    negligible at rank << width). A full `value_model` critic is a model too: its forward for the
    values and a forward and backward per epoch (no vocabulary projection). Rematerialized forwards
    and a critic on the actor's features (TAC, the standard head) are not model FLOPs."""
    n = matmul_params(config)
    attention = lambda keys: 4 * config.num_layers * config.num_heads * config.head_dim * keys
    length = prompt_length + response
    sample = prompts * prompt_length * (2 * n + attention(prompt_length / 2)) + rows * response * (
        2 * n + attention(prompt_length + response / 2)
    )
    forward = rows * length * (2 * n + attention(length / 2))
    trunk_forward = forward - rows * length * 2 * config.hidden_size * config.vocab_size  # no vocabulary projection
    critic = (1 + 3 * epochs) * trunk_forward if value_model else 0
    return (
        sample
        + (int(reference) + int(behaviour)) * forward
        + epochs * (2 if frozen_base else 3) * forward
        + gate_refreshes * trunk_forward
        + critic
    )


class ProgramTime(NamedTuple):
    program: str
    runs: int  # per train step
    seconds: float  # one run, roofline
    bound: str  # "compute", "memory"
    cost: hlo_cost.ProgramCost


def _chip(result: Plan, chip: chips.Chip | None) -> chips.Chip:
    """`chip`, or the peaks of the plan's TPU family."""
    return chip or chips.CHIPS[result.topology.split(":")[0]]


def step_times(result: Plan, chip: chips.Chip | None = None) -> list[ProgramTime]:
    """Each compiled program's predicted time per run on `chip` (default: the topology's); the
    sampler as its prefill and its decode loop; with train.offload_idle, the host transfers (not
    overlapped with compute)."""
    chip = _chip(result, chip)
    times = []
    for step in result.steps:
        if step.cost is None:
            continue
        for name, cost in (
            {f"{step.step} {part}": c for part, c in step.parts.items()} if step.parts else {step.step: step.cost}
        ).items():
            times.append(
                ProgramTime(
                    name,
                    result.runs[step.step],
                    hlo_cost.roofline_seconds(cost, chip),
                    hlo_cost.bound(cost, chip),
                    cost,
                )
            )
    if result.transfer_bytes:
        times.append(
            ProgramTime("host transfers", 1, result.transfer_bytes / chip.host_bytes, "host link", hlo_cost.ZERO)
        )
    return times


TIME_COLUMNS = (
    "program",
    "runs / step",
    "TFLOP / run",
    "HBM GB / run",
    "ICI GB / run",
    "bound",
    "s / run",
    "s / step",
    "share",
)


def time_rows(result: Plan, chip: chips.Chip | None = None) -> list[list[str]]:
    """The step-time breakdown per chip, one row per program (TIME_COLUMNS)."""
    times = step_times(result, chip)
    total = sum(t.seconds * t.runs for t in times)
    return [
        [
            t.program,
            str(t.runs),
            f"{t.cost.flops / 1e12:.3g}",
            f"{t.cost.hbm_bytes / 1e9:.3g}",
            f"{t.cost.collective_bytes / 1e9:.3g}",
            t.bound,
            f"{t.seconds:.3g}",
            f"{t.seconds * t.runs:.3g}",
            f"{t.seconds * t.runs / total:.0%}" if total else "-",
        ]
        for t in times
    ]


def mfu(result: Plan, seconds: float, chip: chips.Chip | None = None) -> float:
    """Model FLOPs of one train step over what the slice's chips could do in `seconds`."""
    chip = _chip(result, chip)
    return result.model_flops / (seconds * result.chips * chips.peak_flops(chip, result.dtype))


class StepSummary(NamedTuple):
    seconds: float  # predicted train step, the programs' roofline times x their runs
    mfu: float
    generated_tokens_per_second: float
    uncounted: tuple  # loops counted once and kernels without a FLOP model


def step_summary(result: Plan, chip: chips.Chip | None = None) -> StepSummary:
    chip = _chip(result, chip)
    times = step_times(result, chip)
    total = sum(t.seconds * t.runs for t in times)
    uncounted = tuple(sorted({name for t in times for name in (*t.cost.unknown_loops, *t.cost.unknown_kernels)}))
    return StepSummary(
        total, mfu(result, total, chip) if total else 0.0, result.generated_tokens / total if total else 0.0, uncounted
    )


def learner_against_real_tokens(result: Plan, chip: chips.Chip | None = None) -> tuple[float, float]:
    """(the learner's programs' predicted seconds per step; the same programs on the real tokens alone:
    each one's time times its real tokens' FLOPs (as evenly over the batch shards as whole sequences
    allow: `LearnerBatch.balanced_real_flops`) over the FLOPs of the rows it computes, for the
    long-tailed lengths of a 16K run, padded or packed as train.packing lays them out)."""
    times = {t.program: t for t in step_times(result, chip)}
    predicted = real = 0.0
    for name, (_, _, real_fraction) in result.learner_rows.items():
        if name in times:
            seconds = times[name].seconds * times[name].runs
            predicted, real = predicted + seconds, real + seconds * real_fraction
    return predicted, real


def format_summary(result: Plan, chip: chips.Chip | None = None) -> str:
    chip = _chip(result, chip)
    summary = step_summary(result, chip)
    text = (
        f"predicted step on {chip.name}: {summary.seconds:.3g} s, MFU {summary.mfu:.1%} "
        f"({result.model_flops / 1e15:.3g} PFLOP of model FLOPs), {summary.generated_tokens_per_second:.3g} "
        "generated tokens/s"
    )
    if summary.uncounted:
        text += "; counted once (no trip count or FLOP model): " + ", ".join(summary.uncounted)
    learner, real = learner_against_real_tokens(result, chip)
    if learner:
        rows = ", ".join(
            f"{name} {count} rows ({efficiency:.0%} real tokens)"
            for name, (count, efficiency, _) in result.learner_rows.items()
        )
        text += (
            f"\nlearner (long-tailed lengths, {rows}): {learner:.3g} s, {learner / real:.2f}x its "
            f"{real:.3g} s on the real tokens alone"
        )
    return text


def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def verdict(step: StepPlan, hbm: int) -> str:
    """ "fits", "fits by peak only" (args + outputs + temp + code exceeds HBM) or "does not fit ..."."""
    if step.error:
        return step.error
    if step.peak > hbm:
        return f"does not fit (needs {step.peak / GIB:.1f} GiB)"
    return "fits" if step.conservative <= hbm else "fits by peak only"


TABLE_COLUMNS = (
    "step",
    "arguments",
    "outputs",
    "resident",
    "temp",
    "code",
    "peak",
    "args+out+temp+code",
    "HBM",
    "verdict",
    "compile s",
)


def table_rows(result: Plan) -> list[list[str]]:
    """One row per compiled step, GiB per chip (peak and args+out+temp+code include the resident state)."""
    return [
        [
            step.step,
            _gib(step.arguments),
            _gib(step.outputs),
            _gib(step.resident),
            _gib(step.temp),
            _gib(step.code),
            _gib(step.peak),
            _gib(step.conservative),
            f"{result.hbm / GIB:.0f}",
            verdict(step, result.hbm),
            f"{step.compile_seconds:.0f}",
        ]
        for step in result.steps
    ]


def aligned(header, rows) -> list[str]:
    """`rows` under `header` as right-aligned text lines."""
    rows = [list(header)] + rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]


def format_plan(result: Plan) -> str:
    """The per-chip memory and step-time tables as text."""
    state = ", ".join(f"{name} {_gib(value)}" for name, value in result.state.items())
    lines = [
        f"{result.topology}: {result.chips} chips, mesh {result.mesh}, {result.attention} attention, "
        f"{result.length} tokens per row; GiB per chip",
        f"state: {state}; sample's KV page pool {_gib(result.page_pool)}"
        + (
            f"; in host memory (train.offload_idle) up to {_gib(result.host_bytes)}, "
            f"moved per step {_gib(result.transfer_bytes)}"
            if result.transfer_bytes
            else ""
        ),
    ]
    lines += format_decode(result)
    lines += aligned(TABLE_COLUMNS, table_rows(result))
    lines += ["step time per chip (roofline: comppo_jax.costs.hlo_cost):"]
    lines += aligned(TIME_COLUMNS, time_rows(result))
    return "\n".join(lines + [format_summary(result)])


def rows_in_flight(result: Plan) -> int | None:
    """The engine's capacity on the plan's chips: the decode slots per replica whose pages fit in
    HBM beside what the compiled sampler holds besides its page pool (None: it did not compile)."""
    sampler = next((s for s in result.steps if s.step == "sample" and s.peak is not None), None)
    if sampler is None or result.engine_layout is None or sampler.peak is None:
        return None
    return engine.rows_in_flight(result.engine_layout, result.page_pool, result.hbm - (sampler.peak - result.page_pool))


def format_decode(result: Plan) -> list[str]:
    """The decode layout, its floor and every group size auto compared (comppo_jax.train.decode_layout)."""
    decode = result.decode
    if decode is None:
        return []
    lines = [f"decode layout: {decode_layout.describe(decode)}"]
    floor = decode.floor
    if floor is not None:
        lines.append(
            f"  floor per chip per token step: weights {floor.weight_bytes / 1e9:.3g} GB + "
            f"live KV {floor.kv_bytes / 1e9:.3g} GB read, {floor.collective_hops:.0f} collective hops; "
            f"{floor.steps} token steps"
        )
    sampler = next((s for s in result.steps if s.step == "sample" and s.decode_collectives), None)
    if sampler is not None:
        kinds = {}
        for c in sampler.decode_collectives:
            kinds.setdefault(c.kind, []).append(c)
        lines.append(
            "  decode loop's collectives (HLO instructions, an inner loop's once): "
            + ", ".join(
                f"{kind} x{len(found)} (largest {max(c.bytes for c in found) / 1e6:.3g} MB, groups of "
                f"{'/'.join(str(g) for g in sorted({c.group for c in found}))})"
                for kind, found in sorted(kinds.items())
            )
        )
    capacity = rows_in_flight(result)
    if capacity is not None:
        lines.append(
            f"  rows in flight per replica that fit in HBM: {capacity} (the engine's capacity; "
            f"{result.engine_layout.slots} decode slots now, pages of {result.page_pool / GIB:.3g} GiB per chip)"
        )
    if decode.candidates:
        lines.append(
            "  group sizes (G: decode floor s, decode weights + page pool GiB per chip): "
            + ", ".join(f"{c.tensor}: {c.seconds:.3g} s, {c.memory_bytes / GIB:.2f}" for c in decode.candidates)
        )
    return lines


def layout_label(result: Plan) -> str:
    """ "G=4 x 2" (groups of 4 chips, 2 replicas) or "training mesh"."""
    if result.decode is None or not result.decode.resharded:
        return "training mesh"
    return f"G={result.decode.tensor} x {result.chips // result.decode.tensor}"


SUMMARY_COLUMNS = (
    "decode layout",
    "reshard s",
    "prefill s",
    "decode s",
    "decode floor s (best G)",
    "decode / floor",
    "decode HBM / ICI GB per token step",
    "score s",
    "values s",
    "actor s (x runs)",
    "critic s (x runs)",
    "host transfers s",
    "step s",
    "decode share",
    "MFU",
)


def summary_row(result: Plan, chip: chips.Chip | None = None) -> list[str]:
    """One row per plan (SUMMARY_COLUMNS): each program's seconds per step, the decode loop beside
    its floor, the step and its MFU (docs/benchmarks.md's step-time table)."""
    chip = _chip(result, chip)
    times = {t.program: t for t in step_times(result, chip)}
    summary = step_summary(result, chip)
    seconds = lambda name: f"{times[name].seconds * times[name].runs:.3g}" if name in times else "-"
    runs = lambda name: f"{seconds(name)} (x{times[name].runs})" if name in times else "-"
    # The row's floor: the best group size's, whichever layout the row decodes in.
    decode = times.get("sample decode")
    floor = (
        min(result.decode.candidates, key=lambda c: c.seconds) if result.decode and result.decode.candidates else None
    )
    steps = floor.steps if floor else 0
    per_step = (
        f"{decode.cost.hbm_bytes / steps / 1e9:.2f} / {decode.cost.collective_bytes / steps / 1e9:.2f}"
        if decode and steps
        else "-"
    )
    return [
        layout_label(result),
        seconds("reshard"),
        seconds("sample prefill"),
        seconds("sample decode"),
        f"{floor.seconds:.3g}" if floor else "-",
        f"{decode.seconds / floor.seconds:.2f}x" if decode and floor else "-",
        per_step,
        seconds("score"),
        seconds("values"),
        runs("actor"),
        runs("critic"),
        seconds("host transfers"),
        f"**{summary.seconds:.3g}**",
        f"{decode.seconds / summary.seconds:.0%}" if decode and summary.seconds else "-",
        f"**{summary.mfu:.1%}**",
    ]
