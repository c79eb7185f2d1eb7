"""The embedded default task: chained arithmetic that needs several steps before the answer.

A problem is a start value and k operations applied left to right, e.g. the prompt
"7 +5 *3 -4 =?\n" with the worked solution "7+5=12\n12*3=36\n36-4=32\nAnswer: 32". Values stay
in [0, 999] (results are taken mod 1000), so every step is short and the answer is verifiable
by math-verify. Deterministic by seed; solutions are included for a supervised warm-start.

The warm start may teach mistakes (`noisy_solution`; 0 disables each):
- `answer_noise`: the probability that an odd answer's `Answer:` line reads answer + 1 (the
  scratchpad stays right, even answers are never touched). Above 1/2 the warm-started greedy policy
  is systematically wrong on odd answers while sampling still finds the right one: one mistake, at
  the end of the response, where broadcast credit is as precise as token credit.
- `step_noise`: the probability that a step whose operand is one of `noisy_operands` writes its
  result + 1, the chain going on from the wrong value. A long chain then holds several such
  decisions, anywhere in the response, and one wrong one decides the outcome: the credit testbed
  (configs/tiny_credit.py). `noisy_first_steps` keeps the noise to the chain's first steps.
- `mark_mistakes`: a step written wrong writes `~` for its `=`, and so does every step after it, so
  the mistake shows in the text and a response's states carry it to the end (the model must, to
  write the later lines): a critic reading them can know the outcome once the decision is made.
  With the noise kept to the first steps, that is the decision testbed (configs/tiny_decision.py).

It may also teach a tool's form (`tool_calls`): the probability that a step is written as a call of
the calculator (comppo_jax.environments.calculator), `[36*7]=252`. The written result carries the
same step noise as any other (the data's writer has no calculator), so only a run whose calls the
calculator answers (rollout.environment) gets them right every time; the tool runs
(configs/tiny_tools.py) learn when to call it, and their tool-free twin gains nothing from the form.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from comppo_jax.data.datasets import Problem

OPERATIONS = ("+", "-", "*")


def chained_arithmetic(
    count: int, *, seed: int = 0, min_steps: int = 2, max_steps: int = 4, operations: str = "".join(OPERATIONS)
) -> list[Problem]:
    """`count` problems with min_steps..max_steps operations each, drawn from `operations`."""
    if count < 1 or not 1 <= min_steps <= max_steps:
        raise ValueError(f"need count >= 1 and 1 <= min_steps <= max_steps, got {count}, {min_steps}, {max_steps}")
    if not operations or set(operations) - set(OPERATIONS):
        raise ValueError(f"operations={operations!r}; expected a non-empty string over {''.join(OPERATIONS)!r}")
    rng = random.Random(seed)
    problems = []
    for index in range(count):
        value = rng.randint(1, 20)
        prompt, lines = [str(value)], []
        for _ in range(rng.randint(min_steps, max_steps)):
            op = rng.choice(operations)
            operand = rng.randint(2, 9)
            result = {"+": value + operand, "-": value - operand, "*": value * operand}[op] % 1000
            prompt.append(f"{op}{operand}")
            lines.append(f"{value}{op}{operand}={result}")
            value = result
        solution = "\n".join(lines + [f"Answer: {value}"])
        problems.append(
            Problem(" ".join(prompt) + " =?\n", str(value), f"arith-{seed}-{index}", "chained_arithmetic", solution)
        )
    return problems


@dataclasses.dataclass(frozen=True)
class Noise:
    """What the warm start's solutions teach besides the task (module docstring): the mistakes
    `answer_noise`, and `step_noise` on the steps whose operand is a digit of `noisy_operands` (among the
    first `noisy_first_steps`, 0: all), marked when `mark_mistakes`; and calculator calls on a `tool_calls`
    fraction of the steps."""

    answer_noise: float = 0.0
    step_noise: float = 0.0
    noisy_operands: str = ""
    tool_calls: float = 0.0
    noisy_first_steps: int = 0
    mark_mistakes: bool = False

    @classmethod
    def of(cls, warm_start) -> Noise:
        """The noise a config's `warm_start` section asks for."""
        return cls(
            warm_start.answer_noise,
            warm_start.step_noise,
            warm_start.noisy_operands,
            warm_start.get("tool_calls", 0.0),
            warm_start.get("noisy_first_steps", 0),
            warm_start.get("mark_mistakes", False),
        )


NO_NOISE = Noise()


def _noisy_steps(solution: str, rng: np.random.Generator, noise: Noise) -> tuple[list[str], int]:
    """The solution's step lines with step noise and calculator calls, each step reading the previous
    one's (possibly wrong) result, and the chain's final value."""
    lines, value, equals = [], None, "="
    for index, line in enumerate(solution.split("\n")[:-1]):
        left, _ = line.split("=")
        op_at = max(left.rfind(op) for op in OPERATIONS if left.rfind(op) > 0)
        start, op, operand = (int(left[:op_at]) if value is None else value), left[op_at], int(left[op_at + 1 :])
        result = {"+": start + operand, "-": start - operand, "*": start * operand}[op] % 1000
        call = noise.tool_calls and rng.random() < noise.tool_calls
        noisy = not noise.noisy_first_steps or index < noise.noisy_first_steps
        if noisy and str(operand) in noise.noisy_operands and rng.random() < noise.step_noise:
            result = (result + 1) % 1000
            equals = "~" if noise.mark_mistakes else equals
        lines.append(f"[{start}{op}{operand}]{equals}{result}" if call else f"{start}{op}{operand}{equals}{result}")
        value = result
    return lines, int(value)


def noisy_solution(problem, rng: np.random.Generator, noise: Noise) -> str:
    """The worked solution with the taught mistakes of `noise` (module docstring)."""
    if not (noise.step_noise or noise.tool_calls):
        lines, answer = problem.solution.split("\n")[:-1], int(problem.answer)
    else:
        lines, answer = _noisy_steps(problem.solution, rng, noise)
    if answer % 2 == 1 and rng.random() < noise.answer_noise:
        answer += 1
    return "\n".join(lines + [f"Answer: {answer}"])
