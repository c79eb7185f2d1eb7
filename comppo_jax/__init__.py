"""comppo_jax: CompPO (computation-conditioned credit transport) in JAX.

Subpackages, from the bottom: `models` (pure-functional policy, HF interop), `credit` (gates,
advantage estimators and policy losses, by name in `credit.registry`), `critic` (TAC), `data`
(rewards, datasets, tokenizers), `rollout` (the experience pipeline: sampling, rewards, the scoring
pass), `runs` (a run's directory: lock, checkpoints, metrics), `train` (the loop, its stages and
the config's specs), `planning` (the TPU plan and cost model) and `eval` (restoring, evaluating and
reporting runs). Notebooks: examples/.
"""

from comppo_jax.credit import (
    comp_gae,
    fixed_gate,
    gae,
    grpo_advantages,
    normalized_concentration,
    retention_gate,
    shuffle_gate,
    transport_kernel,
    whiten_advantages,
)

__version__ = "0.1.0"

__all__ = [
    "comp_gae",
    "fixed_gate",
    "gae",
    "grpo_advantages",
    "normalized_concentration",
    "retention_gate",
    "shuffle_gate",
    "transport_kernel",
    "whiten_advantages",
]
