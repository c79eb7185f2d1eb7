"""The run directory against its own user: a resume that changes what is computed, a checkpoint of
another shape, two commands on one directory, stops before the first checkpoint, a lost reference,
and the best evaluated checkpoint kept."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import (
    CPU_ONLY_ENV,
    HANG_S,
    REPO,
    launch_quick,
    launch_script,
    small_train_config,
    small_train_flags,
    start_script,
    wait_until,
)

from comppo_jax import storage
from comppo_jax.models import CheckpointError, ConfigError
from comppo_jax.runs import run_dir
from comppo_jax.runs.checkpoint import CheckpointMismatchError, RunCheckpoints
from comppo_jax.train import loop
from comppo_jax.train.schema import save_run_config


class Loaded(Exception):
    """train() got past the run directory's checks to its first load."""


@pytest.fixture
def nothing_loads(monkeypatch):
    def reached(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr("comppo_jax.train.start.load_tokenizer", reached)


def recorded_run(run, **overrides):
    """A run directory as train() leaves it after checkpoint 1: its config.json and one checkpoint."""
    save_run_config(small_train_config(run, **overrides), str(run))
    checkpoints = RunCheckpoints(str(run), keep_last=2, keep_best=0)
    checkpoints.save(1, {"w": jnp.zeros((4, 3))}, {"step": 1})
    checkpoints.close()


# --- The config is the run's identity ----------------------------------------------------------


def test_a_resume_that_changes_what_is_computed_is_refused_listing_each_change_and_writes_nothing(
    tmp_path, nothing_loads
):
    recorded_run(tmp_path)
    before = (tmp_path / "config.json").read_text()
    changed = dict(seed=7, train__actor_lr=2e-5, rollout__samples_per_prompt=8, warm_start__steps=0)
    with pytest.raises(ConfigError) as refused:
        loop.train(small_train_config(tmp_path, resume=True, **changed))
    message = str(refused.value)
    for change in (
        "seed: 0 -> 7",
        "train.actor_lr: 1e-05 -> 2e-05",
        "rollout.samples_per_prompt: 2 -> 8",
        "warm_start.steps: 3 -> 0",
    ):
        assert change in message, message
    assert "--config.resume_allow_changes=rollout.samples_per_prompt,seed,train.actor_lr,warm_start.steps" in message
    assert (tmp_path / "config.json").read_text() == before and not (tmp_path / run_dir.CHANGES_FILE).exists()
    assert not (tmp_path / run_dir.LOCK_FILE).exists()  # released on the way out

    # Harmless fields, a longer run and the named changes pass on to the loading.
    with pytest.raises(Loaded):
        loop.train(
            small_train_config(
                tmp_path,
                resume=True,
                steps=9,
                progress=True,
                checkpoint__every=5,
                reward__workers=2,
                resume_allow_changes="seed,train,rollout.samples_per_prompt,warm_start",
                **changed,
            )
        )


def test_resume_changes_sorts_harmless_allowed_and_refused_fields(tmp_path, caplog):
    old = small_train_config(tmp_path)
    new = small_train_config(
        tmp_path,
        resume=True,
        steps=50,
        train__eval_every=5,
        mesh__data=2,
        mesh__coordinator_address="127.0.0.1:41234",
        model__remat="full",
        train__lam=0.9,
        resume_step=3,
        resume_allow_changes="train.lam,critic",
    )
    changes = {change["field"]: change for change in run_dir.resume_changes(new, old)}
    # How this launch starts is not a change of the run: every resume would record it.
    assert not set(changes) & {"resume", "resume_step", "resume_allow_changes", "mesh.coordinator_address"}
    assert changes["train.lam"] == dict(field="train.lam", old=0.95, new=0.9, accepted="resume_allow_changes")
    assert {
        name: changes[name]["accepted"] for name in ("steps", "train.eval_every", "mesh.data", "model.remat")
    } == dict.fromkeys(("steps", "train.eval_every", "mesh.data", "model.remat"), "harmless")
    assert "names critic, which this resume does not change" in caplog.text
    run_dir.record_changes(str(tmp_path), 12, list(changes.values()))
    rows = [json.loads(line) for line in (tmp_path / run_dir.CHANGES_FILE).read_text().splitlines()]
    assert {
        "resumed_after_step": 12,
        "field": "train.lam",
        "old": 0.95,
        "new": 0.9,
        "accepted": "resume_allow_changes",
    } in rows
    with pytest.raises(
        ConfigError, match=r"model.arch.hidden_size: 128 -> 64.*resume_allow_changes=model.arch.hidden_size"
    ):
        run_dir.resume_changes(small_train_config(tmp_path, model__arch__hidden_size=64), old)


# --- A checkpoint of another shape is a mismatch, never damage ------------------------------------


def test_a_checkpoint_of_another_shape_or_dtype_is_refused_naming_the_leaf_and_nothing_moves(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    for step in (1, 2):
        checkpoints.save(step, {"critic": {"kernel": jnp.zeros((128, 32))}, "count": jnp.int32(step)}, {})
    checkpoints.close()
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"checkpoint 2 .* leaf \['critic'\]\['kernel'\] is float32\[128, 32\] but this "
        r"config's state has float32\[128, 64\].*nothing was moved",
    ):
        checkpoints.restore_newest_good({"critic": {"kernel": jnp.zeros((128, 64))}, "count": jnp.int32(0)})
    with pytest.raises(
        CheckpointMismatchError, match=r"leaf \['count'\] is int32\[\] but this config's state has float32\[\]"
    ):
        checkpoints.restore_newest_good({"critic": {"kernel": jnp.zeros((128, 32))}, "count": jnp.float32(0)})
    assert checkpoints.manager.all_steps() == [1, 2] and not (tmp_path / "corrupt_checkpoints").exists()
    checkpoints.close()


def test_no_checkpoint_names_the_set_aside_ones_and_a_new_run_over_them_is_refused(tmp_path, nothing_loads):
    recorded_run(tmp_path)
    (tmp_path / "corrupt_checkpoints").mkdir()
    shutil.move(tmp_path / "checkpoints" / "1", tmp_path / "corrupt_checkpoints" / "1-20261125-101010")
    with pytest.raises(
        FileNotFoundError,
        match=r"no checkpoint under .*corrupt_checkpoints holds 1 set aside as damaged "
        r"\(1-20261125-101010\): .*mv .*/corrupt_checkpoints/1-20261125-101010 .*/checkpoints/1",
    ):
        loop.train(small_train_config(tmp_path, resume=True))
    with pytest.raises(FileExistsError, match="holds an earlier run's checkpoints set aside as damaged"):
        loop.train(small_train_config(tmp_path))


# --- One writer per run directory -------------------------------------------------------------------


def hold_lock(directory) -> subprocess.Popen:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom comppo_jax.runs.run_dir import RunLock\n"
            f"RunLock({str(directory)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(120)",
        ],
        cwd=REPO,
        env=CPU_ONLY_ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_command_refuses_naming_the_holder_and_a_dead_holders_lock_is_taken_over(
    tmp_path, nothing_loads, caplog
):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(
            run_dir.RunDirectoryLocked, match=rf"{tmp_path} is in use by pid {holder.pid} on .*delete .*run.lock"
        ):
            loop.train(small_train_config(tmp_path))
        holder.kill()
        # Killed and not yet reaped (this process, its parent, has not waited): a zombie, as a SIGKILLed launcher
        # stays until its parent or init reaps it, which holds nothing.
        zombie = lambda: pathlib.Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert wait_until(zombie, 30)
        assert (
            json.loads((tmp_path / "run.lock").read_text())["pid"] == holder.pid
        )  # a killed process leaves its lock behind
        with pytest.raises(Loaded):  # ... which the next command takes over
            loop.train(small_train_config(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert f"taking over a stale lock (pid {holder.pid}" in caplog.text and not (tmp_path / "run.lock").exists()


def test_a_reused_pid_does_not_hold_the_lock(tmp_path, caplog):
    (tmp_path / "run.lock").write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started": "1"}))
    with run_dir.RunLock(str(tmp_path)):
        assert json.loads((tmp_path / "run.lock").read_text())["started"] != "1"
    assert "stale lock" in caplog.text


def test_a_lock_on_a_bucket_refuses_a_live_holder_on_another_host_and_takes_over_a_silent_one(bucket, caplog):
    """A pod's hosts share only the bucket: another host's lock is live while its heartbeat beats."""
    run, lock = f"{bucket}/run", f"{bucket}/run/{run_dir.LOCK_FILE}"
    record = {"pid": 1, "host": "worker-7", "since": "earlier", "command": "train.py", "token": "t"}
    storage.write_text(lock, json.dumps({**record, "heartbeat": time.time() - 10}))
    with pytest.raises(run_dir.RunDirectoryLocked, match=r"in use by pid 1 on worker-7 .*last heartbeat 1\d s ago"):
        run_dir.RunLock(run).acquire()
    assert json.loads(storage.read_text(lock))["host"] == "worker-7"  # the refusal changes nothing
    storage.write_text(lock, json.dumps({**record, "heartbeat": time.time() - run_dir.RunLock.STALE_S - 1}))
    with run_dir.RunLock(run):
        assert json.loads(storage.read_text(lock))["pid"] == os.getpid()
    assert "taking over a stale lock (pid 1 on worker-7)" in caplog.text
    assert not storage.path(lock).exists()


def test_the_holder_keeps_its_heartbeat_fresh_and_stops_when_the_lock_is_no_longer_its_own(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(run_dir.RunLock, "HEARTBEAT_S", 0.05)
    lock_file = tmp_path / run_dir.LOCK_FILE
    with run_dir.RunLock(str(tmp_path)):
        first = json.loads(lock_file.read_text())["heartbeat"]
        wait_for(lambda: json.loads(lock_file.read_text())["heartbeat"] > first, timeout=30)
        lock_file.write_text(json.dumps({"pid": 1, "host": "elsewhere", "token": "another"}))  # taken over
        wait_for(lambda: "this run's lock was taken over" in caplog.text, timeout=30)
    assert json.loads(lock_file.read_text())["token"] == "another"  # release leaves another holder's lock


@pytest.fixture(params=["disk", "bucket"])
def run_location(request, tmp_path):
    return f"{request.getfixturevalue('bucket')}/run" if request.param == "bucket" else str(tmp_path / "run")


def test_a_holder_whose_lock_was_taken_over_writes_nothing_more_and_names_the_new_holder(run_location, monkeypatch):
    """A partition or a paused VM: the holder's heartbeat goes silent past STALE_S, another launcher takes the
    lock over, and the old holder comes back. Every write it then tries into the run directory (metrics rows,
    summary, samples, a checkpoint, the reference) is refused naming the new holder; the lock stays the new one's."""
    monkeypatch.setattr(run_dir.RunLock, "HEARTBEAT_S", 3600.0)  # the old holder's heartbeat stays silent
    monkeypatch.setattr(run_dir.RunLock, "STALE_S", 0.5)
    storage.make_dirs(run_location)
    summary, metrics = f"{run_location}/summary.json", f"{run_location}/metrics.jsonl"
    with run_dir.locked(run_location):
        storage.write_text(summary, "before")  # the holder writes while the lock is its own
        log = storage.AppendLog(metrics)
        log.append('{"step": 1}')
        log.flush()
        checkpoints = RunCheckpoints(run_location, keep_last=2, keep_best=0)
        time.sleep(1.0)
        new_holder = run_dir.RunLock(run_location)
        new_holder.acquire()  # the old heartbeat is stale: taken over
        taken_over = rf"lock was taken over \(.*run.lock is now held by pid {os.getpid()} on .* since"
        writes = {
            "summary": lambda: storage.write_text(summary, "after"),
            "metrics": lambda: (log.append('{"step": 2}'), log.flush()),
            "samples": lambda: storage.write_text(f"{run_location}/samples/step_000002.json", "{}"),
            "checkpoint": lambda: checkpoints.save(2, {"w": jnp.zeros((4, 3))}, {"step": 2}),
            "reference": lambda: checkpoints.save_reference({"w": jnp.zeros((4, 3))}),
        }
        for name, write in writes.items():
            with pytest.raises(run_dir.RunLockLost, match=taken_over):
                write()
            print(name, "refused")
    assert storage.read_text(summary) == "before"
    assert storage.read_lines(metrics) == ['{"step": 1}']
    assert set(storage.names(run_location)) - {"checkpoints"} == {"metrics.jsonl", "run.lock", "summary.json"}
    assert storage.names(f"{run_location}/checkpoints") == []  # a disk's folder made while the lock was its own
    assert json.loads(storage.read_text(f"{run_location}/run.lock"))["token"] == new_holder.record["token"]
    new_holder.release()


def test_the_fence_never_reads_the_holders_own_heartbeat_half_written(run_location, monkeypatch):
    """A read of the lock racing the holder's own heartbeat rewrite can see a part of it (on a bucket, a ranged
    read of an object replaced after its size was read). The fence compares tokens only between this holder's
    own rewrites, so the run never stops on its own heartbeat. Here each rewrite takes 0.1 s, during which a
    read of the lock gets half of it."""
    monkeypatch.setattr(run_dir.RunLock, "HEARTBEAT_S", 0.5)
    writing = threading.Event()
    read_text, write_text, replace = storage.read_text, storage.write_text, storage.replace_if_generation

    def slowly(write):
        def rewrite(*args, **kwargs):
            writing.set()
            time.sleep(0.1)
            try:
                return write(*args, **kwargs)
            finally:
                writing.clear()

        return rewrite

    def torn_while_rewritten(location):
        text = read_text(location)
        return text[: len(text) // 2] if writing.is_set() and str(location).endswith(run_dir.LOCK_FILE) else text

    monkeypatch.setattr(storage, "read_text", torn_while_rewritten)
    monkeypatch.setattr(storage, "write_text", slowly(write_text))
    monkeypatch.setattr(storage, "replace_if_generation", slowly(replace))
    storage.make_dirs(run_location)
    with run_dir.RunLock(run_location) as lock:
        # Until 5 checks began during a rewrite (however busy the machine; the test's own cap 60 s).
        deadline, raced = time.time() + 60.0, 0
        while raced < 5 and time.time() < deadline:
            during = writing.is_set()
            lock.check()
            raced += during
            time.sleep(0.01)
        assert lock.lost is None and raced == 5


def test_a_late_heartbeat_never_overwrites_the_lock_of_the_holder_that_took_over(run_location, monkeypatch):
    """The old holder's heartbeat thread was between its check and its write when the new holder took over: the
    rewrite carries a precondition (the generation it last wrote on a bucket; the token under a flock on a disk),
    so it marks the lock lost instead of putting the old record back."""
    monkeypatch.setattr(run_dir.RunLock, "HEARTBEAT_S", 3600.0)
    monkeypatch.setattr(run_dir.RunLock, "STALE_S", 0.5)
    storage.make_dirs(run_location)
    old_holder = run_dir.RunLock(run_location)
    old_holder.acquire()
    time.sleep(1.0)
    new_holder = run_dir.RunLock(run_location)
    new_holder.acquire()
    old_holder._renew()  # the beat the heartbeat thread would write
    assert json.loads(storage.read_text(f"{run_location}/run.lock"))["token"] == new_holder.record["token"]
    assert old_holder.lost is not None and "taken over" in old_holder.lost
    old_holder.release()
    assert json.loads(storage.read_text(f"{run_location}/run.lock"))["token"] == new_holder.record["token"]
    new_holder.release()


def test_a_holder_back_from_a_pause_renews_before_writing_when_no_one_took_over(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir.RunLock, "HEARTBEAT_S", 3600.0)
    with run_dir.locked(str(tmp_path)) as lock:
        # As after a pause longer than the heartbeat's period: its last beat is old, on the record and here.
        lock.renewed -= 3 * run_dir.RunLock.HEARTBEAT_S
        (tmp_path / "run.lock").write_text(json.dumps({**lock.record, "heartbeat": lock.renewed}))
        storage.write_text(tmp_path / "summary.json", "{}")
        assert time.time() - json.loads((tmp_path / "run.lock").read_text())["heartbeat"] < 60


def files_under(folder) -> dict:
    """{relative path: bytes} of every file under `folder`."""
    return {
        os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(folder)
        for name in names
    }


@pytest.mark.slow
def test_a_launcher_whose_lock_was_taken_over_writes_nothing_more_and_exits_naming_the_new_holder(tmp_path):
    """launch/train.py paused (SIGSTOP: a paused VM) past its lock's staleness while another launcher takes the run
    over; once it runs again it writes nothing more into the run directory and exits 1 with one line naming the
    holder. A write in flight when it was paused completes as it resumes: no checkpoint or evaluation falls due
    here, and TensorBoard is off, since a pause lands at random inside its writes of a row (one whose metrics
    row was written before the takeover)."""
    run = start(tmp_path, steps=1000, checkpoint__every=1000, train__eval_every=0, loggers="jsonl")
    try:
        wait_for(lambda: len(storage.read_lines(tmp_path / "metrics.jsonl")) >= 1)
        os.kill(run.pid, signal.SIGSTOP)
        lock_file = tmp_path / run_dir.LOCK_FILE
        silent = {**json.loads(lock_file.read_text()), "heartbeat": time.time() - run_dir.RunLock.STALE_S - 1}
        lock_file.write_text(json.dumps(silent))  # as after five minutes without a heartbeat
        new_holder = run_dir.RunLock(str(tmp_path))
        new_holder.acquire()
        before = files_under(tmp_path)
    finally:
        os.kill(run.pid, signal.SIGCONT)
    stdout, stderr = run.communicate(timeout=HANG_S)
    assert run.returncode == 1, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: RunLockLost: ") and f"now held by pid {os.getpid()} on " in line, line
    assert files_under(tmp_path) == before
    new_holder.release()


# --- Stops before the first checkpoint ------------------------------------------------------------


def start(run, **overrides) -> subprocess.Popen:
    return start_script("launch/train.py", *small_train_flags(run, **overrides))


def wait_for(condition, timeout=HANG_S):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def test_a_ctrl_c_during_the_warm_start_stops_in_seconds_with_one_line(tmp_path):
    """SIGINT here; SIGTERM takes the same path (one handler), and stops the runs of the slow tier."""
    run = start(tmp_path, warm_start__steps=100_000)
    wait_for(lambda: (tmp_path / "config.json").exists())
    time.sleep(1)
    run.send_signal(signal.SIGINT)
    sent = time.time()
    stdout, stderr = run.communicate(timeout=HANG_S)
    # The signal may land before the warm start's first step compiles: the bound leaves room for that on a
    # busy machine (without the guard the 100,000 steps run for hours).
    assert time.time() - sent < 600 and run.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr + stdout and "KeyboardInterrupt" not in stderr
    (line,) = [line for line in stdout.splitlines() if line.startswith("stopped")]
    assert (
        line.startswith("stopped during the warm start (step ")
        and "nothing to resume; start it again with: python launch/train.py" in line
    )
    resumed = launch_quick("launch/train.py", *small_train_flags(tmp_path, resume=True))
    assert resumed.returncode == 1 and "no checkpoint under" in resumed.stderr and "yet" in resumed.stderr
    assert "run the same command without --config.resume" in resumed.stderr and "Traceback" not in resumed.stderr


@pytest.mark.slow
def test_a_stop_after_the_warm_start_keeps_it_and_the_next_start_reuses_it(tmp_path):
    run = start(tmp_path, warm_start__steps=20)
    wait_for(lambda: list(tmp_path.glob("warm_start_*.npz")))
    cache = next(tmp_path.glob("warm_start_*.npz"))
    run.send_signal(signal.SIGTERM)
    sent = time.time()
    stdout, stderr = run.communicate(timeout=HANG_S)
    # The stop lands at the next stage boundary of the dev evaluation or the first step: one compile at most
    # (seconds alone; the bound leaves room for a busy machine, and the line below names the stage).
    print(f"stopped {time.time() - sent:.1f} s after the SIGTERM")
    assert time.time() - sent < 300 and run.returncode == 0, stderr[-2000:]
    assert any(
        line.startswith("stopped during ") and "before the run's first checkpoint" in line
        for line in stdout.splitlines()
    ), stdout
    written = cache.stat().st_mtime
    again = launch_script("launch/train.py", *small_train_flags(tmp_path, warm_start__steps=20))
    assert again.returncode == 0, again.stderr[-2000:]
    assert cache.stat().st_mtime == written and json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


# --- The reference policy, rebuilt from the warm start --------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A small run (3 steps, checkpoints 1-3) to damage; each test works on its own copy."""
    run = tmp_path_factory.mktemp("finished") / "run"
    loop.train(small_train_config(run, checkpoint__keep_last=3))
    return run


def copy_of(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "summary.json").unlink()  # as if it died after its last checkpoint: the resume reloads the reference
    return run


REFERENCE_DAMAGE = {
    "deleted": lambda run: shutil.rmtree(run / "reference"),
    "digests deleted": lambda run: (run / "reference_digests.json").unlink(),
    "4 KB overwritten": lambda run: overwrite_largest(run / "reference"),
}


def overwrite_largest(directory):
    path = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("damage", REFERENCE_DAMAGE)
def test_a_damaged_reference_is_rebuilt_from_the_warm_start(finished_run, tmp_path, damage, capsys):
    run = copy_of(finished_run, tmp_path)
    digests = json.loads((run / "reference_digests.json").read_text())
    REFERENCE_DAMAGE[damage](run)
    summary = loop.train(small_train_config(run, resume=True, checkpoint__keep_last=3))
    assert summary["steps"] == 3 and "rebuilt the reference policy" in capsys.readouterr().out
    assert json.loads((run / "reference_digests.json").read_text()) == digests  # the same policy, bit for bit
    with ocp.StandardCheckpointer() as checkpointer:
        original, rebuilt = checkpointer.restore(finished_run / "reference"), checkpointer.restore(run / "reference")
    for a, b in zip(jax.tree.leaves(original), jax.tree.leaves(rebuilt), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_reference_the_warm_start_cannot_replay_says_what_is_lost_and_what_to_do(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    shutil.rmtree(run / "reference")
    digests = json.loads((run / "reference_digests.json").read_text())
    (run / "reference_digests.json").write_text(
        json.dumps(dict.fromkeys(digests, "0" * 16))
    )  # computed elsewhere, differently
    with pytest.raises(
        CheckpointError,
        match=r"reference policy is lost: .* replaying the warm start gives other weights .*restore "
        r".*reference .*from a backup, or start a new run",
    ):
        loop.train(small_train_config(run, resume=True, checkpoint__keep_last=3))
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3"]


# --- The best evaluated policy is a checkpoint ----------------------------------------------------


@pytest.mark.slow
def test_every_dev_evaluation_saves_so_the_best_checkpoint_is_the_best_evaluated_policy(tmp_path):
    # 1 critic warm-up step, then 4 actor updates evaluated every 2: steps 3 and 5; checkpoints only at the end
    # otherwise.
    finished = launch_script(
        "launch/train.py",
        *small_train_flags(
            tmp_path,
            steps=4,
            train__eval_every=2,
            checkpoint__every=100,
            checkpoint__keep_last=1,
            checkpoint__keep_best=2,
            rollout__temperature=1.0,
            warm_start__steps=60,
        ),
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = {row["step"]: row["dev_accuracy"] for row in rows if "dev_accuracy" in row}
    assert sorted(evaluated) == [3, 5]
    summary = json.loads((tmp_path / "summary.json").read_text())
    best = max(evaluated, key=lambda step: (evaluated[step], step))
    assert summary["best_checkpoint_step"] == best and summary["best_dev_accuracy"] == evaluated[best]
    checkpoints = RunCheckpoints(str(tmp_path), read_only=True)
    assert checkpoints.manager.all_steps() == [3, 5]  # both evaluated steps, kept as the 2 best
    assert checkpoints.resolve_step("best") == best
    assert f"best checkpoint: step {best}, dev accuracy {evaluated[best]:.3f}" in finished.stdout
    assert f"--checkpoint={tmp_path} --step=best" in finished.stdout


def test_best_without_an_evaluated_checkpoint_is_refused_not_the_latest(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1, keep_best=1)
    checkpoints.save(1, {"w": np.zeros(2)}, {})
    checkpoints.close()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint under .* has a dev accuracy .*saved steps: \[1\]"):
        RunCheckpoints(str(tmp_path), read_only=True).resolve_step("best")
