"""The decision testbed: the tiny model on chains whose outcome an early, visible decision fixes.

Each problem chains 6-10 additions and subtractions, so a worked solution is 46-110 tokens (74 on
average). The warm start teaches a mistake in the chain's first three steps: a step whose operand is
7, 8 or 9 writes its result + 1 with probability 0.6, and marks it, writing `~` for its `=`, as every
step after it does (`warm_start.mark_mistakes`). A response is decided within its first 25 tokens or
so, and the rest, 50 tokens on average, do not matter to its outcome. The model must remember the
mark to write the later lines, so its states carry the decision to the end: a critic on them can know
the outcome long before the answer, which on the credit testbed (configs/tiny_credit.py, its mistakes
unmarked) no critic can. docs/results_decision.md reports the paper's comparisons on it.
"""

import pathlib

from comppo_jax.models import load_config_file


def get_config():
    config = load_config_file(pathlib.Path(__file__).with_name("tiny.py"))
    config.output_dir = "runs/tiny_decision"
    config.data.update(min_steps=6, max_steps=10, operations="+-")
    config.warm_start.update(
        answer_noise=0.0, step_noise=0.6, noisy_operands="789", noisy_first_steps=3, mark_mistakes=True
    )
    config.rollout.update(max_new_tokens=112)
    return config
