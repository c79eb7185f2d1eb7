"""A training run's checkpoint as files other tools serve: Hugging Face weights or PEFT adapters.

    export_run("runs/tiny_lora", "best", "exported/", "hf")    # merged safetensors + config.json + tokenizer
    export_run("runs/tiny_lora", "best", "adapters/", "peft")  # adapter_config.json + adapter_model.safetensors

`hf` loads with `transformers.AutoModelForCausalLM.from_pretrained(out)` (and vLLM): a LoRA run's
adapters merged into its base, in the compute dtype. `peft` loads with
`peft.PeftModel.from_pretrained(base, out)`: the adapters alone, on the base named in
adapter_config.json. That is `model.path` when the run trained on it as loaded; a base the run
made itself (warm-started, or random) is written beside them under `out/base` in `hf` format, so
the adapters always come with the weights they were trained on. A full fine-tuning run has no
adapters and exports `hf` only.

The checkpoint is restored onto one device of this machine (verified against its digests; a LoRA
run's base against base.json), whatever mesh the run trained on.

`out` gets a whole export or nothing (`_export_folder`). It must be new or empty (checked first,
before anything is read); the export is written into a folder of its own and put in place only
when complete, and only if `out` is still new or empty then, so of two exports to one `out` one
succeeds and the other fails naming it. A failure (a full disk) or SIGTERM / SIGINT on the way
removes what was written and says in one line that nothing was written to `out`. On a disk its files
and folders get the modes new ones get under the umask (0644 and 0755 under 022; safetensors
writes 0600), so a server running as another user can read them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import jax
import numpy as np

from comppo_jax import hub, sharding, storage
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.eval.restore import resolve_step, restored_actor
from comppo_jax.models import ConfigError, lora, model_config, to_hf
from comppo_jax.models.hf import to_peft
from comppo_jax.models.lora import LoraConfig
from comppo_jax.runs.checkpoint import RunCheckpoints
from comppo_jax.train.schema import load_run_config
from comppo_jax.train.update import cast_params

FORMATS = ("hf", "peft")
NO_ADVISORY = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
CLAIM = ".exporting"  # on a bucket: the object that claims `out` while an export uploads into it


class ExportError(RuntimeError):
    """An export that failed or was stopped part way; nothing of it is left at its `out`."""


class ExportStopped(BaseException):
    """SIGTERM or SIGINT during an export: a stop, not a failure (a BaseException, as KeyboardInterrupt is)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


def export_run(run_dir: str, step: str | int, out: str, format: str = "hf") -> list[str]:
    """Writes checkpoint `step` (latest, best or N) of the run in `run_dir` to `out` as `format`
    (module docstring); returns what it wrote, one line each."""
    try:
        with _StopSignals() as signals, _no_advisory_notices():
            return _export(run_dir, step, out, format, signals)
    except ExportStopped as stop:
        raise ExportError(f"{stop} received: the export was stopped; nothing was written to {out}") from None


@contextlib.contextmanager
def _no_advisory_notices() -> Iterator[None]:
    """transformers, first imported by the export, logs "PyTorch was not found..." where torch is not
    installed: an advisory notice (an export needs no torch) that TRANSFORMERS_NO_ADVISORY_WARNINGS
    silences, and only advisory ones; its warnings and errors still show."""
    previous = os.environ.get(NO_ADVISORY)
    os.environ[NO_ADVISORY] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[NO_ADVISORY]
        else:
            os.environ[NO_ADVISORY] = previous


def _export(run_dir: str, step: str | int, out: str, format: str, signals: _StopSignals) -> list[str]:
    if format not in FORMATS:
        raise ConfigError(f"--format={format!r}: expected one of {', '.join(FORMATS)}")
    _check_new_or_empty(out)
    cfg = load_run_config(run_dir)
    adapters = LoraConfig.of(cfg.model)
    if format == "peft" and not adapters.enabled:
        raise ConfigError(
            f"{run_dir} is a full fine-tuning run (model.lora.rank=0): it has no adapters to export as PEFT; "
            "export its weights with --format=hf"
        )
    config = model_config(cfg.model)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
    signals.check()
    checkpoints = RunCheckpoints(run_dir, read_only=True)
    try:
        step = resolve_step(checkpoints, step, cfg)
        params = restored_actor(
            cfg, checkpoints, step, mesh, config
        )  # adapters in the master dtype on the compute-dtype base
    finally:
        checkpoints.close()
    signals.check()
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    with _export_folder(out, signals, f"step {step} of {run_dir}") as folder:
        return [f"step {step} of {run_dir}", *_write_export(cfg, config, params, tokenizer, format, out, folder)]


def _check_new_or_empty(out: str) -> None:
    """Refuses an `out` that is a file or holds anything, before anything is read."""
    target = storage.path(out)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{out} is a file: --out names the folder to export into (new or empty)")
    names = storage.names(out)
    if CLAIM in names:
        raise FileExistsError(
            f"{out} exists and is not empty: another export is uploading into it, or one was killed part way "
            f"({storage.read_text(target / CLAIM)}); wait for it, or remove {out}"
        )
    if names:
        raise FileExistsError(f"{out} exists and is not empty: choose another --out, or remove it")


class _StopSignals:
    """Within `with _StopSignals() as signals:`, SIGTERM and SIGINT are noted, and `signals.check()`
    raises ExportStopped at the export's next safe point: before and after the restore, and before
    the written export is put in place (an exception raised from the handler itself, inside an XLA
    compile, crashes the process on its way out). A repeated signal changes nothing. Handlers can be
    set only from the main thread: elsewhere signals keep theirs."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.previous: dict = {}

    def _handle(self, signum, frame):
        del frame
        if self.received is None:
            self.received = signum

    def check(self) -> None:
        if self.received is not None:
            raise ExportStopped(self.received)

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _failed(out: str, error: Exception) -> ExportError:
    cause = (str(error).strip().splitlines() or [""])[0]
    return ExportError(f"export to {out} failed: {type(error).__name__}: {cause}; nothing was written to {out}")


def _export_folder(out: str, signals: _StopSignals, export: str) -> contextlib.AbstractContextManager[str]:
    """A local folder to write the export (`export` says which) into, that becomes `out` whole when the
    block ends, or not at all: on an error or a signal what was written is removed (ExportError,
    ExportStopped), and when `out` is no longer new or empty by then, another export took it
    (FileExistsError). A signal while it is put in place lets it complete."""
    return _bucket_folder(out, signals, export) if storage.is_remote(out) else _disk_folder(out, signals)


@contextlib.contextmanager
def _disk_folder(out: str, signals: _StopSignals) -> Iterator[str]:
    target = storage.path(out)
    # Beside `out`, on its file system, so that putting it in place is one rename: atomic, and refused
    # where `out` is no longer new or empty by then.
    partial = target.parent / f".{target.name}.exporting-{uuid.uuid4().hex[:8]}"
    try:
        try:
            storage.make_dirs(partial)
            yield os.fspath(partial)
            _readable_as_made(partial)
        except Exception as error:  # a full disk, a writer's error
            raise _failed(out, error) from error
        signals.check()
        try:
            storage.rename_folder(partial, target)
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise _failed(out, error) from error
            raise FileExistsError(
                f"{out} is no longer new or empty: another export (or another process) wrote it while this one "
                f"ran; nothing of this one was written to {out}"
            ) from error
    finally:
        storage.remove(partial)  # gone already once moved


def _readable_as_made(folder) -> None:
    """Gives every file and folder under `folder` the mode a new one gets under this process's umask
    (0644 and 0755 under the usual 022): safetensors writes its files 0600, which a server running as
    another user cannot read. The umask is read off `folder`'s own mode (mkdir's 0777 less the umask),
    not set and reset: os.umask is process-wide, and exports may run in threads."""
    folder_mode = os.stat(folder).st_mode & 0o777
    folders = [folder]
    while folders:  # epath has no recursive glob on a disk
        for entry in folders.pop().iterdir():
            os.chmod(entry, folder_mode if entry.is_dir() else folder_mode & 0o666)
            if entry.is_dir():
                folders.append(entry)


@contextlib.contextmanager
def _bucket_folder(out: str, signals: _StopSignals, export: str) -> Iterator[str]:
    # A bucket cannot rename a folder: `out` is claimed with the object `out/.exporting`, created only
    # where none exists (of two exports one gets it), and the export is uploaded file by file beside it.
    # A reader listing `out` meanwhile sees the claim (which names the export) and the files so far;
    # the claim goes last, once every file is up. An export that fails or is stopped removes all of
    # `out` (it held only the claim); one killed outright leaves the claim, which a later export names.
    target = storage.path(out)
    claim = f"{export}, pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    if not storage.create_new(target / CLAIM, claim):
        raise FileExistsError(
            f"{out} is taken by another export ({storage.read_text(target / CLAIM)}); nothing was written to it"
        )
    try:
        if storage.names(out) != [CLAIM]:  # another export finished between the first check and the claim
            raise FileExistsError(
                f"{out} is no longer new or empty: another export wrote it while this one ran; nothing of this "
                f"one was written to {out}"
            )
    except BaseException:
        storage.remove(target / CLAIM)
        raise
    try:
        with storage.local_folder(out) as folder:
            yield folder
            signals.check()  # before the upload starts
    except BaseException as error:  # a failure or a signal: all of `out` is this export's
        storage.remove(target)
        if isinstance(error, Exception):
            raise _failed(out, error) from error
        raise
    storage.remove(target / CLAIM)


def _write_export(cfg, config, params, tokenizer, format: str, out: str, folder: str) -> list[str]:
    """Writes the export into the local `folder` (which becomes `out`); says what it wrote."""
    adapters = LoraConfig.of(cfg.model)
    written = []
    if format == "hf":
        to_hf(config, cast_params(lora.merged(params, config), config.dtype), folder)
        written.append(
            f"{out}: {'merged ' if adapters.enabled else ''}weights ({config.dtype}), config.json"
            + _tokenizer_files(tokenizer, folder)
        )
        return written
    own_base = (
        not cfg.model.path or cfg.warm_start.steps
    )  # the run made its base (warm start or random init): it goes along
    # where the adapters' base will be: the exported copy, else model.path as the run named it (a hub id stays one)
    base_model, revision = (str(storage.path(out) / "base"), None) if own_base else _as_named(cfg.model.path)
    to_peft(config, lora.trainable(params), folder, base_model=base_model, revision=revision)
    written.append(
        f"{out}: adapter_config.json, adapter_model.safetensors (rank {adapters.rank}, alpha {adapters.alpha}, "
        f"{', '.join(adapters.targets)})" + _tokenizer_files(tokenizer, folder)
    )
    if own_base:
        to_hf(config, lora.base(params), storage.join(folder, "base"))
        written.append(
            f"{base_model}: the base the adapters were trained on (the run's own, not model.path), weights and "
            f"config.json" + _tokenizer_files(tokenizer, storage.join(folder, "base"))
        )
    return written


def _as_named(model_path: str) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) of model.path as an adapter config names it: a local directory
    absolute, a hub id split from its pinned commit (PEFT takes the revision apart), a bucket path without its
    pinned generations (which no reader of an adapter config knows)."""
    if hub.is_hub_id(model_path):
        return hub.split_hub_id(model_path)
    if storage.is_remote(model_path):
        return hub.split_gcs_pins(model_path)[0], None
    return (str(storage.path(model_path)) if os.path.exists(model_path) else model_path), None


def _tokenizer_files(tokenizer, out: str) -> str:
    """Saves a Hugging Face tokenizer's files into `out`; says what was written."""
    if not hasattr(tokenizer, "tokenizer"):
        return " (no tokenizer files: the run uses the character tokenizer, which Hugging Face does not know)"
    tokenizer.tokenizer.save_pretrained(out)
    return ", tokenizer files"
