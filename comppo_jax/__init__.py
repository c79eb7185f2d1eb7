"""comppo_jax: CompPO (computation-conditioned credit transport) in JAX.

Subpackages: `models` (pure-functional policy, HF interop), `credit` (gates and
advantage estimators), with critic, rollout, data, train and eval to follow.
"""

__version__ = "0.1.0"
