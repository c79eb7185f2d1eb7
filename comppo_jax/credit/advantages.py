"""Advantage estimators: Comp-GAE, GAE, the transport kernel, GRPO, whitening.

Also DAPO's group filter (`informative_groups`), which runs on host rewards.

Per-token arrays are [B, T], aligned with the response tokens y_1..y_T, with
`mask[b, t] = 1` on valid tokens (docs/conventions.md, "Index conventions"). All
arithmetic is float32 whatever the input precision; outputs are float32.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Shaped

from comppo_jax.credit import _validation

_METHODS = ("scan", "associative")


def _shift_left(x: Float[Array, "B T"]) -> Float[Array, "B T"]:
    """x[:, t + 1] at column t, with zero past the end (V_{T+1} = m_{T+1} = 0)."""
    return jnp.pad(x[:, 1:], ((0, 0), (0, 1)))


def _reverse_scan(b: Float[Array, "B T"], c: Float[Array, "B T"]) -> Float[Array, "B T"]:
    """A_t = b_t + c_t A_{t+1}, A_{T+1} = 0, by one reverse loop over time.

    A_t overwrites b_t in b's time-major copy once b_t is read, which spares
    the zero-filled output buffer a `lax.scan` would allocate.
    """
    b_by_time, c_by_time = b.T, c.T
    length = b_by_time.shape[0]
    if length == 0:
        return b

    def step(i: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        a_next, out = carry
        t = length - 1 - i
        b_t = jax.lax.dynamic_index_in_dim(out, t, keepdims=False)
        c_t = jax.lax.dynamic_index_in_dim(c_by_time, t, keepdims=False)
        a_t = b_t + c_t * a_next
        return a_t, jax.lax.dynamic_update_index_in_dim(out, a_t, t, 0)

    _, a = jax.lax.fori_loop(0, length, step, (jnp.zeros(b.shape[0], b.dtype), b_by_time))
    return a.T


# Rows per while loop on CPU. XLA:CPU's [B, T] <-> [T, B] transposes and its loop
# slow down 2-4x once more rows than this share a power-of-two row stride
# (cache-set conflicts; docs/benchmarks.md, "Credit estimators").
_CPU_GROUP_ROWS = 8
# Up to this many groups each gets its own loop (their row slices fuse into the
# producers); beyond it one `lax.map` over the groups keeps the compile time flat.
_CPU_SEPARATE_LOOPS = 8


def _reverse_scan_cpu(b: Float[Array, "B T"], c: Float[Array, "B T"]) -> Float[Array, "B T"]:
    """`_reverse_scan` for XLA:CPU, in groups of `_CPU_GROUP_ROWS` rows."""
    rows, length = b.shape
    group = _CPU_GROUP_ROWS
    if rows <= group:
        return _reverse_scan(b, c)
    if rows <= group * _CPU_SEPARATE_LOOPS:
        pieces = [_reverse_scan(b[lo : lo + group], c[lo : lo + group]) for lo in range(0, rows, group)]
    else:
        grouped = rows - rows % group
        shape = (grouped // group, group, length)
        a = jax.lax.map(lambda bc: _reverse_scan(*bc), (b[:grouped].reshape(shape), c[:grouped].reshape(shape)))
        pieces = [a.reshape(grouped, length)]
        if grouped < rows:
            pieces.append(_reverse_scan(b[grouped:], c[grouped:]))
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def _affine_scan_sequential(b: Float[Array, "B T"], c: Float[Array, "B T"]) -> Float[Array, "B T"]:
    """A_t = b_t + c_t A_{t+1}, A_{T+1} = 0, by a reverse loop over time: one
    loop over all rows on accelerators, `_reverse_scan_cpu` on CPU."""
    return jax.lax.platform_dependent(b, c, cpu=_reverse_scan_cpu, default=_reverse_scan)


def _compose_affine(later: tuple[Array, Array], earlier: tuple[Array, Array]) -> tuple[Array, Array]:
    """Composes x -> b_e + c_e x after x -> b_l + c_l x (the map of the earlier step
    applied to the result of the later ones)."""
    b_later, c_later = later
    b_earlier, c_earlier = earlier
    return b_earlier + c_earlier * b_later, c_earlier * c_later


def _affine_scan_associative(b: Float[Array, "B T"], c: Float[Array, "B T"]) -> Float[Array, "B T"]:
    """A_t = b_t + c_t A_{t+1}, A_{T+1} = 0, in O(log T) depth.

    Each step is the affine map x -> b_t + c_t x; A_t is the composition of the
    maps t..T applied to 0, i.e. the `b` of a right-to-left scan of the maps.
    """
    a, _ = jax.lax.associative_scan(_compose_affine, (b, c), reverse=True, axis=1)
    return a


@_validation.unit_interval_arguments("lam")
@functools.partial(jax.jit, static_argnames=("method",))
def comp_gae(
    rewards: Float[Array, "B T"],
    values: Float[Array, "B T"],
    kappa: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    lam: float | Float[Array, ""] = 0.95,
    method: str = "scan",
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Computation-conditioned GAE, paper eqs. (comp_td) and (comp_gae).

    With V_{T+1} = A_{T+1} = 0 and m the mask:

        delta_t = r_t + kappa_t V_{t+1} m_{t+1} - V_t m_t
        A_t     = delta_t + lam kappa_t A_{t+1} m_{t+1}
        G_t     = A_t + V_t m_t

    and A_t = G_t = 0 where m_t = 0. Padding never reaches a valid position,
    whatever its content. Equivalently A = K delta with the causal transport
    kernel of eq. (cct_kernel), see `transport_kernel`.

    Args:
      rewards: [B, T] float, reward evidence r_t (terminal in the paper).
      values: [B, T] float, critic values V_t.
      kappa: [B, T] float, detached retention gate kappa_t (`retention_gate`).
      mask: [B, T] bool/int/float, 1 on valid response tokens.
      lam: trace parameter lambda in [0, 1], a Python or traced float (a Python
        number outside [0, 1] raises ValueError before anything is traced).
      method: "scan" (a sequential loop over T; on CPU one loop per group of
        8 rows, which XLA:CPU runs faster than one loop over all rows) or
        "associative" (`lax.associative_scan` of the affine recurrence, O(log T)
        depth, O(T log T) work). On CPU "scan" is the faster one
        (docs/benchmarks.md); the associative form exists for accelerators,
        where a T-step loop is latency-bound. Both agree to float32 rounding.

    Returns:
      (advantages, returns), both [B, T] float32; returns are the critic
      targets G_t.
    """
    _validation.check_bt(rewards=rewards, values=values, kappa=kappa, mask=mask)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    # Padding is removed with `where`, not by multiplying with the mask, so that
    # non-finite garbage in padded slots cannot reach a valid position.
    valid = mask.astype(bool)
    v = jnp.where(valid, values.astype(jnp.float32), 0.0)
    k = jnp.where(valid, kappa.astype(jnp.float32), 0.0)
    # delta_t = r_t + kappa_t V_{t+1} m_{t+1} - V_t m_t (v is masked), 0 on padding.
    delta = jnp.where(valid, rewards.astype(jnp.float32) + k * _shift_left(v) - v, 0.0)
    # Retention of A_{t+1}. The paper's factor m_{t+1} is implicit: delta and k
    # are zero on padding, so A_{t+1} = 0 there already.
    decay = jnp.asarray(lam, jnp.float32) * k
    if method == "scan":
        advantages = _affine_scan_sequential(delta, decay)
    else:
        advantages = _affine_scan_associative(delta, decay)
    # G_t = A_t + V_t m_t. Reading `values` again rather than reusing `v` lets XLA
    # fuse the masking into both consumers instead of materializing `v`.
    returns = jnp.where(valid, advantages + values.astype(jnp.float32), 0.0)
    return advantages, returns


@_validation.unit_interval_arguments("gamma", "lam")
@functools.partial(jax.jit, static_argnames=("method",))
def gae(
    rewards: Float[Array, "B T"],
    values: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    gamma: float | Float[Array, ""] = 1.0,
    lam: float | Float[Array, ""] | Float[Array, " B"] | Float[Array, "B 1"] = 0.95,
    method: str = "scan",
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Standard masked GAE, paper eq. (stdgae): `comp_gae` with kappa_t = gamma.

    Args:
      rewards, values, mask: as in `comp_gae`, [B, T].
      gamma: discount, a Python or traced float.
      lam: trace parameter lambda: one float, or one per row ([B] or [B, 1], e.g. VAPO's
        `vapo_lambda`), row b's A_t = delta_t + lam_b gamma A_{t+1}. An array's entries must lie
        in [0, 1]; only a Python number is range-checked.
      method: as in `comp_gae`.

    Returns:
      (advantages, returns), both [B, T] float32.
    """
    _validation.check_rank("rewards", rewards, 2, "[B, T]")
    kappa = jnp.full(rewards.shape, gamma, jnp.float32)
    lam = jnp.asarray(lam, jnp.float32)
    if lam.ndim:
        batch = rewards.shape[0]
        if lam.shape not in ((batch,), (batch, 1)):
            raise ValueError(f"lam must be a float, [B] or [B, 1] with B = {batch}, got shape {tuple(lam.shape)}")
        # A [B, 1] column: comp_gae's retention lam * kappa_t then broadcasts it over each row's T.
        lam = lam.reshape(batch, 1)
    return comp_gae(rewards, values, kappa, mask, lam, method=method)


def vapo_lambda(lengths: Shaped[ArrayLike, " B"], alpha: float | Float[Array, ""] = 0.05) -> Float[Array, " B"]:
    """The policy's length-adaptive GAE lambda of VAPO (Yue et al. 2025, "VAPO: Efficient and
    Reliable Reinforcement Learning for Advanced Reasoning Tasks", arXiv 2504.05118, section
    "Managing Heterogeneous Sequence Lengths during Training", Length-Adaptive GAE).

    A response of l tokens gets the lambda whose GAE weights lambda^k sum to alpha l, so that the
    number of TD errors an advantage effectively averages grows with the response:

        sum_{k>=0} lambda^k = 1 / (1 - lambda) = alpha l   =>   lambda_policy = 1 - 1 / (alpha l)

    For alpha l < 1 (VAPO's alpha = 0.05: responses under 20 tokens) no lambda in [0, 1] solves
    it (the weights' sum is at least 1, reached at lambda = 0) and the formula turns negative; the
    paper does not say what then. Clipped to [0, 1], lambda is 0 there: the advantage is the one-step
    TD error (AReaL's `vapo_length_adaptive_gae` clamps at 0 too). An empty row (l = 0) gets 0.

    Args:
      lengths: [B] response lengths l (valid tokens per row), int or float.
      alpha: the bias-variance knob, > 0 (a Python number <= 0 raises ValueError).

    Returns:
      [B] float32 lambda_policy in [0, 1], for `gae`'s per-row `lam`.
    """
    if isinstance(alpha, (int, float)) and not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = jnp.asarray(lengths)
    _validation.check_rank("lengths", lengths, 1, "[B]")
    # 1 / (alpha * 0) = inf: an empty row's -inf clips to 0 like any alpha l < 1.
    return jnp.clip(1.0 - 1.0 / (alpha * lengths.astype(jnp.float32)), 0.0, 1.0)


@_validation.unit_interval_arguments("lam")
@jax.jit
def transport_kernel(
    kappa: Float[Array, "B T"], lam: float | Float[Array, ""], mask: Shaped[Array, "B T"] | None = None
) -> Float[Array, "B T T"]:
    """Explicit causal transport kernel K of paper eq. (cct_kernel), for small T.

        K[b, t, u] = 1[u >= t] m_t lam^{u-t} prod_{j=t}^{u-1} kappa_j m_{j+1}

    so that `comp_gae` advantages equal `K @ delta` (eq. cct_matrix) and
    K[b, t, u] = dA_t / d delta_u (eq. sensitivity). Built from cumulative
    products, independently of the recurrence; memory is O(B T^2).

    Args:
      kappa: [B, T] float retention gate.
      lam: trace parameter lambda.
      mask: [B, T] mask, or None for all-valid rows.

    Returns:
      [B, T, T] float32 kernel; rows and columns of padded positions are zero.
    """
    if mask is None:
        mask = jnp.ones(kappa.shape, bool)
    _validation.check_bt(kappa=kappa, mask=mask)
    valid = mask.astype(bool)
    m = valid.astype(jnp.float32)
    k = jnp.where(valid, kappa.astype(jnp.float32), 0.0)
    decay = jnp.asarray(lam, jnp.float32) * k * _shift_left(m)  # [B, T], index j
    t_idx = jnp.arange(kappa.shape[1])
    upper = t_idx[None, :] >= t_idx[:, None]  # [t, j]: j >= t
    # factors[b, t, j] = decay_j for j >= t else 1; its cumprod over j, shifted by
    # one, is prod_{j=t}^{u-1} decay_j at [b, t, u].
    factors = jnp.where(upper[None], decay[:, None, :], 1.0)
    prods = jnp.cumprod(factors, axis=-1)
    exclusive = jnp.concatenate([jnp.ones_like(prods[..., :1]), prods[..., :-1]], axis=-1)
    return jnp.where(upper[None], exclusive, 0.0) * m[:, :, None]


def _check_group_size(group_size: int, rewards: Array | np.ndarray) -> None:
    """Raises ValueError unless `group_size` is a positive int dividing len(rewards)."""
    batch = rewards.shape[0]
    if not isinstance(group_size, (int, np.integer)) or group_size < 1 or batch % group_size:
        raise ValueError(
            f"group_size must be a positive int dividing the batch size B = {batch} "
            f"(rewards shape {tuple(rewards.shape)}), got {group_size!r}"
        )


@functools.partial(jax.jit, static_argnames=("group_size", "normalize_std"))
def grpo_advantages(
    rewards: Float[Array, " B"],
    group_size: int,
    mask: Shaped[Array, "B T"],
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> Float[Array, "B T"]:
    """Group-relative advantages, paper eq. (group_broadcast).

    Rows are grouped by `group_size` consecutive responses to the same prompt;
    b_i = (R_i - mean_j R_j) / (std_j R_j + eps) with the unbiased std (ddof=1,
    as verl and TRL). A group whose rewards are all equal (including a group of
    one) gets 0. b_i is broadcast to the row's valid tokens.

    Args:
      rewards: [B] float sequence-level rewards R_i.
      group_size: responses per prompt (static); must divide B.
      mask: [B, T] mask of valid response tokens.
      eps: added to the std.
      normalize_std: False gives Dr.GRPO's b_i = R_i - mean_j R_j, without the
        std division that up-weights groups of low reward variance (static;
        verl's `norm_adv_by_std_in_grpo`, tunix's "drgrpo" estimator).

    Returns:
      [B, T] float32 advantages, zero on padding.
    """
    _validation.check_rank("rewards", rewards, 1, "[B]")
    _validation.check_floating("rewards", rewards)
    _validation.check_rank("mask", mask, 2, "[B, T]")
    _validation.check_mask("mask", mask)
    batch = rewards.shape[0]
    if mask.shape[0] != batch:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but rewards has shape {tuple(rewards.shape)}; "
            "mask must be [B, T] with the same B"
        )
    _check_group_size(group_size, rewards)
    groups = rewards.astype(jnp.float32).reshape(batch // group_size, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    # Compared exactly: a tied group has no ranking to learn from, and its float
    # residuals (R - mean) / eps would otherwise blow up.
    tied = groups.max(axis=1, keepdims=True) == groups.min(axis=1, keepdims=True)
    if normalize_std:
        var = jnp.sum((groups - mean) ** 2, axis=1, keepdims=True) / max(group_size - 1, 1)
        scores = jnp.where(tied, 0.0, (groups - mean) / (jnp.sqrt(var) + eps))
    else:
        scores = jnp.where(tied, 0.0, groups - mean)
    return scores.reshape(batch, 1) * mask.astype(bool).astype(jnp.float32)


def informative_groups(rewards: Float[ArrayLike, " B"], group_size: int) -> Bool[np.ndarray, " groups"]:
    """DAPO's dynamic-sampling filter: which groups have rewards that are not all equal.

    A group whose rewards are all equal gets zero GRPO advantage and so no
    policy gradient; DAPO drops such groups and samples more prompts until the
    batch is full (verl docs/algo/dapo.md, `filter_groups`). Equality is exact,
    as the tie rule of `grpo_advantages`, so the groups kept are exactly those
    with nonzero advantages. A group of one is not informative here (its GRPO
    advantage is 0), whereas verl's DAPO trainer keeps it (verl gives it
    advantage R).

    Plain NumPy, not jitted: it runs on host rewards in the rollout loop, and
    the rows it keeps have a data-dependent count.

    Args:
      rewards: [B] sequence-level rewards (NumPy or JAX array).
      group_size: responses per prompt; must divide B.

    Returns:
      [B // group_size] NumPy bool, True for groups to keep. Rows of group g are
      g * group_size ... (g + 1) * group_size - 1, e.g. `np.repeat(keep, group_size)`.
    """
    rewards = np.asarray(rewards)
    _validation.check_rank("rewards", rewards, 1, "[B]")
    _check_group_size(group_size, rewards)
    groups = rewards.reshape(-1, group_size)
    return groups.max(axis=1) != groups.min(axis=1)


@jax.jit
def whiten_advantages(
    advantages: Float[Array, "B T"], mask: Shaped[Array, "B T"], eps: float = 1e-8
) -> Float[Array, "B T"]:
    """Whitens advantages over all valid tokens of the batch (paper alg. 1, "normalize").

    Same statistics as verl's `masked_whiten` and TRL's `masked_whiten`: masked
    mean, unbiased masked variance, `(A - mean) * rsqrt(var + eps)`. Padding
    stays 0.

    Args:
      advantages: [B, T] float.
      mask: [B, T] mask.
      eps: added to the variance.

    Returns:
      [B, T] float32.
    """
    _validation.check_bt(advantages=advantages, mask=mask)
    valid = mask.astype(bool)
    a = jnp.where(valid, advantages.astype(jnp.float32), 0.0)
    count = jnp.sum(valid, dtype=jnp.float32)
    mean = jnp.sum(a) / jnp.maximum(count, 1.0)
    centered = jnp.where(valid, a - mean, 0.0)
    var = jnp.sum(centered**2) / jnp.maximum(count - 1.0, 1.0)
    return centered * jax.lax.rsqrt(var + eps)


@jax.jit
def clip_advantages(advantages: Float[Array, "B T"], clip: float | Float[Array, ""]) -> Float[Array, "B T"]:
    """Clips advantages to [-clip, clip] (paper app. C: 5.0/4.0/3.5/2.5 by phase).

    Padding zeros stay zero.
    """
    _validation.check_floating("advantages", advantages)
    return jnp.clip(advantages, -clip, clip)
