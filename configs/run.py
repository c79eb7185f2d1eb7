"""A training run's own config, read back from the config.json it wrote when it started:

    --config=configs/run.py:runs/tiny --config.eval.samples=8

The argument after the colon is the run's output_dir; `--config.<field>=` overrides apply on top.
launch/eval.py uses it, with its --checkpoint, when no --config is given (`cli.with_run_config`).
"""

from comppo_jax.train.outputs import load_run_config


def get_config(run_dir: str):
    return load_run_config(run_dir)
