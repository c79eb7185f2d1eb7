"""The decision testbed's experiments (configs/tiny_decision.py): the paper's comparisons where a critic
can know the outcome.

    python launch/experiment.py --experiment=configs/experiments_decision.py:regime --root=results/decision --jobs=2

Names:
- regime: whether the testbed is in the paper's regime, run first: what each critic knows of the outcome
  after 30 critic-only steps on the warm-started policy (PPO's standard head and full-copy critic on GAE
  targets; TAC on CompPO's targets, and on the outcome itself: kappa 1, lambda 1), and PPO (GAE, lambda
  0.95) against its warm start.
- comparison: CompPO beside GRPO, PPO with the standard head, PPO with the full-copy critic, and CompPO's
  machinery without its transport (kappa 1, lambda 1: A_t = R - V_t on TAC, which can learn the outcome here).
- factorial, controls: configs/experiments.py's (the 2x2 gate-by-critic factorial; the shuffle and
  position-only controls) on the testbed.
Identical runs are shared (PPO in regime and comparison; full CompPO in comparison, factorial and
controls). Five seeds (0-4) per arm, 40 actor updates (the critic's warm-up on top), a dev evaluation
every 5. docs/results_decision.md reports the runs.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "comppo_experiments", os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments.py")
)
experiments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(experiments)

SEEDS = (0, 1, 2, 3, 4)
TESTBED = ("checkpoint.every=20",)
ACTOR_UPDATES = ("steps=40", "train.eval_every=5")  # every arm's but the critic probes', whose critics train alone:
PROBE = ("train.critic_warmup_steps=30", "steps=1", "train.eval_every=1")  # 30 steps on the warm start, one update
UNTRANSPORTED = ("gate=fixed", "fixed_gate=1.0", "train.lam=1.0")  # Comp-GAE with kappa 1, lambda 1: A_t = R - V_t
PROBES = (  # the critics whose knowledge of the outcome the regime reads (configs/experiments_credit.py's too)
    ("standard_critic", ("method=ppo",) + PROBE),
    ("full_critic", ("method=ppo", "critic.kind=full") + PROBE),
    ("tac", experiments.FULL + PROBE),
    ("tac_outcome_targets", experiments.FULL + UNTRANSPORTED + PROBE),
)


def get_config(name: str):
    if name == "regime":
        exp = experiments.experiment("regime", "regime", [*PROBES, ("ppo", ("method=ppo",))])
    elif name == "comparison":
        exp = experiments.experiment(
            "comparison",
            "baselines",
            [
                ("comppo", experiments.FULL),
                ("grpo", ("method=grpo",)),
                ("ppo", ("method=ppo",)),
                ("ppo_full_critic", ("method=ppo", "critic.kind=full")),
                ("kappa_1_lam_1", experiments.FULL + UNTRANSPORTED),
            ],
        )
    elif name in ("factorial", "controls"):
        exp = experiments.get_config(name)
        exp.held_out_problems = 16
        if name == "factorial":
            exp.target = 0.5
    else:
        raise ValueError(f"unknown experiment {name!r}; expected regime, comparison, factorial or controls")
    exp.arms = tuple(
        (arm, overrides if any(o.startswith("steps=") for o in overrides) else overrides + ACTOR_UPDATES)
        for arm, overrides in exp.arms
    )
    exp.base_config = "configs/tiny_decision.py"
    exp.overrides = TESTBED
    exp.seeds = SEEDS
    exp.last = 4
    return exp
