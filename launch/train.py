"""Train with CompPO, GRPO or PPO: `python launch/train.py --config=configs/tiny.py`.

Any config value can be overridden, e.g. `--config.method=grpo --config.steps=10`. Under
`config.output_dir` it writes metrics.jsonl, TensorBoard events (tensorboard/), Orbax checkpoints
(checkpoints/, and reference/ after a warm start), summary.json and curves.png.
`--config.resume=True` continues the run in output_dir from its newest checkpoint that verifies.
SIGTERM or Ctrl-C stops the run after the current step with a checkpoint, prints where it is
and the command that resumes it, and exits 0. Multi-host runs: docs/reliability.md.
"""

from __future__ import annotations

import json
import shlex
import sys

from ml_collections import config_flags

from comppo_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "ml_collections config file.")


def main(argv):
    del argv
    import jax

    from comppo_jax.train.loop import train

    summary = train(_CONFIG.value)
    if jax.process_index() != 0:
        return
    if "stopped_at_step" in summary:
        arguments = [arg for arg in sys.argv[1:] if not arg.startswith(("--config.resume=", "--config.resume_step="))]
        command = shlex.join(["python", sys.argv[0], *arguments, "--config.resume=True"])
        print(f"stopped: checkpoint {summary['stopped_at_step']} saved at {summary['checkpoint']}; resume with: {command}", flush=True)
        return
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    cli.run(main)
