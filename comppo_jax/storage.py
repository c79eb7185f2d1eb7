"""One path layer for every file a run reads or writes: a local disk and a `gs://` bucket alike.

Paths are `etils.epath.Path`, the layer Orbax itself writes checkpoints through, so one path type
carries a run directory from the config to Orbax, tensorstore and our own files; `gs://` goes
through fsspec's gcsfs underneath. (fsspec alone would serve our files too, but Orbax would still
take epath, and two path types for one directory is what this module exists to avoid.)

An object store is not a disk: an object cannot be appended to, and a rename is a copy and a delete.
So the few operations whose meaning depends on that are named here, each doing the right thing on
both:
- `write_text` / `write_bytes` replace a file whole: through a temporary and a rename on a disk, one
  upload on a bucket (an object appears whole or not at all);
- `create_new` makes a file only where none exists: `O_EXCL` on a disk, the `ifGenerationMatch=0`
  precondition on a bucket;
- `AppendLog` is an append-only text file: lines flushed as they come on a disk; on a bucket,
  buffered and added at each `flush()` by composing the object with a new part (GCS's server-side
  concatenation, atomic), so a reader always sees whole flushes.
gcsfs's listing cache is off (`use_listings_cache`): the processes of a pod and a resumed run read
what other processes wrote, which a cached listing would hide.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator

import fsspec
import fsspec.asyn
from etils import epath

# Another process's writes must be visible to the next listing / existence check.
fsspec.config.conf.setdefault("gcs", {})["use_listings_cache"] = False

TIMEOUT_VARIABLE = "COMPPO_STORAGE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0


class StorageTimeout(Exception):
    """A bucket request that got no answer in time; the message names the endpoint and the request. Not an
    OSError: gcsfs answers an OSError of a bucket lookup with another request (twice the wait), and our readers
    take an OSError for a missing or damaged file, which a silent endpoint is not. Not a TimeoutError: fsspec
    re-raises that as an FSTimeoutError without its message."""


def timeout_s() -> float:
    """COMPPO_STORAGE_TIMEOUT_S (default 60): how long one request to a bucket or the hub may wait for its answer.
    Without it, an endpoint that accepts a connection and never answers holds a run forever."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    try:
        seconds = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r}: expected a positive number of seconds")
    return seconds


def _request_target(method: str, url) -> str:
    """`method gs://bucket/object` for a Cloud Storage JSON API request (yarl `url`), else `method path`."""
    match = re.fullmatch(r"(?:/upload)?/storage/v1/b/([^/]+)(?:/o/?(.*))?", url.path)
    if match is None:
        return f"{method} {url.path}"
    name = match[2] or url.query.get("name") or url.query.get("prefix", "")
    return f"{method} gs://{match[1]}{'/' + name if name else ''}"


async def _name_timeout(session, context, params) -> None:
    """aiohttp's on_request_exception hook: a request past gcsfs's `requests_timeout` becomes one StorageTimeout
    naming the endpoint and the object (aiohttp's TimeoutError says neither)."""
    del session, context
    if isinstance(params.exception, TimeoutError):
        via = " (STORAGE_EMULATOR_HOST)" if os.environ.get("STORAGE_EMULATOR_HOST") else ""
        raise StorageTimeout(
            f"{params.url.origin()}{via} did not answer {_request_target(params.method, params.url)} within "
            f"{timeout_s():g} s ({TIMEOUT_VARIABLE} sets the limit)"
        ) from params.exception


def _bound_requests(seconds: float) -> None:
    """Every bucket request fails after `seconds` without its answer, through each client's own settings.
    gcsfs: aiohttp's total time per request (a timeout is not retried, so a call fails within `seconds` of
    its stalled request), and the storage-layout probe's retry deadline. tensorstore (Orbax's checkpoints)
    reads its variables at its first request: a transfer moving no byte for `seconds`, or a connection not
    made in `seconds`, fails. (Set, not defaulted: a subprocess inherits its parent's, which would outrank its
    own COMPPO_STORAGE_TIMEOUT_S.)"""
    import aiohttp  # gcsfs's HTTP client

    trace = aiohttp.TraceConfig()
    trace.on_request_exception.append(_name_timeout)
    gcs = fsspec.config.conf["gcs"]
    gcs.update(requests_timeout=seconds, retry_timeout=seconds)
    gcs.setdefault("session_kwargs", {})["trace_configs"] = [trace]
    whole = str(max(1, round(seconds)))
    os.environ.update(
        TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS=whole,
        TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES="1",
        TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS=whole,
    )


_bound_requests(timeout_s())

REMOTE_PREFIXES = ("gs://",)


def is_remote(location: str | os.PathLike) -> bool:
    """Whether `location` names an object store (`gs://...`) rather than a local path."""
    return os.fspath(location).startswith(REMOTE_PREFIXES)


# A scheme-like prefix: s3://, gcs://, http://, hf://, a mistyped gs:/ (each would be a relative local folder).
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/")
# Cloud Storage's bucket naming rules (cloud.google.com/storage/docs/buckets#naming): lower case letters, digits,
# - _ and ., starting and ending with a letter or digit; 3-63 characters, or up to 222 in dot-separated parts of
# at most 63; no dotted IP address, no goog prefix, no google in it.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]*[a-z0-9]")
_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")


def check_location(value: str | os.PathLike, field: str, hub: bool = False) -> None:
    """Raises ValueError naming `field` and what to write instead unless `value` is a local path or a well-formed
    `gs://BUCKET/...` (with `hub`, the field also takes a Hugging Face id owner/name, which has no scheme). No
    network call: whether the bucket exists is `make_dirs`'s check."""
    text = os.fspath(value)
    if is_remote(text):
        problem = _bucket_problem(text.removeprefix("gs://").split("/", 1)[0])
        if problem:
            raise ValueError(f"{field}={text!r}: {problem}; write gs://BUCKET/... with a valid bucket, or a local path")
        return
    scheme = _SCHEME.match(text)
    if scheme:
        rest = text[scheme.end() :].lstrip("/")
        example = rest if hub and scheme.group().lower() == "hf:/" else f"gs://{rest}"
        instead = "a local path or gs://BUCKET/..." + (", or a Hugging Face id owner/name" if hub else "")
        raise ValueError(
            f"{field}={text!r}: neither a local path nor gs:// (it would be taken as the local folder "
            f"./{scheme.group()[:-1]}); write {instead}, e.g. {example}"
        )


def _bucket_problem(bucket: str) -> str:
    """What breaks Cloud Storage's naming rules in `bucket` ("" when nothing does)."""
    if not bucket:
        return "names no bucket"
    parts = bucket.split(".")
    if not _BUCKET.fullmatch(bucket) or len(bucket) < 3 or len(bucket) > (222 if len(parts) > 1 else 63):
        return (
            f"{bucket!r} is not a bucket name: 3-63 characters of lower case letters, digits, - _ and ., starting "
            "and ending with a letter or digit"
        )
    if any(not part or len(part) > 63 for part in parts) or _IP_ADDRESS.fullmatch(bucket):
        return f"{bucket!r} is not a bucket name: each dot-separated part has 1-63 characters, and no IP address"
    if bucket.startswith("goog") or "google" in bucket:
        return f"{bucket!r} is not a bucket name: Cloud Storage reserves names starting with goog or holding google"
    return ""


def path(location: str | os.PathLike) -> epath.Path:
    """`location` as an epath.Path: a bucket path as it is, a local one made absolute (a relative run
    directory must not be re-read against another working directory, and Orbax refuses one)."""
    text = os.fspath(location)
    return epath.Path(text) if is_remote(text) else epath.Path(os.path.abspath(text))


def make_dirs(location: str | os.PathLike) -> None:
    """Makes a local directory and its parents. A bucket has no directories (an object's name is its
    path), so there it only checks that the bucket exists: creating it is for its owner (gcsfs's own
    makedirs would create a bucket named by a typo)."""
    target = path(location)
    if not is_remote(target):
        target.mkdir(parents=True, exist_ok=True)
        return
    bucket = os.fspath(target).removeprefix("gs://").split("/", 1)[0]
    try:
        found = _filesystem(target).exists(bucket)
    except OSError as error:  # no permission, no credentials
        raise FileNotFoundError(f"gs://{bucket} cannot be read ({type(error).__name__}: {error})") from error
    if not found:
        raise FileNotFoundError(
            f"gs://{bucket} does not exist (needed for {target}): create it (gcloud storage buckets create "
            f"gs://{bucket}) or name another bucket"
        )


def _make_parent(target: epath.Path) -> None:
    """A local file's directory (an object's name needs none)."""
    if not is_remote(target):
        target.parent.mkdir(parents=True, exist_ok=True)


def join(base: str | os.PathLike, *names: str) -> str:
    """`base`/`names` as text, relative if `base` is (what a command line or a report shows)."""
    return os.fspath(epath.Path(os.fspath(base)).joinpath(*names))


def read_text(location: str | os.PathLike) -> str:
    return path(location).read_text()


def write_bytes(location: str | os.PathLike, data: bytes) -> None:
    """Replaces the file whole: a reader (or a crash) sees the old or the new contents, never a part."""
    target = path(location)
    check_fence(target)
    _make_parent(target)
    if is_remote(target):
        target.write_bytes(data)  # one upload: the object appears when it is complete
        return
    partial = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        partial.write_bytes(data)
        partial.replace(target)
    except BaseException:  # a full disk or a signal: no half-written temporary is left beside the file
        partial.unlink(missing_ok=True)
        raise


def write_text(location: str | os.PathLike, text: str) -> None:
    write_bytes(location, text.encode())


def create_new(location: str | os.PathLike, text: str) -> bool:
    """Creates the file with `text` only if it does not exist; False when it does. Two processes (on
    any hosts) racing for it: exactly one gets True (O_EXCL; GCS's ifGenerationMatch=0)."""
    target = path(location)
    check_fence(target)
    _make_parent(target)
    if is_remote(target):
        fs = _filesystem(target)
        if fs.exists(os.fspath(target)):
            return False
        try:
            fs.pipe_file(os.fspath(target), text.encode(), mode="create")
        except FileExistsError:
            return False
        return True
    try:
        descriptor = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as f:
        f.write(text)
    return True


def generation(location: str | os.PathLike) -> str | None:
    """A bucket object's generation, which every write of it changes; None on a disk or when it is absent."""
    target = path(location)
    if not is_remote(target):
        return None
    try:
        return str(_filesystem(target).info(os.fspath(target))["generation"])
    except FileNotFoundError:
        return None


def replace_if_generation(location: str | os.PathLike, data: bytes, expected: str) -> str | None:
    """Replaces a bucket object only while its generation is still `expected` (GCS's ifGenerationMatch, checked by
    the server, so no other writer can slip in between): its new generation, or None when another writer changed
    or deleted it first. One multipart upload, as gcsfs's own (the precondition is not among gcsfs's options)."""
    target = path(location)
    check_fence(target)
    bucket, _, name = os.fspath(target).removeprefix("gs://").partition("/")
    fs = _filesystem(target)
    header = json.dumps({"name": name})
    body = (
        (
            f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{header}\n--==0==\n"
            "Content-Type: application/octet-stream\n\n"
        ).encode()
        + data
        + b"\n--==0==--"
    )
    try:
        reply = fsspec.asyn.sync(
            fs.loop,
            fs._call,
            "POST",
            f"{fs._location}/upload/storage/v1/b/{urllib.parse.quote(bucket)}/o",
            uploadType="multipart",
            headers={"Content-Type": 'multipart/related; boundary="==0=="'},
            ifGenerationMatch=expected,
            data=body,
            json_out=True,
        )
    except (FileExistsError, FileNotFoundError):  # gcsfs's words for 412 Precondition Failed, and 404
        return None
    return str(reply["generation"])


def remove(location: str | os.PathLike) -> None:
    """Removes a file or a whole tree; nothing if it is already gone."""
    target = path(location)
    check_fence(target)
    if target.is_dir():
        target.rmtree(missing_ok=True)
    else:
        target.unlink(missing_ok=True)


def move(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Moves a file or a tree (on a bucket a copy then a delete, object by object: not atomic)."""
    source_path, destination_path = path(source), path(destination)
    check_fence(source_path)
    check_fence(destination_path)
    _make_parent(destination_path)
    if not is_remote(source_path):
        source_path.rename(destination_path)
        return
    fs = _filesystem(source_path)
    # copy + delete by hand: gcsfs's mv tries GCS's moveTo first, which only some buckets offer
    fs.copy(os.fspath(source_path), os.fspath(destination_path), recursive=True)
    fs.rm(os.fspath(source_path), recursive=True)


def rename_folder(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Renames the local folder `source` to `destination` in one step, where `destination` does not
    exist or is an empty folder (which it replaces); otherwise OSError (ENOTEMPTY, EEXIST, ENOTDIR)
    and nothing moves, so of two renames to one destination exactly one succeeds. (epath's rename
    checks first, then renames: not one step.) A bucket has no such rename."""
    if is_remote(source) or is_remote(destination):
        raise ValueError(f"rename_folder({source}, {destination}): a bucket has no atomic rename")
    check_fence(path(source))
    check_fence(path(destination))
    os.rename(path(source), path(destination))


def names(location: str | os.PathLike) -> list[str]:
    """The sorted names in a directory; [] when it does not exist."""
    folder = path(location)
    return sorted(child.name for child in folder.iterdir()) if folder.is_dir() else []


@contextlib.contextmanager
def local_folder(location: str | os.PathLike) -> Iterator[str]:
    """A local folder for writers that need one (safetensors, a tokenizer's save_pretrained) whose
    contents end up at `location`: `location` itself on a disk; on a bucket a temporary folder,
    uploaded file by file when the block ends without an error."""
    if not is_remote(location):
        make_dirs(location)
        yield os.fspath(path(location))
        return
    with tempfile.TemporaryDirectory(prefix="comppo_upload_") as folder:
        yield folder
        for root, _, files in os.walk(folder):
            for name in files:
                local = os.path.join(root, name)
                write_bytes(path(location) / os.path.relpath(local, folder), epath.Path(local).read_bytes())


def _filesystem(target: epath.Path) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("gcs")


class AppendLog:
    """An append-only text file (JSONL): `append(line)` then `flush()`.

    On a disk each line is written and flushed as it comes (a crash tears at most the line being
    written). On a bucket the lines are kept until `flush()`, which uploads them as a part object
    and composes the file with it (one atomic server-side concatenation; the file is created by the
    first flush). The composite's component count grows by one each flush and GCS caps it at 1024,
    so every `REWRITE_EVERY` flushes the file is rewritten as one plain object instead.
    """

    REWRITE_EVERY = 256

    def __init__(self, location: str | os.PathLike, truncate: bool = False):
        self.path = path(location)
        self.remote = is_remote(self.path)
        self.pending: list[str] = []
        self.flushes = 0
        _make_parent(self.path)
        if truncate:
            self.path.unlink(missing_ok=True)
        self.file = None if self.remote else open(self.path, "a")  # noqa: SIM115 (closed in close())

    def append(self, line: str) -> None:
        if self.file is not None:
            check_fence(self.path)
            self.file.write(line.rstrip("\n") + "\n")
            self.file.flush()
        else:
            self.pending.append(line.rstrip("\n") + "\n")

    def extend(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.append(line)

    def flush(self) -> None:
        """Makes every appended line durable and visible to readers."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            return
        if not self.pending:
            return
        check_fence(self.path)
        data = "".join(self.pending).encode()
        fs, target = _filesystem(self.path), os.fspath(self.path)
        if not fs.exists(target):
            fs.pipe_file(target, data)
        elif self.flushes % self.REWRITE_EVERY == self.REWRITE_EVERY - 1:
            fs.pipe_file(target, fs.cat_file(target) + data)
        else:
            part = f"{target}.part-{uuid.uuid4().hex[:12]}"
            fs.pipe_file(part, data)
            try:
                fs.merge(target, [target, part])
            finally:
                fs.rm_file(part)
        self.flushes += 1
        self.pending = []

    def close(self) -> None:
        self.flush()
        if self.file is not None:
            self.file.close()
            self.file = None


def append_lines(location: str | os.PathLike, lines: Iterable[str]) -> None:
    """Appends `lines` to a text file at once (config_changes.jsonl, set-aside rows)."""
    log = AppendLog(location)
    log.extend(lines)
    log.close()


def read_lines(location: str | os.PathLike) -> list[str]:
    """A text file's non-empty lines (without their newlines); [] when it does not exist."""
    source = path(location)
    if not source.exists():
        return []
    return [line for line in source.read_bytes().decode(errors="surrogateescape").splitlines() if line.strip()]


# Fenced folders: {folder: check}. Every write above to a path inside `folder` calls `check(path)` first, which
# raises to refuse it (a run directory whose lock another process took over; comppo_jax.runs.run_dir).
_FENCES: dict[str, Callable[[epath.Path], None]] = {}


@contextlib.contextmanager
def fenced(folder: str | os.PathLike, check: Callable[[epath.Path], None]) -> Iterator[None]:
    """While the block runs, every write through this module into `folder` first calls `check(target)`;
    writers of their own (Orbax) call `check_fence` before they write."""
    key = os.fspath(path(folder))
    _FENCES[key] = check
    try:
        yield
    finally:
        _FENCES.pop(key, None)


def check_fence(location: str | os.PathLike) -> None:
    """Calls the check of each fenced folder holding `location` (raises when that write is refused)."""
    target = path(location)
    text = os.fspath(target)
    for folder, check in list(_FENCES.items()):
        if text == folder or text.startswith(folder.rstrip("/") + "/"):
            check(target)
