"""Multi-process runs as on a pod: 2 `jax.distributed` processes x 2 fake CPU devices on 127.0.0.1
(launch/local_cluster.py) against 1 process x 4 devices, and 2 x 1 (one process per GPU) against 1 x 2, each
writing its run to a bucket of the local Cloud Storage server as the pod command does, the 2 x 1 run killed
with SIGKILL mid-run and resumed (SIGTERM's stop and a bitwise resume on two processes:
tests/train/test_staleness.py); a stalled process that ends the run instead of hanging it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import (
    CPU_ONLY_ENV,
    HANG_S,
    REPO,
    SMALL_TRAIN_RUN,
    WALL_CLOCK,
    cluster_tail,
    fake_devices_env,
    launch_script,
    on_local_cluster,
    restored_on_one_device,
    small_train_flags,
)

from comppo_jax import storage

# One-operation sums: 120 warm-start steps give a policy that is right about a quarter of the
# time, so rewards, advantages and gradients carry signal (not rounding noise) to compare. Dynamic
# sampling (reward filter) drops the groups of equal rewards and refills from the prompt stream (2-3 rounds a step
# here), so the refills, their regrouping of rows sharded over both processes (take_groups) and
# the stream's position across a preemption are checked on two processes too. The mesh splits the
# weights over fsdp across the processes (as ZeRO-3 over hosts does), so the sampler decodes in its own
# layout (rollout.mesh.tensor=auto: groups of the 2 tensor devices, one a process), resharded across
# both processes every step.
POD_RUN = dict(
    steps=3,
    warm_start__steps=120,
    warm_start__learning_rate=2e-3,
    data__train_size=200,
    data__dev_size=4,
    data__min_steps=1,
    data__max_steps=1,
    data__operations="+",
    rollout__max_new_tokens=20,
    train__minibatch_size=4,
    train__eval_every=2,
    checkpoint__keep_last=10,
    mesh__data=1,
    mesh__fsdp=2,
    mesh__tensor=2,
    rollout__dynamic_sampling=True,
    rollout__dynamic_sampling_filter="reward",
)
LAST_CHECKPOINT = 4  # a critic warm-up step and 3 actor updates
PROMPTS_PER_STEP = SMALL_TRAIN_RUN["rollout.prompts_per_step"]
OUTCOME_DIAGNOSTICS = {
    "credit/outcome_explained_variance",
    "credit/outcome_spearman",
    "credit/early_sign_agreement",
    "credit/trace_horizon",
}
# Devices per process -> POD_RUN's mesh as changed for them. One device each (a GPU cluster's one process per
# GPU, a slice of one chip per host): data parallel over the 2 devices, weights replicated.
LAYOUTS = {2: {}, 1: dict(mesh__data=2, mesh__fsdp=1, mesh__tensor=1)}


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warm_start_cache")


def flags(run_dir, cache, **overrides):
    return small_train_flags(run_dir, **{**POD_RUN, "warm_start__cache_dir": str(cache), **overrides})


def one_process(run_dir, cache, devices=8, env=None, **overrides):
    return launch_script(
        "launch/train.py", *flags(run_dir, cache, **overrides), env={**fake_devices_env(devices), **(env or {})}
    )


@pytest.fixture(scope="module")
def pod_bucket(gcs_emulator):
    """A bucket for the module's runs, as the pod command's --config.output_dir=gs://BUCKET/..."""
    return storage.path(f"gs://{gcs_emulator.bucket()}")


@pytest.fixture(scope="module")
def two_process_runs(gcs_emulator, pod_bucket, warm_cache):
    """devices per process -> (run dir, output, launches) of POD_RUN on 2 processes in that LAYOUTS mesh, its run
    directory on the bucket, run once. The one-device-per-process run is SIGKILLed (no chance to save) once 3 of
    its 4 steps are logged (checkpoint 2 committed before step 3 saves; 3 may be half written), then resumed:
    the equality with one process shows the resume continued from the newest whole checkpoint and refilled
    from the prompt stream where it was (bitwise against a straight run: tests/train/test_staleness.py)."""
    runs = {}

    def run(devices):
        if devices not in runs:
            run_dir = pod_bucket / f"two_process_{devices}"
            launches = 0
            if devices == 1:
                killed = on_local_cluster(
                    flags(run_dir, warm_cache, **LAYOUTS[devices]),
                    devices_per_process=devices,
                    signal_after_rows=3,
                    signum=signal.SIGKILL,
                    metrics=run_dir / "metrics.jsonl",
                    env=gcs_emulator.env,
                )
                assert killed.returncode != 0 and not (run_dir / "summary.json").exists(), cluster_tail(killed)
                launches = 1
            result = on_local_cluster(
                flags(run_dir, warm_cache, resume=launches > 0, **LAYOUTS[devices]),
                devices_per_process=devices,
                env=gcs_emulator.env,
            )
            assert result.returncode == 0, cluster_tail(result)
            runs[devices] = run_dir, result.stdout, launches + 1 + len(result.earlier)
        return runs[devices]

    return run


def rows(run_dir):
    return [
        {k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
        for line in storage.read_lines(storage.path(run_dir) / "metrics.jsonl")
    ]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 1], ids=["2x2_vs_1x4", "2x1_vs_1x2"])
def test_two_processes_equal_one_process_with_as_many_devices(
    gcs_emulator, pod_bucket, warm_cache, two_process_runs, devices
):
    two, output, launches = two_process_runs(devices)
    one = pod_bucket / f"one_process_{2 * devices}"
    result = one_process(one, warm_cache, devices=2 * devices, env=gcs_emulator.env, **LAYOUTS[devices])
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(rows(two)) == len(rows(one)) == LAST_CHECKPOINT
    assert min(row["dynamic_sampling/refills"] for row in rows(two)) >= 1  # every step refilled (2-3 rounds)
    # A batch holding a group of right and wrong responses (what the filter keeps) measures its credit against the
    # outcome. Most batches do; one whose refills found none (its groups all uninformative: every response equally
    # right) may have no outcome to measure, as the rounding of another CPU's programs once drew at step 2.
    informative = [row for row in rows(two) if row["dynamic_sampling/uninformative_kept"] < PROMPTS_PER_STEP]
    assert len(informative) >= LAST_CHECKPOINT - 1, [row["dynamic_sampling/uninformative_kept"] for row in rows(two)]
    assert all(OUTCOME_DIAGNOSTICS <= row.keys() for row in informative)
    assert all("credit/trace_horizon" in row for row in rows(two))
    if rows(two)[0] in informative:  # step 1's zero-initialized critic ranks nothing
        assert rows(two)[0]["credit/outcome_spearman"] == 0.0
    for a, b in zip(rows(two), rows(one)):
        assert a.keys() == b.keys()
        for name in a:
            if name.endswith("clip_fraction"):  # tokens on a clip boundary: rounding may move a few of a step's ~120
                assert abs(a[name] - b[name]) <= 0.05, (a["step"], name)
            elif isinstance(a[name], float):
                np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=f"step {a['step']} {name}")
            else:
                assert a[name] == b[name], (a["step"], name)
    a, b = restored_on_one_device(two, LAST_CHECKPOINT), restored_on_one_device(one, LAST_CHECKPOINT)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(x, np.float64),
            np.asarray(y, np.float64),
            rtol=1e-5,
            atol=1e-6,
            err_msg=jax.tree_util.keystr(path),
        )
    # Only process 0 writes: on a bucket one TensorBoard event file per flush, numbered from 0 by each launch
    # (a rerun after a gloo timeout starts its own; its resume, on a new coordinator port, changes nothing of
    # the run, so no config_changes.jsonl), the summary printed once, the same files as one process.
    segments = [int(name.rsplit(".", 1)[1]) for name in storage.names(two / "tensorboard")]
    assert 1 <= segments.count(0) <= launches, segments
    # Besides the rows a resume set aside (the killed run's past its checkpoint, logged again), the one
    # process's files.
    assert [name for name in storage.names(two) if ".set_aside_at_step_" not in name] == storage.names(one)
    # The kept responses, gathered from both processes' shards, are the one process's.
    kept = storage.names(two / "samples")
    assert kept == storage.names(one / "samples") and kept
    for name in kept:
        a, b = (json.loads((run / "samples" / name).read_text()) for run in (two, one))
        for x, y in zip(a["responses"], b["responses"], strict=True):
            assert x["pieces"] == y["pieces"] and x["reward"] == y["reward"]
            for array in x["tokens"]:
                np.testing.assert_allclose(x["tokens"][array], y["tokens"][array], atol=1e-4, err_msg=(name, array))
    assert "[p0] {" in output and "[p1] {" not in output
    if devices != 1:
        return

    # launch/eval.py the same way (on the cheaper layout): every process evaluates, process 0 writes.
    evaluated = on_local_cluster(
        [*flags(two, warm_cache, **LAYOUTS[devices]), f"--checkpoint={two}", "--config.eval.samples=2"],
        devices_per_process=devices,
        script="launch/eval.py",
        env=gcs_emulator.env,
    )
    assert evaluated.returncode == 0, cluster_tail(evaluated)
    results = json.loads((two / "eval" / f"step_{LAST_CHECKPOINT}" / "results.json").read_text())
    assert (
        results["rows"][0]["set"] == "id_dev"
        and "[p0] | id_dev | 4 |" in evaluated.stdout
        and "[p1] | id_dev" not in evaluated.stdout
    )


@pytest.mark.slow
def test_a_reference_made_on_each_process_own_device_saves_and_restores_on_one_device_per_process(tmp_path):
    """2 processes x 1 device: the warm-started policy, on each process's one device, placed on the
    mesh and saved as the reference (jax.device_put made arrays whose shards Orbax could not list)."""
    result = on_local_cluster(
        [f"--output_dir={tmp_path}"], devices_per_process=1, script="tests/launch/reference_round_trip.py"
    )
    assert result.returncode == 0, cluster_tail(result)
    assert "[p0] restored the policy made: True" in result.stdout, cluster_tail(result)
    assert "[p1] restored the policy made: True" in result.stdout, cluster_tail(result)


@pytest.mark.slow
def test_a_stalled_process_ends_the_run_within_the_collective_timeout():
    """Process 1 stalls 900 s before an all-reduce (a hung host). Process 0's all-reduce fails after the
    20 s collective timeout (long enough for the processes' first all-reduce, which waits for the
    slower compile), it exits at once (not in jax.distributed's shutdown barrier), and process 1 stops
    with it, so the run ends long before the stall would."""
    start = time.time()
    result = subprocess.run(
        [
            sys.executable,
            "launch/local_cluster.py",
            "--processes=2",
            "--devices_per_process=2",
            "--collective_timeout_s=20",
            "--grace_s=1",
            "--",
            "tests/launch/collective_stall.py",
            "--stall_s=900",
        ],
        cwd=REPO,
        env=CPU_ONLY_ENV,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    elapsed = time.time() - start
    events = "\n".join(line for line in result.stdout.splitlines() if "all-reduce" in line or "error" in line.lower())
    assert result.returncode != 0, events
    assert "[p1] all-reduce 0: 4.0" in result.stdout and "[p0] all-reduce 0: 4.0" in result.stdout, events
    assert "[p0] error: JaxRuntimeError" in result.stdout and "Timed out waiting 20000ms" in result.stdout, events
    # Far below the stall, with room for a busy machine's start-up and compiles.
    assert elapsed < 600, (elapsed, events)


@pytest.mark.slow
def test_processes_started_directly_with_the_mesh_fields_get_the_collective_timeout(tmp_path):
    """As a pod starts them: each process with the documented --config.mesh.* fields and no launcher.
    Process 1 stalls 900 s before an all-reduce; process 0's fails after mesh.collective_timeout_s
    (20 s) instead of waiting out the stall (XLA's own default is 30 minutes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.time()
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "tests/launch/collective_stall.py",
                "--stall_s=900",
                "--config.mesh.distributed=True",
                f"--config.mesh.coordinator_address=127.0.0.1:{port}",
                "--config.mesh.num_processes=2",
                f"--config.mesh.process_id={i}",
                "--config.mesh.collective_timeout_s=20",
            ],
            cwd=REPO,
            env=fake_devices_env(2),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        processes[0].wait(timeout=300)
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "p0.log").read_text()
    assert processes[0].returncode != 0 and "Timed out waiting 20000ms" in output, output[-3000:]
    assert time.time() - start < 300


@pytest.mark.parametrize(
    "signum, first_output, runs",
    [
        (
            signal.SIGTERM,
            "[p0] error: JaxRuntimeError: Gloo all-reduce failed: Application timeout caused pair closure",
            2,
        ),
        (None, "[p1] error: JaxRuntimeError: [Gloo] Timed out waiting 120000ms for recv operation to complete", 2),
        (signal.SIGKILL, "[p0] error: JaxRuntimeError: Gloo all-reduce failed: Timed out waiting 120000ms", 1),
        (signal.SIGTERM, "[p0] error: ValueError: a failure of the run's own", 1),
    ],
)
def test_the_cluster_helper_reruns_only_a_gloo_timeout_and_a_sigterm_run_from_its_directory_before(
    tmp_path, monkeypatch, signum, first_output, runs
):
    """The tests' supervisor (`on_local_cluster`): a run that failed on a gloo timeout, on either
    side of the collective, is rerun; a SIGTERM run from its directory as it was before it (the
    run's checkpoints and metrics gone, the earlier ones back); never a SIGKILL run or another error."""
    import conftest

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("earlier\n")
    seen = []

    def once(script_flags, **launch):
        seen.append(
            sorted(path.name for path in run.iterdir()) + [(run / "metrics.jsonl").read_text(), script_flags[-1]]
        )
        (run / "metrics.jsonl").write_text("earlier\nthis run's\n")
        (run / "checkpoints").mkdir(exist_ok=True)
        failed = len(seen) == 1
        return subprocess.CompletedProcess(script_flags, int(failed), first_output if failed else "[p0] done")

    monkeypatch.setattr(conftest, "_on_local_cluster_once", once)
    result = on_local_cluster([f"--config.output_dir={run}"], signum=signum)
    assert len(seen) == runs and len(result.earlier) == runs - 1
    if runs == 2:
        restored = ["metrics.jsonl", "earlier\n", f"--config.output_dir={run}"]  # as before, signalled again
        resumed = ["checkpoints", "metrics.jsonl", "earlier\nthis run's\n", "--config.resume=True"]
        assert seen[1] == (restored if signum == signal.SIGTERM else resumed), seen
