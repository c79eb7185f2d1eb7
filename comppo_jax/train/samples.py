"""Which steps keep sampled responses, and which of their tokens, with each token's credit: the
recorder's half of the kept responses (comppo_jax.runs.samples: their files, which the run report reads).

Every `outputs.sample_every` steps (0: at each dev evaluation; -1: never) the recorder keeps
`outputs.samples_per_step` of the step's responses, spread evenly over the batch. A response
longer than `outputs.sample_tokens` keeps its first and last halves of that many tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from comppo_jax import sharding
from comppo_jax.credit import comp_gae, gae, gate_concentration, gate_range, turns
from comppo_jax.data.tokenizers import token_pieces

CONTROLLED_GATES = ("fixed", "shuffle", "position")  # the recipe gates that replace the policy's own


def keeps_samples(outputs, step: int, evaluates: bool, last: bool = False) -> bool:
    """Whether step `step` keeps responses (config section `outputs`; `evaluates`: the step ends
    with a dev evaluation; `last`: the run's last step, which keeps some whatever the schedule, so a
    run too short to reach one still shows where its credit went)."""
    if outputs.sample_every < 0 or outputs.samples_per_step == 0:
        return False
    return last or (evaluates if outputs.sample_every == 0 else step % outputs.sample_every == 0)


def kept_rows(batch: int, count: int) -> np.ndarray:
    """`count` rows of a batch of `batch`, spread evenly, first and last included."""
    return np.unique(np.linspace(0, batch - 1, min(count, batch)).round().astype(int))


def kept_positions(length: int, limit: int) -> np.ndarray:
    """Indices of the tokens kept of a response of `length`: all, or the first and last limit/2."""
    if length <= limit:
        return np.arange(length)
    head = limit - limit // 2
    return np.concatenate([np.arange(head), np.arange(length - limit // 2, length)])


def _numbers(values, integer: bool = False) -> list:
    """JSON numbers (5 decimals; null where not finite: browsers' JSON.parse rejects NaN)."""
    if integer:
        return [int(v) for v in values]
    rounded = np.round(np.asarray(values, np.float64), 5)
    return [float(v) if np.isfinite(v) else None for v in rounded]


def per_token_credit(credit, scored, sampled, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The module docstring's per-token arrays [len(rows), T] of `rows` of a scored batch
    (comppo_jax.train.learner.Scored) under `credit` (comppo_jax.train.specs.CreditSpec). Every process
    calls it: multi-host arrays are gathered."""
    host = sharding.to_host
    mask = sampled.host_mask[rows]
    arrays = {}
    own = scored.rollout.kappa
    recipe, lam = credit.recipe, credit.estimator.lam
    envelope = dict(kappa_lo=credit.gate.kappa_lo, kappa_hi=credit.gate.kappa_hi, tau=credit.gate.tau)
    if own is not None:
        arrays["kappa"] = host(own)[rows]
        arrays["H"] = host(scored.rollout.herfindahl)[rows]
        arrays["n"] = host(scored.rollout.window_size)[rows]
        arrays["c"] = np.asarray(gate_concentration(jnp.asarray(arrays["kappa"]), **envelope))
    if recipe.gate in CONTROLLED_GATES:
        arrays["credit_kappa"] = host(scored.kappa)[rows]
    if recipe.critic == "none":  # GRPO's broadcast advantages, or a group estimator's (ktae, attention_anchor)
        arrays[recipe.estimator] = host(scored.batch.advantages)[rows]
    else:
        values, rewards = host(scored.batch.old_values)[rows], sampled.reward_tokens[rows]
        arrays["value"] = values
        # PPO: the policy's own gate, what CompPO would have read; CompPO: the gate its Comp-GAE read.
        gate = arrays.get("kappa") if recipe.gate == "gamma" else host(scored.kappa)[rows]
        if gate is not None:
            comp = lambda r, v, k, m: comp_gae(r, v, k, m, lam)
            arrays["comp_gae"] = advantages_of(comp, sampled, rows, credit, rewards, values, gate)
        arrays["gae"] = advantages_of(lambda r, v, m: gae(r, v, m, 1.0, lam), sampled, rows, credit, rewards, values)
        if recipe.estimator not in arrays:  # an estimator beyond the paper's (vapo): the advantages it gave the actor
            arrays[recipe.estimator] = host(scored.batch.advantages)[rows]
    if sampled.env_mask is not None:  # a conversation's environment tokens: marked, no credit
        arrays["env"] = sampled.env_mask[rows].astype(np.int32)
    return {name: np.where(mask, array, 0) for name, array in arrays.items()}


def advantages_of(estimator, sampled, rows: np.ndarray, credit, rewards, values, gate=None) -> np.ndarray:
    """`estimator`'s advantages on `rows`, on the policy's tokens of a conversation (comppo_jax.credit.turns, the
    gate's crossings as `credit.estimator.env_crossing` says); `gate`: its kappa, if it reads one."""
    mask = jnp.asarray(sampled.host_mask[rows])
    per_token = [jnp.asarray(rewards), jnp.asarray(values)] + ([] if gate is None else [jnp.asarray(gate)])
    if sampled.env_mask is None:
        return np.asarray(estimator(*per_token, mask)[0])
    env = jnp.asarray(sampled.env_mask[rows])
    if gate is not None:
        per_token[2] = turns.crossing_gate(per_token[2], env, mask, credit.estimator.env_crossing)
    return np.asarray(turns.on_policy_tokens(estimator, env, mask, *per_token)[0])


def replies_of(sampled, row: int) -> int:
    """A conversation's environment replies: its spans of environment tokens."""
    env = sampled.env_mask[row].astype(np.int8)
    return int(np.sum(np.diff(env, prepend=0) == 1))


def kept_responses(spec, tokenizer, step: int, sampled, scored) -> dict:
    """Step `step`'s kept responses (comppo_jax.runs.samples' record) from its rewarded generation
    (comppo_jax.rollout.experience.Sampled) and its credit (Scored), as the recorder's `spec`
    (comppo_jax.train.specs.RecorderSpec) keeps them."""
    credit, recipe = spec.credit, spec.credit.recipe
    rows = kept_rows(sampled.host_mask.shape[0], spec.kept.samples_per_step)
    arrays = per_token_credit(credit, scored, sampled, rows)
    tokens = sharding.to_host(sampled.generation.response_tokens)[rows]
    group = spec.group
    responses = []
    for i, row in enumerate(rows):
        length = int(sampled.host_mask[row].sum())
        kept = kept_positions(length, spec.kept.sample_tokens)
        responses.append(
            {
                "row": int(row),
                "prompt": sampled.problems[row // group].prompt,
                "response": sampled.texts[row],
                "reward": _numbers([sampled.rewards[row]])[0],
                "verdict": sampled.verdicts[row].value,
                "length": length,
                **({} if sampled.env_mask is None else {"replies": replies_of(sampled, row)}),
                "t": [int(t) + 1 for t in kept],
                "pieces": token_pieces(tokenizer, tokens[i][kept]),
                "tokens": {name: _numbers(values[i][kept], integer=name == "n") for name, values in arrays.items()},
            }
        )
    return {
        "step": step,
        "method": spec.method,
        "gate": recipe.gate,
        "estimator": recipe.estimator,
        "lam": credit.estimator.lam,
        "kappa_range": list(gate_range(credit.gate.kappa_lo, credit.gate.kappa_hi, credit.gate.tau)),
        "responses": responses,
    }
