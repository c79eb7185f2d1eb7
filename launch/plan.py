"""Will this config's train step fit a TPU slice? AOT-compile it for the slice, from this host.

    python launch/plan.py --config=configs/qwen3_4b.py --topology=v5p:2x2x2 [--config.rollout.max_new_tokens=4096]

Needs libtpu (`pip install -e .[tpu]`), not a TPU. Builds `config.mesh` on the topology's abstract
chips, the run's params, optimizer states, reference params, critic and batches as sharded
shapes (nothing is allocated), compiles the resharding into the sampler's decode layout
(rollout.mesh.tensor; the layout auto picks, every group size's decode floor and the decode loop's
collectives are printed), the sampler, the scoring pass, the critic's values, the actor update and the critic update
with the TPU compiler, and prints per chip: arguments, outputs, resident state the step does not
take, temporaries, generated code, the compiler's peak, the conservative args + out + temp + code, the verdict
against the chip's HBM and the compile time (comppo_jax.planning.planner). A program that exceeds HBM
is reported as "does not fit (needs ...)". Then the predicted step time: each program's FLOPs, HBM
and interconnect bytes per chip read from its optimized HLO (loops counted by their trip counts),
its roofline time on the chip's published peaks, how often a train step runs it, and the step's
total and MFU (comppo_jax.costs.hlo_cost). `--markdown=FILE` / `--time_markdown=FILE` append the
tables as markdown, `--summary_markdown=FILE` one row per topology (decode beside its floor, the
step, MFU); `--decode_layouts=train,4` also compiles the sampler in those layouts, side by side.

`--overlap` prints instead, without compiling, the overlapped step (rollout.staleness >= 1 with
mesh.rollout_devices) beside the synchronous colocated one for every rollout / learner split of
the slice, with every response at the limit and with a real run's long-tailed lengths, the
learner's batch padded or packed as train.packing lays it out (comppo_jax.planning.overlap):

    python launch/plan.py --config=configs/qwen3_4b.py --topology=v5p:2x2x2,v6e:4x4 --overlap
"""

from __future__ import annotations

import os

from absl import flags

from comppo_jax import cli, storage

_CONFIG = cli.define_config_file("config", "configs/qwen3_4b.py", "The run's ml_collections config file.")
_TOPOLOGY = flags.DEFINE_list("topology", ["v5p:2x2x2"], "TPU topologies, e.g. v5p:2x2x2,v5e:4x4,v4:2x2x1,v6e:4x4.")
_PROMPT = flags.DEFINE_integer("prompt_length", 512, "Prompt tokens per row (the response is rollout.max_new_tokens).")
_STEPS = flags.DEFINE_list(
    "steps",
    ["reshard", "sample", "resume", "score", "values", "actor", "critic"],
    "Programs to compile: reshard (the weights into the decode layout), sample, resume (with "
    "rollout.environment: the host's replies written into the engine state, once per extra turn), score, "
    "values (the critic's V_t for the credit), actor, critic.",
)
_MARKDOWN = flags.DEFINE_string("markdown", "", "Append the memory table's rows as markdown to this file.")
_TIME_MARKDOWN = flags.DEFINE_string(
    "time_markdown", "", "Append the step-time rows (and a `step` row: total, MFU) as markdown to this file."
)
_DECODE_LAYOUTS = flags.DEFINE_list(
    "decode_layouts",
    [],
    "Also compile the sampler in these decode layouts (rollout.mesh.tensor "
    "values: train, auto, a group size) and report each beside the config's own, the other "
    "programs compiled once.",
)
_OVERLAP = flags.DEFINE_bool(
    "overlap", False, "Print the overlapped step's cost model for every rollout / learner split (no compiles)."
)
_CALIBRATE = flags.DEFINE_bool(
    "calibrate_learner",
    False,
    "--overlap: compile the learner's programs (score, actor, critic) "
    "on the slice and scale the learner's roofline by their predicted time over it.",
)
_SUMMARY_MARKDOWN = flags.DEFINE_string(
    "summary_markdown",
    "",
    "Append one row per topology as markdown to this file: the decode "
    "layout, each program's seconds per step, decode beside its floor, the step and its MFU.",
)
cli.check_location_flags("markdown", "time_markdown", "summary_markdown")


def main(argv):
    del argv
    from comppo_jax.planning import planner

    cfg = _CONFIG.value
    name = os.path.basename(flags.FLAGS["config"].config_filename)
    if _OVERLAP.value:
        for topology in _TOPOLOGY.value:
            print_overlap(cfg, name, topology)
        return
    for topology in _TOPOLOGY.value:
        log = lambda m: print(m, flush=True)
        result = planner.plan(cfg, topology, prompt_length=_PROMPT.value, steps=tuple(_STEPS.value), log=log)
        results = [result] + [
            planner.with_decode_layout(cfg, result, layout, prompt_length=_PROMPT.value, log=log)
            for layout in _DECODE_LAYOUTS.value
        ]
        for index, result in enumerate(results):
            print(planner.format_plan(result), flush=True)
            prefix = [name, topology, str(result.length)]
            # Every layout's own sampler rows; the other programs' once.
            label = f" ({planner.layout_label(result)})" if _DECODE_LAYOUTS.value else ""
            rows = [
                [row[0] + label * (row[0] in planner.SAMPLER_STEPS)] + row[1:]
                for row in planner.table_rows(result)
                if index == 0 or row[0] in planner.SAMPLER_STEPS
            ]
            write_rows(_MARKDOWN.value, prefix, rows)
            if _TIME_MARKDOWN.value:
                summary = planner.step_summary(result)
                total = [
                    "**step**" + label,
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    f"**{summary.seconds:.3g}**",
                    f"MFU **{summary.mfu:.1%}**",
                ]
                write_rows(_TIME_MARKDOWN.value, prefix, planner.time_rows(result) + [total])
            write_rows(_SUMMARY_MARKDOWN.value, prefix, [planner.summary_row(result)])


def print_overlap(cfg, name: str, topology: str) -> None:
    """The overlapped step's splits on `topology` (its chips counted from the shape, e.g. 2x2x2 = 8)."""
    import math

    import numpy as np

    from comppo_jax.costs.chips import CHIPS
    from comppo_jax.models import model_config
    from comppo_jax.planning import overlap, planner
    from comppo_jax.train import controller

    family, shape = topology.split(":")
    chips = math.prod(int(d) for d in shape.split("x"))
    config, rows, limit = (
        model_config(cfg.model),
        cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
        cfg.rollout.max_new_tokens,
    )
    epochs = max(controller.KNOBS["actor_epochs"])  # the phase controller's epochs per step (2 but in its last phase)
    chip, remat = CHIPS[family], cfg.model.remat == "full"
    packed = cfg.train.get("packing", False)  # the learner's layout, as the compiled programs have it
    scale = 1.0
    if _CALIBRATE.value:
        compiled = planner.plan(
            cfg, topology, prompt_length=_PROMPT.value, steps=("score", "actor", "critic"), log=lambda m: None
        )
        seconds = sum(t.seconds * t.runs for t in planner.step_times(compiled))
        layout = overlap.LearnerBatch.of(
            overlap.long_tail_lengths(rows, limit), _PROMPT.value, limit, packed=packed, segment_skip=packed
        )
        roofline = overlap.learner_seconds(config, chip, chips, layout, epochs=epochs, remat=remat)
        scale = seconds / roofline
        print(
            f"learner calibrated on the compiled programs: {seconds:.3g} s against the roofline's {roofline:.3g} s "
            f"(x{scale:.2f})"
        )
    for label, lengths in (
        ("every response at the limit", np.full(rows, limit)),
        ("long-tailed lengths", overlap.long_tail_lengths(rows, limit)),
    ):
        options = dict(
            prompt_length=_PROMPT.value,
            epochs=epochs,
            remat=remat,
            learner_scale=scale,
            packed=packed,
            segment_skip=packed,
        )
        results = overlap.splits(config, chip, chips, lengths, **options)
        print(
            f"{name} on {topology} ({chips} chips), {rows} rows, {label} (mean {lengths.mean():.0f}, "
            f"longest {lengths.max()}), {epochs} epochs:"
        )
        print("\n".join(planner.aligned(overlap.COLUMNS, overlap.split_rows(results))), flush=True)
        moved = overlap.splits(config, chip, chips, lengths, scoring="rollout", **options)
        best = min(moved[1:], key=lambda s: s.seconds)
        print(
            f"scoring on the rollout's chips instead (the critic's features cross): best {best.rollout_devices} "
            f"rollout chips, {best.seconds:.3g} s, {moved[0].seconds / best.seconds:.2f}x",
            flush=True,
        )


def write_rows(path: str, prefix: list[str], rows: list[list[str]]) -> None:
    """Appends `rows` (after `prefix`) to the markdown file `path` ("": none)."""
    if path:
        storage.append_lines(path, ["| " + " | ".join(prefix + row) + " |" for row in rows])


if __name__ == "__main__":
    cli.run(main)
