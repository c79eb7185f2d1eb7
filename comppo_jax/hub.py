"""Where `model.path`, `model.tokenizer` and `data.path` come from: a local path, gs://, or the Hugging Face hub.

Each field takes a local path (one that exists always wins, and is used as it is), a `gs://bucket/...` path
(copied once per version of its objects into `<HF_HOME>/comppo_jax/gcs/`: safetensors and pyarrow read local
files), or a hub id `owner/name`, optionally `owner/name@<branch, tag or commit>`, fetched with huggingface_hub's
`snapshot_download` into its cache, which honours HF_HOME / HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN and
HF_HUB_OFFLINE as huggingface_hub reads them. Only the files a run reads are fetched: a model's safetensors,
configs and tokenizer files, a tokenizer's files, a dataset's parquet file.

`pin_sources(cfg)` rewrites each hub id to `owner/name@<40-hex commit>`, having fetched it: the run saves that
config, so its resume, eval and export read the same bytes, from the cache and with no network. It pins a gs://
path to the generations of the objects it reads, `gs://bucket/path#<name>=<generation>&...` (an upload of an
object, even of the same bytes, gives it a new generation). A pinned gs:// source whose objects have other
generations now is refused in one line naming the field, the object and both generations, rather than read at
its pinned generations: a bucket keeps an object's earlier generations only with versioning on (off by default),
and every process then gets the same answer from the bucket, whatever its own cache holds.

Several processes on one host fetching the same id download each file once while the others wait: huggingface_hub
holds a file lock per blob (`<cache>/.locks/<repo>/<etag>.lock`) around its download, and a process that gets the
lock after another finds the blob there and skips the download (`file_download._hf_hub_download_to_cache_dir`).
A gs:// copy takes its own lock.
"""

from __future__ import annotations

import copy
import fnmatch
import glob
import hashlib
import os
import posixpath
import re
import urllib.parse
from typing import Any

import filelock
import fsspec
import huggingface_hub
from huggingface_hub import constants, errors
from huggingface_hub.utils import _http, validate_repo_id

from comppo_jax import storage
from comppo_jax.errors import ConfigError


def _bound_request(request) -> None:
    """httpx's request hook: each phase (connect, read, write, pool) of a hub request that sets no timeout of its
    own gets comppo_jax.storage.timeout_s(). snapshot_download's first request (repo_info) sets none, and would
    wait forever on an HF_ENDPOINT that accepts the connection and never answers."""
    seconds = storage.timeout_s()
    phases = request.extensions["timeout"]
    request.extensions = {
        **request.extensions,
        "timeout": {phase: seconds if limit is None else limit for phase, limit in phases.items()},
    }


def _bounded_client():
    """huggingface_hub's own client (its `set_client_factory` hook), with `_bound_request`."""
    client = _http.default_client_factory()
    client.event_hooks = {**client.event_hooks, "request": [*client.event_hooks["request"], _bound_request]}
    return client


huggingface_hub.set_client_factory(_bounded_client)

# owner/name, optionally @revision (a branch may hold slashes: refs/pr/1); huggingface_hub validates the name.
_HUB_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^@\s]+))?", re.ASCII)
_COMMIT = re.compile(r"[0-9a-f]{40}")

TOKENIZER_FILES = (
    "config.json",  # transformers reads the model type from it when tokenizer_config.json names no class
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_FILES = ("*.safetensors", "model.safetensors.index.json", "generation_config.json", *TOKENIZER_FILES)
DATASET_FILES = ("*.parquet",)

# The source fields of a run config: (field, what it holds).
SOURCE_FIELDS = (("model.path", "model"), ("model.tokenizer", "tokenizer"), ("data.path", "dataset"))


def split_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of `owner/name[@revision]`, or None when `text` is not of that form."""
    match = _HUB_ID.fullmatch(text or "")
    if match is None:
        return None
    try:
        validate_repo_id(match["repo"])
    except errors.HFValidationError:
        return None
    return match["repo"], match["revision"]


def source_kind(spec: str) -> str | None:
    """What `spec` names: "local" (an existing path, which wins), "gcs" (gs://...), "hub" (a hub id) or None."""
    if not spec:
        return None
    if os.path.exists(spec):
        return "local"
    if storage.is_remote(spec):
        return "gcs"
    return "hub" if split_hub_id(spec) else None


def is_hub_id(spec: str) -> bool:
    """Whether `spec` names a hub repository: `owner/name[@revision]` and no local path of that name."""
    return source_kind(spec) == "hub"


def resolve_model(spec: str, field: str = "model.path") -> str:
    """The local checkpoint directory (config.json, safetensors, tokenizer) that `spec` names."""
    return _resolve(spec, field, "model")[0]


def resolve_tokenizer(spec: str, field: str = "model.tokenizer") -> str:
    """The local directory of the tokenizer files that `spec` (a tokenizer's or a model's) names."""
    return _resolve(spec, field, "tokenizer")[0]


def resolve_dataset_file(spec: str, field: str = "data.path") -> str:
    """The local data file that `spec` names: a hub dataset must hold exactly one parquet file."""
    return _resolve(spec, field, "dataset")[0]


def pinned_sources(cfg: Any, previous: Any = None) -> dict[str, str]:
    """{field: "owner/name@<commit>"} for each source field of `cfg` that is a hub id, fetched now (found in the
    cache offline). A field naming the same repository without a commit as in `previous` (the run's saved config,
    on a resume) keeps `previous`'s commit, so a moved branch does not change a resumed run's weights or data.
    Raises ConfigError naming the field for an unknown id or revision, or offline when the cache lacks it.
    A gs:// field is pinned to its objects' generations the same way (`_pinned_gcs`)."""
    pinned = {}
    for field, role in _source_fields(cfg):
        spec = _field(cfg, field)
        if source_kind(spec) == "gcs":
            pinned.update(_pinned_gcs(spec, field, role, _field(previous, field) if previous is not None else ""))
        if not is_hub_id(spec):
            continue
        repo_id, revision = split_hub_id(spec)  # type: ignore[misc]
        earlier = split_hub_id(_field(previous, field)) if previous is not None else None
        if earlier and earlier[0] == repo_id and earlier[1] and _COMMIT.fullmatch(earlier[1]):
            if not (revision and _COMMIT.fullmatch(revision)):
                spec = f"{repo_id}@{earlier[1]}"
        pinned[field] = f"{repo_id}@{_resolve(spec, field, role)[1]}"
    return pinned


def pin_sources(cfg: Any, previous: Any = None) -> Any:
    """A copy of `cfg` with each hub id pinned to its commit and each gs:// path to its objects' generations
    (`pinned_sources`); local paths unchanged."""
    pinned = copy.deepcopy(cfg)
    for field, value in pinned_sources(cfg, previous).items():
        *sections, name = field.split(".")
        section = pinned
        for part in sections:
            section = section[part]
        section[name] = value
    return pinned


def _source_fields(cfg: Any) -> list[tuple[str, str]]:
    """The source fields a run reads: data.path only for the DAPO-Math data."""
    return [(field, role) for field, role in SOURCE_FIELDS if field != "data.path" or cfg.data.kind == "dapo_math"]


def _field(cfg: Any, dotted: str) -> str:
    section = cfg
    for part in dotted.split("."):
        section = section[part]
    return section


def _resolve(spec: str, field: str, role: str) -> tuple[str, str | None]:
    """(local path, commit: None unless a hub id) of `spec`, a `role` ("model", "tokenizer" or "dataset")."""
    kind = source_kind(spec)
    patterns = {"model": MODEL_FILES, "tokenizer": TOKENIZER_FILES, "dataset": DATASET_FILES}[role]
    if kind == "gcs":
        return _from_gcs(spec, field, role, patterns), None
    if kind != "hub":
        return spec, None  # a local path, or nothing at all: the loader's own error names it
    snapshot = _snapshot(spec, field, "dataset" if role == "dataset" else "model", patterns)
    commit = os.path.basename(snapshot)  # snapshot_download returns <cache>/<repo>/snapshots/<commit>
    if role != "dataset":
        return snapshot, commit
    files = sorted(glob.glob(os.path.join(snapshot, "**", "*.parquet"), recursive=True))
    if len(files) != 1:
        names = ", ".join(os.path.relpath(file, snapshot) for file in files) or "none"
        raise ConfigError(
            f"config.{field}={spec!r}: the dataset holds {len(files)} parquet files ({names}); expected one"
        )
    return files[0], commit


def _snapshot(spec: str, field: str, repo_type: str, patterns: tuple[str, ...]) -> str:
    """snapshot_download of hub id `spec`, its failures one ConfigError line naming the field and the id."""
    repo_id, revision = split_hub_id(spec)  # type: ignore[misc]
    where = f"config.{field}={spec!r}"
    try:
        return huggingface_hub.snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, allow_patterns=list(patterns)
        )
    except errors.RevisionNotFoundError as error:
        raise ConfigError(
            f"{where}: the {repo_type} repository {repo_id} on {constants.ENDPOINT} has no revision {revision!r}"
        ) from error
    except errors.RepositoryNotFoundError as error:  # also a gated or private one without a token
        raise ConfigError(
            f"{where}: no local path of that name, and no {repo_type} repository {repo_id} on {constants.ENDPOINT} "
            "(a private or gated one needs HF_TOKEN or `hf auth login`)"
        ) from error
    except errors.LocalEntryNotFoundError as error:
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.is_offline_mode()
            else f"{constants.ENDPOINT} cannot be reached ({_first_line(error.__cause__ or error)})"
        )
        raise ConfigError(
            f"{where}: {repo_id} is not (completely) in the Hugging Face cache {constants.HF_HUB_CACHE} and {why}; "
            "fetch it once online, or point HF_HOME at a cache that holds it"
        ) from error
    except errors.HfHubHTTPError as error:
        raise ConfigError(
            f"{where}: {repo_id} cannot be fetched from {constants.ENDPOINT}: {_first_line(error)}"
        ) from error


def _first_line(error: BaseException) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)


def gcs_cache_dir() -> str:
    """Where gs:// sources are copied: beside the hub cache, so HF_HOME moves every download to one disk."""
    return os.path.join(constants.HF_HOME, "comppo_jax", "gcs")


def split_gcs_pins(spec: str) -> tuple[str, dict[str, str] | None]:
    """(the gs:// path, {object name: pinned generation} or None when unpinned) of `gs://bucket/path[#pins]`."""
    path, mark, pins = spec.partition("#")
    return path.rstrip("/"), dict(urllib.parse.parse_qsl(pins)) if mark else None


def _pinned_gcs(spec: str, field: str, role: str, previous: str) -> dict[str, str]:
    """{field: `spec` pinned to its objects' generations}: the pins `spec` holds, else those of `previous` (the
    run's recorded value) where it names the same path, else the objects' generations now. A run recorded
    without pins (before they existed) stays without them. Pins that no longer match are refused."""
    path, pins = split_gcs_pins(spec)
    earlier_path, earlier_pins = split_gcs_pins(previous) if storage.is_remote(previous) else ("", None)
    if pins is None and earlier_path == path:
        if earlier_pins is None:
            return {}
        pins = earlier_pins
    current = _gcs_generations(path, field, role)
    if pins is not None:
        _check_pins(path, field, pins, current)
    return {field: f"{path}#{_pin_text(current if pins is None else pins)}"}


def _pin_text(pins: dict[str, str]) -> str:
    return urllib.parse.urlencode(sorted(pins.items()))


def _gcs_generations(path: str, field: str, role: str) -> dict[str, str]:
    """{object name: generation now} of the gs:// file `path` (a dataset) or of the files of the gs:// directory
    `path` that a model or tokenizer load reads (MODEL_FILES, whichever the role: one pin for both loads)."""
    location = path.removeprefix("gs://")
    gcs = fsspec.filesystem("gcs")
    try:
        entries = [gcs.info(location)] if role == "dataset" else gcs.ls(location, detail=True)
    except FileNotFoundError as error:
        raise ConfigError(f"config.{field}={path!r}: no such object or folder in the bucket") from error
    objects = {
        posixpath.basename(entry["name"]): str(entry["generation"])
        for entry in entries
        if entry["type"] == "file" and (role == "dataset" or _matches(entry["name"], MODEL_FILES))
    }
    if not objects:
        what = "is not a file" if role == "dataset" else f"holds none of a model's files ({', '.join(MODEL_FILES)})"
        raise ConfigError(f"config.{field}={path!r}: {what} in the bucket")
    return objects


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(posixpath.basename(name), pattern) for pattern in patterns)


def _check_pins(path: str, field: str, pins: dict[str, str], current: dict[str, str]) -> None:
    """One ConfigError line unless every object in `pins` is still at its pinned generation (`current`)."""
    for name, generation in sorted(pins.items()):
        now = current.get(name)
        if now != generation:
            found = "is gone" if now is None else f"is generation {now} now"
            raise ConfigError(
                f"config.{field}={path!r}: {_object(path, name)} {found}, not the generation {generation} this run "
                "pinned (recorded in its config.json): it was uploaded again or deleted since, so the run would read "
                "other bytes. Put that version back, or start a new run with another --config.output_dir"
            )


def _object(path: str, name: str) -> str:
    """The gs:// object `name` of source `path`: the file `path` itself, or a file in the folder `path`."""
    return path if posixpath.basename(path) == name else f"{path}/{name}"


def _from_gcs(spec: str, field: str, role: str, patterns: tuple[str, ...]) -> str:
    """A local copy of gs:// file `spec` (a dataset) or of the files of gs:// directory `spec` matching
    `patterns`, at their pinned generations (the ones now when `spec` holds none), under `gcs_cache_dir()` in a
    folder named by those generations, so an object uploaded again is copied again. One process per host copies
    (a file lock) while the others wait; each file is downloaded at its generation, and renamed into place whole."""
    path, pins = split_gcs_pins(spec)
    current = _gcs_generations(path, field, role)
    pins = current if pins is None else pins
    wanted = sorted(pins) if role == "dataset" else [name for name in sorted(pins) if _matches(name, patterns)]
    _check_pins(path, field, {name: pins[name] for name in wanted}, current)  # only what this load reads
    version = hashlib.sha256(_pin_text(pins).encode()).hexdigest()[:16]
    folder = os.path.join(gcs_cache_dir(), path.removeprefix("gs://"), version)
    os.makedirs(folder, exist_ok=True)
    with filelock.FileLock(folder + ".lock"):
        for name in wanted:
            local = os.path.join(folder, name)
            if os.path.isfile(local):
                continue
            _download(_object(path, name), pins[name], field, f"{local}.incomplete")
            os.replace(f"{local}.incomplete", local)
    return os.path.join(folder, wanted[0]) if role == "dataset" else folder


def _download(remote: str, generation: str, field: str, local: str) -> None:
    """gs:// object `remote` at `generation` into the file `local`."""
    try:
        fsspec.filesystem("gcs").get_file(remote.removeprefix("gs://"), local, generation=generation)
    except FileNotFoundError as error:
        raise ConfigError(
            f"config.{field}: {remote} generation {generation} is gone (uploaded again or deleted while it was "
            "being copied): start again"
        ) from error
