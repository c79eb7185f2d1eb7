"""A run directory's guards against its own user: one writer at a time, and a config that stays
the run's identity across resumes.

- `RunLock`: `<output_dir>/run.lock` holds the writer's pid, host and process start time. A
  second command on the same directory refuses in one line naming the holder, before anything
  is loaded. A lock left by a dead process on this host (its pid gone, or reused by another
  process) is taken over with a warning. In a multi-process run, process 0 holds it.
- `resume_changes`: what a resume changes against the run's `config.json`. Fields that change
  what is computed (model, data, seed, method, gate, critic, shapes, warm start, rollout sizes,
  loss settings: everything not in `HARMLESS`) refuse the resume in one line listing each
  change, old -> new, unless `--config.resume_allow_changes=<field or section>,...` names them;
  harmless ones (progress, plots, loggers, kept samples, checkpoint and eval cadence, output paths, workers, timeouts,
  the mesh and the kernels, which change how a step runs, not what it computes) and `steps`
  pass. `record_changes` appends every accepted change, with the step it applies from, to
  `<output_dir>/config_changes.jsonl`; the fields of the launch itself (`LAUNCH_ONLY`: `resume`,
  `resume_step`, `resume_allow_changes`, the coordinator's address, the process id) are not changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

import jax
from absl import logging

from comppo_jax.models import ConfigError

LOCK_FILE = "run.lock"
CHANGES_FILE = "config_changes.jsonl"

# Fields that say how this launch starts, not what the run is: every resume changes some of them, and
# none is compared or recorded.
LAUNCH_ONLY = ("resume", "resume_step", "resume_allow_changes", "mesh.coordinator_address", "mesh.process_id")

# Fields (or whole sections) a resume may change without changing what the run computes.
HARMLESS = (
    "output_dir",
    "progress",
    "plot",
    "tensorboard",  # the loggers' field before `loggers`
    "loggers",
    "outputs",
    "steps",
    "checkpoint",
    "eval",
    "train.eval_every",
    "reward.workers",
    "reward.timeout_s",
    "warm_start.cache_dir",
    "mesh",
    "rollout.mesh",
    "rollout.decode_slots",
    "rollout.page_size",
    "rollout.paged_attention",
    "model.attention",
    "model.remat",
    "model.logits_chunk",
    "train.offload_idle",
)


class RunDirectoryLocked(RuntimeError):
    """Another live process writes to this run directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), which tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return started is None or _start_time(pid) in (None, started)


class RunLock:
    """`with RunLock(output_dir, holder=True):` owns output_dir (a no-op with holder=False: the other
    processes of a multi-process run, whose process 0 holds it)."""

    def __init__(self, output_dir: str, holder: bool = True):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.holder = holder
        self.owned = False

    def _write(self) -> None:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(descriptor, "w") as f:
            json.dump(record, f)
        self.owned = True

    def _holder(self) -> dict:
        try:
            with open(self.path) as f:
                record = json.load(f)
            return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else {}
        except (OSError, ValueError):
            return {}  # unreadable (torn by a crash): treated as stale

    def acquire(self) -> None:
        if not self.holder:
            return
        try:
            return self._write()
        except FileExistsError:
            pass
        record = self._holder()
        here = socket.gethostname()
        if record and (record.get("host") != here or _alive(record["pid"], record.get("started"))):
            where = "" if record.get("host") == here else " (another host: its liveness cannot be checked from here)"
            raise RunDirectoryLocked(
                f"{os.path.dirname(self.path)} is in use by pid {record['pid']} on {record.get('host')}{where} since "
                f"{record.get('since')} ({str(record.get('command', ''))[:300]!r}): one process writes a run "
                "directory; wait for it or stop it, choose another --config.output_dir, or delete "
                f"{self.path} if that process is gone"
            )
        logging.warning(
            "%s: taking over a stale lock (%s) left by a process that is gone",
            self.path,
            f"pid {record['pid']} on {record.get('host')}" if record else "unreadable",
        )
        os.remove(self.path)
        try:
            self._write()
        except FileExistsError as error:  # another command took it over first
            raise RunDirectoryLocked(
                f"{os.path.dirname(self.path)}: another command took over its stale lock ({self.path}) "
                "at the same moment"
            ) from error

    def release(self) -> None:
        if self.owned and self._holder().get("pid") == os.getpid():
            os.remove(self.path)
        self.owned = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def locked(output_dir: str):
    """The run directory's lock for the whole run: process 0 holds it, and every process of a
    multi-process run refuses together when it is taken (a collective)."""
    from comppo_jax.sharding import any_process

    main = jax.process_index() == 0
    lock, refusal = RunLock(output_dir, holder=main), None
    try:
        lock.acquire()
    except RunDirectoryLocked as error:
        refusal = error
    if any_process(refusal is not None):
        raise refusal or RunDirectoryLocked(
            f"{output_dir}: process 0 found it in use by another command (its error names the holder)"
        )
    try:
        yield lock
    finally:
        lock.release()


def _leaves(tree, prefix: str = "") -> dict:
    """{dotted field: value} of a JSON-like config (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    leaves = {}
    for name, value in tree.items():
        leaves.update(
            _leaves(value, f"{prefix}{name}.") if isinstance(value, dict) and value else {f"{prefix}{name}": value}
        )
    return leaves


def config_differences(old, new) -> list[tuple[str, object, object]]:
    """[(dotted field, old value, new value)] for every field that differs between two ConfigDicts
    (a field only one has: `<absent>` on the other side)."""
    as_json = lambda config: _leaves(json.loads(config.to_json_best_effort()))
    before, after = as_json(old), as_json(new)
    absent = "<absent>"
    return [
        (field, before.get(field, absent), after.get(field, absent))
        for field in sorted(set(before) | set(after))
        if before.get(field, absent) != after.get(field, absent)
    ]


def _matches(field: str, names) -> bool:
    """Whether `field` is one of `names` or lies in one of their sections."""
    return any(field == name or field.startswith(name + ".") for name in names)


def allowed_changes(cfg) -> tuple[str, ...]:
    return tuple(name.strip() for name in cfg.resume_allow_changes.split(",") if name.strip())


def resume_changes(cfg, run_config) -> list[dict]:
    """The changes of `cfg` against `run_config` (the run's config.json), each
    {"field", "old", "new", "accepted": "harmless" | "resume_allow_changes"}. Raises ConfigError,
    listing every refused change old -> new and the flag that accepts them, when a field that
    changes what is computed differs and `cfg.resume_allow_changes` does not name it."""
    allowed = allowed_changes(cfg)
    changes, refused = [], []
    for field, old, new in config_differences(run_config, cfg):
        if _matches(field, LAUNCH_ONLY):
            continue
        if _matches(field, HARMLESS):
            changes.append(dict(field=field, old=old, new=new, accepted="harmless"))
        elif _matches(field, allowed):
            changes.append(dict(field=field, old=old, new=new, accepted="resume_allow_changes"))
        else:
            refused.append((field, old, new))
    unused = [name for name in allowed if not any(_matches(change["field"], [name]) for change in changes)]
    if unused:
        logging.warning("--config.resume_allow_changes names %s, which this resume does not change", ", ".join(unused))
    if refused:
        listed = "; ".join(f"{field}: {old!r} -> {new!r}" for field, old, new in refused)
        names = ",".join(field for field, _, _ in refused)
        raise ConfigError(
            f"config.resume=True with a config that changes what the run computes ({listed}) against {cfg.output_dir}/"
            f"config.json: resume with the run's own values, or pass --config.resume_allow_changes={names} to "
            f"continue with the change (it is recorded in {CHANGES_FILE}), or choose another --config.output_dir"
        )
    return changes


def record_changes(output_dir: str, step: int, changes: list[dict]) -> None:
    """Appends `changes` (resume_changes') to config_changes.jsonl as applying from step `step` + 1."""
    if not changes:
        return
    with open(os.path.join(output_dir, CHANGES_FILE), "a") as f:
        for change in changes:
            f.write(json.dumps({"resumed_after_step": step, **change}, default=str) + "\n")
    accepted = [c["field"] for c in changes if c["accepted"] == "resume_allow_changes"]
    if accepted:
        logging.warning(
            "resuming after step %d with changed %s (recorded in %s)",
            step,
            ", ".join(accepted),
            os.path.join(output_dir, CHANGES_FILE),
        )
