"""The bucket tests' Cloud Storage server on 127.0.0.1: launch/local_bucket.py's (fake-gcs-server, in memory,
and the variables pointing every client at it), with a new bucket for each test that asks."""

from __future__ import annotations

import uuid

from launch.local_bucket import LocalStorageServer


class GcsEmulator(LocalStorageServer):
    def bucket(self) -> str:
        """Creates a new empty bucket; returns its name."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.create_bucket(name)
        return name
