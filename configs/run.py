"""A training run's own config, read back from the config.json it wrote when it started:

    --config=configs/run.py:runs/tiny --config.eval.samples=8

The argument after the colon is the run's output_dir; `--config.<field>=` overrides apply on top.
launch/eval.py uses it, with its --checkpoint, when no --config is given (`cli.with_run_config`).
How the training launch joined its processes (mesh.distributed, the coordinator's address, the process
count and id) is not kept: a command reading the run starts as its own command line says, so a pod's run
evaluates on one machine as it is, and on every worker of a pod with --config.mesh.distributed=True.
"""

from comppo_jax.train.schema import load_run_config


def get_config(run_dir: str):
    config = load_run_config(run_dir)
    config.mesh.update(distributed=False, coordinator_address="", num_processes=0, process_id=0)
    return config
