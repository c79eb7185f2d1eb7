"""One train step's programs, predicted (comppo_jax.costs.hlo_cost) and measured side by side.

The programs are those `launch/plan.py` compiles for a TPU slice (`planner.train_step_programs`),
here compiled for this machine's devices and run on real arrays: the sampler on random prompts,
the scoring pass on its rollout, the actor and critic updates on a minibatch of it. Each is
predicted from its own optimized HLO with the roofline of `comppo_jax.costs.hlo_cost` on this
machine's peaks: a GPU or TPU's published ones, or, on a CPU, the ones measured here (the rate
of a square matmul in each dtype and the bandwidth of a large array copy), so the method is
checked end to end without an accelerator. Weights are random and every row decodes to
`max_new_tokens` (no row stops early), as the prediction assumes.

Models: `tiny` (`configs/tiny.py`) and `qwen3_0.6b` (Qwen3-0.6B's shapes, bf16, full remat,
512-token prompts + `length` - 512 new tokens, 2 prompts x 4 samples; meant for a GPU).
"""

from __future__ import annotations

import functools
import math
import tempfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.sampler import TunixWorker
from benchmarks.timing import interleaved_medians, print_table
from comppo_jax import sharding
from comppo_jax.costs import chips, hlo_cost
from comppo_jax.credit import registry
from comppo_jax.data.rewards import terminal_reward_tokens
from comppo_jax.models import lora, to_hf
from comppo_jax.models.loading import PRESET_DIR, load_config_file
from comppo_jax.planning import planner
from comppo_jax.train import decode_layout
from comppo_jax.train.learner import controlled_gate
from comppo_jax.train.specs import credit_spec
from comppo_jax.train.update import Minibatch, take_rows

QWEN3_0_6B = dict(
    architecture="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    dtype="bfloat16",
    bos_token_id=151643,
    eos_token_ids=(151645,),
    pad_token_id=151643,
)


def step_config(model: str, length: int):
    """(config, prompt length) of the benchmarked step: its programs one response per row (they run
    on a sampled generation as it comes; `benchmark.py packing` measures packed rows)."""
    cfg = load_config_file(PRESET_DIR / "tiny.py")
    cfg.train.packing = False
    if model == "tiny":
        return cfg, 64
    if model != "qwen3_0.6b":
        raise ValueError(f"--model={model!r}: expected tiny or qwen3_0.6b")
    cfg.model.arch.update(QWEN3_0_6B)
    cfg.model.update(remat="full", logits_chunk=1024)
    cfg.rollout.update(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=length - 512)
    cfg.train.update(minibatch_size=4, master_dtype="float32")
    return cfg, 512


def measured_cpu(megabytes: int = 512, size: int = 1024) -> chips.Chip:
    """This CPU's peaks as the cost model needs them, measured: square matmuls in each dtype and
    an elementwise pass over an array several times the cache, updated in place (a fresh output
    would time the page faults of its first touch)."""
    state = {"x": jnp.ones((megabytes << 18,), jnp.float32)}
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)

    def stream():
        state["x"] = scale(state["x"])
        state["x"].block_until_ready()

    operands = {
        dtype: (jnp.ones((size, size), dtype), jnp.ones((size, size), dtype)) for dtype in (jnp.float32, jnp.bfloat16)
    }
    matmul = jax.jit(jnp.matmul)
    seconds = interleaved_medians(
        {
            "stream": stream,
            **{
                str(jnp.dtype(d)): (lambda a=a, b=b: matmul(a, b).block_until_ready()) for d, (a, b) in operands.items()
            },
        },
        5,
    )
    flop = 2 * size**3
    return chips.Chip(
        f"this CPU ({jax.local_device_count()} device(s), measured)",
        flop / seconds["bfloat16"],
        flop / seconds["float32"],
        2 * state["x"].nbytes / seconds["stream"],
        math.inf,
        math.inf,
        hop_latency=0.0,
    )


def this_chip() -> chips.Chip:
    """The peaks of the first local device: published for a known GPU or TPU, measured on a CPU."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return measured_cpu()
    chip = chips.published_chip(device.device_kind)
    if chip is None:
        raise ValueError(
            f"no published peaks for device kind {device.device_kind!r}; add it to comppo_jax.costs.chips.CHIPS"
        )
    return chip


def _materialize(tree, rng: np.random.Generator, zeros: bool = False):
    """Arrays for a tree of sharded ShapeDtypeStructs: small normals (zeros for optimizer states),
    zero integers, true booleans."""

    def make(x):
        if x is None:
            return None
        dtype = np.dtype(x.dtype)
        if dtype == np.bool_:
            value = np.ones(x.shape, bool)
        elif not jnp.issubdtype(dtype, jnp.floating) or zeros:
            value = np.zeros(x.shape, dtype)
        else:
            value = (0.02 * rng.standard_normal(x.shape)).astype(dtype)
        return jax.device_put(value, x.sharding)

    return jax.tree.map(make, tree, is_leaf=lambda x: x is None)


class OnDevice(NamedTuple):
    """A train step's programs compiled for this machine, on real arrays."""

    step: planner.TrainStepPrograms
    compiled: dict  # program -> jax.stages.Compiled
    calls: dict  # program -> run it once (blocking); the updates carry their donated state
    state: dict  # the arrays the programs read
    prompts: np.ndarray  # [prompts_per_step, prompt_length] int32
    generation: object  # the sampler's output the scoring pass reads (comppo_jax.rollout.Generation)
    rollout: object  # the scoring pass's output (comppo_jax.rollout.Rollout)
    batch: Minibatch  # every rollout row as the learner's credit reads it (random advantages and returns)


def on_device(cfg, prompt_length: int, mesh, rng: np.random.Generator) -> OnDevice:
    """Compiles `cfg`'s sampler, scoring pass, critic values and updates for `mesh` (kernels of its
    platform) and runs each once: random weights and prompts (the same for every config of one
    model from the same `rng` state), the values on the whole scored rollout, the updates on a
    minibatch of it."""
    step = planner.train_step_programs(cfg, mesh, prompt_length=prompt_length, platform=mesh.devices.flat[0].platform)
    host_prompts = rng.integers(3, step.config.vocab_size, (cfg.rollout.prompts_per_step, prompt_length), np.int32)
    state = {
        name: _materialize(tree, rng, zeros=name.endswith("_opt"))
        for name, tree in step.state.items()
        if name != "rollout_batch"
    }
    sample, sample_args, _ = step.programs["sample"]
    score, _, _ = step.programs["score"]
    actor_args = step.programs["actor"][1]
    prompts = jax.device_put(host_prompts, sample_args[1].sharding)
    mask = jax.device_put(np.ones(prompts.shape, bool), sample_args[2].sharding)
    key = jax.device_put(np.asarray(jax.random.PRNGKey(0)), sample_args[3].sharding)
    weights = state["policy"]
    if lora.has_adapters(weights):  # train() decodes with a LoRA actor's adapters merged
        weights = state["sampler"] = jax.jit(functools.partial(decode_layout.decode_weights, config=step.config))(
            weights
        )
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = {"sample": sample.lower(weights, prompts, mask, key).compile()}
        generation = compiled["sample"](weights, prompts, mask, key)
        compiled["score"] = score.lower(state["policy"], state["reference"], generation).compile()
        rollout = compiled["score"](state["policy"], state["reference"], generation)
        per_token = jnp.asarray(rng.standard_normal(generation.response_tokens.shape), jnp.float32)
        batch = Minibatch(
            rollout.tokens,
            rollout.attention_mask,
            rollout.prompt_lengths,
            generation.response_tokens,
            rollout.response_mask,
            rollout.log_probs,
            rollout.ref_log_probs,
            per_token,
            per_token,
            per_token,
            jnp.full(rollout.tokens.shape, 0.9, jnp.float32),
            rollout.hidden_states,
            rollout.routing,
        )
        minibatch = sharding.put(
            take_rows(batch, np.arange(cfg.train.minibatch_size)), jax.tree.map(lambda x: x.sharding, actor_args[2])
        )
        if step.programs["values"] is not None:
            values, values_args, _ = step.programs["values"]
            batch = sharding.put(batch, jax.tree.map(lambda x: x.sharding, values_args[1]))
            compiled["values"] = values.lower(state["critic"], batch).compile()
        hyper = {
            "actor": dict(learning_rate=1e-6, clip=0.2, kl_coef=0.002, grad_clip=1.0),
            "critic": dict(learning_rate=1e-5, value_clip=0.5, grad_clip=1.0),
        }
        hyper = {name: {k: jnp.float32(v) for k, v in values.items()} for name, values in hyper.items()}
        owners = {"actor": ("actor", "actor_opt"), "critic": ("critic", "critic_opt")}

        def arguments(name):  # the actor step takes its trainable part and, apart, a LoRA run's frozen base
            if name == "actor":
                trainable, frozen = lora.split(state["actor"])
                return trainable, state["actor_opt"], minibatch, hyper[name], frozen
            return state["critic"], state["critic_opt"], minibatch, hyper[name]

        for name in ("actor", "critic"):
            if step.programs[name] is not None:
                compiled[name] = step.programs[name][0].lower(*arguments(name)).compile()

    def update(name):
        def call():  # the update donates its state: carry the new one
            params, opt, out = compiled[name](*arguments(name))
            state[owners[name][0]] = lora.join(lora.split(state["actor"])[1], params) if name == "actor" else params
            state[owners[name][1]] = opt
            jax.block_until_ready(out)

        return call

    calls = {
        "sample": lambda: jax.block_until_ready(compiled["sample"](weights, prompts, mask, key)),
        "score": lambda: jax.block_until_ready(compiled["score"](state["policy"], state["reference"], generation)),
        **{name: update(name) for name in ("actor", "critic") if name in compiled},
    }
    if "values" in compiled:
        calls["values"] = lambda: jax.block_until_ready(compiled["values"](state["critic"], batch))
    return OnDevice(step, compiled, calls, state, host_prompts, generation, rollout, batch)


def run(
    model: str = "tiny",
    length: int = 4096,
    repeats: int = 3,
    peer: str | None = None,
    tunix_python: str | None = None,
    method: str = "grpo",
) -> None:
    if peer is not None:
        return peer_step(peer, tunix_python, repeats, method)
    cfg, prompt_length = step_config(model, length)
    devices = jax.devices()
    mesh = sharding.make_mesh(cfg.mesh, devices)
    chip = this_chip()
    programs = on_device(cfg, prompt_length, mesh, np.random.default_rng(0))
    step, compiled, config, layout = programs.step, programs.compiled, programs.step.config, programs.step.layout
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        measured = interleaved_medians(programs.calls, repeats)

    options = planner.cost_options_for(
        layout, window_start=prompt_length if cfg.rollout.window == "response" else 0, devices=len(devices)
    )
    rows, predicted_step, measured_step = [], 0.0, 0.0
    for name, program in compiled.items():
        cost = hlo_cost.program_cost(program.as_text(), **options)
        predicted = hlo_cost.roofline_seconds(cost, chip)
        runs = step.runs[name]
        predicted_step, measured_step = predicted_step + predicted * runs, measured_step + measured[name] * runs
        rows.append(
            {
                "program": name,
                "runs / step": runs,
                "GFLOP": f"{cost.flops / 1e9:.3g}",
                "HBM GB": f"{cost.hbm_bytes / 1e9:.3g}",
                "bound": hlo_cost.bound(cost, chip),
                "predicted ms": f"{predicted * 1e3:.3g}",
                "measured ms": f"{measured[name] * 1e3:.3g}",
                "measured / predicted": f"{measured[name] / predicted:.2f}",
                "uncounted": ", ".join((*cost.unknown_loops, *cost.unknown_kernels)) or "-",
            }
        )
    print(
        f"{model}: {cfg.rollout.prompts_per_step} x {cfg.rollout.samples_per_prompt} rows of {prompt_length} + "
        f"{cfg.rollout.max_new_tokens} tokens, minibatch {cfg.train.minibatch_size}, {config.dtype}, "
        f"on {devices[0].device_kind}"
    )
    print(
        f"peaks ({chip.name}): {chip.bf16_flops / 1e9:.4g} GFLOP/s bf16, {chip.fp32_flops / 1e9:.4g} GFLOP/s fp32, "
        f"{chip.hbm_bytes / 1e9:.4g} GB/s memory"
    )
    print_table(
        rows,
        [
            "program",
            "runs / step",
            "GFLOP",
            "HBM GB",
            "bound",
            "predicted ms",
            "measured ms",
            "measured / predicted",
            "uncounted",
        ],
    )
    mfu = lambda seconds: step.model_flops / (seconds * len(devices) * chips.peak_flops(chip, config.dtype))
    print(
        f"train step (device programs only): predicted {predicted_step:.3g} s, measured {measured_step:.3g} s, "
        f"measured / predicted {measured_step / predicted_step:.2f}; MFU measured {mfu(measured_step):.1%}, "
        f"predicted {mfu(predicted_step):.1%}"
    )


def peer_step(peer: str, tunix_python: str | None, repeats: int, method: str = "grpo") -> None:
    """`method`'s step of the tiny config side by side with tunix's (launch/benchmarks/tunix_step_worker.py
    in its own venv): grpo = `grpo_peer`, ppo = `credit_peer`."""
    if peer != "tunix":
        raise ValueError(f"--peer={peer!r}: the only peer is tunix")
    if not tunix_python:
        raise ValueError("--peer=tunix needs --tunix_python=PATH, the python of a venv with google-tunix")
    if method not in ("grpo", "ppo"):
        raise ValueError(f"--method={method!r}: the tunix comparison runs grpo or ppo")
    (grpo_peer if method == "grpo" else credit_peer)(tunix_python, repeats)


def peer_config(method: str, critic: str = "tac"):
    """(config, prompt length) of a peer comparison: the tiny config sampled from the plain
    categorical (as tunix samples), one update over the whole batch."""
    cfg, prompt_length = step_config("tiny", 0)
    cfg.method, cfg.critic.kind = method, critic
    cfg.rollout.top_p = 1.0
    cfg.train.minibatch_size = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    return cfg, prompt_length


def beside_tunix(tunix_python: str, ours: OnDevice, mesh, candidates: dict, request: dict, repeats: int):
    """(medians, tunix's replies, its ready line): `candidates` and one tunix train step on `ours`'s
    policy weights (written with `to_hf`, loaded by tunix_step_worker.py in tunix's venv), timed in
    interleaved rounds."""
    replies = []
    with tempfile.TemporaryDirectory() as model_dir:
        to_hf(ours.step.config, jax.device_get(ours.state["policy"]), model_dir)
        worker = TunixWorker(tunix_python, model_dir, script="tunix_step_worker.py")
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                medians = interleaved_medians(
                    {**candidates, "tunix": lambda: replies.append(worker.call(request))}, repeats
                )
        finally:
            worker.close()
    return medians, replies, worker.ready


def tunix_medians(replies: list[dict], repeats: int, phases) -> dict:
    """The median of each phase over the timed calls (the first calls compile and size the rounds)."""
    return {phase: float(np.median([reply[f"{phase}_s"] for reply in replies[-repeats:]])) for phase in phases}


def grpo_peer(tunix_python: str, repeats: int) -> None:
    """One GRPO step of the tiny config, ours and tunix's, on the same random weights, prompts,
    samples and lengths, side by side. Both update once over the whole batch (tunix: one
    iteration, the batch as its minibatch). Ours takes the sampler's log-probs
    (`rollout.old_log_probs=sampler`), so its scoring pass runs the reference alone, as tunix's
    does; our default scoring pass (rescored log-probs and the gate statistics) is timed in the
    same rounds and reported beside it."""
    cfg, prompt_length = peer_config("grpo")
    rows = cfg.train.minibatch_size
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    # Our default scoring pass (rescored old log-probs and the gate statistics), timed beside the
    # step that matches tunix's work: the sampler's log-probs, the reference pass alone.
    default_score = planner.train_step_programs(
        cfg, mesh, prompt_length=prompt_length, platform=jax.devices()[0].platform
    ).programs["score"][0]
    cfg.rollout.old_log_probs = "sampler"
    ours = on_device(cfg, prompt_length, mesh, np.random.default_rng(0))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        default_score = default_score.lower(ours.state["policy"], ours.state["reference"], ours.generation).compile()
    rescore = lambda: jax.block_until_ready(
        default_score(ours.state["policy"], ours.state["reference"], ours.generation)
    )
    request = {
        "algo": "grpo",
        "prompts": ours.prompts.tolist(),
        "samples": cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
    }
    candidates = {
        "sample": ours.calls["sample"],
        "score": ours.calls["score"],
        "rescore": rescore,
        "actor": ours.calls["actor"],
    }
    medians, replies, ready = beside_tunix(tunix_python, ours, mesh, candidates, request, repeats)
    theirs = tunix_medians(replies, repeats, ("rollout", "scoring", "update"))
    phases = {"rollout": medians["sample"], "scoring": medians["score"], "update": medians["actor"]}
    phases["step"] = sum(phases.values())
    phases["scoring, rescored (default)"] = medians["rescore"]
    phases["step, rescored (default)"] = phases["step"] - phases["scoring"] + medians["rescore"]
    theirs.update({"step": sum(theirs.values()), "scoring, rescored (default)": theirs["scoring"]})
    theirs["step, rescored (default)"] = theirs["step"]
    table = [
        {
            "phase": phase,
            "comppo_jax s": f"{seconds:.3f}",
            "tunix s": f"{theirs[phase]:.3f}",
            "tunix / ours": f"{theirs[phase] / seconds:.2f}x",
        }
        for phase, seconds in phases.items()
    ]
    print(
        f"GRPO step, tiny: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} samples, "
        f"{prompt_length} + {cfg.rollout.max_new_tokens} tokens, one update over the {rows} rows; "
        f"tunix {ready['tunix']} "
        f"(jax {ready['jax']}), comppo_jax on jax {jax.__version__}, on {jax.devices()[0].device_kind}"
    )
    print_table(table, ["phase", "comppo_jax s", "tunix s", "tunix / ours"])


# Our arms of the credit comparison: (method, critic.kind), each with its default scoring pass.
CREDIT_ARMS = {
    "CompPO": ("comppo", "tac"),
    "PPO": ("ppo", "standard"),
    "PPO, full critic": ("ppo", "full"),
    "GRPO": ("grpo", "tac"),
}
# Phase -> our program (a credit call for "credit"); tunix's worker reports the same phases.
CREDIT_PHASES = {
    "rollout": "sample",
    "scoring": "score",
    "values": "values",
    "credit": "credit",
    "update": "actor",
    "critic_update": "critic",
}


def credit_call(cfg, ours: OnDevice, rng: np.random.Generator):
    """Blocking call of what the learner's `credit` computes besides the critic's values: the
    method's gate control and its estimator (Comp-GAE, GAE or group-relative) with whitening, on
    the values of the scored rollout and uniform random rewards at each row's last token."""
    credit = credit_spec(cfg, ours.step.config)
    mask = ours.rollout.response_mask
    rewards = rng.random(mask.shape[0]).astype(np.float32)
    reward_tokens = terminal_reward_tokens(rewards, sharding.to_host(mask))
    values = (
        ours.compiled["values"](ours.state["critic"], ours.batch)
        if "values" in ours.compiled
        else jnp.zeros(mask.shape)
    )
    key = jax.random.PRNGKey(1)

    def call():
        kappa = controlled_gate(credit, ours.rollout.kappa, mask, key)
        tokens, influence = ours.batch.response_tokens, ours.rollout.influence
        advantages = registry.estimate(
            credit.estimator, rewards, reward_tokens, tokens, values, kappa, mask, registry.Statistics(influence)
        )
        jax.block_until_ready(advantages)

    return call


def credit_peer(tunix_python: str, repeats: int) -> None:
    """One step of CompPO (attention gate, TAC, Comp-GAE), of PPO (the standard value head), of
    PPO with a full-copy critic and of GRPO, ours, beside one step of tunix's `PPOLearner` (its
    critic a full copy of the same weights), phase by phase, medians of interleaved rounds. All
    on the same random tiny weights and prompts, every row to max_new_tokens, one update over the
    whole batch; ours with the default scoring pass (rescored log-probs, the gate, the critic's
    features, and the reference). tunix's PPO samples each prompt once, so it gets each of our
    prompts `samples_per_prompt` times."""
    arms, rng = {}, np.random.default_rng(1)
    for arm, (method, critic) in CREDIT_ARMS.items():
        cfg, prompt_length = peer_config(method, critic)
        mesh = sharding.make_mesh(cfg.mesh, jax.devices())
        ours = on_device(cfg, prompt_length, mesh, np.random.default_rng(0))
        arms[arm] = (cfg, ours, {**ours.calls, "credit": credit_call(cfg, ours, rng)})
    cfg, ours, _ = arms["CompPO"]
    group = cfg.rollout.samples_per_prompt
    request = {
        "algo": "ppo",
        "prompts": np.repeat(ours.prompts, group, axis=0).tolist(),
        "samples": 1,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
    }
    candidates = {
        f"{arm}/{phase}": calls[program]
        for arm, (_, _, calls) in arms.items()
        for phase, program in CREDIT_PHASES.items()
        if program in calls
    }
    medians, replies, ready = beside_tunix(tunix_python, ours, mesh, candidates, request, repeats)
    columns = {arm: {phase: medians.get(f"{arm}/{phase}", 0.0) for phase in CREDIT_PHASES} for arm in arms}
    columns["tunix PPO"] = tunix_medians(replies, repeats, CREDIT_PHASES)
    tunix_total = float(np.median([reply["total_s"] for reply in replies[-repeats:]]))
    for phases in columns.values():
        phases["step"] = sum(phases.values())
    table = [
        {
            "phase": phase,
            **{arm: f"{phases[phase]:.4f}" for arm, phases in columns.items()},
            "tunix PPO / CompPO": ratio(columns["tunix PPO"][phase], columns["CompPO"][phase]),
            "CompPO / GRPO": ratio(columns["CompPO"][phase], columns["GRPO"][phase]),
        }
        for phase in (*CREDIT_PHASES, "step")
    ]
    rows = cfg.train.minibatch_size
    print(
        f"credit step, tiny: {cfg.rollout.prompts_per_step} prompts x {group} samples (tunix PPO: {rows} prompts x 1), "
        f"{prompt_length} + {cfg.rollout.max_new_tokens} tokens, one update over the {rows} rows; seconds, "
        f"medians of {repeats} interleaved rounds; tunix {ready['tunix']} (jax {ready['jax']}), comppo_jax on "
        f"jax {jax.__version__}, on "
        f"{jax.devices()[0].device_kind}"
    )
    print_table(table, ["phase", *columns, "tunix PPO / CompPO", "CompPO / GRPO"])
    print(
        f"tunix PPO's whole train call: {tunix_total:.3f} s (its host work around the phases: "
        f"{tunix_total - columns['tunix PPO']['step']:.3f} s)"
    )


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "-"
