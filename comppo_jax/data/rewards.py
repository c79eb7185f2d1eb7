"""Verifiable math rewards: answer extraction, math-verify in killable worker processes, shaping.

math-verify's own timeout is a SIGALRM, which only works on a process's main thread and has
hung trainers; here every comparison runs in a worker process that is killed and replaced when
it exceeds `timeout_s`, so a pathological answer (say 9^{9^{9^{9}}}) costs one timeout, never a
hang. A timeout, a verifier crash or a worker that died on the answer (killed, out of memory)
counts as incorrect (reward 0) and is counted in the metrics (`reward/timeout`, `reward/error`,
`reward/died`); the dead worker is replaced and the next call verifies normally. The workers run
in a session of their own: a signal to the trainer's process group (Ctrl-C, a scheduler's stop)
does not reach them, so a step the trainer finishes after it holds no verdict damaged by the stop.

Reward of a response (terminal, at its last valid token):
  correct 1, incorrect 0; a response with malformed reasoning tags (unbalanced or misordered
  <think>...</think>) gets -format_coef instead; a correct, well-formed response (only those,
  as in the paper) pays a length penalty (`length_penalty`), and by default never scores below
  an incorrect one; the total is clipped to [-1, 1].
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
from collections.abc import Sequence

import numpy as np

from comppo_jax import workers
from comppo_jax.sharding import split_over_processes
from comppo_jax.workers import WorkerPool

ANSWER_LINE = re.compile(r"^\s*Answer\s*:\s*(.+?)\s*$", re.MULTILINE)


class Verdict(enum.Enum):
    CORRECT = "correct"
    INCORRECT = "incorrect"
    NO_ANSWER = "no_answer"
    TIMEOUT = "timeout"
    ERROR = "error"
    DIED = "died"  # the worker verifying it died (an error verdict of its own, counted as reward/died)


VERDICTS = tuple(Verdict)  # their integer codes, for gathering across processes
FAILED = {workers.TIMEOUT: Verdict.TIMEOUT, workers.ERROR: Verdict.ERROR, workers.DIED: Verdict.DIED}  # by status


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None


def extract_answer(text: str) -> str | None:
    """The DAPO format's last `Answer:` line, else the last \\boxed{}, else None."""
    lines = ANSWER_LINE.findall(text)
    if lines:
        answer = lines[-1]
        return last_boxed(answer) or answer.strip().strip("$").strip()
    return last_boxed(text)


def reasoning_format_ok(text: str) -> bool:
    """No reasoning tags, or exactly one <think> followed by one </think>."""
    opens, closes = text.count("<think>"), text.count("</think>")
    if opens == closes == 0:
        return True
    return opens == closes == 1 and text.index("<think>") < text.index("</think>")


class VerifierPool:
    """math-verify in `num_workers` killable processes (comppo_jax.workers) with a hard per-item timeout.

    Use as a context manager or call `close()`. `check(pairs)` returns a Verdict per
    (gold, answer) pair, in order. In a multi-process JAX run every process calls `check` with
    the same pairs; with `across_processes` each verifies its share and the verdicts are gathered,
    so each pair is verified once and every process gets the same verdicts (a timeout on one
    host cannot make the hosts disagree on a reward).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, across_processes: bool = False):
        self.across_processes = across_processes
        self._pool = WorkerPool([sys.executable, "-m", "comppo_jax.data.verifier_worker"], num_workers, timeout_s)

    def check(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        if not self.across_processes:
            return self._check_here(pairs)
        codes = split_over_processes(lambda share: [VERDICTS.index(v) for v in self._check_here(share)], list(pairs))
        return [VERDICTS[code] for code in codes]

    def _check_here(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        verdicts = []
        for result in self._pool.run([list(pair) for pair in pairs]):
            if result.status == workers.OK:
                verdicts.append(Verdict.CORRECT if result.value else Verdict.INCORRECT)
            else:
                verdicts.append(FAILED[result.status])
        return verdicts

    def close(self) -> None:
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


LENGTH_PENALTIES = ("linear", "overlong")
LENGTH_PENALTY_SCOPES = ("correct", "all")


@dataclasses.dataclass(frozen=True)
class RewardCoefficients:
    """Shaping coefficients; inputs so a trainer can schedule them (comppo_jax.train.controller).

    length_penalty "linear": a correct response pays `length_coef` per token (the paper's form).
    "overlong" (DAPO's soft overlong punishment): it pays nothing up to `max_length -
    overlong_buffer` tokens, then a linear ramp to `length_coef` at `max_length`.
    correct_never_below_incorrect: a correct response's reward is at least an incorrect one's (0).
    length_penalty_on "correct" (the paper's): only correct, well-formed responses pay the penalty;
    "all" (DAPO's overlong reward shaping): every response pays it.
    """

    format_coef: float = 0.5
    length_coef: float = 0.0
    length_penalty: str = "linear"
    max_length: int = 0
    overlong_buffer: int = 0
    correct_never_below_incorrect: bool = True
    length_penalty_on: str = "correct"


def length_penalty(lengths, coefficients: RewardCoefficients) -> np.ndarray:
    """[B] penalty a correct, well-formed response of each length pays (float32)."""
    lengths = np.asarray(lengths, np.float32)
    if coefficients.length_penalty == "linear":
        return (coefficients.length_coef * lengths).astype(np.float32)
    if coefficients.length_penalty == "overlong":
        buffer = coefficients.overlong_buffer
        if not 0 < buffer <= coefficients.max_length:
            raise ValueError(f"overlong_buffer={buffer} must be in (0, max_length={coefficients.max_length}]")
        over = np.clip((lengths - (coefficients.max_length - buffer)) / buffer, 0.0, 1.0)
        return (coefficients.length_coef * over).astype(np.float32)
    raise ValueError(f"length_penalty={coefficients.length_penalty!r}; expected one of {LENGTH_PENALTIES}")


def score_responses(
    responses: Sequence[str],
    golds: Sequence[str],
    response_lengths: Sequence[int],
    pool: VerifierPool,
    coefficients: RewardCoefficients = RewardCoefficients(),
) -> tuple[np.ndarray, list[Verdict], dict[str, float]]:
    """Terminal rewards [B] float32, per-response verdicts, and counts for the metrics."""
    if not len(responses) == len(golds) == len(response_lengths):
        raise ValueError(
            f"responses ({len(responses)}), golds ({len(golds)}) and response_lengths ({len(response_lengths)}) "
            "must have the same length"
        )
    answers = [extract_answer(text) for text in responses]
    to_check = [i for i, answer in enumerate(answers) if answer is not None]
    checked = dict(zip(to_check, pool.check([(golds[i], answers[i]) for i in to_check])))
    verdicts = [checked.get(i, Verdict.NO_ANSWER) for i in range(len(responses))]
    rewards = np.zeros(len(responses), np.float32)
    well_formed = np.array([reasoning_format_ok(text) for text in responses])
    if coefficients.length_penalty_on not in LENGTH_PENALTY_SCOPES:
        raise ValueError(
            f"length_penalty_on={coefficients.length_penalty_on!r}; expected one of {LENGTH_PENALTY_SCOPES}"
        )
    penalty = length_penalty(response_lengths, coefficients)
    correct_rewards = 1.0 - penalty
    if coefficients.correct_never_below_incorrect:
        correct_rewards = np.maximum(correct_rewards, 0.0)
    for i, verdict in enumerate(verdicts):
        if not well_formed[i]:
            rewards[i] = -coefficients.format_coef
        elif verdict is Verdict.CORRECT:
            rewards[i] = correct_rewards[i]
    if coefficients.length_penalty_on == "all":  # the others pay too (correct ones already did)
        paid = well_formed & np.array([v is Verdict.CORRECT for v in verdicts], bool)
        rewards = np.where(paid, rewards, rewards - penalty).astype(np.float32)
    rewards = np.clip(rewards, -1.0, 1.0)
    metrics = {f"reward/{v.value}": float(sum(x is v for x in verdicts)) for v in Verdict}
    metrics["reward/malformed"] = float((~well_formed).sum())
    metrics["reward/mean"] = float(rewards.mean()) if len(rewards) else 0.0
    return rewards, verdicts, metrics


def terminal_reward_tokens(rewards, response_mask):
    """[B] rewards -> [B, T] with each at the row's last valid token (0 elsewhere)."""
    response_mask = np.asarray(response_mask, bool)
    lengths = response_mask.sum(axis=1)
    out = np.zeros(response_mask.shape, np.float32)
    rows = np.nonzero(lengths > 0)[0]
    out[rows, lengths[rows] - 1] = np.asarray(rewards, np.float32)[rows]
    return out
