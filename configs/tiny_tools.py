"""Tool use on the credit testbed: the tiny model may call a calculator at any step.

The task and the taught mistakes are configs/tiny_credit.py's. The warm start also writes a fifth
of the steps as calculator calls, `[36*7]=252`, whose results are always right; in RL the policy's
`[...]` calls go to the calculator (`rollout.environment=calculator`), whose reply `=252` it reads
but is never trained on. Its tool-free twin is configs/tiny_credit.py with the same warm-start
calls written out (`rollout.environment=""`, see configs/experiments_tools.py). docs/tools.md
reports the runs.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "comppo_tiny_credit", os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_credit.py")
)
tiny_credit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_credit)


def get_config():
    config = tiny_credit.get_config()
    config.output_dir = "runs/tiny_tools"
    config.warm_start.update(tool_calls=0.2)
    config.rollout.update(environment="calculator", max_turns=17, max_reply_tokens=8)
    return config
