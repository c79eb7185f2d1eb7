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
  schedule, section 6.4), kept as `{root}/runs/<hash>/gate_profile.json` so that the run's identity
  does not depend on where the root is (the command line gets the path under this root).
Arms with references run after the arms they name.

A run is identified by its base config and overrides (seed included), so identical runs in
different arms or experiments (e.g. full CompPO in main, factorial and controls) are run once
under `<root>/runs/<hash>/`. A finished run (summary.json, and held_out.json when the experiment
asks for held-out diagnostics) is never rerun; an unfinished one resumes from its newest checkpoint.

SIGINT or SIGTERM to the runner is forwarded to its running children (launch/train.py saves a
checkpoint and stops) and starts nothing new; the runs it stopped are reported unfinished, never as
results. Each child also gets SIGTERM when the runner dies, kill -9 included (`Children`).
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
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from comppo_jax import storage, workers
from comppo_jax.runs.checkpoint import committed_steps
from comppo_jax.runs.outputs import METRICS_FILE, read_metrics

KINDS = ("main", "factorial", "controls", "stress", "group", "statistics", "variants", "lora", "baselines", "regime")
SUMMARY_FILE = "summary.json"
HELD_OUT_FILE = "held_out.json"  # written by launch/eval.py --held_out_problems
ROOT = "{root}"  # the experiment's root in a reference to another run's file (`Run.under`)
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

    def under(self, root: str) -> tuple[str, ...]:
        """The overrides with ROOT (a reference to another run's file) made `root`."""
        return tuple(o.replace(ROOT, root) for o in self.overrides)

    def command(self, root: str, python: str = "python") -> list[str]:
        """The launch/train.py command line of this run."""
        return [
            python,
            "launch/train.py",
            *self.config_flags(root),
            f"--config.output_dir={self.directory(root)}",
            f"--config.warm_start.cache_dir={storage.join(root, 'warm_start')}",
            "--config.progress=False",
        ]

    def held_out_command(self, root: str, problems: int, python: str = "python") -> list[str]:
        """The launch/eval.py command line of the held-out diagnostics of this run's final checkpoint."""
        return [
            python,
            "launch/eval.py",
            *self.config_flags(root),
            f"--checkpoint={self.directory(root)}",
            "--step=latest",
            "--accuracy=False",
            f"--held_out_problems={problems}",
            f"--output={self.directory(root)}",
        ]

    def config_flags(self, root: str) -> list[str]:
        return [f"--config={self.base_config}", *(f"--config.{o}" for o in self.under(root))]


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
        return storage.join(ROOT, "runs", done[arm][seed].run.key, "gate_profile.json")

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


def trained_summary(directory: str) -> dict | None:
    """The run's summary.json when it finished training; None without one, or with one that does not
    read (torn by a crash: said in one line), which its resume writes again."""
    path = storage.path(directory) / SUMMARY_FILE
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"{path} cannot be read ({error}): the run is taken as unfinished", file=sys.stderr, flush=True)
        return None
    return summary if isinstance(summary, dict) else None


def load_result(run: Run, root: str) -> RunResult | None:
    """The run's result if it finished (with its held-out diagnostics if computed), else None."""
    directory = run.directory(root)
    summary = trained_summary(directory)
    if summary is None:
        return None
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


class Children:
    """The runner's subprocesses. Within `with Children() as children:` (in the main thread), the
    first SIGINT or SIGTERM is forwarded to every running child and sets `stopped_by`, after which
    `run_reporting` starts nothing; further signals are ignored."""

    def __init__(self):
        self.stopped_by: signal.Signals | None = None
        self._running: set[subprocess.Popen] = set()
        # Worker threads start children; the main thread's handler signals them, reentrantly if signals nest.
        self._lock = threading.RLock()
        self._previous: dict = {}

    def __enter__(self) -> Children:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _forward(self, signum, frame) -> None:
        del frame
        with self._lock:
            if self.stopped_by is not None:
                return
            self.stopped_by = signal.Signals(signum)
            print(
                f"{self.stopped_by.name} received: stopping the {len(self._running)} running command(s) (each run "
                "saves a checkpoint) and starting no other; the same command resumes them (further signals are "
                "ignored)",
                file=sys.stderr,
                flush=True,
            )
            for process in self._running:
                process.send_signal(signum)

    def run_reporting(self, command: list[str], out, progress, log) -> int | None:
        """Runs `command` (its line and output to `out`), logging `progress()` every PROGRESS_EVERY_S
        seconds; its exit code, or None when a stop came before it started."""
        with self._lock:  # a stop either comes before the start, or is forwarded to the child
            if self.stopped_by is not None:
                return None
            out.write("$ " + shlex.join(command) + "\n")
            out.flush()
            # The child sets its parent-death signal itself (comppo_jax.cli.run): a preexec_fn would fork this
            # multithreaded process (JAX's threads) into Python code.
            env = {**os.environ, workers.PARENT_ENV: str(os.getpid())}
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            self._running.add(process)
        started = time.time()
        try:
            while True:
                try:
                    return process.wait(timeout=PROGRESS_EVERY_S)
                except subprocess.TimeoutExpired:
                    log(f"  {progress()} ({time.time() - started:.0f} s)")
        except BaseException:  # this thread failed: the child stops at a checkpoint rather than run on unwatched
            process.terminate()
            process.wait()
            raise
        finally:
            with self._lock:
                self._running.discard(process)


def unfinished_state(directory: str) -> str:
    """What an unfinished run has so far, in a few words."""
    if trained_summary(directory) is not None:
        return "trained, without its held-out diagnostics"
    steps = committed_steps(directory)
    return f"newest checkpoint at step {max(steps)}" if steps else "no checkpoint yet"


def execute(
    runs: list[Run], root: str, *, jobs: int, held_out_problems: int, train: bool, children: Children, log
) -> tuple[dict[Run, RunResult], dict[Run, str], dict[Run, str]]:
    """Trains what has not finished and computes missing held-out diagnostics (`jobs` runs at a
    time, each a launch/train.py then a launch/eval.py subprocess logging to <run>/train.log);
    returns (results, failures: run -> why, unfinished: run -> what it has). A failed run does not
    stop the others; a stop (`children`) starts nothing more. Whether a run finished is read from
    its directory, never from an exit code: launch/train.py stopped by a signal exits 0. With
    train=False nothing is launched: finished runs are collected as they are."""
    runs = list(dict.fromkeys(runs))  # unique, in order

    def finished(directory: str) -> bool:
        return trained_summary(directory) is not None and (
            held_out_problems == 0 or (storage.path(directory) / HELD_OUT_FILE).exists()
        )

    def launch(run: Run) -> str | None:
        directory = run.directory(root)
        if not train or finished(directory) or children.stopped_by is not None:
            return None
        storage.write_text(
            storage.path(directory) / "run.json",
            json.dumps(
                {"arm": run.arm, "seed": run.seed, "base_config": run.base_config, "overrides": list(run.overrides)},
                indent=2,
            ),
        )
        commands = [] if trained_summary(directory) is not None else [run.command(root, sys.executable)]
        if commands and committed_steps(directory):  # an unfinished run continues from its newest checkpoint
            commands[0].append("--config.resume=True")
        if held_out_problems > 0:
            commands.append(run.held_out_command(root, held_out_problems, sys.executable))
        log(f"start {run.arm} seed {run.seed}: {directory}")
        with command_log(storage.path(directory) / "train.log") as out:
            for command in commands:
                code = children.run_reporting(
                    command, out, lambda: f"{run.arm} seed {run.seed}: {run_progress(directory, command)}", log
                )
                if children.stopped_by is not None:
                    return None  # reported unfinished
                if code:
                    return f"{os.path.basename(command[1])} exit code {code}; see {directory}/train.log"
                if trained_summary(directory) is None:
                    return None  # train.py was stopped by a signal of its own: no diagnostics of a partial run
        return None

    results, failures, unfinished = {}, {}, {}
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        for run, failure in zip(runs, pool.map(launch, runs)):
            directory = run.directory(root)
            try:
                result = None if failure or not finished(directory) else load_result(run, root)
            except (OSError, ValueError) as e:
                failure = str(e)
            if failure:
                failures[run] = failure
                log(f"FAILED {run.arm} seed {run.seed}: {failure}")
            elif result is None:
                unfinished[run] = f"{unfinished_state(directory)} ({directory})"
                log(f"UNFINISHED {run.arm} seed {run.seed}: {unfinished[run]}")
            else:
                results[run] = result
                log(f"{run.arm} seed {run.seed}: final dev accuracy {result.summary['final_dev_accuracy']:.3f}")
    return results, failures, unfinished


@dataclasses.dataclass
class Outcome:
    """Everything an experiment produced: per-arm results by seed, its screen, failures, commands,
    and what is left to run."""

    arms: dict[str, dict[int, RunResult]]
    screen: dict[str, list[RunResult]]
    selected: dict[str, tuple[str, ...]]  # arm -> chosen grid cell
    failures: dict[Run, str]
    runs: list[Run]
    unfinished: dict[Run, str] = dataclasses.field(default_factory=dict)  # run -> what it has so far
    not_started: list[str] = dataclasses.field(default_factory=list)  # arms a stop came before
    stopped_by: signal.Signals | None = None  # the signal that stopped the runner


def select(results: list[RunResult]) -> RunResult:
    """The screen's choice: best Final, ties broken by Best, then by grid order."""
    best = max(range(len(results)), key=lambda i: (results[i].accuracies[-1], results[i].accuracies.max(), -i))
    return results[best]


def run_experiment(exp, root: str, jobs: int = 1, train: bool = True, log=print) -> Outcome:
    """Plans, runs what is missing (unless train=False) and collects `exp` under `root` (see the
    module docstring). Call it from the main thread: it forwards the runner's stop signals."""
    if exp.kind not in KINDS:
        raise ValueError(f"experiment {exp.name}: kind={exp.kind!r}; expected one of {KINDS}")
    storage.make_dirs(root)  # a missing bucket is named (as launch/train.py names it) before any run starts
    with Children() as children:
        all_runs, failures, unfinished, not_started = [], {}, {}, []

        def execute_planned(planned):
            results, failed, left = execute(
                planned,
                root,
                jobs=jobs,
                held_out_problems=exp.held_out_problems,
                train=train,
                children=children,
                log=log,
            )
            all_runs.extend(planned)
            failures.update(failed)
            unfinished.update(left)
            return results

        screens = screen_runs(exp)
        screen_results, selected = {}, {}
        if screens:
            results = execute_planned([run for runs in screens.values() for run in runs])
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
            stage_arms = [(name, overrides) for name, overrides in arms if bool(references(overrides)) == stage]
            if children.stopped_by is not None:  # nothing starts after a stop; the same command plans these later
                not_started += [name for name, _ in stage_arms]
                continue
            planned = []
            for name, overrides in stage_arms:
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
            results = execute_planned(planned)
            for run in planned:
                if run in results:
                    done.setdefault(run.arm, {})[run.seed] = results[run]
        return Outcome(done, screen_results, selected, failures, all_runs, unfinished, not_started, children.stopped_by)


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
