"""Steps 1 and 3 of a train step: sample responses and reward them, with DAPO's dynamic sampling.

`reward_generation` verifies a generation's responses. `dynamic_sampling` (rollout.dynamic_sampling,
DAPO, Yu et al. 2025) keeps only informative prompt groups: with the accuracy filter (DAPO's, the
default) those whose verdicts are neither all correct nor all wrong, with the reward filter those
whose shaped rewards are not all equal (a group of equal rewards has zero group-relative advantage).
Dropped groups are replaced from the prompt stream, one full batch of prompts per refill round (the
sampler keeps its compiled shape), for at most `rollout.max_refills` rounds; groups still missing
then are filled with dropped ones, so the batch keeps its size. With max_refills=-1 it draws until
the batch is full, as DAPO does, and stops the run with `DynamicSamplingExhausted` once a whole pass
over the training prompts could not fill it. Rows keep their group order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from comppo_jax import sharding
from comppo_jax.credit import informative_groups
from comppo_jax.data.rewards import RewardCoefficients, Verdict, score_responses, terminal_reward_tokens
from comppo_jax.rollout import Generation, decode_responses

DYNAMIC_SAMPLING_FILTERS = ("accuracy", "reward")


class DynamicSamplingExhausted(RuntimeError):
    """max_refills=-1 drew a whole pass over the training prompts in one step without filling the batch."""


class Sampled(NamedTuple):
    """A generation with its rewards (rows: `group` consecutive responses per prompt)."""

    generation: Generation
    problems: list  # the prompt of each group
    texts: list[str]
    rewards: np.ndarray  # [B] terminal rewards
    verdicts: list
    reward_metrics: dict
    host_mask: np.ndarray  # [B, T] response mask on the host
    reward_tokens: np.ndarray  # [B, T] the reward at each row's last token


def reward_generation(
    tokenizer, pool, generation: Generation, problems, group: int, coefficients: RewardCoefficients
) -> Sampled:
    """Decodes and verifies a generation's responses to `problems` (`group` rows each)."""
    host_mask = sharding.to_host(generation.response_mask)
    texts = decode_responses(tokenizer, generation)
    golds = [p.answer for p in problems for _ in range(group)]
    rewards, verdicts, metrics = score_responses(texts, golds, host_mask.sum(axis=1), pool, coefficients)
    return Sampled(
        generation,
        list(problems),
        texts,
        rewards,
        verdicts,
        metrics,
        host_mask,
        terminal_reward_tokens(rewards, host_mask),
    )


@functools.partial(jax.jit, static_argnames=("width", "layout"))
def _gather_rows(generations: list[Generation], rows: list, width: int, layout) -> Generation:
    """`rows` of each generation, concatenated, sequences right-padded to `width`, laid out as `layout`
    (None: as the compiler picks). One program: a gather, pad and concatenation per field would each be
    one of their own, on a pod a cross-process program (XLA:CPU over gloo hangs on those back to back:
    docs/reliability.md)."""

    def field(name: str, values: list) -> jax.Array:
        if name in ("tokens", "attention_mask"):
            values = [jnp.pad(x, ((0, 0), (0, width - x.shape[1]))) for x in values]
        return jnp.concatenate(values)

    picked = [jax.tree.map(lambda x, r=r: x[r], generation) for generation, r in zip(generations, rows)]
    merged = Generation(*(field(name, list(values)) for name, values in zip(Generation._fields, zip(*picked))))
    return merged if layout is None else jax.lax.with_sharding_constraint(merged, layout)


def take_groups(pieces: list[tuple[Sampled, list[int]]], group: int) -> Sampled:
    """The chosen groups of several `Sampled` as one, in order. Sequences are right-padded to the
    widest (rows are prompt + response + right padding, so that only adds padding)."""
    width = max(s.generation.tokens.shape[1] for s, _ in pieces)
    rows = [np.asarray([g * group + i for g in groups for i in range(group)], np.int32) for _, groups in pieces]
    problems, texts, verdicts = [], [], []
    for (sampled, groups), picked in zip(pieces, rows):
        problems += [sampled.problems[g] for g in groups]
        texts += [sampled.texts[r] for r in picked]
        verdicts += [sampled.verdicts[r] for r in picked]
    host = lambda name: np.concatenate([getattr(s, name)[r] for (s, _), r in zip(pieces, rows)])
    # Replicated over the pieces' mesh, the layout earlier runs scored (the scoring pass's float sums depend on it).
    laid_out = getattr(pieces[0][0].generation.tokens, "sharding", None)
    layout = NamedSharding(laid_out.mesh, PartitionSpec()) if isinstance(laid_out, NamedSharding) else None
    return Sampled(
        _gather_rows([s.generation for s, _ in pieces], rows, width, layout),
        problems,
        texts,
        host("rewards"),
        verdicts,
        {},
        host("host_mask"),
        host("reward_tokens"),
    )


def _combined_metrics(rounds: list[Sampled]) -> dict:
    """Reward counts summed over every sampled response; the mean reward over all of them."""
    total = {
        name: sum(s.reward_metrics[name] for s in rounds) for name in rounds[0].reward_metrics if name != "reward/mean"
    }
    total["reward/mean"] = float(np.mean(np.concatenate([s.rewards for s in rounds])))
    return total


def informative(sampled: Sampled, group: int, filter_by: str) -> np.ndarray:
    """[groups] bool: the groups dynamic sampling keeps. "accuracy": verdicts neither all correct nor
    all wrong (DAPO's filter); "reward": shaped rewards not all equal."""
    if filter_by not in DYNAMIC_SAMPLING_FILTERS:
        raise ValueError(f"rollout.dynamic_sampling_filter={filter_by!r}; expected one of {DYNAMIC_SAMPLING_FILTERS}")
    if filter_by == "accuracy":
        return informative_groups(np.asarray([v is Verdict.CORRECT for v in sampled.verdicts], np.float32), group)
    return informative_groups(sampled.rewards, group)


def dynamic_sampling(
    first: Sampled,
    draw: Callable[[int], Sampled],
    group: int,
    max_refills: int,
    filter_by: str = "accuracy",
    train_prompts: int = 0,
) -> Sampled:
    """DAPO's dynamic sampling (module doc): `first` and more batches `draw(1)`, `draw(2)`, ...,
    keeping informative groups (`informative`) until there are as many as `first` has. At most
    `max_refills` draws, then dropped groups fill the batch; with max_refills=-1 as many draws as a
    pass over the `train_prompts` training prompts takes, then `DynamicSamplingExhausted`.

    The batch's reward_metrics are the reward counts over every sampled response, plus
    dynamic_sampling/dropped_fraction (uninformative groups over all sampled), /refills (rounds
    drawn) and /uninformative_kept (dropped groups that filled the batch after the last round).
    """
    wanted = len(first.problems)
    until_full = max_refills < 0
    refills = (
        -(-train_prompts // wanted) - 1 if until_full else max_refills
    )  # a pass over the prompts: ceil(train / batch) rounds
    rounds, kept, dropped = [], [], []
    sampled = first
    while True:
        rounds.append(sampled)
        for g, useful in enumerate(informative(sampled, group, filter_by)):
            (kept if useful else dropped).append((len(rounds) - 1, g))
        if len(kept) >= wanted or len(rounds) > refills:
            break
        sampled = draw(len(rounds))
    if until_full and len(kept) < wanted:
        raise DynamicSamplingExhausted(
            f"dynamic sampling drew {len(rounds)} rounds of {wanted} prompts in one step, a whole pass over the "
            f"{train_prompts} training prompts, and found {len(kept)} of the {wanted} informative groups the batch "
            f"needs ({filter_by} filter: the policy answers nearly every group all right or all wrong); pass "
            "--config.rollout.max_refills=<count> to fill the batch with uninformative groups after that many refills"
        )
    uninformative_kept = max(wanted - len(kept), 0)
    chosen = sorted(kept[:wanted] + dropped[:uninformative_kept])
    pieces = [(rounds[r], [g for rr, g in chosen if rr == r]) for r in range(len(rounds))]
    batch = take_groups([(s, groups) for s, groups in pieces if groups], group)
    metrics = _combined_metrics(rounds)
    metrics.update(
        {
            "dynamic_sampling/dropped_fraction": len(dropped) / (len(kept) + len(dropped)),
            "dynamic_sampling/refills": float(len(rounds) - 1),
            "dynamic_sampling/uninformative_kept": float(uninformative_kept),
        }
    )
    return batch._replace(reward_metrics=metrics)
