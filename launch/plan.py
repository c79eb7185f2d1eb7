"""Will this config's train step fit a TPU slice? AOT-compile it for the slice, from this host.

    python launch/plan.py --config=configs/qwen3_4b.py --topology=v5p:2x2x2 [--config.rollout.max_new_tokens=4096]

Needs libtpu (`pip install -e .[tpu]`), not a TPU. Builds `config.mesh` on the topology's abstract
chips, the run's params, optimizer states, reference params, critic and batches as sharded
shapes (nothing is allocated), compiles the sampler, the scoring pass, the actor update and the
critic update with the TPU compiler, and prints per chip: arguments, outputs, resident state the step does not
take, temporaries, generated code, the compiler's peak, the conservative args + out + temp + code, the verdict
against the chip's HBM and the compile time (comppo_jax.train.plan). A program that exceeds HBM
is reported as "does not fit (needs ...)". Then the predicted step time: each program's FLOPs, HBM
and interconnect bytes per chip read from its optimized HLO (loops counted by their trip counts),
its roofline time on the chip's published peaks, how often a train step runs it, and the step's
total and MFU (comppo_jax.train.cost). `--markdown=FILE` / `--time_markdown=FILE` append the
tables as markdown.
"""

from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from comppo_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", "configs/qwen3_4b.py", "The run's ml_collections config file.")
_TOPOLOGY = flags.DEFINE_list("topology", ["v5p:2x2x2"], "TPU topologies, e.g. v5p:2x2x2,v5e:4x4,v4:2x2x1,v6e:4x4.")
_PROMPT = flags.DEFINE_integer("prompt_length", 512, "Prompt tokens per row (the response is rollout.max_new_tokens).")
_STEPS = flags.DEFINE_list("steps", ["sample", "score", "actor", "critic"], "Programs to compile: sample, score, actor, critic.")
_MARKDOWN = flags.DEFINE_string("markdown", "", "Append the memory table's rows as markdown to this file.")
_TIME_MARKDOWN = flags.DEFINE_string("time_markdown", "", "Append the step-time rows (and a `step` row: total, MFU) as markdown to this file.")


def main(argv):
    del argv
    from comppo_jax.train import plan

    cfg = _CONFIG.value
    name = os.path.basename(flags.FLAGS["config"].config_filename)
    for topology in _TOPOLOGY.value:
        result = plan.plan(cfg, topology, prompt_length=_PROMPT.value, steps=tuple(_STEPS.value), log=lambda m: print(m, flush=True))
        print(plan.format_plan(result), flush=True)
        prefix = [name, topology, str(result.length)]
        if _MARKDOWN.value:
            with open(_MARKDOWN.value, "a") as f:
                for row in plan.table_rows(result):
                    f.write("| " + " | ".join(prefix + row) + " |\n")
        if _TIME_MARKDOWN.value:
            summary = plan.step_summary(result)
            with open(_TIME_MARKDOWN.value, "a") as f:
                for row in plan.time_rows(result):
                    f.write("| " + " | ".join(prefix + row) + " |\n")
                total = ["**step**", "", "", "", "", "", "", f"**{summary.seconds:.3g}**", f"MFU **{summary.mfu:.1%}**"]
                f.write("| " + " | ".join(prefix + total) + " |\n")


if __name__ == "__main__":
    cli.run(main)
