"""The tool runs (configs/tiny_tools.py): CompPO with the calculator under both conventions for the gate
where the trace crosses a reply (credit.env_crossing, docs/conventions.md), beside its tool-free twin
(the same warm start and problems, every result written by the policy), and GRPO with the calculator
(its advantages kept off the replies as CompPO's are) beside its own tool-free twin, PPO (GAE) with
the calculator, and CompPO with the gate fixed at 1 and lambda 1 (Monte Carlo advantages on the same
critic and losses).

    python launch/experiment.py --experiment=configs/experiments_tools.py:tools --root=results/tools --jobs=2

Three seeds (0-2).
"""

from ml_collections import config_dict


def get_config(name: str = "tools"):
    if name != "tools":
        raise ValueError(f"unknown experiment {name!r}; expected tools")
    exp = config_dict.ConfigDict()
    exp.name = "tools"
    exp.kind = "baselines"
    exp.base_config = "configs/tiny_tools.py"
    exp.overrides = ("train.eval_every=5",)
    exp.seeds = (0, 1, 2)
    exp.arms = (
        ("tools_transition", ("credit.env_crossing=transition",)),
        ("tools_pass", ("credit.env_crossing=pass",)),
        ("tool_free", ("rollout.environment=",)),
        ("grpo_tools", ("method=grpo",)),
        ("grpo_tool_free", ("method=grpo", "rollout.environment=")),
        ("ppo_tools", ("method=ppo",)),
        # CompPO's machinery (TAC, losses, controller) without transport: kappa 1, lambda 1, A_t = R - V_t
        ("kappa_1_lam_1", ("gate=fixed", "fixed_gate=1.0", "train.lam=1.0")),
    )
    exp.grids = ()
    exp.screen_seed = config_dict.placeholder(int)
    exp.last = 4
    exp.target = config_dict.placeholder(float)
    exp.max_drop = 0.15
    exp.run_below = 5
    exp.held_out_problems = 0
    return exp
