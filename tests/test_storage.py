"""The path layer on a local disk and on a gs:// bucket (the GCS emulator): whole-file writes,
create-only-if-absent, the append-only log, listing, moves and the local folder for uploads."""

from __future__ import annotations

import json
import os
import threading

import pytest
from conftest import full_disk

from comppo_jax import storage


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    """A run directory's parent: a temporary folder, or a new bucket on the emulator."""
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue("bucket")


def test_a_local_path_is_made_absolute_and_a_bucket_path_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(storage.path("runs/x")) == os.path.join(str(tmp_path), "runs", "x")
    assert str(storage.path("gs://b/runs/x")) == "gs://b/runs/x"
    assert storage.join("runs", "x") == "runs/x" and storage.join("gs://b", "x") == "gs://b/x"


def test_whole_file_writes_read_back_and_replace(root):
    target = storage.join(root, "run", "config.json")
    storage.write_text(target, "old")
    storage.write_text(target, "new")
    assert storage.read_text(target) == "new"
    assert storage.names(storage.join(root, "run")) == ["config.json"]  # no temporary left beside it


def test_a_whole_file_write_on_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    storage.write_text(target, "old")
    with full_disk(free_bytes=4), pytest.raises(OSError, match="File too large"):
        storage.write_text(target, "new contents")
    assert os.listdir(tmp_path) == ["summary.json"] and target.read_text() == "old"


def test_create_new_refuses_an_existing_file(root):
    lock = storage.join(root, "run", "run.lock")
    assert storage.create_new(lock, "first")
    assert not storage.create_new(lock, "second")
    assert storage.read_text(lock) == "first"


def test_only_one_of_racing_creators_gets_a_local_file(tmp_path):
    lock, winners = str(tmp_path / "run.lock"), []
    threads = [threading.Thread(target=lambda i=i: winners.append(storage.create_new(lock, str(i)))) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert winners.count(True) == 1


def test_the_append_log_shows_whole_flushes_and_reads_back_as_one_file(root, monkeypatch):
    path = storage.join(root, "run", "metrics.jsonl")
    monkeypatch.setattr(storage.AppendLog, "REWRITE_EVERY", 3)  # the rewrite that resets GCS's component count, too
    log = storage.AppendLog(path)
    for step in range(1, 8):
        log.append(json.dumps({"step": step}))
        if step % 2 == 0:
            log.flush()
            assert [json.loads(line)["step"] for line in storage.read_lines(path)] == list(range(1, step + 1))
    log.close()
    assert [json.loads(line)["step"] for line in storage.read_lines(path)] == list(range(1, 8))
    assert storage.names(storage.join(root, "run")) == ["metrics.jsonl"]  # the parts composed in are gone
    storage.append_lines(path, ['{"step": 8}'])
    assert len(storage.read_lines(path)) == 8


def test_a_bucket_log_writes_nothing_before_its_flush(bucket):
    path = storage.join(bucket, "run", "metrics.jsonl")
    log = storage.AppendLog(path)
    log.append('{"step": 1}')
    assert storage.read_lines(path) == []  # an object store has no appends: rows wait for the flush
    log.flush()
    assert storage.read_lines(path) == ['{"step": 1}']


def test_move_and_remove_a_tree(root):
    storage.write_text(storage.join(root, "run", "checkpoints", "3", "a"), "a")
    storage.write_text(storage.join(root, "run", "checkpoints", "3", "sub", "b"), "b")
    storage.move(storage.join(root, "run", "checkpoints", "3"), storage.join(root, "run", "corrupt", "3-x"))
    assert storage.names(storage.join(root, "run", "checkpoints")) == []
    assert storage.read_text(storage.join(root, "run", "corrupt", "3-x", "sub", "b")) == "b"
    storage.remove(storage.join(root, "run", "corrupt"))
    assert "corrupt" not in storage.names(storage.join(root, "run"))


def test_a_local_folder_ends_up_at_its_location(root):
    out = storage.join(root, "export")
    with storage.local_folder(out) as folder:
        os.makedirs(os.path.join(folder, "base"))
        with open(os.path.join(folder, "base", "model.safetensors"), "w") as f:
            f.write("weights")
    assert storage.read_text(storage.join(out, "base", "model.safetensors")) == "weights"


def test_a_missing_bucket_is_named_not_created(gcs_emulator):
    with pytest.raises(FileNotFoundError, match=r"gs://no-such-bucket does not exist \(needed for gs://no-such"):
        storage.make_dirs("gs://no-such-bucket/runs/x")
    assert not storage.path("gs://no-such-bucket").exists()


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("s3://bucket/run", "neither a local path nor gs:// (it would be taken as the local folder ./s3:)"),
        ("gcs://bucket/run", "neither a local path nor gs://"),
        ("gs:/bucket/run", "neither a local path nor gs://"),
        ("http://host/run", "neither a local path nor gs://"),
        ("hf://owner/name", "neither a local path nor gs://"),
        ("gs://", "names no bucket"),
        ("gs:///run", "names no bucket"),
        ("gs://My-Bucket/run", "'My-Bucket' is not a bucket name: 3-63 characters of lower case letters"),
        ("gs://ab/run", "'ab' is not a bucket name"),
        (f"gs://{'a' * 64}/run", "is not a bucket name"),
        ("gs://-bucket/run", "'-bucket' is not a bucket name"),
        ("gs://a..b/run", "each dot-separated part has 1-63 characters"),
        ("gs://192.168.0.1/run", "no IP address"),
        ("gs://google-runs/run", "Cloud Storage reserves names"),
    ],
)
def test_a_location_that_is_neither_local_nor_a_well_formed_bucket_is_refused_naming_the_field(value, why):
    with pytest.raises(ValueError) as error:
        storage.check_location(value, "--out")
    message = str(error.value)
    assert (
        message.startswith(f"--out={value!r}: ")
        and why in message
        and "write " in message
        and "gs://BUCKET/" in message
    )


def test_a_local_path_a_bucket_path_and_for_a_source_a_hub_id_pass():
    for value in (
        "",
        "runs/x",
        "/abs/runs/x",
        "./gs_runs",
        "runs/a:b",
        "gs://my-bucket",
        "gs://my_bucket.example.com/x",
    ):
        storage.check_location(value, "--out")
    storage.check_location("Qwen/Qwen3-4B@main", "config.model.path", hub=True)
    with pytest.raises(ValueError, match=r"or a Hugging Face id owner/name, e.g\. Qwen/Qwen3-4B$"):
        storage.check_location("hf://Qwen/Qwen3-4B", "config.model.path", hub=True)
