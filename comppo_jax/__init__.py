"""comppo_jax: CompPO (computation-conditioned credit transport) in JAX.

Subpackages: `models` (pure-functional policy, HF interop), `credit` (gates and
advantage estimators), `critic` (TAC), `rollout` (sampling, the scoring pass, text in and
answers out), `data` (rewards, datasets, tokenizers), `train` (the loop and what it writes) and
`eval` (restoring, evaluating and reporting runs). Notebooks: examples/.
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
