"""Models, tokenizers and data named by a Hugging Face hub id (or gs://) load through the loop's own loaders,
pinned to a commit, from the cache offline; a wrong id, revision or an empty offline cache is one ConfigError
line naming the field. huggingface_hub's real client talks to a local server (tests/hub_server.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import fsspec
import numpy as np
import pytest
from conftest import CPU_ONLY_ENV, REPO, save_word_tokenizer, small_train_config
from hub_server import hub_env, set_offline, start_hub, use_hub, write_dapo
from ml_collections import config_dict

from comppo_jax import hub as sources
from comppo_jax import storage
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.models import ConfigError, from_hf, load_policy
from comppo_jax.train.start import load_problems
from comppo_jax.train.validation import validate_config

MODEL, DATASET = "tiny-org/qwen3-tiny", "math-org/dapo-tiny"
WORDS = ["what", "is", "+", "1", "?"]


@pytest.fixture(scope="module")
def checkpoint_dir(hf_checkpoint, tmp_path_factory):
    """The tiny random Qwen3 with a word tokenizer, and files a run never reads (they must not be fetched)."""
    folder = tmp_path_factory.mktemp("qwen3_tiny")
    shutil.copytree(hf_checkpoint("qwen3", True)[0], folder, dirs_exist_ok=True)
    save_word_tokenizer(folder, WORDS)
    (folder / "README.md").write_text("a model card")
    (folder / "pytorch_model.bin").write_bytes(b"pickled weights")
    return folder


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dapo_tiny")
    write_dapo(folder, problems=12)
    return folder


@pytest.fixture(scope="module")
def server(checkpoint_dir, dataset_dir):
    hub = start_hub()
    hub.commits = {MODEL: hub.add("model", MODEL, checkpoint_dir), DATASET: hub.add("dataset", DATASET, dataset_dir)}
    yield hub
    hub.stop()


@pytest.fixture
def hub(server, tmp_path, monkeypatch):
    """The server, with this test's own empty cache (HF_HOME) and online."""
    use_hub(monkeypatch, server.url, tmp_path / "hf")
    server.hold_download = None
    return server


def run_config(model=MODEL, tokenizer="", data=DATASET):
    return config_dict.ConfigDict(
        {"model": {"path": model, "tokenizer": tokenizer}, "data": {"kind": "dapo_math", "path": data}}
    )


def load_dapo(path):
    """(train, dev) problems through the loop's own loader."""
    return load_problems(config_dict.ConfigDict({"kind": "dapo_math", "path": path, "dev_size": 2}), seed=0)


def downloads(hub, start=0):
    """The files fetched (GET .../resolve/...) since request `start`."""
    return sorted(
        request.rsplit("/", 1)[1]
        for request in hub.requests[start:]
        if "/resolve/" in request and request.startswith("GET")
    )


def test_ids_pin_to_their_commits_fetching_only_what_a_run_reads(hub):
    config = run_config()
    pinned = sources.pin_sources(config)
    assert pinned.model.path == f"{MODEL}@{hub.commits[MODEL]}"
    assert pinned.data.path == f"{DATASET}@{hub.commits[DATASET]}"
    assert pinned.model.tokenizer == "" and config.model.path == MODEL  # the tokenizer comes with the model
    assert sources.pinned_sources(config) == {"model.path": pinned.model.path, "data.path": pinned.data.path}
    fetched = downloads(hub)
    assert "model.safetensors" in fetched and "tokenizer.json" in fetched and "dapo-math-17k.parquet" in fetched
    assert not {"README.md", "pytorch_model.bin"} & set(fetched)


def test_a_revision_pins_and_a_pinned_id_keeps_its_bytes_when_the_branch_moves(hub, tmp_path, dataset_dir):
    moving = "math-org/moving"
    first = hub.add("dataset", moving, dataset_dir)
    hub.add("dataset", moving, dataset_dir, branch="v1")
    assert sources.pinned_sources(run_config(data=f"{moving}@v1"))["data.path"] == f"{moving}@{first}"
    pinned = sources.pin_sources(run_config(data=moving))
    assert pinned.data.path == f"{moving}@{first}"
    write_dapo(tmp_path / "changed", problems=20)
    second = hub.add("dataset", moving, tmp_path / "changed")  # main moves on
    assert len(load_dapo(pinned.data.path)[0]) == 10 and len(load_dapo(moving)[0]) == 18
    assert sources.pin_sources(pinned).data.path == pinned.data.path  # pinning a pinned config changes nothing
    assert sources.pin_sources(run_config(data=moving)).data.path == f"{moving}@{second}"
    # A resume keeps its saved commit for the same id; another id is resolved afresh.
    assert sources.pin_sources(run_config(data=moving), previous=pinned).data.path == pinned.data.path
    assert sources.pin_sources(run_config(), previous=pinned).data.path == f"{DATASET}@{hub.commits[DATASET]}"


def test_the_loops_loaders_read_a_model_its_tokenizer_and_dapo_math_by_id(hub, checkpoint_dir):
    local_config, local_params = from_hf(str(checkpoint_dir))
    section = config_dict.ConfigDict({"path": MODEL, "arch": local_config.to_dict()})
    config, params = load_policy(section, rng=None)
    assert config == local_config
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(local_params["embed"]))
    tokenizer = load_tokenizer(MODEL)
    assert tokenizer.use_chat_template and tokenizer.decode(tokenizer.encode("what is 1")) == "what is 1"
    train, dev = load_dapo(DATASET)
    assert len(train) == 10 and len(dev) == 2 and {p.answer for p in train + dev} == {str(i + 1) for i in range(12)}


def test_a_pinned_config_loads_offline_from_the_cache_with_no_request(hub, monkeypatch, checkpoint_dir):
    pinned = sources.pin_sources(run_config())
    set_offline(monkeypatch, True)
    before = len(hub.requests)
    assert sources.pin_sources(run_config()) == pinned  # an unpinned id offline: the cached branch
    local_config, _ = from_hf(str(checkpoint_dir))
    section = config_dict.ConfigDict({"path": pinned.model.path, "arch": local_config.to_dict()})
    assert load_policy(section, rng=None)[0] == local_config
    assert load_tokenizer(pinned.model.path).use_chat_template
    assert len(load_dapo(pinned.data.path)[0]) == 10
    assert hub.requests[before:] == []


def test_offline_with_an_empty_cache_is_one_line_naming_the_field_and_id(hub, monkeypatch):
    set_offline(monkeypatch, True)
    start = len(hub.requests)
    with pytest.raises(ConfigError) as error:
        sources.pin_sources(run_config())
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"config.model.path='{MODEL}': {MODEL} is not")
    assert "HF_HUB_OFFLINE is set" in message and hub.requests[start:] == []


@pytest.mark.parametrize(
    "config, message",
    [
        (
            run_config(model="tiny-org/nope"),
            "config.model.path='tiny-org/nope': no local path of that name, and no model repository tiny-org/nope "
            "on http",
        ),
        (
            run_config(model=f"{MODEL}@v9"),
            f"config.model.path='{MODEL}@v9': the model repository {MODEL} on http.* has no revision 'v9'",
        ),
        (run_config(tokenizer="tiny-org/nope"), "config.model.tokenizer='tiny-org/nope': no local path"),
        (
            run_config(data="math-org/nope"),
            "config.data.path='math-org/nope': no local path of that name, and no dataset repository",
        ),
    ],
    ids=["model", "revision", "tokenizer", "dataset"],
)
def test_an_unknown_id_or_revision_is_one_line_naming_it(hub, config, message):
    with pytest.raises(ConfigError, match=message) as error:
        sources.pin_sources(config)
    assert "\n" not in str(error.value)


def test_local_paths_win_and_are_used_as_they_are(hub, tmp_path, monkeypatch, checkpoint_dir, dataset_dir):
    parquet = str(dataset_dir / "data" / "dapo-math-17k.parquet")
    config = run_config(model=str(checkpoint_dir), tokenizer=str(checkpoint_dir), data=parquet)
    start = len(hub.requests)
    assert sources.pin_sources(config) == config
    assert sources.resolve_model(str(checkpoint_dir)) == str(checkpoint_dir)
    assert sources.resolve_dataset_file(parquet) == parquet
    # A local directory spelt like an id is the local directory.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoint_dir, tmp_path / MODEL)
    assert sources.source_kind(MODEL) == "local" and sources.pinned_sources(run_config(data=parquet)) == {}
    assert hub.requests[start:] == []
    assert [sources.source_kind(text) for text in ("owner/name@main", "gs://b/x", "a/b/c", "name", "")] == [
        "hub",
        "gcs",
        None,
        None,
        None,
    ]


def test_validation_takes_ids_without_a_request_and_names_what_is_none_of_them(hub, tmp_path):
    config = small_train_config(
        tmp_path,
        model__path=MODEL,
        model__tokenizer=MODEL,
        data__kind="dapo_math",
        data__path=DATASET,
        warm_start__steps=0,
    )
    start = len(hub.requests)
    validate_config(config)
    config.model.path, config.data.path = "not an id", "a/b/c.parquet"
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    lines = str(error.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "config.model.path='not an id'",
        "config.data.path='a/b/c.parquet'",
    ]
    assert "Hugging Face model id" in lines[0] and "Hugging Face dataset id" in lines[1]
    assert hub.requests[start:] == []


def upload(bucket, checkpoint_dir, dataset_dir):
    """The checkpoint under <bucket>/ckpt, the DAPO parquet file under <bucket>/dapo."""
    for folder, name in ((checkpoint_dir, "ckpt"), (dataset_dir / "data", "dapo")):
        for file in os.listdir(folder):
            storage.write_bytes(storage.join(bucket, name, file), (folder / file).read_bytes())


def generation(location):
    return str(fsspec.filesystem("gcs").info(location.removeprefix("gs://"))["generation"])


def uploaded_again(location) -> tuple[str, str]:
    """(generation before, after) of `location` overwritten with other bytes of the same size."""
    before, data = generation(location), storage.path(location).read_bytes()
    storage.write_bytes(location, bytes(255 - byte for byte in data))
    return before, generation(location)


def test_gcs_sources_are_copied_once_into_the_local_cache(hub, bucket, checkpoint_dir, dataset_dir):
    upload(bucket, checkpoint_dir, dataset_dir)
    local = sources.resolve_model(f"{bucket}/ckpt")
    assert os.path.dirname(local) == os.path.join(sources.gcs_cache_dir(), bucket.removeprefix("gs://"), "ckpt")
    assert "model.safetensors" in os.listdir(local) and not {"README.md", "pytorch_model.bin"} & set(os.listdir(local))
    assert from_hf(local)[0] == from_hf(str(checkpoint_dir))[0]
    copied = os.stat(os.path.join(local, "model.safetensors")).st_mtime_ns
    assert sources.resolve_model(f"{bucket}/ckpt/") == local
    assert os.stat(os.path.join(local, "model.safetensors")).st_mtime_ns == copied  # not copied again
    assert len(load_dapo(f"{bucket}/dapo/dapo-math-17k.parquet")[0]) == 10


def resolved_at_once(tmp_path, env, source: str, before_go=lambda: None) -> str:
    """hub.resolve_model(`source`) in two processes started together (both imported, `before_go()`, then both
    let go at once); asserts both succeed with the same path, and returns it."""
    go = tmp_path / "go"
    code = (
        "import os, time\nfrom comppo_jax import hub\nprint('imported', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\nprint(hub.resolve_model({source!r}))"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    assert [process.stdout.readline().strip() for process in processes] == ["imported", "imported"]
    before_go()
    go.touch()
    outputs = [process.communicate(timeout=120)[0].strip() for process in processes]
    assert [process.returncode for process in processes] == [0, 0] and outputs[0] == outputs[1]
    return outputs[0]


def test_processes_fetching_one_id_at_once_download_each_file_once(hub, tmp_path):
    """huggingface_hub's lock per file: a process that asks for a file another is downloading waits for it."""
    hub.hold("model.safetensors", heads=2)  # the weights' download waits until both processes asked for them
    env = {**CPU_ONLY_ENV, **hub_env(hub.url, tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    start = []
    resolved_at_once(tmp_path, env, MODEL, before_go=lambda: start.append(len(hub.requests)))
    asked = [request for request in hub.requests[start[0] :] if request.endswith("/model.safetensors")]
    assert sorted(request.split()[0] for request in asked) == ["GET", "HEAD", "HEAD"]  # both asked; one fetched


@pytest.mark.slow
def test_processes_copying_one_gcs_source_at_once_copy_it_once_and_whole(bucket, gcs_emulator, tmp_path):
    """The copy lock: two processes ask for one gs:// model at once; one copies while the other waits, and
    both read every byte (without it both download into one temporary file: a rename fails, or the bytes
    interleave). Six shards of 16 MiB, each a chance for the two downloads to overlap however the processes
    are scheduled."""
    rng = np.random.default_rng(0)
    shards = {f"model-{i:05d}-of-00006.safetensors": rng.bytes(16 << 20) for i in range(1, 7)}
    for name, weights in shards.items():
        storage.write_bytes(f"{bucket}/big/{name}", weights)
    storage.write_text(f"{bucket}/big/config.json", "{}")
    env = {**CPU_ONLY_ENV, **gcs_emulator.env, "HF_HOME": str(tmp_path / "hf")}
    local = resolved_at_once(tmp_path, env, f"{bucket}/big")
    for name, weights in shards.items():
        with open(os.path.join(local, name), "rb") as copied:
            assert copied.read() == weights, name
    assert sorted(os.listdir(local)) == ["config.json", *shards]  # no temporary file left


def test_a_gcs_file_uploaded_again_with_the_same_size_is_copied_again(hub, bucket, checkpoint_dir, dataset_dir):
    """The local copy is kept per generation: a fine-tune of the same shape uploaded over the model is read."""
    upload(bucket, checkpoint_dir, dataset_dir)
    weights = f"{bucket}/ckpt/model.safetensors"
    sources.resolve_model(f"{bucket}/ckpt")
    uploaded_again(weights)
    local = os.path.join(sources.resolve_model(f"{bucket}/ckpt"), "model.safetensors")
    assert storage.path(local).read_bytes() == storage.path(weights).read_bytes()


def test_a_run_pins_gcs_sources_to_their_generations_and_refuses_one_uploaded_again(
    hub, bucket, checkpoint_dir, dataset_dir
):
    upload(bucket, checkpoint_dir, dataset_dir)
    data = f"{bucket}/dapo/dapo-math-17k.parquet"
    config = run_config(model=f"{bucket}/ckpt", data=data)
    pinned = sources.pin_sources(config)
    assert pinned.data.path == f"{data}#dapo-math-17k.parquet={generation(data)}"
    path, pins = sources.split_gcs_pins(pinned.model.path)
    assert path == f"{bucket}/ckpt" and pins["model.safetensors"] == generation(f"{path}/model.safetensors")
    assert "README.md" not in pins and "tokenizer.json" in pins
    assert sources.pin_sources(config, previous=pinned) == pinned  # a resume keeps the run's generations
    assert len(load_dapo(pinned.data.path)[0]) == 10

    before, after = uploaded_again(f"{path}/model.safetensors")
    for refused in (
        lambda: sources.pin_sources(config, previous=pinned),  # the resume's unpinned path, against config.json
        lambda: sources.resolve_model(pinned.model.path),  # an eval or export of the run
    ):
        with pytest.raises(ConfigError) as error:
            refused()
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"config.model.path='{path}': {path}/model.safetensors ")
        assert f"is generation {after} now, not the generation {before} this run pinned" in message
    assert load_tokenizer(pinned.model.path).use_chat_template  # its tokenizer files did not change
    # A run recorded before gs:// sources were pinned resumes as it was, unpinned.
    assert sources.pin_sources(config, previous=config) == config
