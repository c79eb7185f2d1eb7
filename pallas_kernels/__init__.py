"""Attention that also yields the per-token Herfindahl concentration of the head-averaged attention.

`attention_with_concentration(q, k, v, attention_mask, window_start, *, sm_scale=None,
block_q=None, block_k=None, backend=None)` returns (out, herfindahl, window_size); see
../shared/DESIGN.md. Backends available now: "reference" (materialized, the oracle for small L).
The blockwise Pallas backends ("tpu", "gpu", "interpret") are the kernel issue's work.
"""

from __future__ import annotations

from pallas_kernels.reference import attention_with_concentration_reference

BACKENDS = {"reference": attention_with_concentration_reference}


def attention_with_concentration(
    q, k, v, attention_mask, window_start, *, sm_scale=None, block_q=None, block_k=None, backend=None
):
    """Causal GQA attention plus (herfindahl [B, L] f32, window_size [B, L] int32); see module doc."""
    backend = backend or "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not available; available backends: {sorted(BACKENDS)}")
    del block_q, block_k  # block sizes only apply to the blockwise backends
    return BACKENDS[backend](q, k, v, attention_mask, window_start, sm_scale=sm_scale)


__all__ = ["attention_with_concentration", "attention_with_concentration_reference", "BACKENDS"]
