"""Comp-GAE (both methods) against rlax's truncated GAE and a NumPy loop, in one run.

    python launch/benchmark.py credit

Needs `rlax` (the `test` extra). All implementations get
the same right-padded batch: terminal rewards, and values and gates zero on
padding, so rlax with per-step discount = kappa computes the same advantages as
comp_gae (checked before timing). Two rlax rows:

- "rlax ... truncated GAE": rlax's own API alone (the baseline of the ratio
  column): advantages only, with the bootstrap column V_{T+1} = 0 already
  appended to the values outside the timed call;
- "... same outputs": also appends that column and returns A + V, i.e. the
  inputs and outputs of comp_gae (which in addition masks its inputs).

Timing: `benchmarks.timing.interleaved_medians` (interleaved rounds of >= 0.2 s,
median per-call time); "time / rlax" = time / (rlax's own API time), lower is better.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import interleaved_medians, print_table
from comppo_jax import comp_gae, normalized_concentration, retention_gate

LAM = 0.95


def _batch(batch, length, seed=0):
    """Right-padded rollout batch with terminal +-1 rewards and gates from random attention."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, batch)
    mask = np.arange(length)[None] < lengths[:, None]
    rewards = np.zeros((batch, length), np.float32)
    rewards[np.arange(batch), lengths - 1] = rng.choice([-1.0, 1.0], batch)
    values = np.where(mask, rng.uniform(-1, 1, (batch, length)), 0.0).astype(np.float32)
    window = np.maximum(np.arange(length) - 1, 0)[None].repeat(batch, 0)  # n_t = t - 1
    herfindahl = np.exp(rng.uniform(-np.log(np.maximum(window, 1)), 0.0)).astype(np.float32)
    kappa = np.asarray(retention_gate(normalized_concentration(herfindahl, window.astype(np.int32))))
    kappa = np.where(mask, kappa, 0.0).astype(np.float32)
    return rewards, values, kappa, mask


def _numpy_loop(rewards, values, kappa, mask, lam):
    """The reversed loop a NumPy implementation would run (vectorized over the batch)."""
    m = mask.astype(np.float32)
    adv = np.zeros_like(rewards)
    a_next = v_next = np.zeros(rewards.shape[0], np.float32)
    for t in range(rewards.shape[1] - 1, -1, -1):
        v_t = values[:, t] * m[:, t]
        a_next = (rewards[:, t] + kappa[:, t] * v_next - v_t + lam * kappa[:, t] * a_next) * m[:, t]
        adv[:, t] = a_next
        v_next = v_t
    return adv, adv + values * m


def run(batch: int = 16, length: int = 16384, repeats: int = 5) -> list[dict]:
    import rlax

    rewards, values, kappa, mask = _batch(batch, length)
    args = [jnp.asarray(x) for x in (rewards, values, kappa, mask)]
    values_bootstrap = jnp.asarray(np.pad(values, ((0, 0), (0, 1))))
    batched_rlax = jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=(0, 0, None, 0))
    rlax_gae = jax.jit(batched_rlax)

    @jax.jit
    def rlax_same_outputs(rewards, values, kappa, lam):
        advantages = batched_rlax(rewards, kappa, lam, jnp.pad(values, ((0, 0), (0, 1))))
        return advantages, advantages + values

    rlax_name = f"rlax {rlax.__version__} truncated GAE (vmap, jit)"
    # Each candidate returns its advantages, blocking until all its outputs are computed.
    candidates = {
        "comp_gae scan (jit)": lambda: jax.block_until_ready(comp_gae(*args, LAM, method="scan"))[0],
        "comp_gae associative (jit)": lambda: jax.block_until_ready(comp_gae(*args, LAM, method="associative"))[0],
        rlax_name: lambda: jax.block_until_ready(rlax_gae(args[0], args[2], LAM, values_bootstrap)),
        "rlax, same outputs as comp_gae (jit)": lambda: jax.block_until_ready(
            rlax_same_outputs(args[0], args[1], args[2], LAM)
        )[0],
        "NumPy loop": lambda: _numpy_loop(rewards, values, kappa, mask, LAM)[0],
    }
    outputs = {name: np.asarray(fn()) for name, fn in candidates.items()}
    reference = outputs["comp_gae scan (jit)"]
    for name, out in outputs.items():
        err = np.max(np.abs(np.where(mask, out, 0.0) - reference))
        if not err <= 1e-4:
            raise AssertionError(f"{name} disagrees with comp_gae scan by {err}")

    seconds = interleaved_medians(candidates, repeats)
    rlax_seconds = seconds[rlax_name]
    rows = [{"implementation": name, "ms": s * 1e3, "time / rlax": s / rlax_seconds} for name, s in seconds.items()]

    print(
        f"credit: Comp-GAE advantages, batch {batch} x {length} tokens, lam {LAM}, median of {repeats} "
        f"interleaved rounds; jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPU cores"
    )
    print_table(
        [
            {"implementation": r["implementation"], "ms": f"{r['ms']:.3f}", "time / rlax": f"{r['time / rlax']:.2f}x"}
            for r in rows
        ],
        ["implementation", "ms", "time / rlax"],
    )
    return rows
