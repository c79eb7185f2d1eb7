"""Sampled responses kept with their per-token credit: their files, which the run report reads
(launch/report.py); comppo_jax.train.samples picks them and computes the credit.

Every `outputs.sample_every` steps (0: at each dev evaluation; -1: never) the recorder keeps
`outputs.samples_per_step` of the step's responses, spread evenly over the batch, in
`<output_dir>/samples/step_<N>.json` (N zero-padded to 6 digits), written by process 0:

    {"step", "method", "gate", "estimator", "lam", "kappa_range": [g(0), g(1)],
     "responses": [{"row", "prompt", "response", "reward", "verdict", "length", ("replies",)
                    "t": [t of each kept token, 1-based], "pieces": [its text],
                    "tokens": {name: [value per kept token]}}]}

(`replies`: a conversation's environment replies, with rollout.environment.)

The per-token arrays (`tokens`) are aligned with y_1..y_T (docs/conventions.md) and are whatever
the run has of:

- `kappa`, `H`, `n`, `c`: the behaviour policy's own gate kappa_t, the final-layer Herfindahl
  H_t over the window of n_t keys, and the concentration c_t that gave kappa_t (paper eqs.
  herfindahl, cnorm, kappa_attention; no behaviour pass, as GRPO with rollout.old_log_probs=sampler,
  none of them);
- `credit_kappa`: the gate Comp-GAE read, where a control (fixed, shuffle, position) replaced the
  policy's own;
- `value`: the critic's V_t on the behaviour features (TAC, the standard head or the full critic);
- `comp_gae` and `gae`: advantages before whitening, from the same rewards and values, of paper eq.
  (comp_gae) with the gate the run's credit read (CompPO; PPO: the policy's own gate, what CompPO
  would have assigned) and of eq. (stdgae) with kappa_t = gamma = 1. The estimator the run updated
  with is named by `estimator`;
- `grpo`: GRPO's group-relative advantage;
- `env`: 1 on a conversation's environment tokens (rollout.environment), which get no credit: the
  advantages above are the policy's tokens' (comppo_jax.credit.turns).

A response longer than `outputs.sample_tokens` keeps its first and last halves of that many
tokens (`t` shows the gap), so a step's file stays under about samples_per_step x sample_tokens x
80 bytes. Non-finite values (a step the skipped-update guard caught) are written as null.
"""

from __future__ import annotations

import json

from comppo_jax import storage

SAMPLES_DIR = "samples"


def sample_path(output_dir: str, step: int) -> str:
    return str(storage.path(output_dir) / SAMPLES_DIR / f"step_{step:06d}.json")


def save_samples(output_dir: str, record: dict) -> str:
    """Writes `record` (kept_responses') to its step's file, atomically; returns the path."""
    path = sample_path(output_dir, record["step"])
    storage.write_text(path, json.dumps(record, separators=(",", ":"), allow_nan=False))
    return path


def load_samples(output_dir: str) -> tuple[list[dict], list[str]]:
    """(every kept step's record under `output_dir` by step, "path: why" of each file that does not
    parse: a report shows the rest and names those)."""
    folder = storage.path(output_dir) / SAMPLES_DIR
    records, unreadable = [], []
    for name in [n for n in storage.names(folder) if n.startswith("step_") and n.endswith(".json")]:
        path = folder / name
        try:
            record = json.loads(path.read_text())
            records.append((int(record["step"]), record))
        except (OSError, ValueError, KeyError, TypeError) as error:
            unreadable.append(f"{path}: {type(error).__name__}: {error}")
    return [record for _, record in sorted(records, key=lambda pair: pair[0])], unreadable
