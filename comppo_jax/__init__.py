"""comppo_jax: CompPO (computation-conditioned credit transport) in JAX.

Subpackages, from the bottom: `models` (pure-functional policy, HF interop), `credit` (gates,
advantage estimators and policy losses, by name in `credit.registry`), `critic` (TAC), `data`
(rewards, datasets, tokenizers), `rollout` (the experience pipeline: sampling, rewards, the scoring
pass), `runs` (a run's directory: lock, checkpoints, metrics), `costs` (the per-chip cost model),
`train` (the loop, its stages and the config's specs), `planning` (the TPU plan) and `eval`
(restoring, evaluating and reporting runs). Notebooks: examples/.

Importing it on a machine with no TPU or GPU attached selects JAX's CPU platform unless
JAX_PLATFORMS says otherwise (`comppo_jax.accelerators`): libtpu, installed by the `tpu` extra, is then
never started as a backend and prints nothing.
"""

from comppo_jax.accelerators import select_cpu_without_accelerator

select_cpu_without_accelerator()

from comppo_jax.credit import (  # noqa: E402  (the platform is chosen before anything can start JAX)
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
