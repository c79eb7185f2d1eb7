"""Orbax checkpoints: keep-last-N plus best-by-dev, integrity (digests, fallback, failed saves), and runs stopped
(SIGTERM) or damaged then resumed equal to a straight one, bitwise."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import CPU_ONLY_ENV, HANG_S, WALL_CLOCK, small_train_config, small_train_flags, start_script

from comppo_jax.models import CheckpointError
from comppo_jax.runs.checkpoint import CheckpointMismatchError, RunCheckpoints
from comppo_jax.train.loop import train
from comppo_jax.train.start import restore_for_resume


def test_keeps_the_last_n_and_the_best_by_dev_accuracy(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=1)
    state = {"w": np.arange(4.0)}
    for step, accuracy in zip(range(1, 6), [0.5, 0.9, None, 0.2, 0.3]):
        checkpoints.save(step, {"w": state["w"] + step}, {"next_step": step}, accuracy)
    checkpoints.wait()
    assert checkpoints.manager.all_steps() == [2, 4, 5] and checkpoints.best_step() == 2
    restored, meta = checkpoints.restore(state, step=2)
    np.testing.assert_array_equal(restored["w"], np.arange(4.0) + 2)
    assert meta == {"next_step": 2}
    checkpoints.close()


def test_saving_without_metrics_and_reading_a_run_log_no_orbax_warning(tmp_path, caplog):
    """The steps that do not evaluate save without a dev accuracy, and evaluation opens runs read-only:
    both by design, so neither may print Orbax's warnings (a user reads WARNING as a fault)."""
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1, keep_best=1)
    with caplog.at_level("WARNING"):
        checkpoints.save(1, {"w": np.arange(4.0)}, {"next_step": 1}, None)
        checkpoints.wait()
        checkpoints.close()
        reader = RunCheckpoints(str(tmp_path), read_only=True)
        restored, _ = reader.restore({"w": np.zeros(4)}, step=1)
        reader.close()
    np.testing.assert_array_equal(restored["w"], np.arange(4.0))
    assert [record.getMessage() for record in caplog.records if record.levelname == "WARNING"] == []


def test_resume_without_a_checkpoint_and_rerun_without_resume_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        RunCheckpoints(str(tmp_path), keep_last=1).restore({"w": np.zeros(2)})
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1)
    checkpoints.save(1, {"w": np.zeros(2)}, {})
    checkpoints.wait()
    checkpoints.close()
    (tmp_path / "config.json").write_text("the run's own record")
    with pytest.raises(FileExistsError, match="--config.resume=True"):
        train(small_train_config(tmp_path))
    assert (tmp_path / "config.json").read_text() == "the run's own record"  # the refused command wrote nothing


def restored_state(run_dir, step):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(run_dir / "checkpoints" / str(step) / "state")


def stop_with_sigterm_after(run_dir, rows, **overrides) -> subprocess.CompletedProcess:
    """Runs launch/train.py and sends it SIGTERM twice (the second during its save) once metrics.jsonl has
    `rows` rows."""
    process = start_script("launch/train.py", *small_train_flags(run_dir, **overrides))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while process.poll() is None and time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.1)
    stdout, stderr = process.communicate(timeout=HANG_S)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def metric_rows(run):
    return [
        {k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def assert_same_checkpoint(a_dir, b_dir, step):
    a, b = restored_state(a_dir, step), restored_state(b_dir, step)
    paths = jax.tree_util.tree_flatten_with_path(a)[0]
    assert len(paths) == len(jax.tree.leaves(b)) > 0
    for (path, x), y in zip(paths, jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_sigterm_then_resume_and_a_damaged_checkpoint_then_resume_equal_the_straight_run_bitwise(tmp_path):
    # CompPO: 1 critic warm-up step, then 4 actor updates: steps 1..5, checkpoints 2, 4 and 5.
    straight, split = tmp_path / "straight", tmp_path / "split"
    settings = dict(steps=4, checkpoint__every=2, checkpoint__keep_last=2)
    train(small_train_config(straight, **settings))

    rows = int(np.random.default_rng().integers(1, 4))  # SIGTERM once 1-3 steps are logged
    stopped = stop_with_sigterm_after(split, rows, **settings)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    saved = [line for line in stopped.stdout.splitlines() if line.startswith("stopped: checkpoint")]
    assert len(saved) == 1 and saved[0].endswith("--config.resume=True"), stopped.stdout
    next_step = int(saved[0].split()[2])
    assert rows <= next_step < 5 and (split / "checkpoints" / str(next_step)).is_dir(), (rows, stopped.stdout)
    assert not (split / "summary.json").exists()
    train(small_train_config(split, resume=True, **settings))
    assert_same_checkpoint(straight, split, 5)
    assert metric_rows(straight) == metric_rows(split) and [r["step"] for r in metric_rows(split)] == [1, 2, 3, 4, 5]
    summary = lambda run: json.loads((run / "summary.json").read_text())
    assert summary(straight) == summary(split)
    assert not (split / "config_changes.jsonl").exists()  # a plain resume changes nothing of the run

    # Checkpoint 5's arrays replaced by checkpoint 4's (the files read fine, with other values), and no
    # summary (as if the run died right after that save): resuming detects it by the digests, falls
    # back to 4 and redoes step 5.
    (split / "summary.json").unlink()
    shutil.rmtree(split / "checkpoints" / "5" / "state")
    shutil.copytree(split / "checkpoints" / "4" / "state", split / "checkpoints" / "5" / "state")
    train(small_train_config(split, resume=True, **settings))
    assert os.listdir(split / "corrupt_checkpoints")[0].startswith("5-")
    assert_same_checkpoint(straight, split, 5)
    assert metric_rows(straight) == metric_rows(split)


# --- Integrity: digests verified on restore, fallback to the newest good step ----------------------


def small_state(seed):
    rng = np.random.default_rng(seed)
    # `ids` is incompressible, so its bytes are stored verbatim and can be damaged without breaking the file's format.
    return {
        "actor": {
            "w": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(64), jnp.bfloat16),
        },
        "ids": jnp.asarray(rng.integers(-(2**31), 2**31 - 1, (64, 64), dtype=np.int32)),
        "rng": jax.random.PRNGKey(seed),
        "count": jnp.int32(seed),
    }


def data_files(run_dir, step):
    root = run_dir / "checkpoints" / str(step) / "state"
    return sorted((p for p in root.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)


def overwrite_inside(path, size=4096, at=None):
    """Overwrites `size` bytes of `path` in place (its size unchanged), from byte `at` (default: the middle)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - size // 2) if at is None else at
    data[start : start + size] = (
        np.random.default_rng(1).integers(0, 256, min(size, len(data) - start), dtype=np.uint8).tobytes()
    )
    path.write_bytes(bytes(data))


def overwrite_values_silently(run_dir, step):
    """4 KB overwritten inside the stored bytes of `ids`: the file still reads, with other values."""
    stored = np.asarray(small_state(step)["ids"]).tobytes()
    for path in data_files(run_dir, step):
        offset = path.read_bytes().find(stored[:64])
        if offset >= 0:
            return overwrite_inside(path, at=offset + 1024)
    raise AssertionError("the ids leaf's bytes were not found stored verbatim")


DAMAGE = {
    "overwritten in place": overwrite_values_silently,
    "format broken": lambda run, step: overwrite_inside(data_files(run, step)[-1]),
    "truncated": lambda run, step: data_files(run, step)[-1].write_bytes(data_files(run, step)[-1].read_bytes()[:100]),
    "meta emptied": lambda run, step: (run / "checkpoints" / str(step) / "meta" / "metadata").write_text(""),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_the_newest_good_one_restored(tmp_path, damage, capsys):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1, keep_best=0)
    for step in (1, 2):
        checkpoints.save(step, small_state(step), {"next_step": step})
    checkpoints.close()
    DAMAGE[damage](tmp_path, 2)
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1, keep_best=0)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint 2 "
        + (r"item state leaf \['ids'\]: content digest" if damage == "overwritten in place" else ""),
    ):
        checkpoints.restore(small_state(0), step=2)
    state, meta, step = checkpoints.restore_newest_good(small_state(0))
    assert step == 1 and meta == {"next_step": 1}
    jax.tree.map(np.testing.assert_array_equal, state, small_state(1))
    assert "checkpoint(s) [2] failed verification" in capsys.readouterr().out
    assert checkpoints.manager.all_steps() == [1] and os.listdir(tmp_path / "corrupt_checkpoints")[0].startswith("2-")
    checkpoints.close()


def test_a_checkpoint_of_another_state_structure_is_refused_not_set_aside(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    checkpoints.save(1, small_state(1), {"next_step": 1})
    checkpoints.close()
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"checkpoint 1 under .* has no leaf \['critic'\]\['w'\] .*another state structure",
    ):
        checkpoints.restore_newest_good({**small_state(0), "critic": {"w": jnp.zeros(3)}})
    assert checkpoints.manager.all_steps() == [1] and not (tmp_path / "corrupt_checkpoints").exists()
    checkpoints.close()


def in_flight(state, count):
    """`state` as a run at rollout.staleness=`count` checkpoints it: its policies of the batches in flight beside it."""
    return {**state, "behaviour": [state["actor"]] * count} if count else state


def with_critic(state):
    """`state` as a method with a critic checkpoints it (comppo); without one (grpo) both entries are None."""
    critic = {"w": jnp.ones((4, 3))}
    return {**state, "critic": critic, "critic_opt": [{"mu": critic, "count": jnp.int32(0)}]}


def without_critic(state):
    return {**state, "critic": None, "critic_opt": None}


# (what was saved, what this config restores into): each a structure mismatch, never damage.
STRUCTURE_CHANGES = {
    # The reports: a staleness-1 run resumed at staleness 0, a comppo run resumed as grpo, both allowed by
    # resume_allow_changes; the checkpoint holds leaves this config has no place for.
    "staleness 1 -> 0 (policies in flight the target lacks)": (lambda s: in_flight(s, 1), lambda s: s),
    "comppo -> grpo (a critic the target lacks)": (with_critic, without_critic),
    "staleness 2 -> 1 (a list of another length)": (lambda s: in_flight(s, 2), lambda s: in_flight(s, 1)),
    "staleness 0 -> 1 (policies in flight the checkpoint lacks)": (lambda s: s, lambda s: in_flight(s, 1)),
    "grpo -> comppo (a critic the checkpoint lacks)": (without_critic, with_critic),
}


@pytest.mark.parametrize("change", STRUCTURE_CHANGES)
def test_a_checkpoint_of_another_state_structure_either_way_is_refused_naming_the_leaf_and_nothing_moves(
    tmp_path, change
):
    saved, target = STRUCTURE_CHANGES[change]
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    for step in (7, 8):
        checkpoints.save(step, saved(small_state(step)), {"next_step": step})
    checkpoints.close()
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"^checkpoint 8 under .* (has no|holds) leaf \['(behaviour|critic|critic_opt)'\].*another state "
        r"structure.*nothing was moved$",
    ) as refused:
        checkpoints.restore_newest_good(target(small_state(0)))
    assert "\n" not in str(refused.value)
    assert checkpoints.manager.all_steps() == [7, 8] and not (tmp_path / "corrupt_checkpoints").exists()
    assert checkpoints.set_aside_note() == ""
    # The run's own structure still restores: nothing was set aside as damaged.
    state, meta, step = checkpoints.restore_newest_good(saved(small_state(0)))
    assert step == 8 and meta == {"next_step": 8}
    jax.tree.map(np.testing.assert_array_equal, state, saved(small_state(8)))
    checkpoints.close()


def test_a_structure_error_of_the_restore_itself_is_a_mismatch_not_damage(tmp_path, monkeypatch):
    """The general rule, past the metadata check: Orbax's own structure errors never set a checkpoint aside."""
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    checkpoints.save(8, in_flight(small_state(8), 1), {"next_step": 8})
    checkpoints.close()
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    monkeypatch.setattr(RunCheckpoints, "_check_structure", lambda *args, **kwargs: None)
    monkeypatch.setattr("comppo_jax.runs.checkpoint.leaf_paths", lambda tree: [])  # nor the digests' names
    with pytest.raises(
        CheckpointMismatchError,
        match=r"checkpoint 8 under .* does not fit this config's state: ValueError: User-provided restore item and "
        r"on-disk value metadata tree structures do not match.*nothing was moved",
    ):
        checkpoints.restore_newest_good(small_state(0))
    assert checkpoints.manager.all_steps() == [8] and not (tmp_path / "corrupt_checkpoints").exists()
    checkpoints.close()


def test_a_target_made_per_step_follows_what_each_checkpoint_holds(tmp_path):
    """A resume after a staleness change: each checkpoint is read with as many in-flight policies as it holds."""
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    checkpoints.save(7, in_flight(small_state(7), 2), {"next_step": 7})
    checkpoints.save(8, in_flight(small_state(8), 1), {"next_step": 8})
    checkpoints.close()
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    assert [checkpoints.saved_list_length(step, "behaviour") for step in (7, 8)] == [2, 1]
    assert checkpoints.saved_list_length(7, "critic") == 0
    target = lambda step: in_flight(small_state(0), checkpoints.saved_list_length(step, "behaviour"))
    for step, count in ((7, 2), (8, 1)):
        state, _ = checkpoints.restore(target, step)
        assert len(state["behaviour"]) == count
        jax.tree.map(np.testing.assert_array_equal, state, in_flight(small_state(step), count))
    checkpoints.close()


def test_a_damaged_resume_step_is_refused_with_the_flag_that_falls_back(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    for step in (1, 2):
        checkpoints.save(step, small_state(step), {"next_step": step})
    checkpoints.close()
    overwrite_values_silently(tmp_path, 2)
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=0)
    config = small_train_config(tmp_path, resume=True, resume_step=2)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint 2 .*; pass --config\.resume_step=-1 to resume from the newest checkpoint that verifies",
    ):
        restore_for_resume(config, checkpoints, small_state(0))
    assert checkpoints.manager.all_steps() == [1, 2]  # nothing moved: the user decides
    state, meta = restore_for_resume(
        small_train_config(tmp_path, resume=True, resume_step=1), checkpoints, small_state(0)
    )
    assert meta == {"next_step": 1}
    checkpoints.close()


def test_retention_keeps_the_newest_good_checkpoint_until_a_newer_save_is_confirmed(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1, keep_best=0)
    checkpoints.save(1, small_state(1), {})
    checkpoints.save(2, small_state(2), {})  # confirms 1 first: 1 is kept while 2 is unconfirmed
    checkpoints.manager.wait_until_finished()
    assert checkpoints.manager.all_steps() == [1, 2]
    checkpoints.save(3, small_state(3), {})  # 2 confirmed: 1 may go
    checkpoints.close()
    assert checkpoints.manager.all_steps() == [2, 3]


FAILED_SAVE = """
import resource, sys
import jax.numpy as jnp, numpy as np
from comppo_jax.runs.checkpoint import CheckpointMismatchError, RunCheckpoints
checkpoints = RunCheckpoints(sys.argv[1], keep_last=1, keep_best=0)
checkpoints.save(1, {"w": jnp.ones(8)}, {"next_step": 1})
checkpoints.confirm_saves(wait=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # a write past 200 kB fails with EFBIG, like a full disk
large = jnp.asarray(np.random.default_rng(0).standard_normal(500_000), jnp.float32)
checkpoints.save(2, {"w": large}, {"next_step": 2})
try:
    checkpoints.confirm_saves(wait=True)
except Exception as error:
    print("RAISED", type(error).__name__, error)
"""


def test_a_failed_async_save_is_one_error_naming_step_path_and_cause_and_loses_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", FAILED_SAVE, str(tmp_path)],
        capture_output=True,
        text=True,
        env=CPU_ONLY_ENV,
        timeout=HANG_S,
    )
    raised = [line for line in result.stdout.splitlines() if line.startswith("RAISED")]
    assert raised and raised[0].startswith(
        f"RAISED CheckpointError saving checkpoint 2 to {tmp_path}/checkpoints/2 failed: "
    ), result.stdout
    assert "File too large" in raised[0] and "the older checkpoints are intact ([1])" in raised[0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]  # no partial step 2 left behind
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1, keep_best=0)
    np.testing.assert_array_equal(checkpoints.restore({"w": np.zeros(8, np.float32)})[0]["w"], np.ones(8))
    checkpoints.close()


@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_the_next_step_boundary_with_the_older_checkpoints_intact(tmp_path, monkeypatch):
    save = RunCheckpoints.save
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def save_onto_a_full_disk_from_checkpoint_3(self, step, *args, **kwargs):
        if step == 3:
            self.confirm_saves(wait=True)  # checkpoint 2 is on disk
            resource.setrlimit(
                resource.RLIMIT_FSIZE, (200_000, hard)
            )  # writes past 200 kB now fail with EFBIG, like a full disk
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(RunCheckpoints, "save", save_onto_a_full_disk_from_checkpoint_3)
    try:
        with pytest.raises(
            CheckpointError, match=f"saving checkpoint 3 to {tmp_path}/checkpoints/3 failed: .*File too large"
        ):
            train(small_train_config(tmp_path, steps=4, checkpoint__keep_last=1, checkpoint__keep_best=0))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    rows = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows in ([1, 2, 3], [1, 2, 3, 4])  # reported at the first step boundary after the failed save ended
    # 1 is kept until 2 is confirmed by a later save: 3 never was, and nothing of it is left.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(restored_state(tmp_path, 2)))


def test_a_save_without_a_dev_accuracy_logs_no_warning(tmp_path, caplog):
    """Steps that do not evaluate have no metric for the best-checkpoint policy, by design: Orbax's
    warning about it would print inside the progress bar at every such save."""
    with caplog.at_level("WARNING"):
        checkpoints = RunCheckpoints(str(tmp_path), keep_last=1, keep_best=1)
        checkpoints.save(1, small_state(1), {"step": 1})
        checkpoints.save(2, small_state(2), {"step": 2}, dev_accuracy=0.5)
        checkpoints.close()
    assert checkpoints.best_step() == 2 and "metrics" not in caplog.text, caplog.text
