"""Export a training run's checkpoint for serving or sharing.

    python launch/export.py --run=runs/tiny --step=best --out=exported [--format=hf|peft]

`hf` (the default) writes safetensors + config.json + the tokenizer files that
`transformers.AutoModelForCausalLM.from_pretrained` and vLLM load; a LoRA run's adapters are
merged into its base. `peft` writes a LoRA run's adapters in PEFT's layout
(adapter_config.json + adapter_model.safetensors, loaded by `peft.PeftModel.from_pretrained` on
the base it names; a base the run made itself, by its warm start, goes along under <out>/base).
A full fine-tuning run exports `hf` only. Details: comppo_jax.eval.export.

`--out` gets the whole export or nothing. It is written beside `--out` and put in place when complete,
only if `--out` is still new or empty (of two exports to one folder, one succeeds and the other says
so); a failure such as a full disk, or SIGTERM / Ctrl-C, removes what was written and says in one line
that nothing was written to `--out`.
"""

from __future__ import annotations

from absl import flags

from comppo_jax import cli

_RUN = flags.DEFINE_string(
    "run", None, "The training run's output_dir (holding checkpoints/ and config.json).", required=True
)
_STEP = flags.DEFINE_string("step", "best", "best (by dev accuracy), latest (or last) or a saved step number.")
_OUT = flags.DEFINE_string("out", None, "The directory to write (new or empty).", required=True)
_FORMAT = flags.DEFINE_enum(
    "format", "hf", ["hf", "peft"], "hf: merged weights for transformers / vLLM; peft: LoRA adapters."
)
cli.check_location_flags("run", "out")


def main(argv):
    del argv
    from comppo_jax.eval.export import export_run

    for line in export_run(_RUN.value, _STEP.value, _OUT.value, _FORMAT.value):
        print(line, flush=True)


if __name__ == "__main__":
    cli.run(main)
