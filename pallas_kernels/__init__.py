"""Attention that also yields the per-token Herfindahl concentration of the head-averaged attention.

`attention_with_concentration(q, k, v, attention_mask, window_start, *, sm_scale=None,
block_q=None, block_k=None, backend=None, segment_ids=None)` -> (out [B, L, Hq, D], herfindahl
[B, L] f32, window_size [B, L] int32); definitions in docs/conventions.md (paper eq. herfindahl).

Packed rows (several sequences per row, the learner's sequence packing): `segment_ids` [B, L]
gives each token its sequence, a query sees only its own segment's keys, and `window_start` is
per query [B, L] (at or after the query's segment start), so every token's H_t is its own
sequence's. Segments are contiguous runs; the blockwise kernels skip the key blocks before a
query block's earliest segment start.

Backends:
- "tpu": one Mosaic kernel (`pallas_kernels.tpu`), blockwise, never materializes [L, L].
- "gpu": two Triton kernels (`pallas_kernels.gpu`): attention + LSE, then the concentration.
- "interpret": the TPU kernel interpreted on CPU (exact same blocking; slow, for tests).
- "reference": materialized [L, L] probabilities, the test oracle (small L only).
`backend=None` picks "tpu" on TPU, "gpu" on GPU and "interpret" on CPU.

Optional statistics of the same window distribution (entropy, sink-masked Herfindahl, max
weight; `statistics=`) come from the same pass on every backend.

Gradients: herfindahl, window_size and the statistics are detached (CompPO never differentiates
kappa), so they carry none. The kernels themselves are forward-only (the scoring pass); the
attention output gets its gradient from `causal_attention` (XLA) recomputed in the backward
pass, so `forward(..., window_start=...)` stays differentiable in its logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import (
    DEFAULT_SINK_TOKENS,
    STATISTICS,
    ConcentrationOutputs,
    causal_attention,
    row_segments,
    window_sizes,
)
from pallas_kernels.gpu import attention_with_concentration_gpu
from pallas_kernels.reference import attention_with_concentration_reference
from pallas_kernels.tpu import attention_with_concentration_tpu

BACKENDS: dict[str, Callable[..., ConcentrationOutputs]] = {
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
        raise ValueError(
            f"no attention_with_concentration backend for platform {platform!r}; "
            f"pass backend= one of {sorted(BACKENDS)}"
        )
    return PLATFORM_BACKENDS[platform]


def attention_with_concentration(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    window_start: Int[Array, " B"],
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    statistics: Sequence[str] = (),
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    segment_ids: Int[Array, "B L"] | None = None,
) -> ConcentrationOutputs:
    """Causal GQA attention plus (herfindahl [B, L] f32, window_size [B, L] int32); see module doc.

    window_start: [B] (one per row) or [B, L] (per query); segment_ids: [B, L] or None (one
    sequence per row).

    `return_lse=True` appends the per-head log-sum-exp of the scaled logits, [B, Hq, L] f32
    (detached), which lets a later pass recompute exact attention probabilities blockwise.
    `statistics` (a subset of `STATISTICS`) appends {statistic: [B, L] f32}, computed in the same
    pass over the same window distribution a_i as H (0 where the window is empty):
      "entropy"          -sum_i a_i log a_i (nats);
      "sink_herfindahl"  H of a renormalized over the window without its first `sink_tokens` key
                         positions (its window size: `window_sizes(mask, window_start + sink_tokens)`);
      "max_weight"       max_i a_i.
    """
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not available; available backends: {sorted(BACKENDS)}")
    if backend == "reference":  # block sizes only apply to the blockwise backends
        return attention_with_concentration_reference(
            q,
            k,
            v,
            attention_mask,
            window_start,
            sm_scale=sm_scale,
            return_lse=return_lse,
            statistics=statistics,
            sink_tokens=sink_tokens,
            segment_ids=segment_ids,
        )
    kernel = functools.partial(
        BACKENDS[backend],
        sm_scale=sm_scale,
        block_q=block_q,
        block_k=block_k,
        return_lse=return_lse,
        statistics=statistics,
        sink_tokens=sink_tokens,
    )
    segments = row_segments(attention_mask, segment_ids)
    return _with_xla_gradient(kernel, sm_scale)(q, k, v, attention_mask, window_start, segments)


def _with_xla_gradient(
    kernel: Callable[..., ConcentrationOutputs], sm_scale: float | None
) -> Callable[[Array, Array, Array, Array, Array, Array], ConcentrationOutputs]:
    """`kernel` whose output's VJP is that of `causal_attention`; the statistics get no gradient."""

    @jax.custom_vjp
    def attention(
        q: Array, k: Array, v: Array, attention_mask: Array, window_start: Array, segments: Array
    ) -> ConcentrationOutputs:
        return kernel(q, k, v, attention_mask, window_start, segment_ids=segments)

    def forward_pass(
        q: Array, k: Array, v: Array, attention_mask: Array, window_start: Array, segments: Array
    ) -> tuple[ConcentrationOutputs, tuple[Array, ...]]:
        outputs = kernel(q, k, v, attention_mask, window_start, segment_ids=segments)
        return outputs, (q, k, v, attention_mask, segments)

    def backward_pass(residuals: tuple[Array, ...], cotangents: tuple[Array, ...]) -> tuple[Array | None, ...]:
        q, k, v, attention_mask, segments = residuals
        _, pullback = jax.vjp(
            lambda q, k, v: causal_attention(q, k, v, attention_mask, sm_scale=sm_scale, segment_ids=segments), q, k, v
        )
        return (*pullback(cotangents[0]), None, None, None)  # mask, window_start, segments: not differentiable

    attention.defvjp(forward_pass, backward_pass)
    return attention


__all__ = [
    "attention_with_concentration",
    "default_backend",
    "window_sizes",
    "BACKENDS",
    "DEFAULT_SINK_TOKENS",
    "PLATFORM_BACKENDS",
    "STATISTICS",
]
