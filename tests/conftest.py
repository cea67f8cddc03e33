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


PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database on the machine's server (5432, trust), dropped after."""
    import uuid

    import psycopg2

    name = f"tf_test_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(PG_ADMIN)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@pytest.fixture(params=["sqlite", "postgres"])
def state_target(request, tmp_path):
    """trainflow's state database, of each kind (embedded SQLite, distributed PostgreSQL)."""
    if request.param == "sqlite":
        return tmp_path / "state.db"
    return request.getfixturevalue("pg_url")
