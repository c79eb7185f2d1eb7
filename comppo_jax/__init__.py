"""comppo_jax: CompPO (computation-conditioned credit transport) in JAX.

Subpackages: `models` (pure-functional policy, HF interop), `credit` (gates and
advantage estimators), with critic, rollout, data, train and eval to follow.
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
