"""The credit testbed's experiments (configs/tiny_credit.py): where token credit decides the outcome.

    python launch/experiment.py --experiment=configs/experiments_credit.py:discrimination --root=results/credit --jobs=2

Names:
- discrimination: PPO (GAE: token credit from a critic) beside GRPO (one advantage broadcast over the
  response). The testbed is only evidence if these two separate beyond seed noise; run it first.
- baselines, factorial, controls: configs/experiments.py's, on the testbed; lora: its CompPO arms.
- transport: full CompPO beside its machinery without transport (the gate fixed at 1, lambda 1:
  A_t = R - V_t on the same TAC critic, losses and controller), which tells the gate's and trace's
  part in CompPO's outcome here from the rest of it.
- outcome: PPO at lambda 0.95 and 1, CompPO and GRPO at seed 0 alone, for their credit against the
  outcome (the credit/* metrics, logged by every run since; the other experiments' records predate them).
- probes: the decision testbed's critic probes (configs/experiments_decision.py, regime) at seed 0: what each
  critic learns of the outcome in 30 critic-only steps on the warm-started policy.
Five seeds (0-4) per arm but outcome's and probes'; 40 actor updates; a dev evaluation every 5. docs/results_credit.md
reports the runs.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "comppo_experiments_decision",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments_decision.py"),
)
decision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decision)
experiments = decision.experiments  # configs/experiments.py, as the decision testbed loaded it

SEEDS = (0, 1, 2, 3, 4)
TESTBED = ("steps=40", "train.eval_every=5", "checkpoint.every=20")
# The testbed's sizes for what configs/experiments.py sets at paper scale: VAPO's value pretraining (50 steps
# there), LoRA at rank 8 of width 128 and 10x the full fine-tuning learning rate (as configs/experiments_tiny.py).
SCALED = {"train.critic_warmup_steps": "6", "model.lora.rank": "8", "model.lora.alpha": "16", "train.actor_lr": "1e-4"}


def scaled(overrides):
    return tuple(f"{o.split('=')[0]}={SCALED[o.split('=')[0]]}" if o.split("=")[0] in SCALED else o for o in overrides)


def get_config(name: str):
    if name == "discrimination":
        exp = experiments.experiment(
            "discrimination", "baselines", [("ppo", ("method=ppo",)), ("grpo", ("method=grpo",))]
        )
    elif name == "transport":
        untransported = ("method=comppo", "gate=fixed", "fixed_gate=1.0", "critic.kind=tac", "train.lam=1.0")
        exp = experiments.experiment(
            "transport", "baselines", [("comppo", experiments.FULL), ("kappa_1_lam_1", untransported)]
        )
    elif name == "outcome":
        exp = experiments.experiment(
            "outcome",
            "baselines",
            [
                ("ppo", ("method=ppo",)),
                ("ppo_lam_1", ("method=ppo", "train.lam=1.0")),
                ("comppo", experiments.FULL),
                ("grpo", ("method=grpo",)),
            ],
        )
    elif name == "probes":
        exp = experiments.experiment("probes", "regime", list(decision.PROBES))
    else:
        exp = experiments.get_config(name)
        exp.arms = tuple((arm, scaled(overrides)) for arm, overrides in exp.arms)
    exp.base_config = "configs/tiny_credit.py"
    exp.overrides = TESTBED + tuple(exp.overrides)
    exp.seeds = (0,) if name in ("outcome", "probes") else SEEDS
    exp.last = 4
    exp.held_out_problems = min(exp.held_out_problems, 16)
    if name == "factorial":
        exp.target = 0.5
    if name == "baselines":  # DAPO's overlong buffer inside the testbed's responses (176 tokens), on its arms
        # only, so the arms without it are the same runs as discrimination's and factorial's (same config)
        dapo = lambda overrides: "reward.length_penalty=overlong" in overrides
        exp.arms = tuple((arm, o + ("reward.overlong_buffer=16",) if dapo(o) else o) for arm, o in exp.arms)
    if name == "lora":  # CompPO's intrinsic signal under LoRA; GRPO reads none
        exp.arms = tuple((arm, overrides) for arm, overrides in exp.arms if arm.startswith("comppo"))
    return exp
