"""launch/eval.py reuses a set's cached result only for the same policy weights, problems and settings;
evaluates a LoRA run whose reference/ was lost; and names the flag for a run with its own rollout devices."""

from __future__ import annotations

import json
import shutil

import jax
import pytest
from conftest import launch_quick, launch_script, restored_on_one_device, small_train_config

from comppo_jax.runs.checkpoint import RunCheckpoints
from comppo_jax.train.loop import train
from comppo_jax.train.schema import save_run_config

LORA = dict(model__lora__rank=4, model__lora__targets="q,v,gate,down", train__actor_lr=1e-2)
STEP = 3  # the run's last checkpoint (2 steps after a 1-step critic warm-up)


def write_math500(path, problems: int) -> None:
    path.write_text(
        "".join(json.dumps({"problem": f"{i} + 3 =?", "answer": str(i + 3)}) + "\n" for i in range(problems))
    )


def evaluate(run, benchmark, *flags):
    result = launch_script(
        "launch/eval.py",
        f"--checkpoint={run}",
        f"--config.eval.benchmarks=math500={benchmark}",
        "--config.eval.samples=1",
        *flags,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def set_cached(run, name: str, **metrics) -> None:
    """Overwrites metrics of the cached result of set `name`: a rerun that shows them reused it."""
    path = run / "eval" / f"step_{STEP}" / f"{name}.json"
    stored = json.loads(path.read_text())
    stored["metrics"].update(metrics)
    path.write_text(json.dumps(stored))


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """(a 2-step LoRA run evaluated once on its dev set of 4 and a math500 file of 4 problems, that file)."""
    root = tmp_path_factory.mktemp("evaluated")
    run, benchmark = root / "run", root / "math500.jsonl"
    train(small_train_config(run, **LORA))
    write_math500(benchmark, 4)
    stdout = evaluate(run, benchmark)
    assert "| id_dev | 4 |" in stdout and "| math500 | 4 |" in stdout
    return run, benchmark


@pytest.fixture
def copied(evaluated, tmp_path):
    """A copy of the evaluated run and its benchmark file, with its cached results."""
    run, benchmark = evaluated
    shutil.copytree(run, tmp_path / "run")
    shutil.copy(benchmark, tmp_path / "math500.jsonl")
    return tmp_path / "run", tmp_path / "math500.jsonl"


@pytest.mark.slow
def test_a_changed_benchmark_file_is_evaluated_again_and_an_unchanged_one_reused(copied):
    run, benchmark = copied
    set_cached(run, "math500", **{"greedy_pass@1": 0.5})
    same = evaluate(run, benchmark)  # the same content at another path: the same problems
    assert "| math500 | 4 | 0.500 (" in same and "evaluating again" not in same

    write_math500(benchmark, 6)
    grown = evaluate(run, benchmark)
    assert "| math500 | 6 |" in grown, grown
    assert f"cached results in {run}/eval/step_{STEP}/math500.json were for other problems" in grown
    assert "id_dev.json" not in grown  # the dev set is unchanged: reused


@pytest.mark.slow
def test_another_dev_size_is_evaluated_again(copied):
    run, benchmark = copied
    resized = evaluate(run, benchmark, "--config.data.dev_size=6")
    assert "| id_dev | 6 |" in resized, resized
    assert f"cached results in {run}/eval/step_{STEP}/id_dev.json were for other problems" in resized
    assert "math500.json" not in resized


@pytest.mark.slow
def test_a_checkpoint_saved_again_at_the_same_step_with_other_weights_is_evaluated_again(copied):
    run, benchmark = copied
    for name in ("id_dev", "math500"):
        set_cached(run, name, **{"greedy_pass@1": 0.125})
    # What a rerun from an earlier step (config.resume_step) leaves: checkpoint STEP saved again, other weights.
    state = restored_on_one_device(run, STEP)
    state["actor"] = jax.tree.map(lambda x: x * 1.5, state["actor"])
    saved = run / "checkpoints" / str(STEP)
    meta = json.loads((saved / "meta" / "metadata").read_text())
    dev_accuracy = json.loads((saved / "metrics" / "metrics").read_text())["dev_accuracy"]
    shutil.rmtree(saved)
    checkpoints = RunCheckpoints(str(run))
    checkpoints.save(STEP, state, {k: v for k, v in meta.items() if k != "digests"}, dev_accuracy)
    checkpoints.close()

    again = evaluate(run, benchmark)
    assert "0.125" not in again, again
    for name in ("id_dev", "math500"):
        assert f"cached results in {run}/eval/step_{STEP}/{name}.json were for another checkpoint" in again


@pytest.mark.slow
def test_a_lora_run_that_lost_its_reference_is_evaluated_after_rebuilding_it(copied):
    run, benchmark = copied
    shutil.rmtree(run / "reference")
    for kept in run.glob("warm_start_*"):  # the warm start runs again
        kept.unlink()
    stdout = evaluate(run, benchmark)
    assert f"rebuilt the reference policy under {run}/reference from the warm start (it matches" in stdout
    assert (run / "reference").is_dir()
    # The rebuilt base gives the policy evaluated before: its cached results are reused.
    assert "| math500 | 4 |" in stdout and "evaluating again" not in stdout


def test_a_run_with_its_own_rollout_devices_on_one_device_names_the_flag_before_any_restore(tmp_path):
    save_run_config(small_train_config(tmp_path, mesh__rollout_devices=4), tmp_path)  # no checkpoint: not reached
    result = launch_quick("launch/eval.py", f"--checkpoint={tmp_path}")
    assert result.returncode == 1
    assert "config.mesh.rollout_devices=4" in result.stderr and "pass --config.mesh.rollout_devices=0" in result.stderr
    assert "checkpoints" not in result.stderr
