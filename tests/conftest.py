from __future__ import annotations

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS ``weed mini``) on loopback for the whole session: it
    stores on disk, checks SigV4 credentials and SHA-256 checksums."""
    from trainflow.testing.seaweed import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()
