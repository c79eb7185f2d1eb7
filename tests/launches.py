"""Launches of a script that skip what a fresh interpreter pays before the script's own work.

A tiny run launched in a fresh interpreter spends most of its time before its first step: the interpreter, the
imports, JAX's backend, and tracing, lowering and loading from the compilation cache each of its programs (a
2-device run of conftest's SMALL_TRAIN_RUN with the compilation cache warm: 11 s; as a warm process's next
launch: 4 s; this 2-core machine, `launch_script(..., fresh=True)` against `launch_script(...)`, 2026-11-30).
Two kinds of process take launches instead, one at a time, as JSON lines on their stdin (the script, its args,
working directory, and the files for its stdout and stderr), answering each with a JSON line:

- quick (`serve_forks`): has imported what the launchers import, never starts a JAX backend (JAX warns on a
  fork after one), and forks a child per launch. For launches that end on their flags or config, and
  launch/report.py: a fork instead of an interpreter and the imports.
- warm (`serve_warm`): has also started JAX's backend with the devices its environment asks for, and runs
  each launch in itself, keeping what JAX traced and compiled: a run of the shapes of an earlier one reuses
  its programs. What a launch changes in the process is put back before the next: the environment, the
  working directory, absl's flags and verbosity, signal handlers, warning filters, `sys.stdout`, `sys.stderr`
  and `sys.unraisablehook`. A launch that fails (status other than 0), that leaves a thread running, or that
  ends the process itself (os._exit, a signal: its status is then the process's) is the process's last:
  whatever a failure left half done reaches no other launch.

Either runs the script as `python <script> <args>` would (`run_as_main`): `__main__`, its argv, sys.path[0],
its working directory, file descriptors 1 and 2 its own, stdin /dev/null, the functions it registered with
`atexit` run as it ends, its exit status (SystemExit's, or 1 after a traceback for anything else raised).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def run_as_main(request: dict) -> int:
    """Runs `request`'s script as the interpreter would (module docstring); returns its exit status, with this
    process's file descriptors 0-2, argv, working directory and sys.path[0] as they were."""
    import runpy
    import traceback

    kept = {fd: os.dup(fd) for fd in (0, 1, 2)}
    argv, cwd, path0, register = sys.argv, os.getcwd(), sys.path[0], atexit.register
    for fd, path in ((1, request["stdout"]), (2, request["stderr"]), (0, os.devnull)):
        opened = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC if fd else os.O_RDONLY)
        os.dup2(opened, fd)
        os.close(opened)
    exits = []
    atexit.register = lambda fn, *args, **kwargs: (exits.append((fn, args, kwargs)), fn)[1]
    os.chdir(request["cwd"])
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exit:  # as the interpreter reports it
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    for fn, args, kwargs in reversed(exits):  # what the interpreter would run at its exit
        try:
            fn(*args, **kwargs)
        except BaseException:
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, saved in kept.items():
        os.dup2(saved, fd)
        os.close(saved)
    sys.argv, sys.path[0], atexit.register = argv, path0, register
    os.chdir(cwd)
    return code


def _answers():
    """Where the process answers (its stdout as started); file descriptor 1 goes to its stderr's log. Called
    before the first launch: weakref.finalize registers its exit function with atexit on its first use, which
    must not be a launch's (run_as_main runs a launch's atexit functions as it ends)."""
    import weakref

    weakref.finalize(_answers, int)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    return answers


def serve_forks() -> None:
    """The quick process (module docstring); a child past the launch's timeout_s is SIGKILLed."""
    import signal
    import time

    import matplotlib  # its plots, drawn as comppo_jax.runs.outputs draws them

    import comppo_jax.cli  # noqa: F401  (the launchers' imports)
    import comppo_jax.eval.restore  # noqa: F401
    import comppo_jax.eval.run_report  # noqa: F401  (launch/report.py's)
    import comppo_jax.train.validation  # noqa: F401

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    answers = _answers()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_as_main(request)
            finally:
                os._exit(code)
        deadline = time.monotonic() + request["timeout_s"]
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                status = os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status[1]), "last": False}), file=answers, flush=True)


def serve_warm() -> None:
    """The warm process (module docstring)."""
    import gc
    import logging as std_logging
    import signal
    import threading
    import time
    import warnings

    import jax
    from absl import flags, logging

    jax.devices()  # the backend, with the devices this environment asks for
    import comppo_jax.cli  # noqa: F401  (the launchers' imports)
    import comppo_jax.eval.restore  # noqa: F401
    import comppo_jax.train.loop  # noqa: F401
    import comppo_jax.train.validation  # noqa: F401

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
    base_flags, base_env, base_threads = set(flags.FLAGS), dict(os.environ), set(threading.enumerate())
    base_streams, base_hook, base_warnings = (sys.stdout, sys.stderr), sys.unraisablehook, list(warnings.filters)
    base_handlers = {signum: signal.getsignal(signum) for signum in signals}
    absl_logger = std_logging.getLogger("absl")
    base_log_filters = list(absl_logger.filters)  # comppo_jax.cli adds one unless --verbosity is given
    answers = _answers()
    for line in sys.stdin:
        verbosity = logging.get_verbosity()
        code = run_as_main(json.loads(line))
        (sys.stdout, sys.stderr), sys.unraisablehook, warnings.filters[:] = base_streams, base_hook, base_warnings
        warnings._filters_mutated()  # type: ignore[attr-defined]  (what warnings.filterwarnings calls)
        absl_logger.filters[:] = base_log_filters
        signal.alarm(0)
        for signum, handler in base_handlers.items():
            signal.signal(signum, handler)
        os.environ.clear()
        os.environ.update(base_env)
        logging.set_verbosity(verbosity)
        for name in set(flags.FLAGS) - base_flags:
            delattr(flags.FLAGS, name)
        flags.FLAGS.unparse_flags()
        gc.collect()
        deadline = time.monotonic() + 5
        while (left := set(threading.enumerate()) - base_threads) and time.monotonic() < deadline:
            time.sleep(0.05)
        last = code != 0 or bool(left)
        print(json.dumps({"returncode": code, "last": last}), file=answers, flush=True)
        if last:
            return


class Server:
    """A quick or warm process (`serve`: "forks" or "warm") started with `env` in `cwd`."""

    def __init__(self, serve: str, env: dict, cwd: str):
        self.busy = threading.Lock()  # held by the thread whose launch it runs
        self.log = tempfile.TemporaryFile(mode="w+")  # what it prints itself: shown only if it fails to start
        # sys.path[0] (-c's working directory) is this folder while this module loads (before the package: tests/
        # holds folders named as its packages), the repository while the process starts, and each launch's
        # script's folder during it.
        program = (
            f"import sys; sys.path[0] = {HERE!r}; import launches; sys.path[0] = {os.path.dirname(HERE)!r}; "
            f"launches.serve_{serve}()"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", program],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        if self.process.stdout.readline() != '{"ready": true}\n':
            self.process.kill()
            self.process.wait()
            self.log.seek(0)
            printed = self.log.read()[-3000:]
            self.stop()
            raise RuntimeError(f"the {serve} launch process did not start:\n{printed}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.log):
            stream.close()

    def launch(self, script: str, args, cwd: str, timeout_s: float) -> subprocess.CompletedProcess:
        """`python <script> <args>` in `cwd` (module docstring). Past `timeout_s` a quick process's child is
        SIGKILLed (status -9); a warm process is stopped 60 s later and the launch raises TimeoutExpired, as
        subprocess.run's would."""
        import selectors

        command = [script, *args]
        with tempfile.TemporaryDirectory() as scratch:
            outputs = {name: os.path.join(scratch, name) for name in ("stdout", "stderr")}
            request = dict(script=script, args=list(args), cwd=str(cwd), timeout_s=timeout_s, **outputs)
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                with selectors.DefaultSelector() as selector:
                    selector.register(self.process.stdout, selectors.EVENT_READ)
                    if not selector.select(timeout_s + 60):  # a quick process stops its child at timeout_s itself
                        raise subprocess.TimeoutExpired(command, timeout_s)
                line = self.process.stdout.readline()
                if line:
                    answer = json.loads(line)
                    if answer["last"]:
                        self.process.wait(timeout=60)  # threads the launch left may hold its exit
                    returncode = answer["returncode"]
                else:  # it ended the process: its status is the launch's
                    returncode = self.process.wait(timeout=60)
            except BaseException:  # a timeout, or this thread interrupted: no later launch may read this answer
                self.stop()
                raise
            stdout, stderr = (
                pathlib.Path(outputs[name]).read_text() if os.path.exists(outputs[name]) else ""
                for name in ("stdout", "stderr")
            )
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)


# (kind, environment as sorted items) -> its process. At most MAX_WARM warm ones are kept (each holds its
# compiled programs: a GB or two): the idle one used longest ago is stopped for a new one.
_servers: dict[tuple, Server] = {}
_servers_lock = threading.Lock()
MAX_WARM = 2


def launch(
    serve: str, script: str, args, *, env: dict, cwd: str, timeout_s: float
) -> subprocess.CompletedProcess | None:
    """`python <script> <args>` with `env` in `cwd`, in the `serve` process ("forks" or "warm") for `env`, started
    if there is none. None while that process runs another thread's launch (launches that must meet run at once):
    the caller runs this one in a fresh interpreter."""
    key = (serve, tuple(sorted(env.items())))
    with _servers_lock:
        for dead in [k for k, server in _servers.items() if not server.alive()]:
            _servers.pop(dead).stop()
        held = _servers.pop(key, None)
        if held is not None:
            _servers[key] = held  # the newest used last
            if not held.busy.acquire(blocking=False):
                return None
        else:
            idle = [k for k, server in _servers.items() if k[0] == "warm" and not server.busy.locked()]
            while serve == "warm" and idle and sum(kind == "warm" for kind, _ in _servers) >= MAX_WARM:
                _servers.pop(idle.pop(0)).stop()
            held = _servers[key] = Server(serve, env, cwd)
            held.busy.acquire()
    try:
        return held.launch(script, args, cwd, timeout_s)
    finally:
        held.busy.release()


@atexit.register
def stop_all() -> None:
    while _servers:
        _servers.popitem()[1].stop()
