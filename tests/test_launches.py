"""A warm launch process (tests/launches.py) runs scripts one after another as fresh interpreters would."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor

import launches
from conftest import CPU_ONLY_ENV, HANG_S, REPO

SCRIPT = """
import atexit, os, signal, sys, time
from absl import app, flags

_NAME = flags.DEFINE_string("name", "nobody", "who")
_FAIL = flags.DEFINE_string("fail", "", "raise, or exit with a status")
_SLEEP = flags.DEFINE_float("sleep", 0.0, "seconds to wait before exiting")


def main(argv):
    print("pid", os.getpid(), "name", _NAME.value, "seen", os.environ.get("WARM_TEST_SEEN"), flush=True)
    print("handler", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    os.environ["WARM_TEST_SEEN"] = _NAME.value
    signal.signal(signal.SIGTERM, lambda *_: None)
    atexit.register(print, "at exit", _NAME.value)
    print("to stderr", file=sys.stderr)
    time.sleep(_SLEEP.value)
    if _FAIL.value == "raise":
        raise RuntimeError("failed as asked")
    if _FAIL.value:
        os._exit(int(_FAIL.value))


app.run(main)
"""


def test_launches_in_one_process_see_their_own_flags_and_nothing_the_one_before_changed(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    launch = lambda *args: launches.launch("warm", str(script), args, env=CPU_ONLY_ENV, cwd=REPO, timeout_s=HANG_S)
    first, second = launch("--name=first"), launch("--name=second")
    assert (first.returncode, second.returncode) == (0, 0), first.stderr + second.stderr
    pid = first.stdout.split()[1]
    assert first.stdout.splitlines() == [f"pid {pid} name first seen None", "handler True", "at exit first"]
    assert second.stdout.splitlines() == [f"pid {pid} name second seen None", "handler True", "at exit second"]
    assert first.stderr == second.stderr == "to stderr\n"

    failed = launch("--name=third", "--fail=raise")
    assert failed.returncode == 1 and "RuntimeError: failed as asked" in failed.stderr
    assert failed.stdout.split()[1] == pid and failed.stdout.endswith("at exit third\n")
    after = launch("--name=fourth", "--fail=3")  # a failure is its process's last launch
    assert after.returncode == 3 and after.stdout.split()[1] != pid and "at exit" not in after.stdout
    assert launch("--name=fifth").stdout.split()[1] not in (pid, after.stdout.split()[1])


def test_a_launch_while_another_thread_holds_the_warm_process_is_left_to_a_fresh_one(tmp_path):
    """Launches meant to meet (two processes racing for one folder) must run at once, not one after the other."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    launch = lambda name: launches.launch(
        "warm", str(script), [f"--name={name}", "--sleep=2"], env=CPU_ONLY_ENV, cwd=REPO, timeout_s=HANG_S
    )
    assert launch("first").returncode == 0  # the warm process is started
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(launch, ("one", "two"))
    assert [result is None for result in (first, second)].count(True) == 1  # the other thread's to run fresh
    ran = first or second
    assert ran.returncode == 0 and ran.stdout.startswith("pid ")
