"""Steps 1 and 3 of a train step: sample responses and reward them, with DAPO's dynamic sampling.

`reward_generation` verifies a generation's responses. `dynamic_sampling` (rollout.dynamic_sampling,
DAPO, Yu et al. 2025) keeps only prompt groups whose rewards are not all equal: a group of equal
rewards has zero group-relative advantage, so it only dilutes the batch. Dropped groups are
replaced from the prompt stream, one full batch of prompts per refill round (the sampler keeps
its compiled shape), for at most `rollout.max_refills` rounds; groups still missing then are
filled with dropped ones, so the batch keeps its size. Rows keep their group order.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from comppo_jax import sharding
from comppo_jax.credit import informative_groups
from comppo_jax.data.rewards import RewardCoefficients, score_responses, terminal_reward_tokens
from comppo_jax.rollout import Generation, decode_responses


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


def reward_generation(tokenizer, pool, generation: Generation, problems, group: int, coefficients: RewardCoefficients) -> Sampled:
    """Decodes and verifies a generation's responses to `problems` (`group` rows each)."""
    host_mask = sharding.to_host(generation.response_mask)
    texts = decode_responses(tokenizer, generation)
    golds = [p.answer for p in problems for _ in range(group)]
    rewards, verdicts, metrics = score_responses(texts, golds, host_mask.sum(axis=1), pool, coefficients)
    return Sampled(generation, list(problems), texts, rewards, verdicts, metrics, host_mask, terminal_reward_tokens(rewards, host_mask))


def _pad_width(x, width: int):
    return jnp.pad(x, ((0, 0), (0, width - x.shape[1])))


def take_groups(pieces: list[tuple[Sampled, list[int]]], group: int) -> Sampled:
    """The chosen groups of several `Sampled` as one, in order. Sequences are right-padded to the
    widest (rows are prompt + response + right padding, so that only adds padding)."""
    width = max(s.generation.tokens.shape[1] for s, _ in pieces)
    fields = {name: [] for name in Generation._fields}
    problems, texts, rewards, verdicts, masks, reward_tokens = [], [], [], [], [], []
    for sampled, groups in pieces:
        rows = np.asarray([g * group + i for g in groups for i in range(group)], np.int32)
        for name, value in sampled.generation._asdict().items():
            value = value[rows]
            fields[name].append(_pad_width(value, width) if name in ("tokens", "attention_mask") else value)
        problems += [sampled.problems[g] for g in groups]
        texts += [sampled.texts[r] for r in rows]
        verdicts += [sampled.verdicts[r] for r in rows]
        rewards.append(sampled.rewards[rows])
        masks.append(sampled.host_mask[rows])
        reward_tokens.append(sampled.reward_tokens[rows])
    generation = Generation(**{name: jnp.concatenate(parts) for name, parts in fields.items()})
    return Sampled(generation, problems, texts, np.concatenate(rewards), verdicts, {}, np.concatenate(masks),
                   np.concatenate(reward_tokens))


def _combined_metrics(rounds: list[Sampled]) -> dict:
    """Reward counts summed over every sampled response; the mean reward over all of them."""
    total = {name: sum(s.reward_metrics[name] for s in rounds) for name in rounds[0].reward_metrics if name != "reward/mean"}
    total["reward/mean"] = float(np.mean(np.concatenate([s.rewards for s in rounds])))
    return total


def dynamic_sampling(first: Sampled, draw: Callable[[int], Sampled], group: int, max_refills: int) -> Sampled:
    """DAPO's dynamic sampling (module doc): `first` and up to `max_refills` more batches
    `draw(1)`, `draw(2)`, ..., keeping informative groups until there are as many as `first` has.

    The batch's reward_metrics are the reward counts over every sampled response, plus
    dynamic_sampling/dropped_fraction (uninformative groups over all sampled), /refills (rounds
    drawn) and /uninformative_kept (dropped groups that filled the batch after the last round).
    """
    wanted = len(first.problems)
    rounds, kept, dropped = [], [], []
    sampled = first
    while True:
        rounds.append(sampled)
        informative = informative_groups(sampled.rewards, group)
        for g, useful in enumerate(np.asarray(informative)):
            (kept if useful else dropped).append((len(rounds) - 1, g))
        if len(kept) >= wanted or len(rounds) > max_refills:
            break
        sampled = draw(len(rounds))
    uninformative_kept = max(wanted - len(kept), 0)
    chosen = sorted(kept[:wanted] + dropped[:uninformative_kept])
    pieces = [(rounds[r], [g for rr, g in chosen if rr == r]) for r in range(len(rounds))]
    batch = take_groups([(s, groups) for s, groups in pieces if groups], group)
    metrics = _combined_metrics(rounds)
    metrics.update({"dynamic_sampling/dropped_fraction": len(dropped) / (len(kept) + len(dropped)),
                    "dynamic_sampling/refills": float(len(rounds) - 1),
                    "dynamic_sampling/uninformative_kept": float(uninformative_kept)})
    return batch._replace(reward_metrics=metrics)
