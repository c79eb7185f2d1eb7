"""Frozen evaluation (paper section 6.1, and the metrics of the math-RL literature) on one problem set.

Per problem: one greedy response, and n sampled responses (`eval.samples`, at `eval.temperature`
and `eval.top_p`), each answer extracted and verified exactly as in training
(comppo_jax.data.rewards). From the c correct of the n samples:

- avg@n: c / n, the mean accuracy of the samples (DAPO's "avg@32" on AIME);
- pass@k: 1 - C(n - c, k) / C(n, k), the unbiased estimator of Chen et al. 2021 (eq. 1 of
  "Evaluating Large Language Models Trained on Code"), for each k <= n; pass@1 is avg@n;
- majority@n: the majority vote over the n extracted answers, verified.

A set's value is the mean over its problems, with its standard error (the sample standard
deviation of the per-problem values over sqrt(problems); `<metric>_se`). pass@k and avg@n are
computed as exact fractions, so pass@1 equals avg@n bit for bit.

Vote rules: answers are compared as whitespace-stripped strings (so "1/2" and "0.5" are
different votes); responses without an answer do not vote; a tie goes to the tied answer that
appears first in sample order (sample 0, 1, ...), which makes the vote deterministic given the
samples; a problem where no sample has an answer counts as incorrect.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from fractions import Fraction

import jax
import numpy as np
import tqdm

from comppo_jax.data.rewards import VerifierPool
from comppo_jax.models import ModelConfig
from comppo_jax.rollout.text import answers_correct, generated_answers
from comppo_jax.rollout.turns import ToolUse


def majority_answer(answers) -> str | None:
    """The most frequent answer; ties go to the earliest in sample order; None values do not vote."""
    votes = [a.strip() for a in answers if a is not None]
    if not votes:
        return None
    counts = collections.Counter(votes)
    best = max(counts.values())
    return next(a for a in votes if counts[a] == best)


def pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Unbiased pass@k from c correct of n samples (Chen et al. 2021, eq. 1): 1 - C(n - c, k) / C(n, k),
    the probability that k of the n samples drawn without replacement include a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def eval_sampling(eval_cfg) -> tuple[int, ...]:
    """Checks the config's `eval` sampling fields (samples, temperature, top_p, pass_k), naming the
    first bad one; returns the k of pass@k."""
    samples, temperature, top_p = eval_cfg.samples, eval_cfg.temperature, eval_cfg.top_p
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"config.eval.samples={samples!r}: expected an integer >= 1 (responses per problem)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"config.eval.temperature={temperature!r}: expected a number >= 0 (0: greedy)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"config.eval.top_p={top_p!r}: expected a number in (0, 1]")
    return pass_k_values(eval_cfg.pass_k, samples)


def pass_k_values(spec: str, samples: int) -> tuple[int, ...]:
    """The k of pass@k from `eval.pass_k` ("1,4,16"; "": 1 and `samples`), each in [1, samples]."""
    try:
        ks = sorted({int(k) for k in spec.split(",") if k.strip()}) if spec.strip() else sorted({1, samples})
    except ValueError as error:
        raise ValueError(f"config.eval.pass_k={spec!r}: expected integers separated by commas, e.g. 1,4,16") from error
    if not ks or ks[0] < 1 or ks[-1] > samples:
        raise ValueError(f"config.eval.pass_k={spec!r}: each k must be in [1, eval.samples={samples}]")
    return tuple(ks)


def mean_and_standard_error(values) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-problem values (ints or Fractions, summed exactly); SE 0 below 2
    values."""
    count = len(values)
    if count == 0:
        return 0.0, 0.0
    mean = float(sum(values, Fraction(0)) / count)
    spread = float(np.std(np.asarray(values, np.float64), ddof=1)) if count > 1 else 0.0
    return mean, spread / math.sqrt(count)


def set_metrics(greedy_correct, sample_correct, majority_correct, samples: int, ks) -> dict:
    """A set's metrics from per-problem results: greedy_correct [P] bool, sample_correct [P][n] bool,
    majority_correct [P] bool; {"problems", metric, metric + "_se", ...}."""
    per_problem = {
        "greedy_pass@1": [int(x) for x in greedy_correct],
        f"avg@{samples}": [Fraction(sum(row), samples) for row in sample_correct],
    }
    per_problem.update({f"pass@{k}": [pass_at_k(samples, sum(row), k) for row in sample_correct] for k in ks})
    per_problem[f"majority@{samples}"] = [int(x) for x in majority_correct]
    out = {"problems": len(greedy_correct)}
    for name, values in per_problem.items():
        out[name], out[f"{name}_se"] = mean_and_standard_error(values)
    return out


def metric_names(samples: int, ks) -> tuple[str, ...]:
    """The metrics of a set, in column order (each has a `_se` beside it)."""
    return ("greedy_pass@1", f"avg@{samples}", *(f"pass@{k}" for k in ks), f"majority@{samples}")


def evaluate_problems(
    params,
    config: ModelConfig,
    tokenizer,
    problems,
    pool: VerifierPool,
    *,
    max_new_tokens: int,
    samples: int,
    temperature: float,
    top_p: float,
    pass_k: tuple[int, ...] = (),
    seed: int = 0,
    batch_size: int = 32,
    desc: str = "",
    tools: ToolUse | None = None,
    compiling: Callable[[str], None] = lambda what: None,
) -> dict:
    """`set_metrics` over `problems`: greedy pass@1, avg@samples, pass@k for k in `pass_k` (default 1
    and samples) and majority@samples, each a fraction in [0, 1] with its standard error. `tools`: each
    response is a conversation with its environment (a tool run's, rollout.environment). `compiling(what)` is
    called before each decoder's first batch, which compiles it (a launcher's first-call notice)."""
    greedy_correct, sample_correct, majority_correct = [], [], []
    for start in tqdm.trange(0, len(problems), batch_size, desc=desc, leave=False):
        chunk = problems[start : start + batch_size]
        compiling("the greedy decoder")
        greedy = generated_answers(params, config, tokenizer, chunk, max_new_tokens=max_new_tokens, tools=tools)
        compiling(f"the sampler ({samples} samples a problem)")
        sampled = generated_answers(
            params,
            config,
            tokenizer,
            chunk,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            num_samples=samples,
            rng=jax.random.fold_in(jax.random.PRNGKey(seed), start),
            tools=tools,
        )
        voted = [majority_answer(sampled[i * samples : (i + 1) * samples]) for i in range(len(chunk))]
        greedy_correct += answers_correct(chunk, greedy, pool)
        correct = answers_correct([p for p in chunk for _ in range(samples)], sampled, pool)
        sample_correct += [correct[i * samples : (i + 1) * samples] for i in range(len(chunk))]
        majority_correct += answers_correct(chunk, voted, pool)
    return set_metrics(greedy_correct, sample_correct, majority_correct, samples, pass_k or sorted({1, samples}))
