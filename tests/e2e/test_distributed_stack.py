"""The distributed profile on this machine's real services: Airflow's metadata on
PostgreSQL, the CeleryExecutor with a Redis broker, trainflow's own state (allocator, host
registry, rendezvous) in a PostgreSQL database of its own, three Celery workers as three
"hosts" (two serve the cpu queue with one slot each, one serves the default queue for the
control tasks), and checkpoints published to a real S3 server. The two node tasks of a
run land on the two cpu hosts; the run completes and its checkpoint verifies in S3.

The broker is a Redis server of the test's own (append-only file on, as a production broker
runs), so the second test can restart it while a gang trains: the run still completes.

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


class RedisServer:
    """A private ``redis-server`` on a free loopback port, restartable on the same port and
    data directory (append-only file: queued messages survive the restart)."""

    def __init__(self, root) -> None:
        self.root, self.port = root, free_port()
        self.proc = None

    def start(self) -> "RedisServer":
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--dir", str(self.root), "--appendonly", "yes", "--save", ""],
                                     stdout=open(self.root / "redis.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=self.port).ping()
                return self
            except redis.exceptions.ConnectionError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start: {(self.root / 'redis.log').read_text()[-500:]}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _database(name: str):
    import psycopg2

    con = psycopg2.connect(PG_ADMIN)
    con.autocommit = True
    con.cursor().execute(f"CREATE DATABASE {name}")
    return con


@pytest.fixture(scope="module")
def dist_stack(tmp_path_factory, s3_server):
    tag = uuid.uuid4().hex[:10]
    meta, state = f"tf_airflow_{tag}", f"tf_state_{tag}"
    admin = _database(meta)
    admin.cursor().execute(f"CREATE DATABASE {state}")
    root = tmp_path_factory.mktemp("dist")
    broker = RedisServer(root).start()
    stack = EmbeddedStack(
        home=root / "airflow", trainflow_home=root / "trainflow", port=free_port(),
        database_url=f"postgresql+psycopg2://postgres@127.0.0.1:5432/{meta}",
        broker_url=broker.url,
        state_db=f"postgresql://postgres@127.0.0.1:5432/{state}",
        workers=({"name": "host-a", "queues": "cpu", "concurrency": 1},
                 {"name": "host-b", "queues": "cpu", "concurrency": 1},
                 {"name": "control", "queues": "default", "concurrency": 4}),
        extra_env={"AIRFLOW_CONN_TRAINFLOW_S3": s3_server.airflow_connection()})
    stack.broker = broker
    try:
        stack.up(timeout=300)
        yield stack
    finally:
        stack.stop()
        broker.stop()
        for db in (meta, state):
            admin.cursor().execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        admin.close()


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


def test_a_redis_restart_mid_run_does_not_lose_the_run(dist_stack, run_to_end):
    """The broker goes down while the gang trains and comes back on the same port: the
    running node tasks never needed it, the workers reconnect, and the tasks queued after
    the restart (checkpoint sync, evaluate, release) still run."""
    import threading
    import time
    from pathlib import Path

    from trainflow.checkpoint import manifest

    client = dist_stack.client()
    run_id = "dist-redis-restart"
    conf = {"steps": 1500, "checkpoint_interval": 250, "keep_last": 2, "tenant": "dist-redis"}
    restarted = threading.Event()

    def restart_when_training() -> None:
        run_dir = Path(dist_stack.trainflow_home) / "runs" / "dist-redis" / DAG / run_id
        deadline = time.time() + 600
        while time.time() < deadline and manifest.newest_verified(run_dir / "checkpoints") is None:
            time.sleep(0.5)
        dist_stack.broker.stop()
        time.sleep(3)
        dist_stack.broker.start()
        restarted.set()
    watcher = threading.Thread(target=restart_when_training, daemon=True)
    watcher.start()
    run_to_end(client, DAG, conf, run_id, timeout=900)
    watcher.join(timeout=5)
    assert restarted.is_set(), "the run ended before the broker restart"
    assert client.xcom(DAG, run_id, "evaluate", "metrics")["step"] == 1500
