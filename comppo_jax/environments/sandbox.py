"""A Python sandbox: math programs the policy writes, run as untrusted code.

The policy writes a program between `<tool_call>` and its call token `</tool_call>`; the sandbox
runs it and replies with what it printed, `<tool_response>\n{output}\n</tool_response>\n` (the
tags are `Sandbox`'s arguments; the output is cut to its last `output_chars` characters first, so
a reply keeps its closing tag). A program that fails replies with its error's last line (outcome
ERROR), one that outlives `wall_s` with `timeout` (TIMEOUT), an empty one `malformed`.

Each program runs in a fresh interpreter (`python -I -S`: no site-packages, no environment
variables but PATH) started by a killable worker (comppo_jax.workers) through a launcher that
confines itself first (comppo_jax.environments.confine, a single-threaded interpreter):
- its own session and its own empty working directory (as root a tmpfs bounded in bytes and in
  files), deleted afterwards; its output goes to a file, so it is bounded by the written-file limit;
- resource limits: CPU seconds, address space, open files, written file size, no core dumps, and
  processes: RLIMIT_NPROC, which does not bind root, so as root a pids cgroup of its own (v1 or
  v2), which also finds every process it started, to kill them at the end;
- a network namespace of its own with no interface up (root, or a user namespace around it);
- as root, no capabilities (none regained by exec);
- Landlock: reading only the Python installation and system libraries, writing only its
  directory, no TCP connect or bind, no signals to or abstract sockets of processes outside it;
- a seccomp filter for what Landlock does not cover: no change of a file's mode, owner, times or
  attributes, no UNIX-domain, vsock or netlink sockets (a path socket reaches the host's daemons, a
  vsock one the hypervisor's), no namespace, mount, key, ptrace, BPF or kernel calls.
A `Sandbox` refuses to start where the machine lacks any of these (`missing_protections`).

A program never outlives its worker: it gets SIGKILL when the worker dies (the launcher's
PR_SET_PDEATHSIG); a worker stopped by SIGTERM kills the program's cgroup and removes its mount
itself; and after a worker is killed or found dead (the pool's timeout, the OOM killer), the pool
calls `reap(pid)`, which finds what it left by name (`comppo-sandbox-<worker pid>-...`, the
program's cgroup and directory), kills every process in the cgroup, unmounts the directory and
removes both.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from comppo_jax import workers
from comppo_jax.environments import confine
from comppo_jax.environments.protocol import ERROR, MALFORMED, OK, TIMEOUT, Environment, Reply, Turn

if TYPE_CHECKING:  # a worker imports this module: not the data sets' (hub, storage) modules
    from comppo_jax.data.datasets import Problem

LAUNCHER = os.path.abspath(confine.__file__)
MIN_LANDLOCK_ABI = 6  # files, TCP and signals
MNT_DETACH = 2
CGROUP_PARENTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1's pids hierarchy, or v2's root


def _prefix(worker: int) -> str:
    """What the names of a worker's program cgroup and directory start with."""
    return f"comppo-sandbox-{worker}-"


def pids_cgroup() -> str | None:
    """A new pids cgroup for one program (root only), or None where there is none to make."""
    if os.geteuid() != 0:
        return None
    for parent in CGROUP_PARENTS:
        if not os.path.exists(os.path.join(parent, "cgroup.procs")):
            continue
        writable = os.access(parent, os.W_OK)
        directory = tempfile.mkdtemp(prefix=_prefix(os.getpid()), dir=parent) if writable else None
        if directory and os.path.exists(os.path.join(directory, "pids.max")):
            return directory
        if directory:
            os.rmdir(directory)
    return None


DEFAULT_LIMITS = dict(
    wall_s=5.0,
    cpu_s=4,
    memory_bytes=512 << 20,
    processes=16,
    open_files=64,
    file_bytes=1 << 20,
    disk_bytes=16 << 20,
    disk_files=1024,
    output_chars=400,
)


def _tmpfs(directory: str, size: int, files: int) -> None:
    """Mounts a tmpfs of `size` bytes and `files` inodes on `directory` (root only: elsewhere it stays
    a plain directory)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={size},nr_inodes={files},mode=0700".encode()
    if libc.mount(b"tmpfs", directory.encode(), b"tmpfs", 0, options) != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs on {directory}: {os.strerror(ctypes.get_errno())}")


def _kill_cgroup(cgroup: str) -> None:
    """SIGKILLs every process in `cgroup` until it is empty (cgroup.kill where the kernel has it)."""
    kill = os.path.join(cgroup, "cgroup.kill")  # cgroup v2, Linux 5.14+: atomic against forks
    while True:
        with open(os.path.join(cgroup, "cgroup.procs")) as procs:
            left = [int(line) for line in procs.read().split()]
        if not left:
            return
        if os.path.exists(kill):
            with open(kill, "w") as everyone:
                everyone.write("1")
        else:
            for other in left:
                with contextlib.suppress(ProcessLookupError):  # it has just exited
                    os.kill(other, signal.SIGKILL)
        time.sleep(0.01)


def _remove_cgroup(cgroup: str, timeout_s: float = 10.0) -> None:
    """Kills every process in `cgroup` and removes it. A killed process leaves cgroup.procs when it
    starts exiting but holds the cgroup until it has exited: rmdir fails with EBUSY until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        _kill_cgroup(cgroup)
        try:
            os.rmdir(cgroup)
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise OSError(error.errno, f"remove the program's cgroup {cgroup}: {error.strerror}") from error
        time.sleep(0.01)


def _kill_all(pid: int, cgroup: str | None) -> None:
    """Kills the program's session and, with a cgroup, every process in it."""
    with contextlib.suppress(ProcessLookupError):  # the session has already ended
        os.killpg(pid, signal.SIGKILL)
    if cgroup:
        _kill_cgroup(cgroup)


def _remove_directory(directory: str) -> None:
    """Unmounts the program's tmpfs (if mounted) and deletes its directory."""
    libc = ctypes.CDLL(None, use_errno=True)
    if os.path.ismount(directory) and libc.umount2(directory.encode(), MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), f"umount {directory}: {os.strerror(ctypes.get_errno())}")
    shutil.rmtree(directory, ignore_errors=True)


def reap(worker: int) -> None:
    """Kills and removes what a dead worker left of its program: every process in its cgroup, the
    cgroup, its directory's mount and the directory (the pool's cleanup, after the worker exits)."""
    pattern = _prefix(worker) + "*"
    for parent in CGROUP_PARENTS:
        for cgroup in glob.glob(os.path.join(parent, pattern)):
            _remove_cgroup(cgroup)
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), pattern)):
        _remove_directory(directory)


def run_program(item: list) -> dict:
    """Runs [code, limits] (see DEFAULT_LIMITS) confined; returns {"returncode", "output", "timed_out"}.
    The sandbox's tool, run in a worker process."""
    code, limits = item
    limits = {**DEFAULT_LIMITS, **limits}
    directory, cgroup = tempfile.mkdtemp(prefix=_prefix(os.getpid())), pids_cgroup()
    process = None
    output = tempfile.TemporaryFile()  # outside the program's directory; written through its stdout
    try:
        _tmpfs(directory, limits["disk_bytes"], limits["disk_files"])
        if cgroup:
            with open(os.path.join(cgroup, "pids.max"), "w") as limit:
                limit.write(str(limits["processes"]))
        spec = {"code": code, "directory": directory, "limits": limits, "cgroup": cgroup, "worker": os.getpid()}
        process = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", LAUNCHER, json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=directory,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
        try:
            process.wait(timeout=limits["wall_s"])
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
    finally:
        if process is not None:
            _kill_all(process.pid, cgroup)  # what it left running, too
            process.wait()
        _remove_directory(directory)
        if cgroup:
            _remove_cgroup(cgroup)
    output.seek(0)
    text = output.read().decode(errors="replace")
    output.close()
    if process.returncode == confine.EXIT_UNCONFINED:
        raise RuntimeError(f"the sandbox could not confine the program: {text.strip()}")
    return {"returncode": process.returncode, "output": text, "timed_out": timed_out}


def protections() -> dict[str, object]:
    """Which confinements this machine grants the sandbox (the module docstring's list)."""
    flags = confine.CLONE_NEWNET if os.geteuid() == 0 else confine.CLONE_NEWUSER | confine.CLONE_NEWNET
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({flags}) != 0)"
    namespace = subprocess.run([sys.executable, "-I", "-S", "-c", probe], check=False)
    seccomp = subprocess.run(
        [sys.executable, "-I", "-S", LAUNCHER, json.dumps({"probe": "seccomp"})], check=False, capture_output=True
    )
    cgroup = pids_cgroup()
    if cgroup:
        os.rmdir(cgroup)
    return {
        "landlock_abi": confine.landlock_abi(),
        "network_namespace": namespace.returncode == 0,
        "seccomp": seccomp.returncode == 0,
        "process_limit": "pids cgroup" if cgroup else "RLIMIT_NPROC" if os.geteuid() != 0 else "none (root)",
    }


def missing_protections() -> list[str]:
    """What the sandbox needs and this machine lacks, in words (empty: it may run)."""
    granted = protections()
    missing = []
    if granted["landlock_abi"] < MIN_LANDLOCK_ABI:  # type: ignore[operator]
        missing.append(f"Landlock ABI {MIN_LANDLOCK_ABI}+ (Linux 6.12+; this kernel has {granted['landlock_abi']})")
    if not granted["network_namespace"]:
        missing.append("a network namespace (root, or unprivileged user namespaces)")
    if not granted["seccomp"]:
        missing.append("seccomp filters")
    if granted["process_limit"] == "none (root)":
        missing.append("a writable pids cgroup (as root, RLIMIT_NPROC does not bind)")
    return missing


class Sandbox(Environment):
    """Runs the program of each call (`tool` runs [code, limits] in the workers)."""

    def __init__(
        self,
        *,
        open_tag: str = "<tool_call>",
        call_token: str = "</tool_call>",
        reply_format: str = "<tool_response>\n{output}\n</tool_response>\n",
        limits: dict | None = None,
        tool: str = "comppo_jax.environments.sandbox:run_program",
        num_workers: int = 2,
    ):
        self.open_tag, self.call_tokens, self.reply_format = open_tag, (call_token,), reply_format
        self.limits = {**DEFAULT_LIMITS, **(limits or {})}
        unknown = set(self.limits) - set(DEFAULT_LIMITS)
        if unknown:
            raise ValueError(f"unknown sandbox limits {sorted(unknown)}; known: {sorted(DEFAULT_LIMITS)}")
        missing = missing_protections()
        if missing:
            raise RuntimeError(
                f"the Python sandbox cannot confine programs on this machine: it lacks {'; '.join(missing)}"
            )
        self._pool = workers.function_pool(tool, num_workers, timeout_s=self.limits["wall_s"] + 5.0, cleanup=reap)

    def reset(self, problems: Sequence[Problem]) -> None:
        del problems  # every conversation gets a fresh directory per program

    def program(self, text: str) -> str:
        """The program of a turn ending in a call: the text after its last open tag (ValueError if none)."""
        call = self.call_tokens[0]
        if not text.endswith(call) or self.open_tag not in text:
            raise ValueError(f"a call reads {self.open_tag}program{call}")
        program = text[text.rindex(self.open_tag) + len(self.open_tag) : -len(call)]
        if not program.strip():
            raise ValueError("the program is empty")
        return program

    def step(self, turns: Sequence[Turn]) -> list[Reply]:
        replies: list[Reply | None] = [None] * len(turns)
        programs = []
        for index, turn in enumerate(turns):
            try:
                programs.append((index, self.program(turn.text)))
            except ValueError:
                replies[index] = Reply(self.reply_format.format(output="malformed"), outcome=MALFORMED)
        results = self._pool.run([[program, self.limits] for _, program in programs])
        for (index, _), result in zip(programs, results):
            replies[index] = self._reply(result)
        return [reply for reply in replies if reply is not None]

    def _reply(self, result: workers.Result) -> Reply:
        if result.status != workers.OK:  # the worker itself failed or hung: not the program's doing
            return Reply(
                self.reply_format.format(output=result.status),
                outcome=TIMEOUT if result.status == workers.TIMEOUT else ERROR,
            )
        run = result.value
        if run["timed_out"]:
            return Reply(self.reply_format.format(output="timeout"), outcome=TIMEOUT)
        output = run["output"].strip()[-self.limits["output_chars"] :]
        if run["returncode"] != 0:
            last = output.splitlines()[-1] if output else f"exit status {run['returncode']}"
            return Reply(self.reply_format.format(output=last), outcome=ERROR)
        return Reply(self.reply_format.format(output=output), outcome=OK)

    def close(self) -> None:
        self._pool.close()
