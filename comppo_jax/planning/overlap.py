"""The overlapped step's cost model: how to split a slice between the rollout and the learner.

With rollout.staleness >= 1 and mesh.rollout_devices = r, the rollout stage decodes on r chips
while the learner scores and updates on the other N - r, so a step costs the longer of the two
plus the weights' move to the rollout chips; the synchronous colocated step pays both in turn on
all N chips. Both are rooflines, as the plan's:

- decoding (`rollout_seconds`): per token step, each chip reads its share of the weights (groups
  of G chips, `decode_layout`) and the live rows' KV cache, and its group pays the per-layer
  collectives' latency; rows end at their own lengths, so with a long-tailed length distribution
  (`long_tail_lengths`: most responses far below the limit, a few clipped at it, as in a real 16K
  run) the cache shrinks as the step goes on, but the loop runs to the longest row;
- the learner (`learner_seconds`): the scoring pass (behaviour and reference forwards) and the
  actor's epochs of forward + backward over the batch as the learner lays it out (`LearnerBatch`:
  padded to its longest row, or packed, train.packing), at the chips' peak (the compiled actor
  update is compute-bound in the plan), on the learner's chips;
- the move (`transfer_seconds`): the compute-dtype weights sent once over the interconnect.

Where the scoring pass runs is a choice (`splits(scoring=...)`): on the learner's chips (what
the loop does: they hold the generating policy, and only token ids cross) or on the rollout's
(then the critic's features, layers x rows x length x hidden, cross instead, `feature_bytes`).
It belongs to the shorter stage; at 16K the rollout is the longer one (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from comppo_jax.costs import chips, hlo_cost
from comppo_jax.costs.decode_floor import decode_group_sizes, kv_bytes_per_position, weight_bytes_per_chip
from comppo_jax.models.config import ModelConfig
from comppo_jax.models.packing import worth_packing
from pallas_kernels.common import round_up, segment_starts
from pallas_kernels.packed_attention import block_bounds, visited_block_pairs

# A 16K run's response lengths: log-normal around 30% of the limit, 5% clipped at it (DAPO-style
# math runs clip a few percent; most responses end far earlier).
TAIL_MEDIAN, TAIL_SIGMA, TAIL_CLIPPED = 0.3, 0.6, 0.05


def long_tail_lengths(
    rows: int, max_new_tokens: int, *, median=TAIL_MEDIAN, sigma=TAIL_SIGMA, clipped=TAIL_CLIPPED
) -> np.ndarray:
    """[rows] response lengths at evenly spaced quantiles of the log-normal (deterministic), the
    top `clipped` fraction (at least one row) at the limit."""
    quantiles = (np.arange(rows) + 0.5) / rows
    from statistics import NormalDist

    normal = np.asarray([NormalDist().inv_cdf(q) for q in quantiles])
    lengths = np.minimum(np.exp(np.log(median * max_new_tokens) + sigma * normal), max_new_tokens)
    lengths[-max(1, int(round(clipped * rows))) :] = max_new_tokens
    return np.maximum(lengths.astype(int), 1)


def rollout_seconds(
    config: ModelConfig, chip: chips.Chip, devices: int, lengths: np.ndarray, prompt_length: int
) -> tuple[float, int]:
    """(the decode roofline of rows of `lengths` on `devices` chips, the group size G it takes:
    the fastest `decode_group_sizes` allows). Rows are dealt to the devices / G replicas in turn."""
    itemsize = np.dtype(config.dtype).itemsize
    best = None
    for tensor in decode_group_sizes(config, devices):
        replicas = devices // tensor
        _, read = weight_bytes_per_chip(config, tensor)
        kv_per_position = kv_bytes_per_position(config, tensor)
        hops = (2 * config.num_layers + 1) * hlo_cost.ring_steps("all-reduce", tensor) + hlo_cost.ring_steps(
            "all-gather", tensor
        )
        steps = np.arange(int(lengths.max()))
        per_replica = []
        for replica in range(replicas):
            mine = np.sort(lengths[replica::replicas])
            live = len(mine) - np.searchsorted(mine, steps, side="right")  # rows still decoding at each step
            context = live * (prompt_length + steps)  # positions their attention reads
            flops = 2 * live * read / itemsize
            per_replica.append(
                np.maximum(
                    flops / chips.peak_flops(chip, config.dtype), (read + context * kv_per_position) / chip.hbm_bytes
                )
            )
        seconds = float(np.sum(np.max(per_replica, axis=0)) + len(steps) * hops * chip.hop_latency)
        if best is None or seconds < best[0]:
            best = (seconds, tensor)
    return best


def matmul_params(config: ModelConfig) -> int:
    """N: weights one token multiplies through (every projection and the vocabulary head; the
    embedding lookup is free)."""
    attention = config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    return (
        config.num_layers * (attention + 3 * config.hidden_size * config.intermediate_size)
        + config.hidden_size * config.vocab_size
    )


def attention_flops(config: ModelConfig, tokens: float, keys: float) -> float:
    """Causal attention of `tokens` queries over `keys` keys each on average: 4 x layers x heads x
    head_dim per key (QK^T and PV)."""
    return tokens * 4 * config.num_layers * config.num_heads * config.head_dim * keys


def token_flops(config: ModelConfig, tokens: float, keys: float) -> float:
    """A forward pass over `tokens` tokens attending to `keys` keys each on average: 2N per token
    plus their attention (`attention_flops`)."""
    return tokens * 2 * matmul_params(config) + attention_flops(config, tokens, keys)


class LearnerBatch(NamedTuple):
    """A step's sequences as the learner computes them: padded (one per row of `row_length`) or
    packed (train.packing: first-fit-decreasing rows of `row_length`, comppo_jax.models.packing)."""

    lengths: np.ndarray  # [rows] tokens (prompt + response) of each sequence
    row_length: int
    packed: bool = False
    multiple: int = 1  # the packed row count's divisor (the devices rows are split over)
    segment_skip: bool = False  # packed: the attention kernels skip other segments' key blocks
    min_saving: float = 0.0  # packed only where that saves this fraction of the rows (train.packing_min_saving)

    @classmethod
    def of(cls, lengths, prompt_length: int, max_new_tokens: int, **options) -> LearnerBatch:
        """Responses of `lengths` tokens after `prompt_length`-token prompts, rows of the longest possible."""
        return cls(prompt_length + np.asarray(lengths), prompt_length + max_new_tokens, **options)

    def packing(self):
        """The packed rows (comppo_jax.models.packing.Packing, host arrays); None when padded (or
        when packing would save less than `min_saving` of the rows, as the learner decides)."""
        if not self.packed:
            return None
        return worth_packing(self.lengths, self.row_length, multiple=self.multiple, min_saving=self.min_saving)

    def rows(self) -> int:
        """Rows computed."""
        packing = self.packing()
        return len(self.lengths) if packing is None else packing.segment_ids.shape[0]

    def attention_visited(self, block: int = 512) -> float:
        """The share of causal (query block, key block) pairs a segment-skipping attention kernel
        visits on the busiest batch shard's rows (`pallas_kernels.packed_attention`'s bounds, which
        ignore the key mask: an empty row is visited whole); 1 when padded or not skipping."""
        packing = self.packing()
        if packing is None or not self.segment_skip:
            return 1.0
        segments = jnp.asarray(packing.segment_ids)
        padded = round_up(self.row_length, block)
        starts = jnp.pad(segment_starts(segments), ((0, 0), (0, padded - self.row_length)), mode="edge")
        visited, _ = visited_block_pairs(*block_bounds(starts, block, block), block, block)
        blocks = padded // block
        per_row = np.asarray(visited.sum(axis=(1, 2))) / (blocks * (blocks + 1) / 2)
        return float(per_row.reshape(self.multiple, -1).mean(axis=1).max())

    def shard_sequences(self) -> list[list[list[int]]]:
        """Per batch shard (`multiple` of them, each a contiguous block of rows), its rows' sequence lengths."""
        packing = self.packing()
        if packing is not None:
            rows = [[int(packing.lengths[s - 1]) for s in np.unique(row[row > 0])] for row in packing.segment_ids]
        else:
            rows = [[int(n)] for n in self.lengths]
        per_shard = len(rows) // self.multiple
        return [rows[k * per_shard : (k + 1) * per_shard] for k in range(self.multiple)]

    def forward_flops(self, config: ModelConfig) -> float:
        """One forward over the rows computed, as the data-parallel program runs it: its busiest batch
        shard's FLOPs times the shards. Every slot of each row goes through the matmuls; attention over
        each row's causal keys, or (segment_skip) each sequence's own."""
        length = self.row_length

        skipping = self.segment_skip and self.packing() is not None

        def shard(rows: list[list[int]]) -> float:
            if skipping:
                attention = sum(attention_flops(config, n, n / 2) for row in rows for n in row)
            else:
                attention = attention_flops(config, len(rows) * length, length / 2)
            return token_flops(config, len(rows) * length, 0) + attention

        return self.multiple * max(shard(rows) for rows in self.shard_sequences())

    def real_flops(self, config: ModelConfig) -> float:
        """One forward over the real tokens alone: each sequence by itself."""
        return sum(token_flops(config, n, n / 2) for n in self.lengths)

    def balanced_real_flops(self, config: ModelConfig) -> float:
        """`real_flops` as the `multiple` batch shards could at best compute it, whole sequences per
        shard: each shard at least the even share and the longest sequence, times the shards (a
        data-parallel program runs as long as its busiest shard)."""
        alone = [token_flops(config, n, n / 2) for n in self.lengths]
        return self.multiple * max(max(alone), sum(alone) / self.multiple)


def learner_seconds(
    config: ModelConfig,
    chip: chips.Chip,
    devices: int,
    batch: LearnerBatch,
    *,
    epochs: int,
    reference: bool = True,
    behaviour: bool = True,
    remat: bool = True,
) -> float:
    """Scoring (behaviour and reference forwards) and `epochs` forward + backward passes over
    `batch` as the learner lays it out, at `devices` chips' peak; `remat` (model.remat=full)
    recomputes each forward in the backward pass."""
    forward = batch.forward_flops(config)
    flops = (int(reference) + int(behaviour)) * forward + epochs * (4 if remat else 3) * forward
    return flops / (devices * chips.peak_flops(chip, config.dtype))


def scoring_seconds(
    config: ModelConfig, chip: chips.Chip, devices: int, batch: LearnerBatch, *, reference: bool = True
) -> float:
    """The scoring pass alone (behaviour and reference forwards) on `devices` chips."""
    return learner_seconds(config, chip, devices, batch, epochs=0, reference=reference)


def feature_bytes(config: ModelConfig, *, rows: int, length: int, fused_layers: int = 4) -> float:
    """What crosses when the rollout's chips score: TAC's fused hidden states (compute dtype) and
    the per-token log-probs, reference log-probs and gate (float32)."""
    return rows * length * (fused_layers * config.hidden_size * np.dtype(config.dtype).itemsize + 3 * 4)


def transfer_seconds(config: ModelConfig, chip: chips.Chip, devices: int) -> float:
    """The compute-dtype weights sent to `devices` rollout chips over the interconnect (each chip
    receives at least its share, at its link rate)."""
    held, _ = weight_bytes_per_chip(config, 1)
    return held / devices / chip.ici_bytes if devices else 0.0


class Split(NamedTuple):
    rollout_devices: int  # 0: the synchronous colocated step
    group: int  # G of the rollout
    rollout: float
    learner: float
    transfer: float

    @property
    def seconds(self) -> float:
        if not self.rollout_devices:
            return self.rollout + self.learner
        return max(self.rollout, self.learner) + self.transfer


def splits(
    config: ModelConfig,
    chip: chips.Chip,
    devices: int,
    lengths: np.ndarray,
    *,
    prompt_length: int,
    epochs: int,
    reference: bool = True,
    remat: bool = True,
    scoring: str = "learner",
    learner_scale: float = 1.0,
    packed: bool = False,
    segment_skip: bool = False,
) -> list[Split]:
    """The synchronous colocated step (rollout_devices 0), then every split r = 1 .. devices - 1,
    the scoring pass on the `scoring` ("learner" or "rollout") side; `learner_scale` calibrates
    the learner's roofline (the compiled programs' time over it, `launch/plan.py --calibrate_learner`);
    `packed` (and `segment_skip`): the learner packs the batch (`LearnerBatch`)."""
    rows, length = len(lengths), prompt_length + int(lengths.max())
    batch = LearnerBatch(prompt_length + np.asarray(lengths), length, packed, segment_skip=segment_skip)
    learner = lambda chips: (
        learner_scale * learner_seconds(config, chip, chips, batch, epochs=epochs, reference=reference, remat=remat)
    )
    rollout, group = rollout_seconds(config, chip, devices, lengths, prompt_length)
    result = [Split(0, group, rollout, learner(devices), 0.0)]
    for r in range(1, devices):
        if not decode_group_sizes(config, r):
            continue
        rollout, group = rollout_seconds(config, chip, r, lengths, prompt_length)
        split = Split(r, group, rollout, learner(devices - r), transfer_seconds(config, chip, r))
        if scoring == "rollout":
            moved = learner_scale * scoring_seconds(config, chip, r, batch, reference=reference)
            kept = learner_scale * scoring_seconds(config, chip, devices - r, batch, reference=reference)
            split = split._replace(
                rollout=rollout + moved,
                learner=split.learner - kept,
                transfer=split.transfer
                + feature_bytes(config, rows=rows, length=length) / (devices - r) / chip.ici_bytes,
            )
        result.append(split)
    return result


COLUMNS = ("rollout chips", "G", "rollout s", "learner s", "weights move s", "step s", "vs synchronous")


def split_rows(results: list[Split]) -> list[list[str]]:
    """One row per split (COLUMNS), the synchronous step first; the best split marked."""
    synchronous = results[0].seconds
    best = min(results[1:], key=lambda s: s.seconds, default=None)
    rows = []
    for s in results:
        label = "synchronous" if not s.rollout_devices else str(s.rollout_devices) + (" (best)" if s is best else "")
        rows.append(
            [
                label,
                str(s.group),
                f"{s.rollout:.3g}",
                f"{s.learner:.3g}",
                f"{s.transfer:.2g}",
                f"{s.seconds:.3g}",
                f"{synchronous / s.seconds:.2f}x",
            ]
        )
    return rows
