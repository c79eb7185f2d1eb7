"""Killable worker processes: a function applied to JSON items with a hard per-item timeout.

A function that can hang or crash (math-verify on a pathological answer, a tool the policy calls,
code the policy wrote) runs in a worker process, which is killed and replaced when an item exceeds
`timeout_s` or kills it; the caller gets a `Result` per item and never hangs. Workers are fresh
interpreters (`python -m comppo_jax.workers module:function`, or a module's own `serve` loop): no
fork of a process running JAX threads, no re-import of the caller's __main__.

What holds:
- A worker that dies costs at most the item it held (a DIED result); it is replaced, and the pool
  goes on. One found dead while idle held nothing: it is replaced before it is given an item.
- Workers run in a session (and process group) of their own, so a signal to the caller's group
  (a terminal's Ctrl-C, `kill -- -PGID`, systemd's or a batch scheduler's stop) reaches the caller
  alone, which finishes its step with every verdict intact.
- Workers die with the pool's process, kill -9 included: each asks the kernel for SIGTERM when its
  parent dies (PR_SET_PDEATHSIG, set in `serve`, which exits if the parent died before that), and
  an idle one also ends at EOF on stdin. SIGTERM raises SystemExit in a worker, so what its
  function holds is released by its `finally` blocks (the sandbox kills its program).
- After a worker exits or is killed, `cleanup(pid)` (the pool's argument) removes what it left
  behind (the sandbox's program, cgroup and mount).

The protocol is JSON lines: the worker answers ["ready"] once its function is imported, then one
["ok", value] or ["error", message] per item on stdin.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, NamedTuple

STARTUP_TIMEOUT_S = 120.0
OK, ERROR, TIMEOUT, DIED = "ok", "error", "timeout", "died"
PARENT_ENV = "COMPPO_PARENT"  # the pid of the starting process (a pool, the experiment runner), checked at start
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Result(NamedTuple):
    status: str  # OK, ERROR (the function raised), TIMEOUT (killed at timeout_s) or DIED
    value: Any  # the function's return value (OK) or what went wrong, in words


class WorkerPool:
    """`num_workers` processes of `command`, each item at most `timeout_s` seconds.

    Use as a context manager or call `close()`. `run(items)` returns a `Result` per item, in order.
    `cleanup(pid)`, if given, is called after each worker has exited, with its pid.
    """

    def __init__(
        self,
        command: Sequence[str],
        num_workers: int = 2,
        timeout_s: float = 5.0,
        env: dict | None = None,
        cleanup: Callable[[int], None] | None = None,
    ):
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"num_workers must be >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self.command, self.timeout_s, self.env, self.cleanup = list(command), timeout_s, env, cleanup
        self._workers: list[subprocess.Popen] = []
        for _ in range(num_workers):
            self._workers.append(self._start())

    def _start(self) -> subprocess.Popen:
        env = {**(os.environ if self.env is None else self.env), PARENT_ENV: str(os.getpid())}
        # A worker never runs JAX on an accelerator; with the platform named, `import comppo_jax` skips
        # the accelerator probe, which imports JAX (seconds and ~150 MB of each worker).
        env["JAX_PLATFORMS"] = "cpu"
        process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # out of reach of signals to the caller's process group
        )
        assert process.stdout is not None
        if (
            not multiprocessing.connection.wait([process.stdout.fileno()], STARTUP_TIMEOUT_S)
            or process.stdout.readline().strip() != '["ready"]'
        ):
            self._stop(process, grace_s=0.0)
            self.close()
            raise RuntimeError(
                f"the worker `{' '.join(self.command)}` did not start within {STARTUP_TIMEOUT_S} s "
                f"(is what it imports installed in {sys.executable}?)"
            )
        return process

    def _stop(self, process: subprocess.Popen, grace_s: float) -> None:
        """Ends `process` (EOF, then SIGKILL after `grace_s`), reaps it and cleans up after it."""
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()  # a worker's loop ends at EOF; nothing is buffered here (`_send`) to fail on a dead one
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
        if self.cleanup is not None:
            self.cleanup(process.pid)

    def _replace(self, index: int, grace_s: float = 0.0) -> None:
        self._stop(self._workers[index], grace_s)
        self._workers[index] = self._start()

    def _output(self, worker: int) -> IO[str]:
        stream = self._workers[worker].stdout
        assert stream is not None
        return stream

    def _send(self, worker: int, item: Any) -> bool:
        """Writes `item` to an idle worker, replacing it first if it died while idle (it held no
        item); False if it died as the item was written."""
        if self._workers[worker].poll() is not None:
            self._replace(worker)
        stdin = self._workers[worker].stdin
        assert stdin is not None
        data = (json.dumps(item) + "\n").encode()
        try:  # unbuffered: a line a dead worker never read stays in no buffer to fail again at close
            while data:
                data = data[os.write(stdin.fileno(), data) :]
        except BrokenPipeError:  # it died since it was polled
            return False
        return True

    def run(self, items: Sequence[Any]) -> list[Result]:
        results: list[Result | None] = [None] * len(items)
        pending = list(range(len(items)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (item, start time)
        while pending or busy:
            for worker in range(len(self._workers)):
                if worker not in busy and pending:
                    item = pending.pop()
                    if self._send(worker, items[item]):
                        busy[worker] = (item, time.monotonic())
                    else:
                        results[item] = self._died(worker)
            if not busy:
                continue
            streams = {self._output(w).fileno(): w for w in busy}
            deadline = min(start for _, start in busy.values()) + self.timeout_s
            for ready in multiprocessing.connection.wait(list(streams), max(0.0, deadline - time.monotonic())):
                worker = streams[ready]  # type: ignore[index]  # a file descriptor, as given
                item, _ = busy.pop(worker)
                line = self._output(worker).readline()
                results[item] = Result(*json.loads(line)) if line else self._died(worker)
            now = time.monotonic()
            for worker, (item, start) in list(busy.items()):
                if now - start >= self.timeout_s:
                    results[item] = Result(TIMEOUT, f"no answer within {self.timeout_s} s")
                    del busy[worker]
                    self._replace(worker)
        return [r for r in results if r is not None]

    def _died(self, worker: int) -> Result:
        """The result of the item a worker died on (out of memory, killed); the worker is replaced."""
        process = self._workers[worker]
        self._replace(worker, grace_s=1.0)  # its stdout is closed: it is exiting, or made to
        return Result(DIED, f"the worker exited with status {process.returncode}")

    def close(self) -> None:
        for process in self._workers:
            self._stop(process, grace_s=2.0)  # the worker's loop ends at EOF
        self._workers = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def function_pool(
    function: str,
    num_workers: int = 2,
    timeout_s: float = 5.0,
    env: dict | None = None,
    cleanup: Callable[[int], None] | None = None,
) -> WorkerPool:
    """A pool applying `function` ("module:name", importable in a fresh interpreter) to each item."""
    return WorkerPool([sys.executable, "-m", "comppo_jax.workers", function], num_workers, timeout_s, env, cleanup)


def die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux; the parent's thread that started it, in
    fact); exits at once if the parent named by PARENT_ENV is already gone."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    parent = os.environ.get(PARENT_ENV)
    if parent is not None and os.getppid() != int(parent):
        sys.exit(f"the parent {parent} exited before this process started")


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the function, running its `finally` blocks


def serve(function: Callable[[Any], Any]) -> None:
    """The worker's side: answers ["ready"], then `function(item)` per JSON line on stdin. What the
    function prints goes to stderr: stdout carries the protocol alone."""
    die_with_parent()
    signal.signal(signal.SIGTERM, _terminated)
    protocol, sys.stdout = sys.stdout, sys.stderr
    protocol.write(json.dumps(["ready"]) + "\n")
    protocol.flush()
    for line in sys.stdin:
        try:
            reply = [OK, function(json.loads(line))]
        except Exception as error:  # reported to the parent, which counts it
            reply = [ERROR, f"{type(error).__name__}: {error}"]
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


def load_function(spec: str) -> Callable[[Any], Any]:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"a worker's function is 'module:name', got {spec!r}")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    serve(load_function(sys.argv[1]))
