"""Position-only gate control (paper sec. 6.4): a frozen schedule of the mean gate
in equal-width bins of relative position t/T.

Fit once from an earlier full-method run's rollout gates, save it, then replace
kappa by its lookup everywhere kappa appears.

Binning: a valid token is numbered t = 1..T within its row (T = the row's valid
token count; for right padding t is the column + 1). Bin k of n_bins holds
t/T in (k/n_bins, (k+1)/n_bins], so t = T falls in the last bin. The index is
computed in integers, (n_bins * t - 1) // T, so bin edges are exact.

File format (JSON, written by `save_position_schedule`):

    {
      "format": "comppo_jax.position_schedule",
      "version": 1,
      "n_bins": 20,
      "bin_edges": [0.0, 0.05, ..., 1.0],   # n_bins + 1 edges of t/T, equal width
      "mean_gate": [...],                   # n_bins floats in [0, 1]
      "token_counts": [...],                # n_bins ints, tokens seen per bin
      "metadata": {...}                     # free-form JSON object (source run, ...)
    }

A bin that received no token during the fit (only possible when some rows have
fewer than n_bins tokens) holds the mean over all tokens; its count is 0.
"""

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Shaped

from comppo_jax import storage
from comppo_jax.credit import _validation

FORMAT = "comppo_jax.position_schedule"
VERSION = 1
DEFAULT_BINS = 20


@dataclasses.dataclass(frozen=True)
class PositionSchedule:
    """Mean gate per bin of t/T.

    Attributes:
      mean_gate: [n_bins] float64, the mean gate in each bin.
      token_counts: [n_bins] int64, how many tokens the fit saw in each bin.
      metadata: free-form JSON-serializable dict saved with the schedule.
    """

    mean_gate: Float[np.ndarray, " n_bins"]
    token_counts: Int[np.ndarray, " n_bins"]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def n_bins(self) -> int:
        return self.mean_gate.shape[0]

    @property
    def bin_edges(self) -> Float[np.ndarray, " n_bins+1"]:
        return np.linspace(0.0, 1.0, self.n_bins + 1)


def position_bins(mask: Shaped[Array | np.ndarray, "B T"], n_bins: int = DEFAULT_BINS) -> Int[Array, "B T"]:
    """Bin index of every token's relative position t/T (see module docstring).

    Args:
      mask: [B, T] mask of valid response tokens.
      n_bins: number of equal-width bins.

    Returns:
      [B, T] int32 bin indices in [0, n_bins); 0 on padding.
    """
    _validation.check_rank("mask", mask, 2, "[B, T]")
    _validation.check_mask("mask", mask)
    valid = jnp.asarray(mask).astype(bool)
    t = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
    length = jnp.maximum(t[:, -1:], 1)
    return jnp.where(valid, (n_bins * t - 1) // length, 0)


def fit_position_schedule(
    kappa: Float[Array | np.ndarray, "B T"]
    | list[Float[Array | np.ndarray, "B T"]]
    | tuple[Float[Array | np.ndarray, "B T"], ...],
    mask: Shaped[Array | np.ndarray, "B T"]
    | list[Shaped[Array | np.ndarray, "B T"]]
    | tuple[Shaped[Array | np.ndarray, "B T"], ...],
    n_bins: int = DEFAULT_BINS,
    metadata: dict[str, Any] | None = None,
) -> PositionSchedule:
    """Fits the position-only schedule: the mean gate in each bin of t/T.

    Runs on the host (NumPy accumulation) since it is fit once, offline.

    Args:
      kappa: a [B, T] array of realized gates, or a sequence of such arrays
        (rollout batches; widths may differ between batches).
      mask: the matching [B, T] mask, or a sequence of masks.
      n_bins: number of equal-width bins (the paper uses 20).
      metadata: optional JSON-serializable dict stored with the schedule.

    Returns:
      A `PositionSchedule`.
    """
    if isinstance(kappa, (list, tuple)) != isinstance(mask, (list, tuple)):
        raise ValueError("kappa and mask must both be arrays or both be sequences of arrays")
    kappas = list(kappa) if isinstance(kappa, (list, tuple)) else [kappa]
    masks = list(mask) if isinstance(mask, (list, tuple)) else [mask]
    if len(kappas) != len(masks) or not kappas:
        raise ValueError(
            f"need one mask per kappa batch and at least one batch, got {len(kappas)} kappa "
            f"and {len(masks)} mask arrays"
        )
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive int, got {n_bins!r}")
    sums = np.zeros(n_bins, np.float64)
    counts = np.zeros(n_bins, np.int64)
    for i, (k, m) in enumerate(zip(kappas, masks)):
        _validation.check_bt(**{f"kappa[{i}]": np.asarray(k), f"mask[{i}]": np.asarray(m)})
        batch_sums, batch_counts = position_bin_totals(k, m, n_bins)
        sums += batch_sums
        counts += batch_counts
    return schedule_from_totals(sums, counts, metadata)


def position_bin_totals(
    kappa: Float[ArrayLike, "B T"], mask: Shaped[ArrayLike, "B T"], n_bins: int = DEFAULT_BINS
) -> tuple[Float[np.ndarray, " n_bins"], Int[np.ndarray, " n_bins"]]:
    """(sum of kappa, token count) per bin of t/T for one [B, T] batch (host NumPy).

    Summed over batches, these are all a schedule needs, so a training run can
    accumulate its rollout gates step by step (`schedule_from_totals`).
    """
    kappa, valid = np.asarray(kappa), np.asarray(mask).astype(bool)
    bins = np.asarray(position_bins(valid, n_bins))[valid]
    return (
        np.bincount(bins, weights=kappa[valid].astype(np.float64), minlength=n_bins),
        np.bincount(bins, minlength=n_bins).astype(np.int64),
    )


def schedule_from_totals(
    sums: Float[ArrayLike, " n_bins"], counts: Int[ArrayLike, " n_bins"], metadata: dict[str, Any] | None = None
) -> PositionSchedule:
    """The `PositionSchedule` of accumulated per-bin kappa sums and token counts."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.int64)
    total = counts.sum()
    if total == 0:
        raise ValueError("cannot fit a position schedule: the masks have no valid token")
    means = np.where(counts > 0, sums / np.maximum(counts, 1), sums.sum() / total)
    return PositionSchedule(means, counts, dict(metadata or {}))


@jax.jit
def _lookup(mean_gate: Float[Array, " n_bins"], mask: Shaped[Array, "B T"]) -> Float[Array, "B T"]:
    bins = position_bins(mask, mean_gate.shape[0])
    return jnp.where(mask.astype(bool), mean_gate[bins], 0.0)


def apply_position_schedule(schedule: PositionSchedule, mask: Shaped[Array, "B T"]) -> Float[Array, "B T"]:
    """Position-only gate: kappa_t = the schedule's mean gate at t/T.

    Args:
      schedule: a `PositionSchedule`.
      mask: [B, T] mask of valid response tokens.

    Returns:
      [B, T] float32 gates, 0 on padding (never read).
    """
    _validation.check_rank("mask", mask, 2, "[B, T]")
    _validation.check_mask("mask", mask)
    return _lookup(jnp.asarray(schedule.mean_gate, jnp.float32), mask)


def save_position_schedule(schedule: PositionSchedule, path: str | os.PathLike[str]) -> None:
    """Writes `schedule` as JSON (format in the module docstring)."""
    record = {
        "format": FORMAT,
        "version": VERSION,
        "n_bins": schedule.n_bins,
        "bin_edges": schedule.bin_edges.tolist(),
        "mean_gate": np.asarray(schedule.mean_gate, np.float64).tolist(),
        "token_counts": np.asarray(schedule.token_counts, np.int64).tolist(),
        "metadata": schedule.metadata,
    }
    storage.write_text(path, json.dumps(record, indent=2) + "\n")


def _field(record: dict[str, Any], path: str, name: str, kind: type) -> Any:
    if name not in record:
        raise ValueError(f"{path}: missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{path}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _number_list(
    record: dict[str, Any], path: str, name: str, length: int, kind: type[int] | tuple[type[int], type[float]]
) -> list[Any]:
    values = _field(record, path, name, list)
    if len(values) != length:
        raise ValueError(f"{path}: field {name!r} must have {length} entries, got {len(values)}")
    for v in values:
        if not isinstance(v, kind) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{path}: field {name!r} holds a bad entry {v!r}")
    return values


def load_position_schedule(path: str | os.PathLike[str]) -> PositionSchedule:
    """Reads a schedule written by `save_position_schedule`.

    Raises:
      ValueError naming the path and the offending field for a malformed file
      (OSError if it cannot be read).
    """
    path = os.fspath(path)
    text = storage.read_text(path)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object at top level")
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: field 'format' must be {FORMAT!r}, got {record.get('format')!r}")
    if _field(record, path, "version", int) != VERSION:
        raise ValueError(f"{path}: field 'version' must be {VERSION}, got {record['version']!r}")
    n_bins = _field(record, path, "n_bins", int)
    if n_bins < 1:
        raise ValueError(f"{path}: field 'n_bins' must be positive, got {n_bins}")
    edges = _number_list(record, path, "bin_edges", n_bins + 1, (int, float))
    if not np.allclose(edges, np.linspace(0.0, 1.0, n_bins + 1), rtol=0.0, atol=1e-9):
        raise ValueError(f"{path}: field 'bin_edges' must be {n_bins} equal-width bins of [0, 1]")
    means = _number_list(record, path, "mean_gate", n_bins, (int, float))
    if not all(0.0 <= m <= 1.0 for m in means):
        raise ValueError(f"{path}: field 'mean_gate' must hold gates in [0, 1]")
    counts = _number_list(record, path, "token_counts", n_bins, int)
    if any(c < 0 for c in counts):
        raise ValueError(f"{path}: field 'token_counts' must be non-negative")
    metadata = _field(record, path, "metadata", dict)
    return PositionSchedule(np.asarray(means, np.float64), np.asarray(counts, np.int64), metadata)
