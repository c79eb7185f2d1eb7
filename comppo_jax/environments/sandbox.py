"""A Python sandbox: math programs the policy writes, run as untrusted code.

The policy writes a program between `<tool_call>` and its call token `</tool_call>`; the sandbox
runs it and replies with what it printed, `<tool_response>\n{output}\n</tool_response>\n` (the
tags are `Sandbox`'s arguments). A program that fails replies with its error's last line (outcome
ERROR), one that outlives `wall_s` with `timeout` (TIMEOUT), an empty one `malformed`.

Each program runs in a fresh interpreter (`python -I -S`: no site-packages, no environment
variables but PATH) started by a killable worker (comppo_jax.workers), and before it starts:
- its own session and its own empty working directory, deleted afterwards;
- resource limits: CPU seconds, address space, open files, written file size, no core dumps, and
  processes: RLIMIT_NPROC, which does not bind root, so as root a pids cgroup of its own (v1 or
  v2), which also finds every process it started, to kill them at the end;
- a network namespace of its own with no interface up (needs root or user namespaces);
- as root, no capabilities (none kept across exec: the bounding set is emptied), so it cannot
  mount, reboot, load modules or reconfigure anything;
- Landlock (Linux 5.13+): reading only the Python installation and system libraries, writing
  only its directory; no TCP connect or bind (Landlock ABI 4+); no signals to, or abstract
  sockets of, processes outside it (ABI 6+).
`protections()` says which of these the machine grants: without Landlock (macOS, Linux before
5.13) a program could read what its user can; only use the sandbox where they hold.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from comppo_jax import workers
from comppo_jax.data.datasets import Problem
from comppo_jax.environments import ERROR, MALFORMED, OK, TIMEOUT, Environment, Reply, Turn

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(os.uname().machine, 126)
CAPABILITY_VERSION_3 = 0x20080522
_SYS_LANDLOCK = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # the same on x86_64 and aarch64
_FS_READ = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}  # 5+: (1 << 16) - 1
_NET_ALL, _SCOPE_ALL = 1 | 2, 1 | 2  # BIND_TCP | CONNECT_TCP; ABSTRACT_UNIX_SOCKET | SIGNAL


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 without Landlock."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc().syscall(_SYS_LANDLOCK["create_ruleset"], None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(version), 0)


def readable_roots() -> list[str]:
    """What a sandboxed interpreter may read: its installation and the system's libraries."""
    roots = [
        sys.base_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        "/usr",
        "/lib",
        "/lib64",
        "/etc/ld.so.cache",
    ]
    return sorted({r for r in roots if os.path.exists(r)})


def _landlock(abi: int, writable: str) -> None:
    """Restricts this process and its children (called in the child, before exec)."""
    libc = _libc()
    handled_fs = _FS_BY_ABI.get(abi, (1 << 16) - 1)
    attr = _RulesetAttr(handled_fs, _NET_ALL if abi >= 4 else 0, _SCOPE_ALL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(_SYS_LANDLOCK["create_ruleset"], ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    for path, access in [(r, _FS_READ) for r in readable_roots()] + [(writable, handled_fs)]:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        if not os.path.isdir(path):
            access &= 1 | 2 | 4 | (1 << 14) | (1 << 15)  # a file takes file rights only
        rule = _PathBeneathAttr(access & handled_fs, fd)
        if libc.syscall(_SYS_LANDLOCK["add_rule"], ruleset, 1, ctypes.byref(rule), 0) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(fd)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 or libc.syscall(_SYS_LANDLOCK["restrict_self"], ruleset, 0) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def _drop_capabilities() -> None:
    """Empties the bounding set (an exec regains nothing) and every capability set."""
    libc = _libc()
    for capability in range(64):  # past the kernel's last capability prctl fails (EINVAL), harmlessly
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    empty = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words
    if libc.syscall(SYS_CAPSET, ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), empty) < 0:
        raise OSError(ctypes.get_errno(), "capset")


def pids_cgroup() -> str | None:
    """A new pids cgroup for one program (root only), or None where there is none to make."""
    if os.geteuid() != 0:
        return None
    for parent in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):  # cgroup v1's pids hierarchy, or v2's root
        if not os.path.exists(os.path.join(parent, "cgroup.procs")):
            continue
        directory = tempfile.mkdtemp(prefix="comppo-sandbox-", dir=parent) if os.access(parent, os.W_OK) else None
        if directory and os.path.exists(os.path.join(directory, "pids.max")):
            return directory
        if directory:
            os.rmdir(directory)
    return None


def _confine(directory: str, limits: dict, abi: int, cgroup: str | None) -> None:
    """The child's side of `run_program` (subprocess's preexec_fn, in a single-threaded worker)."""
    root = os.geteuid() == 0
    if cgroup:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    # A network namespace: root may unshare one; anyone else inside a user namespace.
    _libc().unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET)
    for name, value in [
        ("RLIMIT_CPU", limits["cpu_s"]),
        ("RLIMIT_AS", limits["memory_bytes"]),
        ("RLIMIT_NPROC", limits["processes"]),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_FSIZE", limits["file_bytes"]),
        ("RLIMIT_CORE", 0),
    ]:
        resource.setrlimit(getattr(resource, name), (value, value))
    os.chdir(directory)
    if abi:
        _landlock(abi, directory)
    if root:
        _drop_capabilities()


DEFAULT_LIMITS = dict(
    wall_s=5.0, cpu_s=4, memory_bytes=512 << 20, processes=16, open_files=64, file_bytes=1 << 20, output_chars=2000
)


def run_program(item: list) -> dict:
    """Runs [code, limits] (see DEFAULT_LIMITS) confined; returns {"returncode", "output", "timed_out"}.
    The sandbox's tool, run in a worker process."""
    code, limits = item
    limits = {**DEFAULT_LIMITS, **limits}
    directory, cgroup = tempfile.mkdtemp(prefix="comppo-sandbox-"), pids_cgroup()
    try:
        if cgroup:
            with open(os.path.join(cgroup, "pids.max"), "w") as limit:
                limit.write(str(limits["processes"]))
        abi = landlock_abi()
        process = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=directory,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            preexec_fn=lambda: _confine(directory, limits, abi, cgroup),
        )
        try:
            output, _ = process.communicate(timeout=limits["wall_s"])
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out, output = True, b""
        _kill_all(process.pid, cgroup)  # what it left running, too
        process.wait()
        return {
            "returncode": process.returncode,
            "output": output.decode(errors="replace")[-limits["output_chars"] :],
            "timed_out": timed_out,
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if cgroup:
            os.rmdir(cgroup)


def _kill_all(pid: int, cgroup: str | None) -> None:
    """Kills the program's session and, with a cgroup, every process in it (until it is empty)."""
    with contextlib.suppress(ProcessLookupError):  # the session has already ended
        os.killpg(pid, signal.SIGKILL)
    while cgroup:
        with open(os.path.join(cgroup, "cgroup.procs")) as procs:
            left = [int(line) for line in procs.read().split()]
        if not left:
            return
        for other in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, signal.SIGKILL)
        time.sleep(0.01)


def protections() -> dict[str, object]:
    """Which confinements this machine grants the sandbox (the module docstring's list)."""
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    probe = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({flags}) != 0)"],
        check=False,
    )
    cgroup = pids_cgroup()
    if cgroup:
        os.rmdir(cgroup)
    return {
        "landlock_abi": landlock_abi(),
        "network_namespace": probe.returncode == 0,
        "process_limit": "pids cgroup" if cgroup else "RLIMIT_NPROC" if os.geteuid() != 0 else "none (root)",
    }


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
        self._pool = workers.function_pool(tool, num_workers, timeout_s=self.limits["wall_s"] + 5.0)

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
        output = run["output"].strip()
        if run["returncode"] != 0:
            last = output.splitlines()[-1] if output else f"exit status {run['returncode']}"
            return Reply(self.reply_format.format(output=last), outcome=ERROR)
        return Reply(self.reply_format.format(output=output), outcome=OK)

    def close(self) -> None:
        self._pool.close()
