"""Run a launch/ entry point as N `jax.distributed` processes on this machine, as on a pod.

    python launch/local_cluster.py --processes=2 --devices_per_process=4 -- \
        launch/train.py --config=configs/tiny.py --config.output_dir=runs/tiny_2proc

Each process gets `devices_per_process` fake CPU devices (XLA_FLAGS
--xla_force_host_platform_device_count) and the flags that join it to the others
(`--config.mesh.distributed=True --config.mesh.coordinator_address=127.0.0.1:<port>
--config.mesh.num_processes=N --config.mesh.process_id=i`), so the mesh spans every process's
devices and collectives run over gloo, as a multi-host TPU slice runs them over ICI/DCN. Their
output is streamed with a `[p<i>]` prefix. SIGTERM / SIGINT are forwarded to every process (a
preemption of the whole slice); the exit status is the first non-zero one, else 0. If one process
dies, the others are stopped after `--grace_s` seconds (they would wait on it forever).

A collective that waits longer than `--collective_timeout_s` fails with gloo's "Timed out waiting"
error instead of waiting for XLA's default 30 minutes (passed on as `--config.mesh.collective_timeout_s`,
which processes started without this launcher take too). XLA:CPU over gloo can leave a collective
waiting for good when a program with a cross-process all-reduce runs back to back on several
devices per process (tests/launch/back_to_back_all_reduce.py; TPU collectives do not go through
gloo); a training run meets that rarely, and should then end as any crash does, to be resumed from
its newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags

from comppo_jax import cli

_PROCESSES = flags.DEFINE_integer("processes", 2, "How many jax.distributed processes.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "Fake CPU devices per process.")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1 (0: a free one).")
_GRACE = flags.DEFINE_float("grace_s", 30.0, "Seconds the others get to finish after one process fails.")
_COLLECTIVE_TIMEOUT = flags.DEFINE_integer(
    "collective_timeout_s", 300, "Seconds a gloo collective waits for its peers before it fails."
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_command(
    command: list[str], process_id: int, processes: int, port: int, collective_timeout_s: int
) -> list[str]:
    """`command` (a launch/ script and its flags) as process `process_id` of `processes`."""
    return [
        sys.executable,
        *command,
        "--config.mesh.distributed=True",
        f"--config.mesh.coordinator_address=127.0.0.1:{port}",
        f"--config.mesh.num_processes={processes}",
        f"--config.mesh.process_id={process_id}",
        f"--config.mesh.collective_timeout_s={collective_timeout_s}",
    ]


def process_env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return env


def _stream(process: subprocess.Popen, prefix: str) -> None:
    for line in process.stdout:
        sys.stdout.write(f"{prefix}{line}")
        sys.stdout.flush()


def main(argv):
    command = argv[1:]
    if not command:
        raise ValueError("no command: pass the entry point after --, e.g. -- launch/train.py --config=configs/tiny.py")
    port = _PORT.value or free_port()
    env = process_env(_DEVICES.value)
    processes = [
        subprocess.Popen(
            process_command(command, i, _PROCESSES.value, port, _COLLECTIVE_TIMEOUT.value),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        for i in range(_PROCESSES.value)
    ]
    streams = [threading.Thread(target=_stream, args=(p, f"[p{i}] "), daemon=True) for i, p in enumerate(processes)]
    for stream in streams:
        stream.start()

    def forward(signum, frame):
        del frame
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed_at = None
    while any(p.poll() is None for p in processes):
        if failed_at is None and any(p.poll() not in (None, 0) for p in processes):
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > _GRACE.value:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.1)
    for stream in streams:
        stream.join()
    codes = [p.returncode for p in processes]
    sys.exit(next((code for code in codes if code), 0))


if __name__ == "__main__":
    cli.run(main)
