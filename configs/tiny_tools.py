"""Tool use on the tiny task: the policy may call a calculator at any step of its chain.

The embedded default's task (2-3 additions and subtractions), taught with a mistake inside the
chain instead of in the answer: a step whose operand is 7, 8 or 9 writes its result + 1 with
probability 0.6 (`warm_start.step_noise`). The warm start also writes half of the steps as
calculator calls, `[36+7]=43`, their results as noisy as the others'. In RL the policy's calls go to
the calculator (`rollout.environment=calculator`), whose reply `=43` is always right; the policy
reads it and is never trained on it. The tool-free twin (`--config.rollout.environment=`) runs the
same warm start and problems, writing every result itself; configs/experiments_tools.py runs both.
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
    config.output_dir = "runs/tiny_tools"
    config.warm_start.update(answer_noise=0.0, step_noise=0.6, noisy_operands="789", tool_calls=0.5)
    # A call and its reply add 3 tokens to a step: at most 3 calls, then the answer.
    config.rollout.update(environment="calculator", max_turns=4, max_reply_tokens=6, max_new_tokens=48)
    return config
