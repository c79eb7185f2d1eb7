"""Attention that also yields the per-token Herfindahl concentration of the head-averaged attention.

`attention_with_concentration(q, k, v, attention_mask, window_start, *, sm_scale=None,
block_q=None, block_k=None, backend=None)` -> (out [B, L, Hq, D], herfindahl [B, L] f32,
window_size [B, L] int32); definitions in ../shared/DESIGN.md (paper eq. herfindahl).

Backends:
- "tpu": one Mosaic kernel (`pallas_kernels.tpu`), blockwise, never materializes [L, L].
- "gpu": two Triton kernels (`pallas_kernels.gpu`): attention + LSE, then the concentration.
- "interpret": the TPU kernel interpreted on CPU (exact same blocking; slow, for tests).
- "reference": materialized [L, L] probabilities, the test oracle (small L only).
`backend=None` picks "tpu" on TPU, "gpu" on GPU and "interpret" on CPU.

No gradient is defined through the kernels: they serve the scoring pass (behaviour-policy
statistics, which CompPO detaches). Training-time attention goes through `forward` without a
window, which uses differentiable fused attention.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.gpu import attention_with_concentration_gpu
from pallas_kernels.reference import attention_with_concentration_reference
from pallas_kernels.tpu import attention_with_concentration_tpu

BACKENDS = {
    "tpu": attention_with_concentration_tpu,
    "gpu": attention_with_concentration_gpu,
    "interpret": functools.partial(attention_with_concentration_tpu, interpret=True),
    "reference": attention_with_concentration_reference,
}
PLATFORM_BACKENDS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "interpret"}


def default_backend() -> str:
    """The backend `backend=None` resolves to on the default JAX platform."""
    platform = jax.default_backend()
    if platform not in PLATFORM_BACKENDS:
        raise ValueError(f"no attention_with_concentration backend for platform {platform!r}; pass backend= one of {sorted(BACKENDS)}")
    return PLATFORM_BACKENDS[platform]


def attention_with_concentration(
    q, k, v, attention_mask, window_start, *, sm_scale=None, block_q=None, block_k=None, backend=None
):
    """Causal GQA attention plus (herfindahl [B, L] f32, window_size [B, L] int32); see module doc."""
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not available; available backends: {sorted(BACKENDS)}")
    if backend == "reference":  # block sizes only apply to the blockwise backends
        return attention_with_concentration_reference(q, k, v, attention_mask, window_start, sm_scale=sm_scale)
    return BACKENDS[backend](q, k, v, attention_mask, window_start, sm_scale=sm_scale, block_q=block_q, block_k=block_k)


__all__ = ["attention_with_concentration", "default_backend", "BACKENDS", "PLATFORM_BACKENDS"]
