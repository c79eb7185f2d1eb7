"""Retention gate (paper eqs. herfindahl, cnorm, kappa_attention) and its controls.

Besides the paper's Herfindahl index, three other concentration statistics of the same window
distribution a_t (the kernel's `statistics`) map to c_t in [0, 1] with eq. cnorm's endpoints
(uniform -> 0, one-hot -> 1); config `gate_statistic` picks the one the gate reads
(`statistic_concentration`). The paper calls its choice "one deployable instantiation, not a
claim of optimality": these are the alternatives to compare it with.

The gate is computed from the behaviour policy's attention, stored with the
rollout and never differentiated (paper section 3.1). The controls of paper
sections 6.3-6.4 replace it everywhere kappa appears: `fixed_gate` (a constant),
`shuffle_gate` (a global permutation of the realized values) and the
position-only schedule in `comppo_jax.credit.schedule`.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, Real, Shaped

from comppo_jax.credit import _validation

FIXED_GATE = 0.61  # The full method's empirical mean gate (paper sec. 6.3, factorial fixed cells).


@jax.jit
def normalized_concentration(herfindahl: Float[Array, "*shape"], n: Real[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Length-normalized attention concentration, paper eq. (cnorm).

        c_t = log(n_t H_t) / log(n_t)   for n_t >= 2,   c_t = 1/2 otherwise.

    Uniform attention (H = 1/n) gives 0 and a point mass (H = 1) gives 1. The
    result is clipped to [0, 1] so that float error in H (e.g. from bf16
    attention, or H = 0 on padding) cannot push the gate outside its range.

    Args:
      herfindahl: float array H_t = sum_i a_ti^2, e.g. [B, T].
      n: int or float array of window sizes n_t, same shape.

    Returns:
      float32 array c_t of the same shape.
    """
    _validation.check_floating("herfindahl", herfindahl)
    _validation.check_same_shape("herfindahl", herfindahl, n=n)
    if not (jnp.issubdtype(n.dtype, jnp.integer) or jnp.issubdtype(n.dtype, jnp.floating)):
        raise ValueError(f"n must be an int or float array, got {n.dtype} (shape {tuple(n.shape)})")
    long_window = n >= 2
    # Safe operands on short windows keep the unused branch finite.
    safe_n = jnp.where(long_window, n.astype(jnp.float32), 2.0)
    safe_h = jnp.where(long_window, herfindahl.astype(jnp.float32), 0.5)
    c = jnp.log(safe_n * safe_h) / jnp.log(safe_n)
    return jnp.where(long_window, jnp.clip(c, 0.0, 1.0), 0.5)


GATE_STATISTICS = ("herfindahl", "entropy", "sink_herfindahl", "max_weight")


def _normalized_log_statistic(log_statistic: Array, n: Array) -> Array:
    """c = (log n + log S) / log n, clipped to [0, 1], for n >= 2, and 1/2 otherwise."""
    long_window = n >= 2
    log_n = jnp.log(jnp.where(long_window, n.astype(jnp.float32), 2.0))
    c = (log_n + jnp.where(long_window, log_statistic, 0.0)) / log_n
    return jnp.where(long_window, jnp.clip(c, 0.0, 1.0), 0.5)


@jax.jit
def entropy_concentration(entropy: Float[Array, "*shape"], n: Real[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Concentration from the Shannon entropy E_t = -sum_i a_ti log a_ti of the window
    distribution (the analogue of eq. cnorm, whose H gives the order-2 Renyi entropy -log H):

        c_t = 1 - E_t / log(n_t)   for n_t >= 2,   c_t = 1/2 otherwise.

    Uniform attention (E = log n) gives 0, a point mass (E = 0) gives 1; clipped to [0, 1].

    Args:
      entropy: float array E_t in nats, e.g. [B, T] (the kernel's "entropy" statistic).
      n: int or float array of window sizes n_t, same shape.
    """
    _validation.check_floating("entropy", entropy)
    _validation.check_same_shape("entropy", entropy, n=n)
    return _normalized_log_statistic(-entropy.astype(jnp.float32), n)


@jax.jit
def max_weight_concentration(max_weight: Float[Array, "*shape"], n: Real[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Concentration from the largest window weight a_max = max_i a_ti (order-infinity Renyi
    entropy -log a_max, normalized as eq. cnorm):

        c_t = log(n_t a_max) / log(n_t)   for n_t >= 2,   c_t = 1/2 otherwise.

    Uniform attention (a_max = 1/n) gives 0, a point mass (a_max = 1) gives 1; clipped to [0, 1].

    Args:
      max_weight: float array a_max, e.g. [B, T] (the kernel's "max_weight" statistic).
      n: int or float array of window sizes n_t, same shape.
    """
    _validation.check_floating("max_weight", max_weight)
    _validation.check_same_shape("max_weight", max_weight, n=n)
    safe = jnp.where(max_weight > 0, max_weight.astype(jnp.float32), 1.0)  # 0 only on an empty window
    return _normalized_log_statistic(jnp.log(safe), n)


def statistic_concentration(statistic: str, value: Float[Array, "B T"], n: Real[Array, "B T"]) -> Float[Array, "B T"]:
    """c_t in [0, 1] for the gate statistic `statistic` (one of GATE_STATISTICS) with value [B, T]
    and its own window size n [B, T]:

    - "herfindahl": eq. cnorm, c = log(n H) / log n;
    - "sink_herfindahl": eq. cnorm on the window without its first sink tokens (n: that window's size);
    - "entropy": `entropy_concentration`, c = 1 - E / log n;
    - "max_weight": `max_weight_concentration`, c = log(n a_max) / log n.
    """
    if statistic in ("herfindahl", "sink_herfindahl"):
        return normalized_concentration(value, n)
    if statistic == "entropy":
        return entropy_concentration(value, n)
    if statistic == "max_weight":
        return max_weight_concentration(value, n)
    raise ValueError(f"gate statistic {statistic!r} is not one of {GATE_STATISTICS}")


def _check_envelope(kappa_lo: float, kappa_hi: float, tau: float) -> None:
    if not 0.0 <= kappa_lo <= kappa_hi <= 1.0:
        raise ValueError(
            f"the gate envelope needs 0 <= kappa_lo <= kappa_hi <= 1, got kappa_lo={kappa_lo}, kappa_hi={kappa_hi}"
        )
    if not tau > 0.0:
        raise ValueError(f"tau must be positive, got {tau}")


@functools.partial(jax.jit, static_argnames=("kappa_lo", "kappa_hi", "tau"))
def retention_gate(
    c: Float[Array, "*shape"], kappa_lo: float = 0.1, kappa_hi: float = 0.9, tau: float = 4.0
) -> Float[Array, "*shape"]:
    """Attention retention gate, paper eq. (kappa_attention).

        kappa_t = kappa_lo + (kappa_hi - kappa_lo) * sigmoid(tau (c_t - 1/2))

    For c in [0, 1] the attained range is the strict sub-interval
    [g(0), g(1)] of (kappa_lo, kappa_hi), see `gate_range`.

    Args:
      c: float array of normalized concentrations (`normalized_concentration`).
      kappa_lo, kappa_hi, tau: envelope (static); the paper uses (0.1, 0.9, 4).

    Returns:
      float32 array kappa_t of the shape of `c`.
    """
    _check_envelope(kappa_lo, kappa_hi, tau)
    _validation.check_floating("c", c)
    s = jax.nn.sigmoid(tau * (c.astype(jnp.float32) - 0.5))
    return kappa_lo + (kappa_hi - kappa_lo) * s


@functools.partial(jax.jit, static_argnames=("kappa_lo", "kappa_hi", "tau"))
def gate_concentration(
    kappa: Float[Array, "*shape"], kappa_lo: float = 0.1, kappa_hi: float = 0.9, tau: float = 4.0
) -> Float[Array, "*shape"]:
    """The c_t a gate kappa_t of `retention_gate` was computed from: eq. (kappa_attention) inverted,

        c_t = 1/2 + logit((kappa_t - kappa_lo) / (kappa_hi - kappa_lo)) / tau,

    whichever statistic gave c_t (config gate_statistic). Exact up to float rounding for gates in
    [g(0), g(1)]; values outside (kappa_lo, kappa_hi) are clipped into it first.
    """
    _check_envelope(kappa_lo, kappa_hi, tau)
    _validation.check_floating("kappa", kappa)
    if not kappa_hi > kappa_lo:
        raise ValueError(f"a constant envelope (kappa_lo = kappa_hi = {kappa_lo}) cannot be inverted")
    share = jnp.clip((kappa.astype(jnp.float32) - kappa_lo) / (kappa_hi - kappa_lo), 1e-7, 1.0 - 1e-7)
    return 0.5 + (jnp.log(share) - jnp.log1p(-share)) / tau


def gate_range(kappa_lo: float = 0.1, kappa_hi: float = 0.9, tau: float = 4.0) -> tuple[float, float]:
    """Returns (g(0), g(1)), the realized range of `retention_gate` (paper sec. 5).

    g(1) is the supremum kappa_bar used by the contraction and bounded-trace
    propositions. Python floats, computed in double precision.
    """
    _check_envelope(kappa_lo, kappa_hi, tau)

    def g(c: float) -> float:
        return kappa_lo + (kappa_hi - kappa_lo) / (1.0 + math.exp(-tau * (c - 0.5)))

    return g(0.0), g(1.0)


@jax.jit
def fixed_gate(mask: Shaped[Array, "B T"], value: float = FIXED_GATE) -> Float[Array, "B T"]:
    """Fixed-gate control: kappa_t = `value` on every valid token (paper sec. 6.3).

    Args:
      mask: [B, T] mask of valid response tokens.
      value: the constant gate; defaults to the paper's 0.61.

    Returns:
      [B, T] float32, `value` on valid tokens and 0 on padding (never read).
    """
    _validation.check_rank("mask", mask, 2, "[B, T]")
    _validation.check_mask("mask", mask)
    return jnp.where(mask.astype(bool), jnp.asarray(value, jnp.float32), 0.0)


@jax.jit
def shuffle_gate(kappa: Float[Array, "B T"], mask: Shaped[Array, "B T"], rng: PRNGKeyArray) -> Float[Array, "B T"]:
    """Global-shuffle control (paper sec. 6.4): one seeded permutation of the
    realized gate values over ALL valid positions of the batch.

    The marginal distribution of kappa is kept exactly while its correspondence
    to tokens, positions and rows is destroyed. Padding keeps its values.

    Args:
      kappa: [B, T] float realized gates.
      mask: [B, T] mask of valid response tokens.
      rng: a `jax.random` key.

    Returns:
      [B, T] float32 shuffled gates.
    """
    _validation.check_bt(kappa=kappa, mask=mask)
    flat = kappa.astype(jnp.float32).reshape(-1)
    valid = mask.astype(bool).reshape(-1)
    size = flat.shape[0]
    position = jnp.arange(size)
    # Destinations: valid positions in index order, then padding in index order.
    # Sources: valid positions in a uniformly random order, then the same padding
    # order, so padding maps to itself and valid positions are permuted among
    # themselves. Random priorities are a permutation, hence distinct (no ties).
    priority = jax.random.permutation(rng, size)
    destination = jnp.argsort(jnp.where(valid, position, size + position))
    source = jnp.argsort(jnp.where(valid, priority, size + position))
    return flat.at[destination].set(flat[source]).reshape(kappa.shape)
