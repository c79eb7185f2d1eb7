"""Credit estimators (paper sections 3-4).

- `gate`: normalized attention concentration (and the alternative statistics), the
  retention gate and the fixed and shuffled gate controls.
- `schedule`: the position-only gate control (fit, apply, save, load).
- `advantages`: Comp-GAE, GAE, the explicit transport kernel, GRPO and
  Dr.GRPO advantages, DAPO's group filter, whitening and clipping.
- `key_tokens`: KTAE's key-token values from a group's rollouts (Fisher's exact
  test, information gain, a BM25 direction) added to GRPO's advantage.
- `losses`: PPO and GSPO clipped surrogates, loss aggregation modes, reference
  KL, clipped value loss, entropy, AReaL's decoupled objective, the sampler -> scorer
  mismatch and its rollout correction weights.
"""

from comppo_jax.credit.advantages import (
    clip_advantages,
    comp_gae,
    gae,
    grpo_advantages,
    informative_groups,
    transport_kernel,
    vapo_lambda,
    whiten_advantages,
)
from comppo_jax.credit.gate import (
    FIXED_GATE,
    GATE_STATISTICS,
    entropy_concentration,
    fixed_gate,
    gate_concentration,
    gate_range,
    max_weight_concentration,
    normalized_concentration,
    retention_gate,
    shuffle_gate,
    statistic_concentration,
)
from comppo_jax.credit.key_tokens import (
    TokenCounts,
    bm25_term_frequency,
    direction_score,
    fisher_exact_pvalue,
    fisher_score,
    group_token_counts,
    information_gain,
    key_token_value,
    ktae_advantages,
)
from comppo_jax.credit.losses import (
    IMPORTANCE_WEIGHT_RULES,
    LOSS_AGGREGATIONS,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTIONS,
    aggregate_loss,
    decoupled_ppo_inputs,
    entropy_from_logits,
    gspo_loss,
    importance_weight_stats,
    kl_penalty,
    masked_mean,
    ppo_clip_loss,
    rollout_correction,
    rollout_correction_weights,
    sampler_mismatch,
    value_loss,
)
from comppo_jax.credit.schedule import (
    PositionSchedule,
    apply_position_schedule,
    fit_position_schedule,
    load_position_schedule,
    position_bin_totals,
    position_bins,
    save_position_schedule,
    schedule_from_totals,
)

__all__ = [
    "FIXED_GATE",
    "GATE_STATISTICS",
    "IMPORTANCE_WEIGHT_RULES",
    "LOSS_AGGREGATIONS",
    "PositionSchedule",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTIONS",
    "aggregate_loss",
    "decoupled_ppo_inputs",
    "apply_position_schedule",
    "clip_advantages",
    "comp_gae",
    "entropy_concentration",
    "entropy_from_logits",
    "fit_position_schedule",
    "fixed_gate",
    "gate_concentration",
    "gae",
    "gate_range",
    "grpo_advantages",
    "gspo_loss",
    "importance_weight_stats",
    "informative_groups",
    "TokenCounts",
    "bm25_term_frequency",
    "direction_score",
    "fisher_exact_pvalue",
    "fisher_score",
    "group_token_counts",
    "information_gain",
    "key_token_value",
    "ktae_advantages",
    "kl_penalty",
    "load_position_schedule",
    "masked_mean",
    "max_weight_concentration",
    "normalized_concentration",
    "position_bin_totals",
    "position_bins",
    "ppo_clip_loss",
    "retention_gate",
    "rollout_correction",
    "rollout_correction_weights",
    "sampler_mismatch",
    "save_position_schedule",
    "schedule_from_totals",
    "shuffle_gate",
    "statistic_concentration",
    "transport_kernel",
    "value_loss",
    "vapo_lambda",
    "whiten_advantages",
]
