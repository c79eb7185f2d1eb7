"""A training run's report: one self-contained HTML page that opens from disk.

    python launch/report.py --run=runs/tiny [--out=runs/tiny/report.html]

Config and summary, the curves, the phase controller's timeline, the gate profile by position,
and the responses the run kept (outputs.sample_every) with each token coloured by its gate
kappa_t or its advantage, beside the other estimator's advantages from the same rewards and
values. Works on a run still going (what it has so far); a torn or damaged file is left out and
named on the page. Details: comppo_jax.eval.run_report.
"""

from __future__ import annotations

from absl import flags

from comppo_jax import cli

_RUN = flags.DEFINE_string("run", None, "The training run's output_dir.", required=True)
_OUT = flags.DEFINE_string("out", None, "The page to write (default: <run>/report.html).")
cli.check_location_flags("run", "out")


def main(argv):
    del argv
    from comppo_jax.eval.run_report import write_run_report

    print(write_run_report(_RUN.value, _OUT.value), flush=True)


if __name__ == "__main__":
    cli.run(main)
