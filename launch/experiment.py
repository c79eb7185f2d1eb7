"""Run a named experiment (seeds x configs) and write its report.

    python launch/experiment.py --experiment=configs/experiments_tiny.py:main --root=runs/experiments_tiny [--jobs=2]

Runs what has not finished (launch/train.py subprocesses, `--jobs` at a time; identical runs are
shared between experiments under <root>/runs/) and, when the experiment asks for them, held-out
gate and critic diagnostics of each run's final checkpoint (launch/eval.py, written beside the
run), then writes <root>/<name>/:
report.md (tables shaped like the paper's, and a link to each run's own report.html,
launch/report.py's page), *.png (bar plots), runs.csv (every run's endpoints) and commands.sh
(the exact training commands). `--report_only` skips training and reports what
exists (under way, the arms that finished). Failed runs are listed and make the exit status
non-zero; nothing finished is lost.

Ctrl-C (SIGINT) or SIGTERM stops the running runs at a checkpoint and starts no other; report.md
then lists every unfinished run, and the same command resumes them. The exit status is 128 + the
signal's number (130 for Ctrl-C). Killed outright (kill -9), the runner takes its runs down with it:
each gets SIGTERM and stops at a checkpoint, so the same command resumes them too.
"""

from __future__ import annotations

import csv
import io
import os
import shlex
import sys
import threading

from absl import flags

from comppo_jax import cli, storage

_EXPERIMENT = cli.define_config_file("experiment", None, "configs/experiments.py:NAME (or experiments_tiny.py:NAME).")
_ROOT = flags.DEFINE_string("root", "runs/experiments", "Where runs (runs/) and reports (<name>/) go.")
_JOBS = flags.DEFINE_integer("jobs", 1, "Training runs at a time.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Do not train; report the finished runs.")
cli.check_location_flags("root")


def main(argv):
    del argv
    from comppo_jax.eval import experiment as experiments
    from comppo_jax.eval.report import REPORTS, endpoints
    from comppo_jax.eval.run_report import write_run_report

    exp = _EXPERIMENT.value
    root = _ROOT.value
    lock = threading.Lock()  # runs log from worker threads

    def log(message: str) -> None:
        with lock:
            print(message, flush=True)

    outcome = experiments.run_experiment(exp, root, _JOBS.value, train=not _REPORT_ONLY.value, log=log)
    finished = [r for arm in outcome.arms.values() for r in arm.values()]
    body, plots = REPORTS[exp.kind](exp, outcome)
    folder = storage.join(root, exp.name)
    with storage.local_folder(folder) as local:  # matplotlib writes local files
        for name, draw in plots.items():
            draw(storage.join(local, name))
    storage.write_text(
        storage.path(folder) / "commands.sh", experiments.commands_script(outcome, root, exp.held_out_problems)
    )
    rows = []
    for result in [r for rs in outcome.screen.values() for r in rs] + finished:
        rows.append(
            {
                "arm": result.run.arm,
                "seed": result.run.seed,
                "run": result.directory,
                "base": result.base,
                **endpoints(result, exp),
                **result.held_out,
                "overrides": " ".join(result.run.overrides),
            }
        )
    if rows:
        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = io.StringIO()
        writer = csv.DictWriter(table, columns, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(rows)
        storage.write_text(storage.path(folder) / "runs.csv", table.getvalue())
    # Each finished run's own page (comppo_jax.eval.run_report), linked from the report.
    pages = []
    for result in finished:
        try:
            page = os.path.relpath(write_run_report(result.directory), folder)
        except (OSError, ValueError) as error:
            log(f"no report page for {result.directory}: {error}")
            continue
        pages.append(f"- {result.run.arm} seed {result.run.seed}: [{page}]({page})")
    failed = "".join(f"\n- {run.arm} seed {run.seed}: {why}" for run, why in outcome.failures.items())
    unfinished = "".join(f"\n- {run.arm} seed {run.seed}: {why}" for run, why in outcome.unfinished.items()) + "".join(
        f"\n- arm {arm}: not started" for arm in outcome.not_started
    )
    # The command that finishes them: this one, training.
    resume = shlex.join(["python", *(a for a in sys.argv if not a.startswith(("--report_only", "--noreport_only")))])
    stopped = f"The experiment was stopped by {outcome.stopped_by.name}. " if outcome.stopped_by else ""
    report = (
        f"# Experiment {exp.name} ({exp.kind})\n\nBase config `{exp.base_config}`; runs under `{root}/runs/`; "
        f"exact commands in `commands.sh`; every run's endpoints in `runs.csv`.\n\n{body}\n"
        + "".join(f"\n![{name}]({name})\n" for name in plots)
        + (
            "\n## Run pages\n\nEach run's report: curves, phases, and its kept responses coloured by gate and "
            "advantage.\n\n" + "\n".join(pages) + "\n"
            if pages
            else ""
        )
        + (f"\n## Failed runs{failed}\n" if failed else "")
        + (
            f"\n## Unfinished runs\n\n{stopped}These runs are not in the tables above; `{resume}` resumes each "
            f"from its newest checkpoint and runs the rest.\n{unfinished}\n"
            if unfinished
            else ""
        )
    )
    storage.write_text(storage.path(folder) / "report.md", report)
    print(report)
    if unfinished:
        print(f"unfinished runs are listed in {folder}/report.md; resume them with: {resume}", file=sys.stderr)
    if outcome.stopped_by:
        sys.exit(128 + outcome.stopped_by)
    if outcome.failures or (unfinished and not _REPORT_ONLY.value):
        sys.exit(1)


if __name__ == "__main__":
    flags.mark_flag_as_required("experiment")
    from comppo_jax.eval.experiment import FIELD_HELP

    cli.run(main, field_help={"experiment": FIELD_HELP})
