"""Frozen evaluation (paper section 6.1): greedy pass@1 and majority@k on one problem set.

Answers are extracted and verified exactly as in training (comppo_jax.data.rewards). Majority@k
samples k responses per problem (temperature / top-p from the config), votes over the extracted
answers and verifies the winner.

Vote rules: answers are compared as whitespace-stripped strings (so "1/2" and "0.5" are
different votes); responses without an answer do not vote; a tie goes to the tied answer that
appears first in sample order (sample 0, 1, ...), which makes the vote deterministic given the
samples; a problem where no sample has an answer counts as incorrect.
"""

from __future__ import annotations

import collections

import jax
import tqdm

from comppo_jax.data.rewards import VerifierPool
from comppo_jax.models import ModelConfig
from comppo_jax.rollout.text import count_correct, generated_answers


def majority_answer(answers) -> str | None:
    """The most frequent answer; ties go to the earliest in sample order; None values do not vote."""
    votes = [a.strip() for a in answers if a is not None]
    if not votes:
        return None
    counts = collections.Counter(votes)
    best = max(counts.values())
    return next(a for a in votes if counts[a] == best)


def evaluate_problems(params, config: ModelConfig, tokenizer, problems, pool: VerifierPool, *, max_new_tokens: int, samples: int,
                      temperature: float, top_p: float, seed: int = 0, batch_size: int = 32, desc: str = "") -> dict:
    """{"problems", "greedy_pass@1", "majority@{samples}"} over `problems` (fractions in [0, 1])."""
    greedy_correct = majority_correct = 0
    for start in tqdm.trange(0, len(problems), batch_size, desc=desc, leave=False):
        chunk = problems[start : start + batch_size]
        greedy = generated_answers(params, config, tokenizer, chunk, max_new_tokens=max_new_tokens)
        sampled = generated_answers(params, config, tokenizer, chunk, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    num_samples=samples, rng=jax.random.fold_in(jax.random.PRNGKey(seed), start))
        voted = [majority_answer(sampled[i * samples : (i + 1) * samples]) for i in range(len(chunk))]
        greedy_correct += count_correct(chunk, greedy, pool)
        majority_correct += count_correct(chunk, voted, pool)
    count = max(len(problems), 1)
    return {"problems": len(problems), "greedy_pass@1": greedy_correct / count, f"majority@{samples}": majority_correct / count}
