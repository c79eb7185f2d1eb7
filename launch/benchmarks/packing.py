"""Sequence packing against the padded layout, measured side by side in one run.

A batch of `batch` responses to 64-token prompts, their lengths drawn as launch/plan.py draws a
16K run's (`planning.overlap.long_tail_lengths`: log-normal around 30% of the limit, 5% clipped at
it) with the limit `length`, on configs/tiny.py's model with its TAC critic. Three programs the
learner runs, each on the sequence layout (one response per row, padded to the longest) and on
packed rows (`train.packing`, comppo_jax.models.packing), timed as interleaved medians:
- the scoring pass: behaviour forward with the gate and TAC's features and routing, reference forward;
- the actor update on the whole batch as one minibatch (forward + backward + AdamW);
- the critic update (TAC) on the same.
The table gives both times, the speed-up and the packed rows' efficiency (real / computed tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import interleaved_medians, print_table
from comppo_jax.critic import critic_from_config, fused_hidden_layers, init_tac
from comppo_jax.models import init_params, load_config_file, preset_model_config
from comppo_jax.models.loading import PRESET_DIR
from comppo_jax.models.packing import efficiency, make_packing, on_devices
from comppo_jax.planning.overlap import long_tail_lengths
from comppo_jax.rollout import score_rollout
from comppo_jax.rollout.sampler import Generation
from comppo_jax.train.methods import spread_over_sequence
from comppo_jax.train.update import Minibatch, actor_step, adamw, critic_step

PROMPT = 64
ACTOR_HYPER = dict(learning_rate=1e-5, clip=0.2, kl_coef=1e-2, grad_clip=1.0)
CRITIC_HYPER = dict(learning_rate=1e-3, value_clip=0.5, grad_clip=1.0)


def long_tailed_batch(config, batch: int, length: int, rng: np.random.Generator) -> Generation:
    """Random tokens: PROMPT-token prompts, responses of `long_tail_lengths(batch, length)` tokens."""
    responses = long_tail_lengths(batch, length)
    width = PROMPT + length
    mask = np.arange(width)[None] < (PROMPT + responses)[:, None]
    tokens = rng.integers(3, config.vocab_size, (batch, width)).astype(np.int32) * mask
    response_mask = np.arange(length)[None] < responses[:, None]
    return Generation(
        jnp.asarray(tokens),
        jnp.asarray(mask),
        jnp.full((batch,), PROMPT, jnp.int32),
        jnp.asarray(tokens[:, PROMPT:]),
        jnp.asarray(response_mask),
        jnp.zeros(response_mask.shape, jnp.float32),
    )


def run(batch: int = 16, length: int = 1024, repeats: int = 3) -> None:
    cfg = load_config_file(PRESET_DIR / "tiny.py")
    config = preset_model_config("tiny")
    rng = np.random.default_rng(0)
    generation = long_tailed_batch(config, batch, length, rng)
    host_lengths = np.asarray(generation.attention_mask).sum(axis=1)
    packing = on_devices(make_packing(host_lengths, generation.tokens.shape[1]), None)
    computed = efficiency(host_lengths, packing, generation.tokens.shape[1])
    policy = init_params(config, jax.random.PRNGKey(0))
    reference = init_params(config, jax.random.PRNGKey(1))
    section = cfg.critic
    hidden_layers = fused_hidden_layers(config.num_layers, min(section.fused_layers, config.num_layers + 1))
    critic_module = critic_from_config(section)
    critic = init_tac(critic_module, jax.random.PRNGKey(2), len(hidden_layers), config.hidden_size, section.top_k)
    options = dict(hidden_layers=hidden_layers, top_k=section.top_k)

    score = jax.jit(
        lambda policy, reference, packing: score_rollout(
            policy, reference, config, generation, packing=packing, **options
        )
    )
    rollout = score(policy, reference, None)
    mask = generation.response_mask
    noise = np.where(np.asarray(mask), rng.normal(size=mask.shape), 0.0).astype(np.float32)
    minibatch = Minibatch(
        generation.tokens,
        generation.attention_mask,
        generation.prompt_lengths,
        generation.response_tokens,
        mask,
        rollout.log_probs,
        rollout.ref_log_probs,
        jnp.asarray(noise),
        jnp.tanh(jnp.asarray(noise)),
        jnp.zeros(mask.shape),
        spread_over_sequence(rollout.kappa, generation.prompt_lengths, generation.tokens.shape[1]),
        rollout.hidden_states,
        rollout.routing,
    )
    actor_tx, critic_tx = adamw(1e-5), adamw(1e-3)
    actor_opt, critic_opt = actor_tx.init(policy), critic_tx.init(critic)
    actor = jax.jit(lambda p, o, b: actor_step(p, o, b, ACTOR_HYPER, config=config, tx=actor_tx))
    critic_update = jax.jit(
        lambda p, o, b: critic_step(p, o, b, CRITIC_HYPER, critic_module=critic_module, kind="tac", tx=critic_tx)
    )
    calls = {}
    for layout, packed in (("padded", None), ("packed", packing)):
        batch_of = minibatch._replace(packing=packed)
        calls[f"scoring pass {layout}"] = lambda packed=packed: jax.block_until_ready(score(policy, reference, packed))
        calls[f"actor update {layout}"] = lambda b=batch_of: jax.block_until_ready(actor(policy, actor_opt, b))
        calls[f"critic update {layout}"] = lambda b=batch_of: jax.block_until_ready(
            critic_update(critic, critic_opt, b)
        )
    seconds = interleaved_medians(calls, repeats)
    print(
        f"{batch} responses to {PROMPT}-token prompts, lengths long-tailed up to {length} "
        f"(mean {np.mean(host_lengths - PROMPT):.0f}); {jax.devices()[0].device_kind}: {packing.segment_ids.shape[0]} "
        f"packed rows of {packing.segment_ids.shape[1]} against {batch}, efficiency {computed:.2f} "
        f"(padded {host_lengths.sum() / np.size(generation.tokens):.2f})"
    )
    rows = []
    for program in ("scoring pass", "actor update", "critic update"):
        padded, packed = seconds[f"{program} padded"], seconds[f"{program} packed"]
        rows.append(
            {
                "program": program,
                "padded s": f"{padded:.3f}",
                "packed s": f"{packed:.3f}",
                "speed-up": f"{padded / packed:.2f}x",
            }
        )
    print_table(rows, ["program", "padded s", "packed s", "speed-up"])
