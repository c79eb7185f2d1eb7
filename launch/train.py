"""Train with CompPO, GRPO or PPO: `python launch/train.py --config=configs/tiny.py`.

Any config value can be overridden, e.g. `--config.method=grpo --config.steps=10`. Under
`config.output_dir` it writes metrics.jsonl, TensorBoard events (tensorboard/), Orbax checkpoints
(checkpoints/, and reference/ after a warm start), summary.json and curves.png.
`--config.resume=True` continues the run in output_dir from its newest checkpoint that verifies,
with the config it ran with (config.json): a change to what it computes is refused unless
`--config.resume_allow_changes=<fields>` names it. One command at a time writes an output_dir.
SIGTERM or Ctrl-C stops the run after the current step with a checkpoint (within seconds during
the warm start, the first dev evaluation or the first step's compiles), prints where it is and the
command that resumes it, and exits 0. Multi-host runs and every fault: docs/reliability.md.
"""

from __future__ import annotations

import json
import shlex
import sys

from comppo_jax import cli, storage

_CONFIG = cli.define_config_file("config", "configs/tiny.py", "ml_collections config file.")


def main(argv):
    del argv
    import jax

    from comppo_jax.train.loop import train

    summary = train(_CONFIG.value)
    if jax.process_index() != 0:
        return
    arguments = [arg for arg in sys.argv[1:] if not arg.startswith(("--config.resume=", "--config.resume_step="))]
    if "stopped_at_step" in summary:
        command = shlex.join(["python", sys.argv[0], *arguments, "--config.resume=True"])
        during = f" during {summary['stopped_during']}" if "stopped_during" in summary else ""
        print(
            f"stopped{during}: checkpoint {summary['stopped_at_step']} saved at {summary['checkpoint']}; "
            f"resume with: {command}",
            flush=True,
        )
        return
    if "stopped_during" in summary:
        command = shlex.join(["python", sys.argv[0], *arguments])
        print(
            f"stopped during {summary['stopped_during']}, before the run's first checkpoint: nothing to resume; "
            f"start it again with: {command}",
            flush=True,
        )
        return
    print(json.dumps(summary, indent=2))
    outputs = storage.path(_CONFIG.value.output_dir)
    if summary.get("best_dev_accuracy") is not None:  # absent from the summaries of runs older than it
        print(
            f"outputs in {outputs}; best checkpoint: step {summary['best_checkpoint_step']}, dev accuracy "
            f"{summary['best_dev_accuracy']:.3f} (python launch/eval.py --checkpoint={outputs} --step=best)",
            flush=True,
        )
    else:
        print(
            f"outputs in {outputs}; no checkpoint with a dev accuracy: the final one is step {summary['steps']}",
            flush=True,
        )
    if "credit_reading" in summary:
        print(
            f"credit against the outcome: {summary['credit_reading']} (the run's page: python launch/report.py "
            f"--run={outputs})",
            flush=True,
        )


if __name__ == "__main__":
    cli.run(main)
