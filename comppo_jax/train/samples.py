"""Sampled responses kept with their per-token credit, for the run report (launch/report.py).

Every `outputs.sample_every` steps (0: at each dev evaluation; -1: never) the recorder keeps
`outputs.samples_per_step` of the step's responses, spread evenly over the batch, in
`<output_dir>/samples/step_<N>.json` (N zero-padded to 6 digits), written by process 0:

    {"step", "method", "gate", "estimator", "lam", "kappa_range": [g(0), g(1)],
     "responses": [{"row", "prompt", "response", "reward", "verdict", "length",
                    "t": [t of each kept token, 1-based], "pieces": [its text],
                    "tokens": {name: [value per kept token]}}]}

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
- `grpo`: GRPO's group-relative advantage.

A response longer than `outputs.sample_tokens` keeps its first and last halves of that many
tokens (`t` shows the gap), so a step's file stays under about samples_per_step x sample_tokens x
80 bytes. Non-finite values (a step the skipped-update guard caught) are written as null.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from comppo_jax import sharding, storage
from comppo_jax.credit import comp_gae, gae, gate_concentration, gate_range
from comppo_jax.data.tokenizers import token_pieces

SAMPLES_DIR = "samples"
CONTROLLED_GATES = ("fixed", "shuffle", "position")  # the recipe gates that replace the policy's own


def sample_path(output_dir: str, step: int) -> str:
    return str(storage.path(output_dir) / SAMPLES_DIR / f"step_{step:06d}.json")


def keeps_samples(outputs, step: int, evaluates: bool) -> bool:
    """Whether step `step` keeps responses (config section `outputs`; `evaluates`: the step ends
    with a dev evaluation)."""
    if outputs.sample_every < 0 or outputs.samples_per_step == 0:
        return False
    return evaluates if outputs.sample_every == 0 else step % outputs.sample_every == 0


def kept_rows(batch: int, count: int) -> np.ndarray:
    """`count` rows of a batch of `batch`, spread evenly, first and last included."""
    return np.unique(np.linspace(0, batch - 1, min(count, batch)).round().astype(int))


def kept_positions(length: int, limit: int) -> np.ndarray:
    """Indices of the tokens kept of a response of `length`: all, or the first and last limit/2."""
    if length <= limit:
        return np.arange(length)
    head = limit - limit // 2
    return np.concatenate([np.arange(head), np.arange(length - limit // 2, length)])


def _numbers(values, integer: bool = False) -> list:
    """JSON numbers (5 decimals; null where not finite: browsers' JSON.parse rejects NaN)."""
    if integer:
        return [int(v) for v in values]
    rounded = np.round(np.asarray(values, np.float64), 5)
    return [float(v) if np.isfinite(v) else None for v in rounded]


def per_token_credit(cfg, recipe, scored, sampled, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The module docstring's per-token arrays [len(rows), T] of `rows` of a scored batch
    (comppo_jax.train.learner.Scored). Every process calls it: multi-host arrays are gathered."""
    host = sharding.to_host
    mask = sampled.host_mask[rows]
    arrays = {}
    own = scored.rollout.kappa
    envelope = dict(cfg.gate_envelope)
    if own is not None:
        arrays["kappa"] = host(own)[rows]
        arrays["H"] = host(scored.rollout.herfindahl)[rows]
        arrays["n"] = host(scored.rollout.window_size)[rows]
        arrays["c"] = np.asarray(gate_concentration(jnp.asarray(arrays["kappa"]), **envelope))
    if recipe.gate in CONTROLLED_GATES:
        arrays["credit_kappa"] = host(scored.kappa)[rows]
    if recipe.estimator == "grpo":
        arrays["grpo"] = host(scored.batch.advantages)[rows]
    else:
        values, rewards = host(scored.batch.old_values)[rows], sampled.reward_tokens[rows]
        arrays["value"] = values
        # PPO: the policy's own gate, what CompPO would have read; CompPO: the gate its Comp-GAE read.
        gate = arrays.get("kappa") if recipe.estimator == "gae" else host(scored.kappa)[rows]
        if gate is not None:
            arrays["comp_gae"] = np.asarray(comp_gae(rewards, values, gate, mask, cfg.train.lam)[0])
        arrays["gae"] = np.asarray(gae(rewards, values, mask, 1.0, cfg.train.lam)[0])
    return {name: np.where(mask, array, 0) for name, array in arrays.items()}


def kept_responses(cfg, recipe, tokenizer, step: int, sampled, scored) -> dict:
    """Step `step`'s kept responses (the module docstring's record) from its rewarded generation
    (comppo_jax.train.sampling.Sampled) and its credit (Scored)."""
    rows = kept_rows(sampled.host_mask.shape[0], cfg.outputs.samples_per_step)
    arrays = per_token_credit(cfg, recipe, scored, sampled, rows)
    tokens = sharding.to_host(sampled.generation.response_tokens)[rows]
    group = cfg.rollout.samples_per_prompt
    responses = []
    for i, row in enumerate(rows):
        length = int(sampled.host_mask[row].sum())
        kept = kept_positions(length, cfg.outputs.sample_tokens)
        responses.append(
            {
                "row": int(row),
                "prompt": sampled.problems[row // group].prompt,
                "response": sampled.texts[row],
                "reward": _numbers([sampled.rewards[row]])[0],
                "verdict": sampled.verdicts[row].value,
                "length": length,
                "t": [int(t) + 1 for t in kept],
                "pieces": token_pieces(tokenizer, tokens[i][kept]),
                "tokens": {name: _numbers(values[i][kept], integer=name == "n") for name, values in arrays.items()},
            }
        )
    return {
        "step": step,
        "method": cfg.method,
        "gate": recipe.gate,
        "estimator": recipe.estimator,
        "lam": cfg.train.lam,
        "kappa_range": list(gate_range(**dict(cfg.gate_envelope))),
        "responses": responses,
    }


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
