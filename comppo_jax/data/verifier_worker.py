"""A math-verify worker process (comppo_jax.workers' protocol): JSON lines [gold, answer] on stdin ->
["ok", bool] | ["error", msg], after ["ready"] once math-verify is imported.

Started by `rewards.VerifierPool` as `python -m comppo_jax.data.verifier_worker` (a fresh
interpreter: no fork of a process running JAX threads, no re-import of the caller's __main__), in
a session of its own (a signal to the trainer's process group does not reach it); it exits when
the trainer dies (`serve` sets its parent-death signal) or closes its stdin.
"""

from __future__ import annotations

import logging

from comppo_jax.workers import serve


def verify_answer(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    def as_latex(s):  # math-verify finds LaTeX answers inside $...$
        return s if "$" in s or "\\(" in s else f"${s}$"

    # Timeouts off: the parent enforces a hard one by killing this process.
    gold_parsed = parse(as_latex(gold), parsing_timeout=None)
    return bool(verify(gold_parsed, parse(as_latex(answer), parsing_timeout=None), timeout_seconds=None))


def main() -> None:
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    import math_verify  # noqa: F401  (imported before "ready", so start-up is not timed per item)

    serve(lambda pair: verify_answer(*pair))


if __name__ == "__main__":
    main()
