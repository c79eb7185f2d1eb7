"""Named experiments as sets of training runs (paper sections 6-7, appendix B).

An experiment config (configs/experiments.py) names a base training config, overrides shared by
every run, seeds, and arms: `(name, overrides)` pairs in the `--config.key=value` syntax of
launch/train.py. Optional per-arm grids (`(name, ("key=v1,v2", ...))`) either

- screen (`screen_seed` set): every grid cell runs once at `screen_seed`; the cell with the best
  Final (ties: Best) dev accuracy is the arm's configuration for all seeds (paper section 6.1); or
- expand (`screen_seed` None): every cell is an arm of its own, run at all seeds (the stress grid).

An override value may refer to another arm's finished runs:
- `{mean_gate:ARM}`: the mean of ARM's runs' mean rollout gate over all seeds (the factorial's
  mean-matched fixed gate, section 6.3);
- `{gate_profile:ARM}`: the same seed's ARM run's gate_profile.json (the position-only control's
  schedule, section 6.4).
Arms with references run after the arms they name.

A run is identified by its base config and overrides (seed included), so identical runs in
different arms or experiments (e.g. full CompPO in main, factorial and controls) are run once
under `<root>/runs/<hash>/`. A finished run (summary.json) is never rerun; an interrupted one
resumes from its checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

from comppo_jax import storage
from comppo_jax.train.outputs import METRICS_FILE, read_metrics

KINDS = ("main", "factorial", "controls", "stress", "group", "statistics", "variants", "lora")
SUMMARY_FILE = "summary.json"
HELD_OUT_FILE = "held_out.json"  # written by launch/eval.py --held_out_problems
_REFERENCE = re.compile(r"\{(mean_gate|gate_profile):([A-Za-z0-9_]+)\}")
# One line per experiment config field (launch/experiment.py --help).
FIELD_HELP = {
    "name": "the report's folder under --root",
    "kind": "which report: " + " | ".join(KINDS),
    "base_config": "the launch/train.py config every run starts from",
    "overrides": "key=value for every run, on top of the arms' (e.g. model.path=..., data.path=...)",
    "seeds": "the seeds every arm runs",
    "arms": "(name, overrides) per arm",
    "grids": '(arm, ("key=v1,v2", ...)) per arm: screened at screen_seed, or every cell an arm',
    "screen_seed": "the seed grid cells are screened at (None: every cell is an arm)",
    "last": "Last-N endpoint: the mean of the final N dev evaluations",
    "target": "dev accuracy whose first crossing is reported as step-to-target (None: not reported)",
    "max_drop": "stability rule (section 6.5): the peak-to-final dev-accuracy drop stays below this",
    "run_below": "stability rule: no this many consecutive post-peak evaluations below the warm-start accuracy",
    "held_out_problems": "dev prompts for the final-checkpoint gate / critic diagnostics (0: none)",
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: `overrides` ("key=value", seed included) on `base_config`."""

    arm: str
    seed: int
    base_config: str
    overrides: tuple[str, ...]

    @property
    def key(self) -> str:
        text = json.dumps([self.base_config, sorted(self.overrides)])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def directory(self, root: str) -> str:
        return storage.join(root, "runs", self.key)

    def command(self, root: str, python: str = "python") -> list[str]:
        """The launch/train.py command line of this run."""
        return [
            python,
            "launch/train.py",
            *self.config_flags(),
            f"--config.output_dir={self.directory(root)}",
            f"--config.warm_start.cache_dir={storage.join(root, 'warm_start')}",
            "--config.progress=False",
        ]

    def held_out_command(self, root: str, problems: int, python: str = "python") -> list[str]:
        """The launch/eval.py command line of the held-out diagnostics of this run's final checkpoint."""
        return [
            python,
            "launch/eval.py",
            *self.config_flags(),
            f"--checkpoint={self.directory(root)}",
            "--step=latest",
            "--accuracy=False",
            f"--held_out_problems={problems}",
            f"--output={self.directory(root)}",
        ]

    def config_flags(self) -> list[str]:
        return [f"--config={self.base_config}", *(f"--config.{o}" for o in self.overrides)]


def parse_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"experiment override {item!r}: expected key=value (a launch/train.py --config.key=value)")
    return key, value


def arms_of(exp) -> list[tuple[str, tuple[str, ...]]]:
    """The experiment's arms with grids expanded (stress) and without screening applied."""
    arms = []
    grids = dict(exp.grids)
    for name, overrides in exp.arms:
        if name not in grids or exp.screen_seed is not None:
            arms.append((name, tuple(exp.overrides) + tuple(overrides)))
            continue
        for cell in grid_cells(grids[name]):
            label = ",".join(f"{k.split('.')[-1]}={v}" for k, v in (parse_override(c) for c in cell))
            arms.append((f"{name}[{label}]", tuple(exp.overrides) + tuple(overrides) + cell))
    return arms


def grid_cells(axes) -> list[tuple[str, ...]]:
    """("key=v1,v2", "other=a,b") -> every combination as ("key=v1", "other=a"), ..."""
    parsed = [parse_override(axis) for axis in axes]
    return [
        tuple(f"{key}={value}" for (key, _), value in zip(parsed, values))
        for values in itertools.product(*(values.split(",") for _, values in parsed))
    ]


def screen_runs(exp) -> dict[str, list[Run]]:
    """arm -> its screen's runs (one per grid cell at `screen_seed`); empty without a screen."""
    if exp.screen_seed is None:
        return {}
    arms = dict(exp.arms)
    return {
        name: [
            Run(
                name,
                exp.screen_seed,
                exp.base_config,
                tuple(exp.overrides) + tuple(arms[name]) + cell + (f"seed={exp.screen_seed}",),
            )
            for cell in grid_cells(axes)
        ]
        for name, axes in exp.grids
    }


def references(overrides) -> list[tuple[str, str]]:
    return [match.groups() for item in overrides for match in _REFERENCE.finditer(item)]


def resolve(overrides, seed: int, done: dict[str, dict[int, RunResult]]) -> tuple[str, ...]:
    """Fills `{mean_gate:ARM}` and `{gate_profile:ARM}` from finished runs (see the module docstring)."""

    def fill(match):
        what, arm = match.groups()
        if arm not in done or not done[arm]:
            raise ValueError(f"override {match.group(0)} names arm {arm!r}, which has no finished runs")
        ungated = [r.directory for r in done[arm].values() if "mean_gate" not in r.summary]
        if ungated:  # a GRPO run with rollout.old_log_probs=sampler scores no gate
            raise ValueError(
                f"override {match.group(0)}: arm {arm!r}'s runs {ungated} logged no gate (no behaviour pass)"
            )
        if what == "mean_gate":
            return repr(float(np.mean([r.summary["mean_gate"] for r in done[arm].values()])))
        if seed not in done[arm]:
            raise ValueError(f"override {match.group(0)}: arm {arm!r} has no finished run for seed {seed}")
        return storage.join(done[arm][seed].directory, "gate_profile.json")

    return tuple(_REFERENCE.sub(fill, item) for item in overrides)


@dataclasses.dataclass(eq=False)
class RunResult:
    """A finished run's summary and dev-accuracy curve (steps: actor updates before each evaluation,
    so runs with and without a critic warm-up share one axis)."""

    run: Run
    directory: str
    summary: dict
    steps: np.ndarray
    accuracies: np.ndarray
    held_out: dict  # final-checkpoint diagnostics (comppo_jax.eval.held_out); {} if not computed

    @property
    def base(self) -> float:
        return float(self.summary["warm_start_dev_accuracy"])


def load_result(run: Run, root: str) -> RunResult | None:
    """The run's result if it finished (with its held-out diagnostics if computed), else None."""
    directory = run.directory(root)
    path = storage.path(directory) / SUMMARY_FILE
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    rows = [r for r in read_metrics(storage.path(directory) / METRICS_FILE) if "dev_accuracy" in r]
    if not rows:
        raise ValueError(
            f"{directory}/{METRICS_FILE} has no dev_accuracy rows: set train.eval_every so the run evaluates"
        )
    held_out_path = storage.path(directory) / HELD_OUT_FILE
    held_out = json.loads(held_out_path.read_text()) if held_out_path.exists() else {}
    return RunResult(
        run,
        directory,
        summary,
        np.array([r["actor_updates"] for r in rows], float),
        np.array([r["dev_accuracy"] for r in rows], float),
        held_out,
    )


PROGRESS_EVERY_S = 20.0


@contextlib.contextmanager
def command_log(path):
    """An appendable OS file for a subprocess's output that ends up at `path`: `path` itself on a
    disk; on a bucket a local file seeded with the log so far and uploaded whole when done."""
    if not storage.is_remote(path):
        with open(path, "a") as out:  # a local run path: a subprocess writes to it through the OS
            yield out
        return
    with tempfile.NamedTemporaryFile("a+", suffix=".log") as local:
        if path.exists():
            local.write(path.read_text())
            local.flush()
        try:
            yield local
        finally:
            local.flush()
            local.seek(0)
            storage.write_text(path, local.read())


def run_progress(directory: str, command: list[str]) -> str:
    """Where a run's command is, from what it has written: its newest metrics row, else its first phase."""
    if os.path.basename(command[1]) != "train.py":
        return "held-out diagnostics"
    rows = read_metrics(storage.path(directory) / METRICS_FILE)
    if not rows:
        return "warm start, first evaluation or compiling"
    accuracy = [r["dev_accuracy"] for r in rows if "dev_accuracy" in r]
    return f"step {rows[-1]['step']}" + (f", dev accuracy {accuracy[-1]:.3f}" if accuracy else "")


def run_reporting(command: list[str], out, progress, log) -> int:
    """Runs `command` (output to `out`), logging `progress()` every PROGRESS_EVERY_S seconds; its exit code."""
    started = time.time()
    with subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT) as process:
        try:
            while True:
                try:
                    return process.wait(timeout=PROGRESS_EVERY_S)
                except subprocess.TimeoutExpired:
                    log(f"  {progress()} ({time.time() - started:.0f} s)")
        except BaseException:  # e.g. Ctrl-C: the run stops with the runner (it resumes from its checkpoint)
            process.kill()
            raise


def execute(
    runs: list[Run], root: str, *, jobs: int, held_out_problems: int, train: bool, log
) -> tuple[dict[Run, RunResult], dict[Run, str]]:
    """Trains what has not finished and computes missing held-out diagnostics (`jobs` runs at a
    time, each a launch/train.py then a launch/eval.py subprocess logging to <run>/train.log);
    returns (results, failures: run -> why). A failed run does not stop the others. With
    train=False nothing is launched: finished runs are collected as they are."""
    runs = list(dict.fromkeys(runs))  # unique, in order

    def launch(run: Run) -> str | None:
        directory = run.directory(root)
        done = (storage.path(directory) / SUMMARY_FILE).exists()
        needs_held_out = held_out_problems > 0 and not (storage.path(directory) / HELD_OUT_FILE).exists()
        if not train or (done and not needs_held_out):
            return None
        storage.write_text(
            storage.path(directory) / "run.json",
            json.dumps(
                {"arm": run.arm, "seed": run.seed, "base_config": run.base_config, "overrides": list(run.overrides)},
                indent=2,
            ),
        )
        commands = [] if done else [run.command(root, sys.executable)]
        if commands and storage.names(storage.path(directory) / "checkpoints"):
            commands[0].append("--config.resume=True")
        if held_out_problems > 0:
            commands.append(run.held_out_command(root, held_out_problems, sys.executable))
        log(f"start {run.arm} seed {run.seed}: {directory}")
        with command_log(storage.path(directory) / "train.log") as out:
            for command in commands:
                out.write("$ " + shlex.join(command) + "\n")
                out.flush()
                code = run_reporting(
                    command, out, lambda: f"{run.arm} seed {run.seed}: {run_progress(directory, command)}", log
                )
                if code:
                    return f"{os.path.basename(command[1])} exit code {code}; see {directory}/train.log"
        return None

    results, failures = {}, {}
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        for run, failure in zip(runs, pool.map(launch, runs)):
            try:
                result = None if failure else load_result(run, root)
            except (OSError, ValueError) as e:
                failure = str(e)
            if failure:
                failures[run] = failure
                log(f"FAILED {run.arm} seed {run.seed}: {failure}")
            elif result is not None:
                results[run] = result
                log(f"{run.arm} seed {run.seed}: final dev accuracy {result.summary['final_dev_accuracy']:.3f}")
    return results, failures


@dataclasses.dataclass
class Outcome:
    """Everything an experiment produced: per-arm results by seed, its screen, failures, commands."""

    arms: dict[str, dict[int, RunResult]]
    screen: dict[str, list[RunResult]]
    selected: dict[str, tuple[str, ...]]  # arm -> chosen grid cell
    failures: dict[Run, str]
    runs: list[Run]


def select(results: list[RunResult]) -> RunResult:
    """The screen's choice: best Final, ties broken by Best, then by grid order."""
    best = max(range(len(results)), key=lambda i: (results[i].accuracies[-1], results[i].accuracies.max(), -i))
    return results[best]


def run_experiment(exp, root: str, jobs: int = 1, train: bool = True, log=print) -> Outcome:
    """Plans, runs what is missing (unless train=False) and collects `exp` under `root` (see the
    module docstring)."""
    execute_planned = lambda planned: execute(
        planned, root, jobs=jobs, held_out_problems=exp.held_out_problems, train=train, log=log
    )
    if exp.kind not in KINDS:
        raise ValueError(f"experiment {exp.name}: kind={exp.kind!r}; expected one of {KINDS}")
    all_runs, failures = [], {}
    screens = screen_runs(exp)
    screen_results, selected = {}, {}
    if screens:
        planned = [run for runs in screens.values() for run in runs]
        all_runs += planned
        results, failed = execute_planned(planned)
        failures.update(failed)
        for arm, runs in screens.items():
            finished = [results[r] for r in runs if r in results]
            screen_results[arm] = finished
            if finished:
                cells = grid_cells(dict(exp.grids)[arm])
                selected[arm] = cells[runs.index(select(finished).run)]
    arms = arms_of(exp)
    names = [name for name, _ in arms]
    for name, overrides in arms:
        for _, target in references(overrides):
            if target not in names:
                raise ValueError(f"experiment {exp.name}: arm {name!r} refers to unknown arm {target!r}")
    done: dict[str, dict[int, RunResult]] = {}
    for stage in (False, True):  # arms without references, then arms with them
        planned = []
        for name, overrides in arms:
            if bool(references(overrides)) != stage:
                continue
            if name in dict(exp.grids) and exp.screen_seed is not None:
                if name not in selected:
                    log(f"skip arm {name}: its screen has no finished run")
                    continue
                overrides = overrides + selected[name]
            for seed in exp.seeds:
                try:
                    resolved = resolve(overrides, seed, done)
                except ValueError as e:
                    log(f"skip {name} seed {seed}: {e}")
                    continue
                planned.append(Run(name, seed, exp.base_config, resolved + (f"seed={seed}",)))
        all_runs += planned
        results, failed = execute_planned(planned)
        failures.update(failed)
        for run in planned:
            if run in results:
                done.setdefault(run.arm, {})[run.seed] = results[run]
    return Outcome(done, screen_results, selected, failures, all_runs)


def commands_script(outcome: Outcome, root: str, held_out_problems: int = 0) -> str:
    """A shell script with every run's exact launch/train.py (and launch/eval.py) commands, in order."""
    lines = [
        "#!/bin/bash",
        "# Generated by launch/experiment.py: the exact commands of this experiment's runs.",
        "set -e",
    ]
    for run in dict.fromkeys(outcome.runs):
        lines.append(f"# {run.arm}, seed {run.seed}")
        lines.append(shlex.join(run.command(root)))
        if held_out_problems:
            lines.append(shlex.join(run.held_out_command(root, held_out_problems)))
    return "\n".join(lines) + "\n"
