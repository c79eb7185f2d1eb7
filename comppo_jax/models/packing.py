"""Sequence packing: a batch's sequences laid end to end in fixed-length rows, no padded token computed.

A batch in the sequence layout holds B sequences in rows of L tokens, each sequence's real tokens a
prefix of its row (prompt, then response, then padding). Packed, the same tokens lie in R rows of S
tokens, several sequences per row, placed by first-fit-decreasing (`first_fit_decreasing`).
`Packing` holds the index arrays that move values between the two layouts, and what the model needs
to keep sequences apart in a packed row: each token's segment (its sequence, so attention and the
concentration window see only their own sequence) and its position in the sequence (RoPE).

Shapes come from buckets (`packed_rows`): S is the sequence layout's L, so any sequence fits a row,
and R is rounded up to one of a few sizes per batch size, so the jitted programs are compiled once
per bucket rather than once per batch. A batch that would save few rows stays in the sequence
layout (`worth_packing`). Values at packed slots where no token lies are 0 and are
never read back: `unpack` and `gather_tokens` read only real tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Int, Shaped

from comppo_jax import sharding

# R is rounded up to the nearest of these fractions of the batch size (then to the row multiple):
# at most this many packed program shapes per batch size.
ROW_BUCKETS = 16
Index = Array | np.ndarray


class Packing(NamedTuple):
    """Where B sequences lie in R packed rows of S tokens (int32 index arrays: `make_packing` builds
    them on the host, the learner places them on the devices)."""

    segment_ids: Int[Index, "R S"]  # 1 + the sequence's index in the batch; 0 where no token lies
    positions: Int[Index, "R S"]  # the token's position in its sequence (0 where no token lies)
    source: Int[Index, "R S"]  # flat index b * L + position in the sequence layout (0 where no token lies)
    offsets: Int[Index, " B"]  # flat index r * S + first slot of each sequence in the packed rows
    lengths: Int[Index, " B"]  # real tokens of each sequence

    @property
    def attention_mask(self) -> Index:
        return self.segment_ids > 0


def first_fit_decreasing(lengths: np.ndarray, row_length: int) -> list[list[int]]:
    """Sequences (indices into `lengths`) per row: longest first, each into the first row with room."""
    if len(lengths) and int(np.max(lengths)) > row_length:
        raise ValueError(f"a sequence of {int(np.max(lengths))} tokens does not fit a packed row of {row_length}")
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        length = int(lengths[index])
        row = next((r for r, free in enumerate(room) if free >= length), None)
        if row is None:
            rows.append([])
            room.append(row_length)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= length
    return rows


def packed_rows(needed: int, batch: int, multiple: int = 1) -> int:
    """The bucketed row count for `needed` rows of a batch of `batch` sequences: the smallest of
    ceil(batch * i / ROW_BUCKETS) (i = 1..ROW_BUCKETS) that holds them, rounded up to `multiple`
    (the devices the rows are split over)."""
    buckets = sorted({-(-batch * i // ROW_BUCKETS) for i in range(1, ROW_BUCKETS + 1)})
    rows = next((b for b in buckets if b >= needed), needed)
    return -(-rows // multiple) * multiple


def sequence_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """Real tokens per row [B] of a sequence-layout mask, whose real tokens must be a prefix of each row."""
    mask = np.asarray(attention_mask, bool)
    lengths = mask.sum(axis=1)
    prefix = np.arange(mask.shape[1])[None] < lengths[:, None]
    bad = np.flatnonzero((mask != prefix).any(axis=1))
    if bad.size:
        raise ValueError(
            f"rows {bad[:5].tolist()} of the attention mask are not a prefix of real tokens: "
            "packing reads each sequence as its row's leading tokens"
        )
    return lengths.astype(np.int32)


def make_packing(lengths: np.ndarray, length: int, *, multiple: int = 1) -> Packing:
    """The packing (host arrays) of sequences of `lengths` [B] tokens from rows of `length` (L) tokens
    into bucketed rows of L tokens (`packed_rows`; `multiple`: the row count's divisor, the devices
    the rows are split over in contiguous blocks). First-fit-decreasing fills the heaviest rows
    first; they are dealt to the devices in turn, so no device gets all of them."""
    lengths = np.asarray(lengths, np.int32)
    batch = len(lengths)
    members = first_fit_decreasing(lengths, length)
    rows = packed_rows(len(members), batch, multiple)
    members += [[] for _ in range(rows - len(members))]
    per_device = rows // multiple
    members = [members[(r % per_device) * multiple + r // per_device] for r in range(rows)]
    segment_ids, positions, source = (np.zeros((rows, length), np.int32) for _ in range(3))
    offsets = np.zeros((batch,), np.int32)
    for r, row in enumerate(members):
        start = 0
        for b in row:
            n = int(lengths[b])
            segment_ids[r, start : start + n] = b + 1
            positions[r, start : start + n] = np.arange(n)
            source[r, start : start + n] = b * length + np.arange(n)
            offsets[b] = r * length + start
            start += n
    return Packing(segment_ids, positions, source, offsets, lengths)


def on_devices(packing: Packing, mesh: Mesh | None) -> Packing:
    """A host packing placed on `mesh` with its rows and sequences split over (data, fsdp) (each process
    its own devices' blocks: `sharding.from_host`); on the default device without a mesh."""
    if mesh is None:
        return Packing(*(jnp.asarray(x) for x in packing))
    return sharding.from_host(packing, sharding.batch_sharding(mesh))


def worth_packing(lengths: np.ndarray, length: int, *, multiple: int = 1, min_saving: float = 0.0) -> Packing | None:
    """`make_packing`, or None where its rows would be more than (1 - `min_saving`) of the batch's (the
    sequence layout then costs about as much, without packing's gathers)."""
    packing = make_packing(lengths, length, multiple=multiple)
    return packing if packing.segment_ids.shape[0] <= (1 - min_saving) * len(lengths) else None


def efficiency(lengths: np.ndarray, packing: Packing | None, length: int) -> float:
    """Real tokens (the host `lengths` of its sequences) / computed tokens: of the packed rows, or
    (packing None) of the sequence layout's rows of `length` tokens."""
    computed = len(lengths) * length if packing is None else np.size(packing.segment_ids)
    return float(np.sum(lengths)) / float(computed)


def pack(x: Shaped[Array, "B L *rest"], packing: Packing) -> Shaped[Array, "R S *rest"]:
    """x in the sequence layout -> the packed rows (0 where no token lies)."""
    flat = x.reshape((-1,) + x.shape[2:])
    taken = flat[packing.source]
    real = packing.segment_ids > 0
    return jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), taken, jnp.zeros((), x.dtype))


def unpack(y: Shaped[Array, "R S *rest"], packing: Packing, length: int) -> Shaped[Array, "B L *rest"]:
    """Packed rows -> the sequence layout of rows of `length` tokens (0 past each sequence's end)."""
    index = packing.offsets[:, None] + jnp.arange(length)[None]
    real = jnp.arange(length)[None] < packing.lengths[:, None]
    taken = y.reshape((-1,) + y.shape[2:])[jnp.where(real, index, 0)]
    return jnp.where(real.reshape(real.shape + (1,) * (y.ndim - 2)), taken, jnp.zeros((), y.dtype))


def pack_positions(positions: Int[Array, "B L *rest"], packing: Packing) -> Int[Array, "R S *rest"]:
    """Positions in each token's own sequence (TAC's routed keys) -> the packed slots of those keys in
    its row (0 where no token lies)."""
    row_length = packing.segment_ids.shape[1]
    first_slot = (packing.offsets % row_length)[jnp.maximum(packing.segment_ids - 1, 0)]
    shifted = pack(positions, packing) + first_slot.reshape(first_slot.shape + (1,) * (positions.ndim - 2))
    real = packing.segment_ids > 0
    return jnp.where(real.reshape(real.shape + (1,) * (positions.ndim - 2)), shifted, 0)


def gather_tokens(
    y: Shaped[Array, "R S *rest"], packing: Packing, positions: Int[Array, "B T"]
) -> Shaped[Array, "B T *rest"]:
    """y at sequence positions [B, T] (each row's positions in its own sequence; clipped to it)."""
    within = jnp.clip(positions, 0, jnp.maximum(packing.lengths[:, None] - 1, 0))
    return y.reshape((-1,) + y.shape[2:])[packing.offsets[:, None] + within]


def next_tokens(tokens: Int[Array, "R S"]) -> Int[Array, "R S"]:
    """Each packed slot's next token in its row (the last slot's: 0); a sequence's last token's
    is another sequence's first, which nothing reads."""
    return jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
