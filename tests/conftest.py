from __future__ import annotations

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import pytest  # noqa: E402

# The suite runs on two pytest-xdist workers, a file at a time (scripts/test: -n 2 --dist
# loadfile --no-loadscope-reorder), handed out in collection order (xdist would otherwise
# hand out the files with the most tests first): the longest files go first so that neither
# worker is left with a long one at the end (minutes on a quiet 2-core machine: soak 13,
# chaos 9, distributed stack 7, elastic gangs 5, embedded stack 3).
LONGEST_FIRST = ("e2e/test_soak.py", "e2e/test_chaos.py", "e2e/test_distributed_stack.py",
                 "e2e/test_elastic_gangs.py", "e2e/test_embedded_stack.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within a file and among the rest is kept


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


@pytest.fixture(scope="session")
def soak_bench():
    """``bench/soak.py`` as a module (the 10-minute soak in the suite and the unit tests of
    its verdicts run the benchmark's own code)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "soak.py"
    spec = importlib.util.spec_from_file_location("bench_soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
