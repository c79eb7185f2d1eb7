"""The paper's experiments (sections 6-7, appendix B) as sets of launch/train.py runs.

    python launch/experiment.py --experiment=configs/experiments.py:main --root=experiments \
        --experiment.overrides='("model.path=/ckpt/Qwen3-4B", "data.path=/data/dapo_math_17k.parquet")'

Names: main | factorial | controls | stress | group, and beyond the paper: statistics (the gate's
concentration statistic) | variants (CompPO beside GRPO, DAPO, GSPO and Dr.GRPO) | lora (LoRA beside full
fine-tuning, for CompPO and GRPO) | baselines (CompPO beside the token-credit methods published since the
paper: VAPO, the 80/20 high-entropy selection, KTAE, attention-anchor credit). Semantics of the fields (arms,
grids, screens, `{mean_gate:ARM}` / `{gate_profile:ARM}` references) are in comppo_jax.eval.experiment.
configs/experiments_tiny.py scales these down to the CPU default (configs/tiny.py).

Every arm makes the same number of actor updates (`steps`): a critic's warm-up comes on top
(MATCHED_BUDGET; docs/controller.md).
"""

from ml_collections import config_dict

SEEDS = (17, 42, 123, 256, 2026)  # section 6.1; 42 is the submitted seed
LEARNING_RATES = "5e-7,1e-6,2e-6"
KL = "0,1e-3,2e-3"
FULL = ("method=comppo", "gate=attention", "critic.kind=tac")
MATCHED_BUDGET = ("train.critic_warmup_counts_toward_steps=False",)
# DAPO (Yu et al. 2025) on top of a method: the decoupled clip 0.2 / 0.28, dynamic sampling on accuracy,
# overlong shaping on every response from the first step, and no KL term (so no reference forward pass).
DAPO = (
    "train.clip_high_scale=1.4",
    "rollout.dynamic_sampling=True",
    "rollout.dynamic_sampling_filter=accuracy",
    "reward.length_penalty=overlong",
    "reward.length_penalty_on=all",
    "reward.length_penalty_schedule=constant",
    "train.kl_coef=0",
    "train.kl_coef_grpo=0",
)


# VAPO (Yue et al. 2025): PPO with its length-adaptive, decoupled GAE, its clip-higher and its value
# pretraining, which here is the critic's warm-up on the initial policy (50 steps, VAPO's).
VAPO = (
    "method=ppo",
    "credit.estimator=vapo",
    "train.clip_high_scale=1.4",
    "train.critic_warmup_steps=50",
)


def experiment(
    name: str, kind: str, arms, *, grids=(), screen_seed=None, seeds=SEEDS, target=None, held_out_problems=0
):
    exp = config_dict.ConfigDict()
    exp.name = name
    exp.kind = kind
    exp.base_config = "configs/qwen3_4b.py"
    # "key=value" for every run, on top of the arms': the user's model.path, data.path, ... (the
    # definitions below keep their own settings in the arms, so replacing this loses nothing).
    exp.overrides = ()
    exp.seeds = tuple(seeds)
    exp.arms = tuple((arm, tuple(o) + MATCHED_BUDGET) for arm, o in arms)
    exp.grids = tuple((arm, tuple(axes)) for arm, axes in grids)
    exp.screen_seed = config_dict.placeholder(int) if screen_seed is None else screen_seed
    exp.last = 20  # Last-N endpoint: mean of the final N dev evaluations (train.eval_every apart)
    exp.target = config_dict.placeholder(float) if target is None else target  # "step to X" (accuracy fraction)
    exp.max_drop = 0.15  # stability rule (section 6.5)
    exp.run_below = 5
    # Dev prompts for the final-checkpoint gate / critic diagnostics (comppo_jax.eval.held_out); 0 = none.
    exp.held_out_problems = held_out_problems
    return exp


def get_config(name: str):
    if name == "main":  # section 6.1: a common 3x3 LR x KL screen at seed 42, then five seeds
        return experiment(
            "main",
            "main",
            [("comppo", FULL), ("grpo", ("method=grpo",))],
            screen_seed=42,
            grids=[
                ("comppo", (f"train.actor_lr={LEARNING_RATES}", f"train.kl_coef={KL}")),
                ("grpo", (f"train.actor_lr={LEARNING_RATES}", f"train.kl_coef_grpo={KL}")),
            ],
        )
    if name == "factorial":  # section 6.2: transport x critic; the fixed gate is full CompPO's mean gate
        fixed = ("method=comppo", "gate=fixed", "fixed_gate={mean_gate:full}")
        return experiment(
            "factorial",
            "factorial",
            [
                ("full", FULL),
                ("gate_std", ("method=comppo", "gate=attention", "critic.kind=standard")),
                ("fixed_aligned", fixed + ("critic.kind=tac",)),
                ("fixed_std", fixed + ("critic.kind=standard",)),
            ],
            target=0.564,
            held_out_problems=64,
        )
    if name == "controls":  # section 6.3: global shuffle; position-only from the same seed's full run
        return experiment(
            "controls",
            "controls",
            [
                ("full", FULL),
                ("shuffle", ("method=comppo", "gate=shuffle", "critic.kind=tac")),
                (
                    "position",
                    ("method=comppo", "gate=position", "position_schedule={gate_profile:full}", "critic.kind=tac"),
                ),
            ],
            held_out_problems=64,
        )
    if name == "stress":  # section 6.5: 150 steps, no controller or critic warm-up, two seeds per cell
        grid = ("train.actor_lr=2e-7,5e-7,1e-6", "train.kl_coef=0,1e-3")
        bare = ("steps=150", "controller.enabled=False", "train.critic_warmup_steps=0")
        return experiment(
            "stress",
            "stress",
            [("ppo", ("method=ppo",) + bare), ("comppo", FULL + bare)],
            seeds=(17, 42),
            grids=[("ppo", grid), ("comppo", grid)],
        )
    if name == "group":  # section 6.6: a single 8x8 GRPO run beside the 4x4 baseline and the CompPO reference
        four, eight = (
            ("rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"),
            ("rollout.prompts_per_step=8", "rollout.samples_per_prompt=8"),
        )
        return experiment(
            "group",
            "group",
            [
                ("grpo_4x4", ("method=grpo", "train.kl_coef_grpo=1e-3") + four),
                ("grpo_8x8", ("method=grpo", "train.kl_coef_grpo=1e-3") + eight),
                ("comppo", FULL + four),
            ],
            seeds=(42,),
        )
    if (
        name == "statistics"
    ):  # the gate's concentration statistic (comppo_jax.credit.GATE_STATISTICS), beside the controls
        reads = lambda statistic: FULL + (f"gate_statistic={statistic}",)
        return experiment(
            "statistics",
            "statistics",
            [
                ("herfindahl", FULL),
                ("entropy", reads("entropy")),
                ("sink_herfindahl", reads("sink_herfindahl")),
                ("max_weight", reads("max_weight")),
                ("shuffle", ("method=comppo", "gate=shuffle", "critic.kind=tac")),
                ("fixed", ("method=comppo", "gate=fixed", "fixed_gate={mean_gate:herfindahl}", "critic.kind=tac")),
            ],
        )
    if (
        name == "variants"
    ):  # CompPO with and without DAPO's tricks, beside GRPO and its 2025 variants (each from its one switch)
        return experiment(
            "variants",
            "variants",
            [
                ("comppo", FULL),
                ("comppo_dapo", FULL + DAPO),
                ("grpo", ("method=grpo",)),
                ("dapo", ("method=grpo",) + DAPO),
                ("gspo", ("method=grpo", "train.policy_loss=gspo")),
                ("dr_grpo", ("method=grpo", "train.group_std_normalization=False")),
            ],
        )
    if name == "baselines":  # token credit without a learned gate, each from its one switch (docs/variants.md)
        entropy_top = ("train.token_selection=entropy_top",)
        return experiment(
            "baselines",
            "baselines",
            [
                ("comppo", FULL),
                ("grpo", ("method=grpo",)),
                ("ppo", ("method=ppo",)),
                ("vapo", VAPO),
                ("grpo_entropy_top", ("method=grpo",) + entropy_top),
                ("dapo", ("method=grpo",) + DAPO),
                ("dapo_entropy_top", ("method=grpo",) + DAPO + entropy_top),
                ("comppo_entropy_top", FULL + entropy_top),
                ("ktae", ("method=grpo", "credit.estimator=ktae")),
                ("attention_anchor", ("method=grpo", "credit.estimator=attention_anchor")),
            ],
        )
    if name == "lora":  # LoRA adapters on the frozen base (which is also the reference) beside full fine-tuning,
        # at 10x the full fine-tuning learning rate (the usual LoRA rule; the main screen's centre is 1e-6)
        lora = ("model.lora.rank=64", "model.lora.alpha=128", "train.actor_lr=1e-5")
        return experiment(
            "lora",
            "lora",
            [
                ("comppo", FULL),
                ("comppo_lora", FULL + lora),
                ("grpo", ("method=grpo",)),
                ("grpo_lora", ("method=grpo",) + lora),
            ],
        )
    raise ValueError(
        f"unknown experiment {name!r}; expected main, factorial, controls, stress, group, statistics, variants, "
        "lora or baselines"
    )
