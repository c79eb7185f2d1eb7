"""Benchmarks that print side-by-side ratios measured in one run.

    python launch/benchmark.py forward   # jitted policy forward vs transformers (torch CPU)
    python launch/benchmark.py credit    # comp_gae (scan / associative) vs rlax and a NumPy loop
    python launch/benchmark.py kernel    # attention_with_concentration vs plain causal attention
    python launch/benchmark.py critic    # TAC routing and critic fwd+bwd vs the policy forward
    python launch/benchmark.py sampler   # rollout engine vs the dense sampler, tunix and transformers
    python launch/benchmark.py host      # a step's host-side work: decoding and verifying the responses
    python launch/benchmark.py step      # a train step's programs: predicted (launch/plan.py's cost model) vs measured
    python launch/benchmark.py step --peer=tunix --tunix_python=/tmp/tunix_venv/bin/python  # a GRPO step: ours vs tunix
    python launch/benchmark.py step --peer=tunix --method=ppo --tunix_python=...
                                         # CompPO, PPO, GRPO vs tunix's PPO, per phase
    python launch/benchmark.py lora      # LoRA vs full fine-tuning: actor state, update time, decoding merged or not
    python launch/benchmark.py staleness # a short tiny run at rollout.staleness 0 and 1: step times, generation overlap
    python launch/benchmark.py packing   # the learner's programs on packed rows vs padded, long-tailed lengths

Flags left unset keep each suite's defaults. Record results in docs/benchmarks.md.
"""

from __future__ import annotations

import importlib

from absl import app, flags

from comppo_jax import cli

SUITES = ("forward", "credit", "kernel", "critic", "sampler", "host", "step", "lora", "staleness", "packing")
_BATCH = flags.DEFINE_integer("batch", None, "Batch size (suite default if unset).")
_LENGTH = flags.DEFINE_integer("length", None, "Sequence length (suite default if unset).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Timed repetitions (suite default if unset).")
_TUNIX = flags.DEFINE_string("tunix_python", None, "sampler and step suites: the python of a venv with google-tunix.")
_TABLES = flags.DEFINE_string(
    "tables", None, "sampler suite: a comma-separated subset of tiny,plain,uniform,long_tailed."
)
_MODEL = flags.DEFINE_string(
    "model", None, "step and lora suites: tiny (configs/tiny.py) or qwen3_0.6b (its shapes, bf16; for a GPU)."
)
_SHAPES = flags.DEFINE_string(
    "shapes", None, "lora suite: the shapes to run, comma-separated (tiny, wide, qwen3_0.6b; default: --model's)."
)
_PEER = flags.DEFINE_string(
    "peer", None, "step suite: tunix = one step of ours and of tunix side by side (needs --tunix_python)."
)
_METHOD = flags.DEFINE_string(
    "method",
    None,
    "step suite with --peer: grpo (default; a GRPO step each) or ppo (our CompPO, PPO, "
    "PPO with a full critic and GRPO beside tunix's PPO, phase by phase).",
)


def main(argv):
    if len(argv) != 2 or argv[1] not in SUITES:
        raise app.UsageError(f"usage: benchmark.py SUITE, with SUITE one of {SUITES}")
    suite = importlib.import_module(f"benchmarks.{argv[1]}")
    overrides = {
        "batch": _BATCH.value,
        "length": _LENGTH.value,
        "repeats": _REPEATS.value,
        "tunix_python": _TUNIX.value,
        "tables": _TABLES.value,
        "model": _MODEL.value,
        "shapes": _SHAPES.value,
        "peer": _PEER.value,
        "method": _METHOD.value,
    }
    suite.run(**{name: value for name, value in overrides.items() if value is not None})


if __name__ == "__main__":
    cli.run(main)
