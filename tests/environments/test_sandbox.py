"""The Python sandbox against hostile programs: each is stopped or refused, and the caller, its files
and its network are untouched."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from conftest import wait_until

from comppo_jax.environments import ERROR, MALFORMED, OK, TIMEOUT, Turn, confine
from comppo_jax.environments.sandbox import (
    CGROUP_PARENTS,
    LAUNCHER,
    Sandbox,
    missing_protections,
    protections,
    reap,
)

MISSING = missing_protections() if sys.platform.startswith("linux") else ["Linux"]
# Where the kernel grants less, a Sandbox refuses to start (test_a_sandbox_refuses_...): nothing here can run.
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"this machine lacks the sandbox's {'; '.join(MISSING)}")
MARK = "comppo_sandbox_test_marker"  # in every hostile program's text, to find processes it left


def call(program: str, row: int = 0) -> Turn:
    text = f"<tool_call>{program}\n# {MARK}</tool_call>"
    return Turn(row, text, ())


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(limits=dict(wall_s=3.0, cpu_s=2, memory_bytes=256 << 20, processes=8), num_workers=2) as box:
        yield box


def left_running() -> list[str]:
    out = subprocess.run(["pgrep", "-af", MARK], capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def leftovers(worker: int) -> list[str]:
    """The cgroups, directories and mounts a worker's programs left (named after the worker)."""
    name = f"comppo-sandbox-{worker}-"
    found = [path for parent in CGROUP_PARENTS for path in glob.glob(os.path.join(parent, name + "*"))]
    found += glob.glob(os.path.join(tempfile.gettempdir(), name + "*"))
    with open("/proc/mounts") as mounts:
        return found + [line for line in mounts if name in line]


def digest(directory) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


def test_this_machine_grants_every_confinement():
    granted = protections()
    assert granted["landlock_abi"] >= 6, granted  # files, TCP and signals
    assert granted["network_namespace"] and granted["seccomp"], granted
    assert granted["process_limit"] != "none (root)", granted


def test_a_sandbox_refuses_to_start_on_a_machine_lacking_a_confinement(monkeypatch):
    monkeypatch.setattr(confine, "landlock_abi", lambda: 5)  # Linux 6.10: no scoped signals
    with pytest.raises(RuntimeError, match="Landlock ABI 6"):
        Sandbox(num_workers=1)


def test_a_program_runs_and_its_output_is_the_reply(sandbox):
    reply = sandbox.step([call("import math\nprint(math.comb(10, 3))")])[0]
    assert (reply.text, reply.outcome) == ("<tool_response>\n120\n</tool_response>\n", OK)
    assert sandbox.step([Turn(0, "no tags</tool_call>", ())])[0].outcome == MALFORMED
    assert (
        sandbox.step([call("1/0")])[0].text
        == "<tool_response>\nZeroDivisionError: division by zero\n</tool_response>\n"
    )


@pytest.mark.parametrize(
    "name,program,outcome",
    [
        ("infinite loop", "while True:\n    pass", (TIMEOUT, ERROR)),  # the wall clock or the CPU limit
        ("memory hog", "hog = [bytearray(1 << 26) for _ in range(16)]\nprint('allocated 1 GiB')", (ERROR,)),
        (
            "fork bomb",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            (TIMEOUT, ERROR),
        ),
    ],
)
def test_runaway_programs_are_stopped_and_leave_nothing_running(sandbox, name, program, outcome):
    start = time.monotonic()
    reply = sandbox.step([call(program)])[0]
    assert reply.outcome in outcome, (name, reply)
    assert time.monotonic() - start < 8, name
    assert left_running() == [], name
    assert sandbox.step([call("print(6 * 7)")])[0].text.splitlines()[1] == "42"  # the sandbox still answers


def test_a_program_starts_at_most_its_process_limit(sandbox):
    program = (
        "import os, time\nstarted = 0\nfor _ in range(50):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(2)\n            os._exit(0)\n        started += 1\n    except OSError:\n        break\n"
        "print(started)"
    )
    reply = sandbox.step([call(program)])[0]
    assert reply.outcome == OK and int(reply.text.splitlines()[1]) < 8, reply
    assert left_running() == []


@pytest.mark.parametrize(
    "limit,program,message",
    [
        ("cpu_s", "while True:\n    pass", "exit status"),  # killed by SIGXCPU long before its wall clock
        ("open_files", "files = [open(f'{i}.txt', 'w') for i in range(200)]", "Too many open files"),
        ("file_bytes", "open('big', 'wb').write(bytes(4 << 20))", "File too large"),
        ("disk_bytes", "for i in range(100):\n    open(f'{i}', 'wb').write(bytes(1 << 19))", "No space left"),
        ("disk_files", "for i in range(100_000):\n    open(f'{i}', 'w').close()", "No space left"),
    ],
)
def test_each_resource_limit_binds(limit, program, message):
    with Sandbox(limits=dict(wall_s=20.0, cpu_s=1), num_workers=1) as box:
        start = time.monotonic()
        reply = box.step([call(program)])[0]
    assert reply.outcome == ERROR and message in reply.text, (limit, reply)
    assert time.monotonic() - start < 10, limit


def test_it_has_no_capabilities(sandbox):
    reply = sandbox.step([call("import os\nos.nice(-1)")])[0]  # raising its priority needs CAP_SYS_NICE
    assert reply.outcome == ERROR and "not permitted" in reply.text, reply


def test_files_outside_its_directory_cannot_be_read_or_deleted(sandbox, tmp_path):
    run_directory = tmp_path / "run"
    run_directory.mkdir()
    (run_directory / "config.json").write_text('{"secret": "run"}')
    before = digest(run_directory)
    for program in [
        f"print(open({str(run_directory / 'config.json')!r}).read())",
        f"import os\nos.remove({str(run_directory / 'config.json')!r})",
        f"import shutil\nshutil.rmtree({str(run_directory)!r})",
        f"open({str(run_directory / 'new.txt')!r}, 'w').write('x')",
        f"import os\nprint(os.listdir({os.path.expanduser('~')!r}))",
        "print(open('/etc/passwd').read())",
    ]:
        reply = sandbox.step([call(program)])[0]
        assert reply.outcome == ERROR and "Permission" in reply.text, (program, reply)
    assert digest(run_directory) == before


def test_its_own_directory_is_writable_empty_and_fresh(sandbox):
    first = sandbox.step([call("import os\nprint(os.listdir('.'))\nopen('kept.txt', 'w').write('x')")])[0]
    second = sandbox.step([call("import os\nprint(os.listdir('.'))")])[0]
    assert first.outcome == second.outcome == OK and "[]" in first.text and "[]" in second.text


def test_no_credentials_reach_a_program(sandbox, monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/secret/key.json")
    with Sandbox(num_workers=1) as fresh:  # workers started with the secret in their environment
        reply = fresh.step([call("import os\nprint(sorted(os.environ))")])[0]
    assert reply.outcome == OK and "GOOGLE" not in reply.text


def test_sockets_reach_nothing(sandbox):
    with socket.socket() as server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as datagrams:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        datagrams.bind(("127.0.0.1", 0))
        datagrams.settimeout(0.5)
        tcp, udp = server.getsockname()[1], datagrams.getsockname()[1]
        udp_socket = "socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
        replies = sandbox.step(
            [
                call(f"import socket\nsocket.create_connection(('127.0.0.1', {tcp}), timeout=1)"),
                call(f"import socket\n{udp_socket}.sendto(b'x', ('127.0.0.1', {udp}))"),
                call("import socket\nsocket.create_connection(('8.8.8.8', 53), timeout=1)"),
            ]
        )
        assert [r.outcome for r in replies] == [ERROR] * 3, replies
        with pytest.raises(TimeoutError):
            server.accept()
        with pytest.raises(TimeoutError):
            datagrams.recv(1)


def test_unix_sockets_mode_owner_and_time_changes_and_kernel_calls_are_refused(sandbox, tmp_path):
    with socket.socket(socket.AF_UNIX) as daemon:  # a host daemon's socket, by path
        path = str(tmp_path / "daemon.sock")
        daemon.bind(path)
        daemon.listen()
        daemon.settimeout(0.5)
        victim = tmp_path / "victim.txt"
        victim.write_text("kept")
        before = victim.stat()
        for program in [
            f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})",
            f"import os\nos.chmod({str(victim)!r}, 0)",
            f"import os\nos.utime({str(victim)!r}, (0, 0))",
            f"import os\nos.chown({str(victim)!r}, 1, 1)",
            "import os\nos.unshare(os.CLONE_NEWUSER)"
            if hasattr(os, "unshare")
            else "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0",
        ]:
            reply = sandbox.step([call(program)])[0]
            assert reply.outcome == ERROR, (program, reply)
        with pytest.raises(TimeoutError):
            daemon.accept()
        after = victim.stat()
        assert (after.st_mode, after.st_mtime, after.st_uid) == (before.st_mode, before.st_mtime, before.st_uid)


def test_its_output_is_bounded_and_a_reply_keeps_its_closing_tag(sandbox):
    reply = sandbox.step([call("while True:\n    print('x' * 1000)")])[0]  # would print gigabytes in its CPU time
    assert reply.outcome == ERROR and reply.text.endswith("</tool_response>\n") and len(reply.text) < 1000


def test_it_cannot_signal_the_process_that_runs_it(sandbox):
    reply = sandbox.step([call(f"import os, signal\nos.kill({os.getpid()}, signal.SIGCONT)")])[0]
    assert reply.outcome == ERROR and "not permitted" in reply.text


def test_vsock_and_netlink_sockets_are_refused(sandbox):
    replies = sandbox.step(
        [
            call("import socket\nsocket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)"),  # the hypervisor's ports
            call("import socket\nsocket.socket(socket.AF_NETLINK, socket.SOCK_RAW)", row=1),  # the kernel's
        ]
    )
    assert [(r.outcome, "Permission denied" in r.text) for r in replies] == [(ERROR, True)] * 2, replies


def test_a_worker_killed_mid_program_leaves_no_program_cgroup_or_mount():
    with Sandbox(limits=dict(wall_s=20.0), num_workers=1) as box:
        worker = box._pool._workers[0].pid

        def kill_when_running():
            wait_until(lambda: left_running() != [], 10)
            os.kill(worker, signal.SIGKILL)  # the OOM killer, or the pool's own timeout

        threading.Thread(target=kill_when_running).start()
        reply = box.step([call("import time\ntime.sleep(60)")])[0]
        assert (reply.outcome, reply.text) == (ERROR, "<tool_response>\ndied\n</tool_response>\n")
        assert wait_until(lambda: left_running() == [], 2), left_running()
        assert leftovers(worker) == []
        assert box.step([call("print(6 * 7)")])[0].outcome == OK


def test_reap_waits_while_a_dead_programs_cgroup_is_still_busy():
    """A killed process leaves cgroup.procs before it has exited, and rmdir fails with EBUSY until it
    has: here the cgroup is kept busy for a moment by a child cgroup instead."""
    worker = 2**22 + 1  # above pid_max's default: no live worker has this name
    parent = next(p for p in CGROUP_PARENTS if os.path.exists(os.path.join(p, "cgroup.procs")))
    cgroup = tempfile.mkdtemp(prefix=f"comppo-sandbox-{worker}-", dir=parent)
    busy = os.path.join(cgroup, "busy")
    os.mkdir(busy)
    release = threading.Timer(0.3, os.rmdir, [busy])
    release.start()
    try:
        reap(worker)
        assert leftovers(worker) == []
    finally:
        release.join()
        reap(worker)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_program_never_outlives_its_worker_even_unsupervised(stop):
    """SIGTERM (the trainer died: the worker's parent-death signal): the worker kills its program and
    removes its cgroup and mount itself. SIGKILL: the program dies with it; `reap`, which the pool
    calls after a worker exits, removes the rest."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "comppo_jax.workers", "comppo_jax.environments.sandbox:run_program"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    try:
        assert worker.stdout.readline() == '["ready"]\n'
        worker.stdin.write(json.dumps([f"import time\ntime.sleep(60)\n# {MARK}", {"wall_s": 60.0}]) + "\n")
        worker.stdin.flush()
        assert wait_until(lambda: left_running() != [], 10)
        worker.send_signal(stop)
        worker.wait()
        assert wait_until(lambda: left_running() == [], 2), left_running()
        if stop == signal.SIGKILL:
            assert leftovers(worker.pid) != []  # the cgroup and mount of a program that died with its worker
            reap(worker.pid)
        assert leftovers(worker.pid) == []
    finally:  # a failure leaves no process, cgroup or mount behind
        worker.kill()
        worker.wait()
        reap(worker.pid)


def test_a_program_whose_worker_is_already_gone_never_starts():
    spec = {"code": f"print('ran')  # {MARK}", "directory": "/", "limits": {}, "cgroup": None, "worker": 1}
    run = subprocess.run(
        [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == confine.EXIT_UNCONFINED and "its worker 1 exited before" in run.stdout, run
