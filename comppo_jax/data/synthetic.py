"""The embedded default task: chained arithmetic that needs several steps before the answer.

A problem is a start value and k operations applied left to right, e.g. the prompt
"7 +5 *3 -4 =?\n" with the worked solution "7+5=12\n12*3=36\n36-4=32\nAnswer: 32". Values stay
in [0, 999] (results are taken mod 1000), so every step is short and the answer is verifiable
by math-verify. Deterministic by seed; solutions are included for a supervised warm-start.
"""

from __future__ import annotations

import random

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
