"""A run directory's guards against its own user: one writer at a time, and a config that stays
the run's identity across resumes.

- `RunLock`: `<output_dir>/run.lock` (a local path or a bucket) holds the writer's pid, host,
  process start time and a heartbeat. A second command on the same directory refuses in one line
  naming the holder, before anything is loaded. A lock left by a dead process on this host (its pid
  gone, or reused by another process), or whose heartbeat stopped `STALE_S` ago on any host, is
  taken over with a warning. In a multi-process run, process 0 holds it, and fences every write
  into the directory with it: once another launcher has taken the lock over, each write raises
  `RunLockLost` naming the new holder, so the old one writes nothing more and its run ends.
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
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import jax
from absl import logging

from comppo_jax import storage
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


class RunLockLost(RuntimeError):
    """Another launcher took this run directory's lock over: this process writes nothing more to it."""


def _process_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (Linux): [0] the state, [19] the start time in
    clock ticks since boot, which tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:  # this host's process table, not a run path
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    fields = _process_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    fields = _process_stat(pid)
    if fields is None:  # no process table to read: the pid answered
        return True
    if fields[0] in ("Z", "X"):  # a killed launcher not yet reaped by its parent (or init)
        return False
    return started is None or len(fields) <= 19 or fields[19] == started


@contextlib.contextmanager
def _local_guard(lock_path) -> Iterator[None]:
    """Holds an exclusive flock on the lock's local folder: a heartbeat's read-compare-write and a takeover's
    remove-and-create do not interleave. A bucket needs none (generation preconditions)."""
    if storage.is_remote(lock_path):
        yield
        return
    folder = os.open(os.fspath(lock_path.parent), os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the flock


def _describe(record: dict, beat: str = "") -> str:
    """Who holds a lock: pid, host, since when, (`beat`), and its command."""
    command = str(record.get("command", ""))[:300]
    return f"pid {record['pid']} on {record.get('host')} since {record.get('since')}{beat} ({command!r})"


class RunLock:
    """`with RunLock(output_dir, holder=True):` owns output_dir (a no-op with holder=False: the other
    processes of a multi-process run, whose process 0 holds it).

    The lock file is made only where none exists (comppo_jax.storage.create_new: O_EXCL on a disk,
    GCS's ifGenerationMatch=0 on a bucket). Its holder rewrites the record's `heartbeat` every
    `HEARTBEAT_S` seconds from a daemon thread, only while the lock is still its own (on a bucket the
    rewrite carries the generation it last wrote as a precondition; on a disk it compares tokens under a
    flock of the folder). A lock is stale, and taken over with a warning, when its process is gone from
    this host (its pid dead or reused), or, from any host (a preempted pod comes back on other machines,
    where a pid means nothing), when its heartbeat is older than `STALE_S`.

    The holder fences the run directory (`check`, through comppo_jax.storage.fenced): before every write it
    confirms the lock is still its own, renewing the heartbeat first when the last one is older than
    2 x HEARTBEAT_S (a paused process, a partition). Once another launcher has taken the lock over, every
    write raises RunLockLost naming the new holder, so the old one writes nothing more and its run ends."""

    HEARTBEAT_S = 30.0
    STALE_S = 300.0

    def __init__(self, output_dir: str, holder: bool = True):
        self.path = storage.path(output_dir) / LOCK_FILE
        self.holder = holder
        self.owned = False
        self.record: dict = {}
        self.generation: str | None = None  # the lock object's generation as this holder last wrote it (a bucket)
        self.renewed = 0.0  # when this holder's heartbeat was last confirmed written (time.time())
        self.lost: str | None = None  # why every write is refused, once the lock is another's
        self.renewing = threading.Lock()  # the heartbeat thread and the fence renew one at a time
        self.stop_beating = threading.Event()
        self.beat: threading.Thread | None = None

    def _new_record(self) -> dict:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
            "token": uuid.uuid4().hex,  # tells this holder apart from a later one with the same pid and host
            "heartbeat": time.time(),
        }

    def _write(self) -> bool:
        record = self._new_record()
        if not storage.create_new(self.path, json.dumps(record)):
            return False
        self.record, self.owned, self.lost = record, True, None
        self.generation, self.renewed = storage.generation(self.path), record["heartbeat"]
        self.stop_beating.clear()
        self.beat = threading.Thread(target=self._keep_beating, name="run-lock-heartbeat", daemon=True)
        self.beat.start()
        return True

    def _keep_beating(self) -> None:
        while not self.stop_beating.wait(self.HEARTBEAT_S):
            try:
                self._renew()
            except Exception as error:  # a storage hiccup must not kill the run; the next beat retries
                logging.warning("%s: heartbeat not written (%s: %s)", self.path, type(error).__name__, error)
            if self.lost is not None:
                logging.warning("%s: %s", self.path, self.lost)
                return

    def _renew(self) -> None:
        """Rewrites the heartbeat only while the lock is still this holder's; otherwise marks it lost."""
        with self.renewing:
            if self.lost is not None:
                return
            record = {**self.record, "heartbeat": time.time()}
            if storage.is_remote(self.path):
                assert self.generation is not None
                written = storage.replace_if_generation(self.path, json.dumps(record).encode(), self.generation)
                if written is None:
                    self._mark_lost()
                    return
                self.generation = written
            else:
                with _local_guard(self.path):
                    if self._holder(strict=True).get("token") != self.record["token"]:
                        self._mark_lost()
                        return
                    storage.write_text(self.path, json.dumps(record))
            self.record, self.renewed = record, record["heartbeat"]

    def _mark_lost(self) -> None:
        holder = self._holder()
        now = f"is now held by {_describe(holder)}" if holder else "was deleted or is unreadable"
        self.lost = (
            f"{self.path.parent}: this run's lock was taken over ({self.path} {now}); this process "
            f"(pid {os.getpid()} on {socket.gethostname()}) writes nothing more there and stops"
        )

    def check(self, target=None) -> None:
        """The run directory's fence: raises RunLockLost when the lock is no longer this holder's (its own
        writes of the lock file pass)."""
        if not self.owned or target == self.path:
            return
        if self.lost is None:
            if time.time() - self.renewed > 2 * self.HEARTBEAT_S:  # the heartbeat is late: renew before writing
                self._renew()
            else:
                # Not while this holder's heartbeat rewrites the lock: a read racing that can see a part of it.
                with self.renewing:
                    if self.lost is None and self._holder(strict=True).get("token") != self.record["token"]:
                        self._mark_lost()
        if self.lost is not None:
            raise RunLockLost(self.lost)

    def _holder(self, strict: bool = False) -> dict:
        """The lock's record; {} when it is gone or unreadable. `strict`: an error reading it other than its
        absence is raised (a failing storage call is not a lost lock)."""
        try:
            record = json.loads(storage.read_text(self.path))
        except FileNotFoundError:
            return {}
        except ValueError:
            return {}  # torn by a crash: treated as stale
        except OSError:
            if strict:
                raise
            return {}
        return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else {}

    def _stale(self, record: dict) -> bool:
        if not record:
            return True
        if record.get("host") == socket.gethostname() and not _alive(record["pid"], record.get("started")):
            return True
        heartbeat = record.get("heartbeat")
        return isinstance(heartbeat, (int, float)) and time.time() - heartbeat > self.STALE_S

    def acquire(self) -> None:
        if not self.holder or self._write():
            return
        with _local_guard(self.path):
            record = self._holder()
            if not self._stale(record):
                heartbeat = record.get("heartbeat")
                beat = (
                    f", last heartbeat {time.time() - heartbeat:.0f} s ago (stale after {self.STALE_S:.0f} s)"
                    if isinstance(heartbeat, (int, float))
                    else ""
                )
                raise RunDirectoryLocked(
                    f"{self.path.parent} is in use by {_describe(record, beat)}: one process writes a "
                    "run directory; wait for it or stop it, choose another --config.output_dir, or delete "
                    f"{self.path} if that process is gone"
                )
            logging.warning(
                "%s: taking over a stale lock (%s) left by a process that is gone",
                self.path,
                f"pid {record['pid']} on {record.get('host')}" if record else "unreadable",
            )
            storage.remove(self.path)
            if not self._write():  # another command took it over first
                raise RunDirectoryLocked(
                    f"{self.path.parent}: another command took over its stale lock ({self.path}) at the same moment"
                )

    def release(self) -> None:
        self.stop_beating.set()
        if self.beat is not None:
            self.beat.join()
            self.beat = None
        if self.owned and self.lost is None and self._holder().get("token") == self.record.get("token"):
            storage.remove(self.path)
        self.owned = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def locked(output_dir: str):
    """The run directory's lock for the whole run: process 0 holds it and fences every write into the
    directory with it, and every process of a multi-process run refuses together when it is taken (a
    collective)."""
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
        with storage.fenced(output_dir, lock.check):
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
    path = storage.path(output_dir) / CHANGES_FILE
    storage.append_lines(path, [json.dumps({"resumed_after_step": step, **change}, default=str) for change in changes])
    accepted = [c["field"] for c in changes if c["accepted"] == "resume_allow_changes"]
    if accepted:
        logging.warning(
            "resuming after step %d with changed %s (recorded in %s)",
            step,
            ", ".join(accepted),
            path,
        )
