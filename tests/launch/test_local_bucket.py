"""launch/local_bucket.py: the printed variables are all a new user needs for a gs:// run directory on one
machine: our files (gcsfs) and Orbax's checkpoints (tensorstore) reach the local server, and nothing waits on
the real Cloud Storage or a metadata server."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from conftest import CPU_ONLY_ENV, REPO

CLIENTS = """
import jax.numpy as jnp, orbax.checkpoint as ocp
from comppo_jax import storage
storage.make_dirs("gs://runs/tiny")
storage.write_text("gs://runs/tiny/config.json", "{}")
with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save("gs://runs/tiny/reference", {"w": jnp.arange(3.0)})
with ocp.StandardCheckpointer() as checkpointer:
    print(storage.read_text("gs://runs/tiny/config.json"), checkpointer.restore("gs://runs/tiny/reference")["w"])
"""


def test_the_printed_variables_take_our_files_and_orbax_to_the_local_bucket():
    printed = subprocess.run(
        [sys.executable, "launch/local_bucket.py", "--bucket=runs", "--print_env"],
        cwd=REPO,
        env=CPU_ONLY_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.returncode == 0, printed.stderr
    exports = [shlex.split(line)[1] for line in printed.stdout.splitlines() if line.startswith("export ")]
    env = dict(exported.split("=", 1) for exported in exports)
    server_pid = int(printed.stdout.rsplit("kill ", 1)[1])
    try:
        # Only the printed variables: none of the test session's own (its emulator fixture's) leak in.
        clean = {name: value for name, value in CPU_ONLY_ENV.items() if "GCS" not in name and "GCE" not in name}
        used = subprocess.run(
            [sys.executable, "-c", CLIENTS], cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=120
        )
        assert used.returncode == 0, used.stderr[-3000:]
        assert used.stdout.strip() == "{} [0. 1. 2.]"
    finally:
        os.kill(server_pid, 15)
