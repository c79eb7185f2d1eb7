"""Killable worker processes: a function applied to JSON items with a hard per-item timeout.

A function that can hang or crash (math-verify on a pathological answer, a tool the policy calls,
code the policy wrote) runs in a worker process, which is killed and replaced when an item exceeds
`timeout_s` or kills it; the caller gets a `Result` per item and never hangs. Workers are fresh
interpreters (`python -m comppo_jax.workers module:function`, or a module's own `serve` loop): no
fork of a process running JAX threads, no re-import of the caller's __main__.

The protocol is JSON lines: the worker answers ["ready"] once its function is imported, then one
["ok", value] or ["error", message] per item on stdin.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing.connection
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, NamedTuple

STARTUP_TIMEOUT_S = 120.0
OK, ERROR, TIMEOUT, DIED = "ok", "error", "timeout", "died"


class Result(NamedTuple):
    status: str  # OK, ERROR (the function raised), TIMEOUT (killed at timeout_s) or DIED
    value: Any  # the function's return value (OK) or what went wrong, in words


class WorkerPool:
    """`num_workers` processes of `command`, each item at most `timeout_s` seconds.

    Use as a context manager or call `close()`. `run(items)` returns a `Result` per item, in order.
    """

    def __init__(self, command: Sequence[str], num_workers: int = 2, timeout_s: float = 5.0, env: dict | None = None):
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"num_workers must be >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self.command, self.timeout_s, self.env = list(command), timeout_s, env
        self._workers: list[subprocess.Popen] = []
        for _ in range(num_workers):
            self._workers.append(self._start())

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=self.env
        )
        assert process.stdout is not None
        if (
            not multiprocessing.connection.wait([process.stdout.fileno()], STARTUP_TIMEOUT_S)
            or process.stdout.readline().strip() != '["ready"]'
        ):
            process.kill()
            process.wait()
            self.close()
            raise RuntimeError(
                f"the worker `{' '.join(self.command)}` did not start within {STARTUP_TIMEOUT_S} s "
                f"(is what it imports installed in {sys.executable}?)"
            )
        return process

    def _replace(self, index: int) -> None:
        process = self._workers[index]
        process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        self._workers[index] = self._start()

    def _output(self, worker: int) -> IO[str]:
        stream = self._workers[worker].stdout
        assert stream is not None
        return stream

    def run(self, items: Sequence[Any]) -> list[Result]:
        results: list[Result | None] = [None] * len(items)
        pending = list(range(len(items)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (item, start time)
        while pending or busy:
            for worker, process in enumerate(self._workers):
                if worker not in busy and pending:
                    item = pending.pop()
                    assert process.stdin is not None
                    try:
                        process.stdin.write(json.dumps(items[item]) + "\n")
                        process.stdin.flush()
                    except BrokenPipeError:  # died between items: counted as this item's
                        results[item] = Result(DIED, "the worker had exited")
                        self._replace(worker)
                        continue
                    busy[worker] = (item, time.monotonic())
            if not busy:
                continue
            streams = {self._output(w).fileno(): w for w in busy}
            deadline = min(start for _, start in busy.values()) + self.timeout_s
            for ready in multiprocessing.connection.wait(list(streams), max(0.0, deadline - time.monotonic())):
                worker = streams[ready]  # type: ignore[index]  # a file descriptor, as given
                item, _ = busy.pop(worker)
                line = self._output(worker).readline()
                if line:
                    results[item] = Result(*json.loads(line))
                else:  # the worker died (out of memory, killed)
                    results[item] = Result(DIED, f"the worker exited with status {self._workers[worker].wait()}")
                    self._replace(worker)
            now = time.monotonic()
            for worker, (item, start) in list(busy.items()):
                if now - start >= self.timeout_s:
                    results[item] = Result(TIMEOUT, f"no answer within {self.timeout_s} s")
                    del busy[worker]
                    self._replace(worker)
        return [r for r in results if r is not None]

    def close(self) -> None:
        for process in self._workers:
            if process.stdin is not None:
                process.stdin.close()  # the worker's loop ends at EOF
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self._workers = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def function_pool(function: str, num_workers: int = 2, timeout_s: float = 5.0, env: dict | None = None) -> WorkerPool:
    """A pool applying `function` ("module:name", importable in a fresh interpreter) to each item."""
    return WorkerPool([sys.executable, "-m", "comppo_jax.workers", function], num_workers, timeout_s, env)


def serve(function: Callable[[Any], Any]) -> None:
    """The worker's side: answers ["ready"], then `function(item)` per JSON line on stdin. What the
    function prints goes to stderr: stdout carries the protocol alone."""
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
