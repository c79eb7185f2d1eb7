"""A training run's own config, read back from the config.json it wrote when it started:

    python launch/eval.py --config=configs/run.py:runs/tiny --checkpoint=runs/tiny --config.eval.samples=8

The argument after the colon is the run's output_dir. launch/eval.py reads the same file when
--config is not given; this file is for when fields are overridden on top of it.
"""

from comppo_jax.train.outputs import load_run_config


def get_config(run_dir: str):
    return load_run_config(run_dir)
