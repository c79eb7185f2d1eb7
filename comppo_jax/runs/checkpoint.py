"""Orbax checkpoints of a training run: async saves, the last N plus the best by dev accuracy,
content digests verified on restore.

A checkpoint is two items: `state` (arrays: actor and critic params, both optimizer states,
the base rng key) and `meta` (JSON: the step, prompt-iterator position, controller state,
warm-start accuracy, and `digests`: one content digest per state leaf). The frozen reference
policy is saved once, beside the steps, when it is not the loaded checkpoint (the tiny default's
warm-started policy), with its digests in reference_digests.json; otherwise it is reloaded from
`config.model.path` on resume. A LoRA run's checkpoints hold the adapters (the `actor` entry) and
their optimizer state only; the frozen base they sit on is recorded once in base.json (where it
came from and its digests), and a resume or restore refuses a base with other digests.
Restores go into the shardings of a target state built the usual way, so a restored run is
sharded like a fresh one.

Integrity:
- A state with a non-finite leaf is never saved (`NonFiniteStateError` names the leaves).
- Restores recompute every leaf's digest and check finiteness; a checkpoint that cannot be read,
  does not match its digests or holds non-finite values raises `CheckpointError` naming the
  step, item and leaf. `restore_newest_good` then falls back to the next older step with a
  warning and moves the bad one aside to `<output_dir>/corrupt_checkpoints/`.
- A checkpoint whose state has another structure than the restore's target (a leaf missing on
  either side, another shape or dtype: another method, critic, staleness, LoRA rank or code
  version) is not damage: its state metadata is compared with the target before any array is
  read, and any structure error of the restore itself is classified the same way, as one
  `CheckpointMismatchError` naming the step and the leaf; nothing is set aside and there is no
  fallback. A target may be a function of the step (`restore(lambda step: ...)`), for a state
  whose structure follows what the checkpoint holds (`saved_list_length`: the batches in flight).
- A failed async save (disk full, permissions) is raised by `confirm_saves` at the next step
  boundary as one `CheckpointError` naming the step, path and cause; its partial files are
  removed and the older checkpoints are untouched (Orbax deletes rotated-out steps only after a
  save commits).
- Retention never deletes the newest good checkpoint: the one the run resumed from after
  verification, or the newest save confirmed committed. It is kept beside keep_last/keep_best
  until a newer save is confirmed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging as std_logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint._src.serialization import tensorstore_utils
from orbax.checkpoint.checkpoint_managers import preservation_policy

from comppo_jax import storage
from comppo_jax.models import CheckpointError
from comppo_jax.sharding import any_process, to_memory

REFERENCE_DIR = "reference"
REFERENCE_DIGESTS = "reference_digests.json"
BASE_RECORD = "base.json"  # a LoRA run's frozen base: {"source": ..., "digests": {leaf: digest}}
QUARANTINE_DIR = "corrupt_checkpoints"


def committed_steps(run_dir: str) -> list[int]:
    """The step checkpoints whose saves committed under `run_dir`/checkpoints, read from the directory
    names alone (an unfinished save is a `<step>.orbax-checkpoint-tmp*` directory)."""
    return [int(name) for name in storage.names(storage.path(run_dir) / "checkpoints") if name.isdigit()]


class CheckpointMismatchError(CheckpointError):
    """A checkpoint whose state structure differs from the run's: not damage, so no fallback."""


# Orbax's words for a restore target whose tree differs from the saved one (ValueError): a structure
# mismatch, never damage (damaged files fail in TensorStore, JSON or the digests instead).
_STRUCTURE_ERRORS = ("structures do not match", "Sequence lengths do not match", "Types do not match")


def _structure_error(error: BaseException) -> bool:
    return isinstance(error, (ValueError, KeyError, TypeError)) and any(
        words in str(error) for words in _STRUCTURE_ERRORS
    )


def _normal_key(entry: Any) -> str:
    """One step of a leaf path as Orbax's metadata tree spells it: a NamedTuple's field (an optimizer
    state's `.mu`) is a dict key there."""
    if isinstance(entry, jax.tree_util.DictKey):
        return f"[{entry.key!r}]"
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return f"[{entry.name!r}]"
    if isinstance(entry, jax.tree_util.SequenceKey):
        return f"[{entry.idx}]"
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return f"[{entry.key}]"
    return str(entry)


def _normal_leaves(tree: Any) -> dict[str, tuple[str, Any]]:
    """{normalized path: (the path as `leaf_paths` names it, leaf)} of `tree`."""
    return {
        "".join(_normal_key(entry) for entry in path): (jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _entries(names: list[str]) -> str:
    """The top-level state entries of leaf paths ("['critic']['w']" -> critic), listed once each."""
    return ", ".join(dict.fromkeys(name.split("]")[0].strip("['") for name in names))


class NonFiniteStateError(FloatingPointError):
    """A state about to be saved holds NaN or infinity; the message names the leaves."""


def _first_line(error: BaseException) -> str:
    """`Type: first line of the message`, at most 1000 characters (TensorStore errors go on with whole specs)."""
    message = str(error).strip()
    first = message.splitlines()[0] if message else ""
    return f"{type(error).__name__}: {first[:1000]}{' ...' if len(first) > 1000 else ''}"


def _abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _leaf_digest(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two uint32 position-weighted sums of the leaf's bits, and whether it is finite.

    Integer sums wrap exactly, so the digest is the same on every mesh and device count; the
    position weights make it see swapped or shifted values, not only changed ones.
    """
    x = jnp.asarray(x)
    bits = x.dtype.itemsize * 8
    words = x if bits == 32 and x.dtype == jnp.uint32 else jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))
    if bits == 64:  # [..., 2] 32-bit halves
        words = jax.lax.bitcast_convert_type(words, jnp.uint32)
    words = words.astype(jnp.uint32)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    first = jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)
    second = jnp.sum((words ^ (words >> 15)) * jnp.uint32(0x9E3779B1) + index, dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.asarray(True)
    return jnp.stack([first, second]), finite


_digests = jax.jit(lambda leaves: [_leaf_digest(x) for x in leaves])


def leaf_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def state_digests(tree: Any) -> tuple[dict[str, str], list[str]]:
    """({leaf path: 16-hex-digit content digest}, [paths of leaves holding NaN or inf])."""
    paths, leaves = leaf_paths(tree), jax.tree.leaves(tree)
    # Leaves parked in host memory (train.offload_idle) are hashed on their devices like the rest.
    leaves = [
        to_memory(x, "device") if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host" else x
        for x in leaves
    ]
    results = jax.device_get(_digests(leaves)) if leaves else []
    digests = {path: "".join(f"{int(word):08x}" for word in digest) for path, (digest, _) in zip(paths, results)}
    return digests, [path for path, (_, finite) in zip(paths, results) if not finite]


def verify(tree: Any, expected: dict[str, str] | None, what: str) -> None:
    """Raises CheckpointError naming `what` and the first leaf whose digest differs from `expected`
    (a restore may read a subset of the saved leaves) or that holds non-finite values. Without
    `expected` (a checkpoint older than digests) only the values are checked, with a warning."""
    digests, non_finite = state_digests(tree)
    if expected is None:  # written by a version before digests: only finiteness can be checked
        logging.warning("%s has no content digests (saved before they existed): checked for NaN and inf only", what)
        expected = digests
    for path, digest in digests.items():
        if expected.get(path) != digest:
            raise CheckpointError(
                f"{what} leaf {path}: content digest {digest} does not match the saved {expected.get(path)} "
                "(the files were changed or damaged after the save)"
            )
    if non_finite:
        raise CheckpointError(f"{what} holds non-finite values in {non_finite[0]} ({len(non_finite)} leaves)")


@dataclasses.dataclass
class _KeepSteps(preservation_policy.PreservationPolicy):
    """Preserves the steps in `steps` (a set the owner updates)."""

    steps: set

    def should_preserve(
        self, checkpoints: Sequence[preservation_policy.PolicyCheckpointInfo], *, context
    ) -> Sequence[bool]:
        return [info.step in self.steps for info in checkpoints]


# Orbax warnings that describe what was asked for: a save without metrics (only the steps that
# evaluate carry the dev accuracy that ranks the best checkpoints), and a read-only manager (an
# evaluation, an export or a notebook opening a run) being read-only.
_EXPECTED_WARNINGS = ("Requested `tracked_metric`; did not provide metrics.", "Given directory is read only=")


def _expected_orbax_warning(record: std_logging.LogRecord) -> bool:
    """False (drop) for the warnings in `_EXPECTED_WARNINGS`."""
    return not record.getMessage().startswith(_EXPECTED_WARNINGS)


# Attempts of one tensorstore request to a bucket. A stalled one fails after comppo_jax.storage.timeout_s()
# (storage sets tensorstore's low-speed limit), and tensorstore's default 32 attempts would hold a save for
# 32 times that; 3 still ride out a transient 429 or 503.
GCS_ATTEMPTS = 3


def _bound_tensorstore_retries() -> None:
    """Puts `GCS_ATTEMPTS` into the tensorstore context Orbax builds for each save and restore (its
    `get_ts_context` copies these dicts; Orbax has no option for the context of its own)."""
    for context in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
        context["gcs_request_retries"] = {"max_retries": GCS_ATTEMPTS}


class RunCheckpoints:
    """Checkpoints under `directory`/checkpoints (and the reference under `directory`/reference)."""

    def __init__(self, directory: str, keep_last: int = 1, keep_best: int = 1, read_only: bool = False):
        self.directory = storage.path(directory)
        if read_only and not (self.directory / "checkpoints").is_dir():
            raise FileNotFoundError(
                f"{self.directory}/checkpoints does not exist; expected a training run's output_dir"
            )
        self.read_only, self.keep_last, self.keep_best = read_only, keep_last, keep_best
        self.newest_good: set[int] = set()  # at most one step: retention never deletes it
        self.pending: int | None = None  # the step of the save not yet confirmed
        self.manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        std_logging.getLogger("absl").addFilter(_expected_orbax_warning)
        _bound_tensorstore_retries()
        dev_accuracy = lambda metrics: metrics["dev_accuracy"]
        policy = preservation_policy.AnyPreservationPolicy(
            [
                preservation_policy.LatestN(n=self.keep_last),
                preservation_policy.BestN(
                    get_metric_fn=dev_accuracy, n=self.keep_best, keep_checkpoints_without_metrics=False
                ),
                _KeepSteps(self.newest_good),
            ]
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy,
            best_fn=dev_accuracy,
            best_mode="max",
            keep_checkpoints_without_metrics=False,
            enable_async_checkpointing=True,
            create=not self.read_only,
            read_only=self.read_only,
            save_interval_steps=0 if self.read_only else 1,  # Orbax sets (and warns) otherwise
        )
        return ocp.CheckpointManager(self.directory / "checkpoints", options=options, item_names=("state", "meta"))

    @property
    def steps_directory(self) -> str:
        return str(self.directory / "checkpoints")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def best_accuracy(self) -> float | None:
        """The dev accuracy of `best_step` (None: no evaluated checkpoint is kept)."""
        step = self.best_step()
        metrics = None if step is None else self.manager.metrics(step)
        return None if not metrics else float(metrics["dev_accuracy"])

    def save(self, step: int, state: Any, meta: dict, dev_accuracy: float | None = None) -> None:
        """Starts an async save of `state` (after step `step`) and `meta` as checkpoint `step`.

        The previous save is confirmed first (`confirm_saves`); a non-finite state is refused, and so is a save
        into a run directory whose lock this process lost (Orbax writes past comppo_jax.storage's fence)."""
        storage.check_fence(self.directory)
        self.confirm_saves(wait=True)
        digests, non_finite = state_digests(state)
        if non_finite:
            raise NonFiniteStateError(
                f"checkpoint {step} not saved: the state holds NaN or inf in {', '.join(non_finite[:3])}"
                f"{' ...' if len(non_finite) > 3 else ''} ({len(non_finite)} leaves)"
            )
        metrics = None if dev_accuracy is None else {"dev_accuracy": float(dev_accuracy)}
        meta = json.loads(json.dumps({**meta, "digests": digests}))  # a snapshot: the caller keeps mutating its dict
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            metrics=metrics,
        )
        self.pending = step

    @contextlib.contextmanager
    def completed_on_error(self):
        """Lets a pending async save finish when the block raises (a run stopped by an error still
        leaves its last checkpoint whole); a failure of that save is logged, the error re-raised."""
        try:
            yield
        except BaseException:
            try:
                self.manager.wait_until_finished()
            except Exception as error:  # the block's own error is the one to report; this one is logged
                logging.warning("checkpoint %s was not completed: %s: %s", self.pending, type(error).__name__, error)
            raise

    def confirm_saves(self, wait: bool = False) -> None:
        """Reports a failed async save (one CheckpointError naming step, path and cause) once it has
        ended; `wait` blocks until it has. A confirmed save becomes the newest good step."""
        if self.pending is None or (not wait and any_process(self.manager.is_saving_in_progress())):
            return
        step, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as error:  # any failure of the background save: disk full, permissions, ...
            self._remove_partial(step)
            raise CheckpointError(
                f"saving checkpoint {step} to {self.steps_directory}/{step} failed: {_first_line(error)}; "
                f"the older checkpoints are intact ({sorted(self._committed_steps())})"
            ) from error
        if step in self.manager.all_steps():
            self.newest_good.clear()
            self.newest_good.add(step)

    def _committed_steps(self) -> list[int]:
        return committed_steps(self.directory)

    def _remove_partial(self, step: int) -> None:
        """Deletes what a failed save of `step` left behind (Orbax writes into a temporary directory first)."""
        if jax.process_index() == 0:
            for name in storage.names(self.steps_directory):
                if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                    storage.remove(f"{self.steps_directory}/{name}")
        multihost_utils.sync_global_devices(f"comppo_remove_partial_{step}")
        self.manager.reload()

    def _read_digests(self, step: int, target: Any, partial: bool = False) -> dict[str, str] | None:
        """The saved digests of checkpoint `step`, after checking that its state has `target`'s
        structure (CheckpointMismatchError otherwise; `partial`: `target` is a part of the state, so
        leaves beyond it are expected); None for a checkpoint older than digests."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as error:  # an unreadable meta item is damage
            raise CheckpointError(
                f"checkpoint {step} under {self.steps_directory} item meta cannot be read: {_first_line(error)}"
            ) from error
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint {step} under {self.steps_directory} item meta is not a JSON object")
        self._check_structure(step, target, partial)
        digests = meta.get("digests")
        if digests is not None:
            unknown = sorted(set(leaf_paths(target)) - set(digests))
            if unknown:
                raise CheckpointMismatchError(
                    f"checkpoint {step} under {self.steps_directory} has no leaf {unknown[0]} ({len(unknown)} "
                    "such): it was saved with another state structure (another method, critic or code "
                    "version), so it cannot be restored into this run; nothing was moved"
                )
        return digests

    def saved_tree(self, step: int) -> Any:
        """The state metadata tree of checkpoint `step` (Orbax's: one ArrayMetadata per leaf, no
        array read); CheckpointError when it cannot be read (damage)."""
        try:
            return ocp.StandardCheckpointHandler().metadata(epath.Path(self.steps_directory) / str(step) / "state").tree
        except Exception as error:  # unreadable metadata is damage
            raise CheckpointError(
                f"checkpoint {step} under {self.steps_directory} item state metadata cannot be read: "
                f"{_first_line(error)}"
            ) from error

    def saved_list_length(self, step: int, entry: str) -> int:
        """How many trees the state entry `entry` (a list, e.g. the in-flight `behaviour` policies)
        of checkpoint `step` holds; 0 when it has none."""
        tree = self.saved_tree(step)
        saved = tree.get(entry) if isinstance(tree, dict) else None
        return len(saved) if isinstance(saved, (list, tuple)) else 0

    def _check_structure(self, step: int, target: Any, partial: bool = False) -> None:
        """Raises CheckpointMismatchError naming the first leaf that `target` has and checkpoint `step`
        lacks, that the checkpoint has and `target` lacks, or whose saved shape or dtype differs (a
        config that changes the state: another method, critic, staleness, a shape such as
        critic.bottleneck, the LoRA rank): not damage, nothing moves. `partial`: `target` is a part
        of the state, so the leaves the checkpoint has beyond it are not compared."""
        saved = _normal_leaves(self.saved_tree(step))
        wanted = _normal_leaves(target)
        where = f"checkpoint {step} under {self.steps_directory}"
        missing = [name for key, (name, _) in wanted.items() if key not in saved]
        extra = [] if partial else [name for key, (name, _) in saved.items() if key not in wanted]
        if missing:
            also = f"; and {len(extra)} leaves this config has no place for, in {_entries(extra)}" if extra else ""
            raise CheckpointMismatchError(
                f"{where} has no leaf {missing[0]} ({len(missing)} such, in {_entries(missing)}{also}"
                "): it was saved with another state structure (another method, critic or code version), so it "
                "cannot be restored into this run; nothing was moved"
            )
        if extra:
            raise CheckpointMismatchError(
                f"{where} holds leaf {extra[0]} ({len(extra)} such, in {_entries(extra)}) that this config's state "
                "has no place for: it was saved with another state structure (another method, critic or code "
                "version), so it cannot be restored into this run; nothing was moved"
            )
        for key, (name, leaf) in wanted.items():
            stored = saved[key][1]
            if not hasattr(stored, "shape") or not hasattr(leaf, "shape"):
                continue
            if tuple(stored.shape) != tuple(leaf.shape) or jnp.dtype(stored.dtype) != jnp.dtype(leaf.dtype):
                raise CheckpointMismatchError(
                    f"{where} leaf {name} is {jnp.dtype(stored.dtype).name}"
                    f"{list(stored.shape)} but this config's state has {jnp.dtype(leaf.dtype).name}{list(leaf.shape)}: "
                    "it was saved with another config (a shape such as critic.bottleneck, the model, the LoRA rank "
                    "or a dtype differs), so it cannot be restored into this run; nothing was moved"
                )

    def _read_error(self, step: int, error: Exception) -> CheckpointError:
        """The CheckpointError of a restore of checkpoint `step` that raised `error`: a structure
        mismatch (CheckpointMismatchError, nothing moves) or damage."""
        if _structure_error(error):
            return CheckpointMismatchError(
                f"checkpoint {step} under {self.steps_directory} does not fit this config's state: "
                f"{_first_line(error)} (it was saved with another state structure, so it cannot be restored "
                "into this run; nothing was moved)"
            )
        return CheckpointError(f"checkpoint {step} under {self.steps_directory} cannot be read: {_first_line(error)}")

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of `step` (default: the latest), verified, with the target's structure and
        shardings. `target_state` may be a function of the step that returns the target."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(self.no_checkpoint_message())
        if callable(target_state):
            target_state = target_state(step)
        digests = self._read_digests(step, target_state)
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(target_state)), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as error:  # TensorStore errors of damaged files, or a structure Orbax tells apart
            raise self._read_error(step, error) from error
        verify(restored["state"], digests, f"checkpoint {step} item state")
        return restored["state"], {k: v for k, v in restored["meta"].items() if k != "digests"}

    def restore_newest_good(self, target_state: Any) -> tuple[Any, dict, int]:
        """(state, meta, step) of the newest checkpoint that passes verification. Each one that
        fails is named in a warning and moved to corrupt_checkpoints/ (kept for inspection). A
        checkpoint of another state structure raises CheckpointMismatchError and moves nothing.
        `target_state`: as `restore`'s."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(self.no_checkpoint_message())
        failures = {}
        for step in steps:
            try:
                state, meta = self.restore(target_state, step)
            except CheckpointMismatchError:
                raise
            except CheckpointError as error:
                failures[step] = str(error)
                logging.warning("%s; falling back to the previous checkpoint", error)
                self._quarantine(step)
                continue
            if failures:
                print(
                    f"resume: checkpoint(s) {sorted(failures)} failed verification and were moved to "
                    f"{self.directory / QUARANTINE_DIR}; resuming from step {step}",
                    flush=True,
                )
            self.newest_good.clear()
            self.newest_good.add(step)
            return state, meta, step
        raise CheckpointError(
            f"no checkpoint under {self.steps_directory} passes verification: " + " | ".join(failures.values())
        )

    def set_aside(self) -> list[str]:
        """The checkpoints moved to corrupt_checkpoints/ (names `<step>-<time>`), oldest first."""
        return storage.names(self.directory / QUARANTINE_DIR)

    def set_aside_note(self) -> str:
        """What corrupt_checkpoints/ holds and how to use one of them ("" when it is empty)."""
        aside = self.set_aside()
        if not aside:
            return ""
        quarantine = self.directory / QUARANTINE_DIR
        return (
            f"{quarantine} holds {len(aside)} set aside as damaged ({', '.join(aside)}): if one is wanted anyway, "
            f"move it back as its step number (mv {quarantine}/{aside[-1]} "
            f"{self.steps_directory}/{aside[-1].split('-')[0]}) and resume; to start over, choose another "
            "--config.output_dir"
        )

    def no_checkpoint_message(self) -> str:
        """Why a resume finds nothing under checkpoints/: none saved yet, or all set aside as damaged."""
        note = self.set_aside_note()
        if note:
            return f"config.resume=True but there is no checkpoint under {self.steps_directory}; {note}"
        return (
            f"config.resume=True but there is no checkpoint under {self.steps_directory} yet (the run stopped before "
            "its first checkpoint): run the same command without --config.resume to start it"
        )

    def _quarantine(self, step: int) -> None:
        if jax.process_index() == 0:
            target = self.directory / QUARANTINE_DIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            storage.move(f"{self.steps_directory}/{step}", target)
        multihost_utils.sync_global_devices(f"comppo_quarantine_{step}")
        self.manager.reload()

    def resolve_step(self, step: str | int) -> int:
        """ "latest" (or "last"), "best" or a saved step number -> a saved step (a clear error otherwise)."""
        steps = self.manager.all_steps()
        named = {"latest": self.latest_step, "last": self.latest_step, "best": self.best_step}
        if str(step) not in named and not str(step).isdigit():
            raise ValueError(
                f"step {step!r} is none of latest (or last), best or a saved step number; saved steps under "
                f"{self.directory}/checkpoints: {sorted(steps)}"
            )
        resolved = named.get(str(step), lambda: int(step))()
        if str(step) == "best" and resolved is None and steps:
            raise FileNotFoundError(
                f"no checkpoint under {self.directory}/checkpoints has a dev accuracy (the run saved none at a "
                f"dev evaluation: train.eval_every=0, or a run older than that rule); saved steps: {sorted(steps)}"
            )
        if resolved not in steps:
            raise FileNotFoundError(
                f"no checkpoint {step!r} under {self.directory}/checkpoints; saved steps: {sorted(steps)}"
            )
        return resolved

    def restore_params(self, targets: dict, step: int) -> dict:
        """Only the state entries named in `targets` (e.g. {"actor": ..., "critic": ...}) of checkpoint
        `step`, verified, into the targets' shapes, dtypes and shardings (optimizer states are not read)."""
        digests = self._read_digests(step, targets, partial=True)
        abstract = {name: _abstract(target) for name, target in targets.items()}
        args = ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True
        )
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=args))
        except Exception as error:  # TensorStore errors of damaged files, or a structure Orbax tells apart
            raise self._read_error(step, error) from error
        verify(restored["state"], digests, f"checkpoint {step} item state")
        return restored["state"]

    def save_reference(self, params: Any) -> None:
        storage.check_fence(self.directory)
        digests, non_finite = state_digests(params)
        if non_finite:
            raise NonFiniteStateError(f"the reference policy holds NaN or inf in {non_finite[0]}; not saved")
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(self.directory / REFERENCE_DIR, params, force=True)
        if jax.process_index() == 0:
            storage.write_text(self.directory / REFERENCE_DIGESTS, json.dumps(digests))

    def record_base(self, params: Any, source: str) -> None:
        """Writes base.json: where a LoRA run's frozen base came from and its digests."""
        digests, _ = state_digests(params)
        if jax.process_index() == 0:
            storage.write_text(
                self.directory / BASE_RECORD, json.dumps({"source": source, "digests": digests}, indent=1)
            )

    def verify_base(self, params: Any, source: str) -> None:
        """Raises CheckpointError when `params` (the base loaded from `source`) is not the base the
        run's adapters were trained on (base.json's digests)."""
        path = self.directory / BASE_RECORD
        try:
            record = json.loads(storage.read_text(path))
            expected = record["digests"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"{path} cannot be read ({_first_line(error)}): the run's LoRA adapters cannot be checked against "
                f"their base; restore it from a backup"
            ) from error
        digests, _ = state_digests(params)
        differing = [leaf for leaf, digest in digests.items() if expected.get(leaf) != digest]
        if differing or set(expected) != set(digests):
            leaf = differing[0] if differing else sorted(set(expected) ^ set(digests))[0]
            raise CheckpointError(
                f"the base policy from {source} is not the one this run's LoRA adapters were trained on "
                f"({record.get('source')}; leaf {leaf}: digest {digests.get(leaf)}, recorded {expected.get(leaf)} in "
                f"{path}): point config.model.path at the original base"
            )

    def rebuild_reference(self, params: Any) -> None:
        """Saves `params`, the reference replayed from the warm start, as the run's reference policy
        when it matches the saved digests (or none can be read, with a warning). Raises
        CheckpointError saying what is lost and what to do when it does not match."""
        path = self.directory / REFERENCE_DIR
        digests_path = self.directory / REFERENCE_DIGESTS
        try:
            expected = json.loads(storage.read_text(digests_path))
        except (OSError, ValueError) as error:
            expected = None
            logging.warning(
                "%s cannot be read (%s): the rebuilt reference policy is not checked against the original",
                digests_path,
                _first_line(error),
            )
        if expected is not None:
            digests, _ = state_digests(params)
            differing = [leaf for leaf, digest in digests.items() if expected.get(leaf) != digest]
            if differing:
                raise CheckpointError(
                    f"the run's reference policy is lost: {path} cannot be read, and replaying the warm start gives "
                    f"other weights (leaf {differing[0]}: digest {digests[differing[0]]}, saved "
                    f"{expected.get(differing[0])}; another machine or library version computes it differently). "
                    f"The KL term needs the run's own reference: restore {path} and {digests_path} from a backup, or "
                    "start a new run with another --config.output_dir"
                )
        self.save_reference(params)
        if jax.process_index() == 0:
            print(
                f"rebuilt the reference policy under {path} from the warm start"
                f"{' (it matches the saved digests)' if expected is not None else ''}",
                flush=True,
            )

    def restore_reference(self, target: Any) -> Any:
        path = self.directory / REFERENCE_DIR
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is missing: the run's warm-started reference policy cannot be restored")
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                params = checkpointer.restore(path, _abstract(target))
            digests = json.loads(storage.read_text(self.directory / REFERENCE_DIGESTS))
        except Exception as error:  # TensorStore / JSON errors of damaged files
            raise CheckpointError(f"the reference policy under {path} cannot be read: {_first_line(error)}") from error
        verify(params, digests, f"the reference policy ({path})")
        return params

    def wait(self) -> None:
        self.confirm_saves(wait=True)

    def close(self) -> None:
        self.confirm_saves(wait=True)
        self.manager.close()
