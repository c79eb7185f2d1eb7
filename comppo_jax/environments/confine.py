"""The sandbox's launcher: confines its own process, then becomes the untrusted program.

Run as a script in a fresh interpreter (`python -I -S confine.py SPEC`, started by
comppo_jax.environments.sandbox), so it is single-threaded and imports only the standard
library. SPEC (JSON) names the program's code, its directory, its limits, its pids cgroup and its
worker. In order it asks for SIGKILL when its worker dies (PR_SET_PDEATHSIG: the program never
outlives it, even unsupervised), joins the cgroup, unshares a network namespace, sets the resource
limits, moves into the directory, restricts itself with Landlock, drops every capability, installs
a seccomp filter, and execs `python -I -S -c CODE` (the restrictions pass to it and its
children). A step that fails ends it with EXIT_UNCONFINED before the program runs, its reason on
stdout.

The seccomp filter refuses what Landlock does not cover: changing a file's mode, owner, times or
extended attributes, truncating by path, making device nodes, UNIX-domain, vsock and netlink
sockets (a path socket reaches the host's daemons and a vsock one the hypervisor's, whatever the
network namespace; netlink speaks to the kernel), and the calls that change namespaces, mounts,
keys or the kernel (ptrace, mount, unshare, bpf, reboot, module loading, ...).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

EXIT_UNCONFINED = 125
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 22, 24, 38
SIGKILL = 9
SECCOMP_MODE_FILTER = 2
CAPABILITY_VERSION_3 = 0x20080522
_LANDLOCK = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # the same on x86_64 and aarch64
_FS_READ = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}  # 5+: (1 << 16) - 1
_FILE_RIGHTS = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # what a rule on a file (not a directory) may grant
_NET_ALL, _SCOPE_ALL = 1 | 2, 1 | 2  # BIND_TCP | CONNECT_TCP; ABSTRACT_UNIX_SOCKET | SIGNAL
EPERM, EACCES = 1, 13
REFUSED_FAMILIES = (1, 16, 40)  # AF_UNIX, AF_NETLINK, AF_VSOCK
# Per architecture: (audit arch, capset, socket, the refused calls).
_REFUSED = (
    "fchmod fchmodat fchmodat2 fchown fchownat utimensat setxattr lsetxattr fsetxattr removexattr lremovexattr "
    "fremovexattr truncate mknodat ptrace mount umount2 pivot_root chroot unshare setns kexec_load reboot "
    "init_module finit_module delete_module bpf perf_event_open keyctl add_key request_key io_uring_setup "
    "userfaultfd personality"
).split()
_X86_64 = dict(
    chmod=90, fchmod=91, fchmodat=268, fchmodat2=452, chown=92, fchown=93, lchown=94, fchownat=260, utime=132,
    utimes=235, futimesat=261, utimensat=280, setxattr=188, lsetxattr=189, fsetxattr=190, removexattr=197,
    lremovexattr=198, fremovexattr=199, truncate=76, mknod=133, mknodat=259, ptrace=101, mount=165, umount2=166,
    pivot_root=155, chroot=161, unshare=272, setns=308, kexec_load=246, reboot=169, init_module=175,
    finit_module=313, delete_module=176, bpf=321, perf_event_open=298, keyctl=250, add_key=248, request_key=249,
    io_uring_setup=425, userfaultfd=323, personality=135, capset=126, socket=41,
)  # fmt: skip
_AARCH64 = dict(
    fchmod=52, fchmodat=53, fchmodat2=452, fchown=55, fchownat=54, utimensat=88, setxattr=5, lsetxattr=6,
    fsetxattr=7, removexattr=14, lremovexattr=15, fremovexattr=16, truncate=45, mknodat=33, ptrace=117, mount=40,
    umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268, kexec_load=104, reboot=142, init_module=105,
    finit_module=273, delete_module=106, bpf=280, perf_event_open=241, keyctl=219, add_key=217, request_key=218,
    io_uring_setup=425, userfaultfd=282, personality=92, capset=91, socket=198,
)  # fmt: skip
ARCHES = {"x86_64": (0xC000003E, _X86_64, ("chmod", "chown", "lchown", "utime", "utimes", "futimesat", "mknod")),
          "aarch64": (0xC00000B7, _AARCH64, ())}  # fmt: skip


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 without Landlock."""
    if not sys.platform.startswith("linux"):
        return 0
    return max(int(_libc().syscall(_LANDLOCK["create_ruleset"], None, 0, 1)), 0)  # LANDLOCK_CREATE_RULESET_VERSION


def readable_roots() -> list[str]:
    """What a sandboxed interpreter may read: its installation and the system's libraries."""
    roots = [sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    roots += ["/usr", "/lib", "/lib64", "/etc/ld.so.cache"]
    return sorted({r for r in roots if os.path.exists(r)})


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(abi: int, writable: str) -> None:
    """Reading `readable_roots`, writing `writable`, nothing else; no TCP (ABI 4+), no signals or abstract
    sockets outside this process's domain (ABI 6+)."""
    libc = _libc()
    handled = _FS_BY_ABI.get(abi, (1 << 16) - 1)
    attr = _RulesetAttr(handled, _NET_ALL if abi >= 4 else 0, _SCOPE_ALL if abi >= 6 else 0)
    ruleset = libc.syscall(_LANDLOCK["create_ruleset"], ctypes.byref(attr), 8 if abi < 4 else 16 if abi < 6 else 24, 0)
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    for path, access in [(root, _FS_READ) for root in readable_roots()] + [(writable, handled)]:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneathAttr((access if os.path.isdir(path) else access & _FILE_RIGHTS) & handled, fd)
        if libc.syscall(_LANDLOCK["add_rule"], ruleset, 1, ctypes.byref(rule), 0) < 0:
            raise _fail(f"landlock_add_rule {path}")
        os.close(fd)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 or libc.syscall(_LANDLOCK["restrict_self"], ruleset, 0) < 0:
        raise _fail("landlock_restrict_self")
    os.close(ruleset)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def drop_capabilities() -> None:
    """Empties the bounding set (an exec regains nothing) and every capability set."""
    libc = _libc()
    for capability in range(64):  # past the kernel's last capability prctl fails (EINVAL), harmlessly
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    empty = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words
    if (
        libc.syscall(ARCHES[os.uname().machine][1]["capset"], ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), empty)
        < 0
    ):
        raise _fail("capset")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter (module docstring) as classic BPF (code, jt, jf, k) for `machine`: another architecture's
    calls are killed; x32 calls (x86_64) refused."""
    load, jump_equal, jump_at_least, ret = 0x20, 0x15, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    refuse = lambda errno: (ret, 0, 0, 0x00050000 | errno)
    arch, numbers, legacy = ARCHES[machine]
    program = [(load, 0, 0, 4), (jump_equal, 1, 0, arch), (ret, 0, 0, kill), (load, 0, 0, 0)]
    if machine == "x86_64":
        program += [(jump_at_least, 0, 1, 0x40000000), refuse(EPERM)]
    for name in _REFUSED + list(legacy):
        program += [(jump_equal, 0, 1, numbers[name]), refuse(EPERM)]
    # socket(family, ...) of a refused family: args[0]'s low word is at offset 16 (little-endian seccomp_data)
    program += [(jump_equal, 0, 1 + 2 * len(REFUSED_FAMILIES), numbers["socket"]), (load, 0, 0, 16)]
    for family in REFUSED_FAMILIES:
        program += [(jump_equal, 0, 1, family), refuse(EACCES)]
    return program + [(ret, 0, 0, allow)]


def seccomp() -> None:
    instructions = seccomp_program(os.uname().machine)
    table = (_SockFilter * len(instructions))(*(_SockFilter(*i) for i in instructions))
    program = _SockFprog(len(instructions), table)
    libc = _libc()
    if (
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0
        or libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) < 0
    ):
        raise _fail("seccomp")


def die_with(worker: int) -> None:
    """SIGKILL to this process (and the program it execs) when `worker`, its parent, dies."""
    if _libc().prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0:
        raise _fail("prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != worker:
        raise OSError(f"its worker {worker} exited before the program started")


def confine(directory: str, limits: dict, cgroup: str | None, worker: int) -> None:
    """Every step of the module docstring but the exec, on this process."""
    die_with(worker)
    root = os.geteuid() == 0
    if cgroup:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    if _libc().unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise _fail("unshare (a network namespace)")
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
    landlock(landlock_abi(), directory)
    if root:
        drop_capabilities()
    seccomp()


def main(spec: dict) -> None:
    try:
        confine(spec["directory"], spec["limits"], spec["cgroup"], spec["worker"])
    except OSError as error:
        print(f"sandbox: {error}", flush=True)
        os._exit(EXIT_UNCONFINED)
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", spec["code"]])


if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    if arguments.get("probe") == "seccomp":  # whether this machine takes the filter (sandbox.protections)
        try:
            seccomp()
        except OSError:
            sys.exit(1)
        sys.exit(0)
    main(arguments)
