"""The killable worker pool against dying workers, group signals and a killed parent: a dead worker
costs at most the item it held, the caller's group signals never reach a worker, and no worker
outlives the pool's process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from conftest import wait_until

from comppo_jax import workers
from comppo_jax.workers import DIED, OK, Result


def gone(pid: int) -> bool:
    """Whether every thread of `pid` has exited (a zombie runs nothing, but its parent can reap it
    only once its last thread, say OpenBLAS's, has exited)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    states = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:
            continue  # that thread has just been released
    return all(state in "ZX" for state in states)


def child(code: str) -> subprocess.Popen:
    """A Python process running `code`, in a process group of its own (the test's is left alone)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_a_worker_killed_while_idle_is_replaced_and_every_item_is_answered():
    with workers.function_pool("operator:neg", num_workers=1) as pool:
        killed = pool._workers[0].pid
        os.kill(killed, signal.SIGKILL)
        assert wait_until(lambda: gone(killed), 5)
        assert pool.run([1, 2, 3]) == [Result(OK, -1), Result(OK, -2), Result(OK, -3)]  # it held no item
        assert pool._workers[0].pid != killed


def test_a_worker_dying_as_an_item_is_written_costs_that_item_and_raises_nothing():
    with workers.function_pool("operator:neg", num_workers=1) as pool:
        process = pool._workers[0]
        os.kill(process.pid, signal.SIGKILL)
        assert wait_until(lambda: gone(process.pid), 5)
        process.poll = lambda: None  # type: ignore[method-assign]  # it dies after it was polled
        results = pool.run([1, 2])
        assert results[0].status == DIED and results[1] == Result(OK, -2)
        assert pool.run([3]) == [Result(OK, -3)]


def test_a_worker_killed_mid_item_costs_that_item_alone():
    with workers.function_pool("time:sleep", num_workers=1, timeout_s=30) as pool:
        threading.Timer(0.5, os.kill, (pool._workers[0].pid, signal.SIGKILL)).start()
        results = pool.run([2.0, 0.1, 0.1])
        assert [r.status for r in results] == [DIED, OK, OK], results
        assert "status -9" in results[0].value


def test_ready_workers_have_not_loaded_jax():
    """A reward or tool worker imports only what it runs: no JAX (seconds and ~150 MB a worker)."""
    from comppo_jax.data.rewards import VerifierPool
    from comppo_jax.environments.calculator import Calculator

    with VerifierPool(num_workers=1) as verifier, Calculator(num_workers=1) as calculator:
        for pool in (verifier._pool, calculator._pool):
            with open(f"/proc/{pool._workers[0].pid}/maps") as maps:
                assert "jaxlib" not in maps.read(), pool.command


def test_workers_run_in_a_session_and_process_group_of_their_own():
    with workers.function_pool("operator:neg", num_workers=1) as pool:
        pid = pool._workers[0].pid
        assert os.getsid(pid) == os.getpgid(pid) == pid
        assert os.getsid(pid) != os.getsid(0) and os.getpgid(pid) != os.getpgrp()


def test_a_signal_to_the_callers_process_group_leaves_its_verdicts_intact():
    caller = child(
        "import json, signal\nfrom comppo_jax import workers\nstops = []\n"
        "signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum))  # it finishes its step\n"
        "with workers.function_pool('time:sleep', num_workers=1, timeout_s=30) as pool:\n"
        "    print('running', flush=True)\n"
        "    results = pool.run([2.0, 0.1])\n"
        "print(json.dumps([stops, [r.status for r in results]]), flush=True)\n"
    )
    assert caller.stdout is not None and caller.stdout.readline() == "running\n"
    time.sleep(0.5)  # the first item is in the worker
    os.killpg(caller.pid, signal.SIGTERM)  # as systemd, a scheduler or `kill -- -PGID` stops a run
    out, _ = caller.communicate(timeout=120)
    assert json.loads(out) == [[signal.SIGTERM], [OK, OK]]


def test_no_worker_outlives_its_pools_process_killed_mid_item():
    caller = child(
        "import json\nfrom comppo_jax import workers\n"
        "pool = workers.function_pool('time:sleep', num_workers=1, timeout_s=60)\n"
        "print(json.dumps([p.pid for p in pool._workers]), flush=True)\n"
        "pool.run([60])\n"
    )
    assert caller.stdout is not None
    pids = json.loads(caller.stdout.readline())
    time.sleep(0.5)  # the item is in the worker, which does not read its stdin
    caller.kill()
    caller.wait()
    assert wait_until(lambda: all(gone(pid) for pid in pids), 5), pids


def test_a_worker_whose_parent_is_already_gone_exits_before_it_is_ready():
    env = {**os.environ, workers.PARENT_ENV: "1"}  # not its parent: the pool's process died during its start
    run = subprocess.run(
        [sys.executable, "-m", "comppo_jax.workers", "operator:neg"],
        env=env,
        input="",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and run.stdout == "" and "parent 1 exited before this process started" in run.stderr
