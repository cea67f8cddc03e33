"""The distributed profile on this machine's real services: Airflow's metadata on
PostgreSQL, the CeleryExecutor with a Redis broker, trainflow's own state (allocator, host
registry, rendezvous) in a PostgreSQL database of its own, three Celery workers as three
"hosts" (two serve the cpu queue with one slot each, one serves the default queue for the
control tasks), and checkpoints published to a real S3 server. The two node tasks of a
run land on the two cpu hosts; the run completes and its checkpoint verifies in S3.

Not covered here (the scale-out issue keeps them open): hosts in network namespaces of
their own, and killing a worker mid-run."""

from __future__ import annotations

import uuid

import pytest

from trainflow.checkpoint.s3 import S3Store
from trainflow.cluster.allocator import Allocator
from trainflow.launch.local import free_port
from trainflow.stack import EmbeddedStack

pytestmark = pytest.mark.e2e
DAG = "train_digits"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_DB = 11


def _database(name: str):
    import psycopg2

    con = psycopg2.connect(PG_ADMIN)
    con.autocommit = True
    con.cursor().execute(f"CREATE DATABASE {name}")
    return con


@pytest.fixture(scope="module")
def dist_stack(tmp_path_factory, s3_server):
    import redis

    tag = uuid.uuid4().hex[:10]
    meta, state = f"tf_airflow_{tag}", f"tf_state_{tag}"
    admin = _database(meta)
    admin.cursor().execute(f"CREATE DATABASE {state}")
    redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB).flushdb()
    root = tmp_path_factory.mktemp("dist")
    stack = EmbeddedStack(
        home=root / "airflow", trainflow_home=root / "trainflow", port=free_port(),
        database_url=f"postgresql+psycopg2://postgres@127.0.0.1:5432/{meta}",
        broker_url=f"redis://127.0.0.1:6379/{REDIS_DB}",
        state_db=f"postgresql://postgres@127.0.0.1:5432/{state}",
        workers=({"name": "host-a", "queues": "cpu", "concurrency": 1},
                 {"name": "host-b", "queues": "cpu", "concurrency": 1},
                 {"name": "control", "queues": "default", "concurrency": 4}),
        extra_env={"AIRFLOW_CONN_TRAINFLOW_S3": s3_server.airflow_connection()})
    try:
        stack.up(timeout=300)
        yield stack
    finally:
        stack.stop()
        for db in (meta, state):
            admin.cursor().execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        admin.close()
        redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB).flushdb()


def test_a_gang_runs_across_celery_hosts_on_postgres_and_redis(dist_stack, s3_server, run_to_end):
    client = dist_stack.client()
    conf = {"steps": 200, "checkpoint_interval": 100, "keep_last": 2, "tenant": "dist",
            "store_uri": f"s3://{s3_server.bucket}/dist"}
    run_id = "dist-digits-1"
    run_to_end(client, DAG, conf, run_id, timeout=900)
    tis = client.task_instances(DAG, run_id)
    queues = {(t["task_id"], t["map_index"]): t["queue"] for t in tis}
    assert queues[("shard_train", 0)] == queues[("shard_train", 1)] == "cpu"
    assert queues[("provision", -1)] == queues[("evaluate", -1)] == "default"
    hosts = {client.xcom(DAG, run_id, "shard_train", map_index=i)["host"] for i in (0, 1)}
    assert hosts == {"host-a", "host-b"}  # one node per cpu host
    metrics = client.xcom(DAG, run_id, "evaluate", "metrics")
    assert metrics["step"] == 200 and metrics["accuracy"] > 0.9
    pointer = client.xcom(DAG, run_id, "checkpoint_sync", "checkpoint")
    assert pointer["uri"].startswith(f"s3://{s3_server.bucket}/dist/dist/{DAG}/{run_id}/step-00000200")
    store = S3Store(s3_server.client(), s3_server.bucket, "dist", tenant="dist", dag_id=DAG, run_id=run_id)
    assert store.steps() == [200]
    # trainflow's state lived in its own PostgreSQL database, and the lease is released.
    allocator = Allocator(dist_stack.state_db)
    assert allocator.leases() == []
    plan = client.xcom(DAG, run_id, "provision", "plan")
    assert plan["rendezvous"]["endpoint"] == dist_stack.state_db
