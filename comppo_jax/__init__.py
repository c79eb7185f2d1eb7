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

__version__ = "0.1.0"

# The public estimators, imported on first use: a process that imports only a part of the package (a
# reward or sandbox worker) does not pay for JAX and the credit modules.
_CREDIT = (
    "comp_gae",
    "fixed_gate",
    "gae",
    "grpo_advantages",
    "normalized_concentration",
    "retention_gate",
    "shuffle_gate",
    "transport_kernel",
    "whiten_advantages",
)
__all__ = list(_CREDIT)


def __getattr__(name: str):
    if name in _CREDIT:
        from comppo_jax import credit

        return getattr(credit, name)
    raise AttributeError(f"module 'comppo_jax' has no attribute {name!r}")
