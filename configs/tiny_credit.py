"""The credit testbed: the tiny model on long chains whose outcome one wrong step decides.

Each problem chains 10-16 additions and subtractions, so a worked solution is 60-162 tokens. The
warm start teaches a mistake inside the chain: a step whose operand is 9 writes its result + 1 with
probability 0.6, the chain going on from the wrong value (`warm_start.step_noise`). A problem holds
about 1.6 such steps, anywhere in it, and any wrong one makes the answer wrong: the warm-started
policy is right about a quarter of the time, and only some tokens of a wrong response are to
blame. Broadcast credit (GRPO) gives every token of a response its outcome; token credit (GAE,
Comp-GAE) can find the step that lost it. docs/results_credit.md reports the methods on it.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "comppo_tiny", os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")
)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)


def get_config():
    config = tiny.get_config()
    config.output_dir = "runs/tiny_credit"
    config.data.update(min_steps=10, max_steps=16, operations="+-")
    config.warm_start.update(answer_noise=0.0, step_noise=0.6, noisy_operands="9")
    config.rollout.update(max_new_tokens=176)
    return config
