"""The paper's experiments (configs/experiments.py) at toy scale on the CPU default, configs/tiny.py.

    python launch/experiment.py --experiment=configs/experiments_tiny.py:main --root=runs/experiments_tiny

What is smaller than the paper, and why (a 2-core CPU): 3 seeds (0, 1, 2) instead of 5 (2 for
the stress grid and the variants); a 2x2 LR x KL screen instead of 3x3; 40 RL steps with a dev
evaluation every 5 (Last-4 instead of Last-20); held-out diagnostics on 16 dev prompts.
docs/results_tiny.md reports these runs.
"""

import importlib.util
import os

# The paper-scale definitions beside this file (configs/ is not a package).
_spec = importlib.util.spec_from_file_location(
    "comppo_experiments", os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments.py")
)
experiments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(experiments)

SEEDS = (0, 1, 2)
TINY = ("steps=40", "train.eval_every=5", "checkpoint.every=20")


def get_config(name: str):
    exp = experiments.get_config(name)
    exp.base_config = "configs/tiny.py"
    exp.overrides = TINY + tuple(exp.overrides)
    exp.seeds = SEEDS if name != "group" else (0,)
    exp.last = 4
    exp.held_out_problems = min(exp.held_out_problems, 16)
    if name == "main":
        exp.screen_seed = 0
        exp.grids = (
            ("comppo", ("train.actor_lr=1e-5,3e-5", "train.kl_coef=0,1e-2")),
            ("grpo", ("train.actor_lr=1e-5,3e-5", "train.kl_coef_grpo=0,1e-2")),
        )
    if name == "factorial":
        exp.target = 0.8
    if name == "group":  # 16 and 64 trajectories per update: minibatches of 16 split both
        exp.overrides += ("train.minibatch_size=16",)
    if name == "variants":  # DAPO's overlong buffer inside the tiny responses (40 tokens); dynamic sampling's refills
        exp.overrides += ("reward.overlong_buffer=10",)  # cost up to 4 sampling rounds a step: two seeds
        exp.seeds = SEEDS[:2]
    if (
        name == "lora"
    ):  # rank 8 of the tiny model's width 128 (as 64 of a few thousand), at 10x the tiny full fine-tuning rate 1e-5
        tiny = {"model.lora.rank": "8", "model.lora.alpha": "16", "train.actor_lr": "1e-4"}
        exp.arms = tuple(
            (
                arm,
                tuple(
                    f"{o.split('=')[0]}={tiny[o.split('=')[0]]}" if o.split("=")[0] in tiny else o for o in overrides
                ),
            )
            for arm, overrides in exp.arms
        )
    if name == "stress":
        grid = ("train.actor_lr=1e-5,3e-5,1e-4", "train.kl_coef=0,1e-2")
        exp.grids = (("ppo", grid), ("comppo", grid))
        exp.seeds = SEEDS[:2]
        exp.run_below = 2
        exp.arms = tuple(
            (arm, tuple(o for o in overrides if o != "steps=150")) for arm, overrides in exp.arms
        )  # TINY's 40 steps
    return exp
