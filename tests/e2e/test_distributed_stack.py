"""The distributed profile on this machine's real services: Airflow's metadata on
PostgreSQL, the CeleryExecutor with a Redis broker, trainflow's own state (allocator, host
registry, rendezvous) in a PostgreSQL database of its own, and checkpoints in a real S3
server. Five Celery workers are five "hosts": four serve the ``cpu`` queue (one slot each)
from network namespaces of their own (``trainflow.testing.netns``: an address each on a
bridge, so the gang's rendezvous and gloo traffic cross between addresses; PostgreSQL,
Redis, the Airflow API and S3 reach them through a forwarder on each host's loopback), one
serves the ``default`` queue for the control tasks from the machine itself.

- A 2-node run: its node tasks (``cpu`` queue) land on two namespaced hosts, the control
  tasks (``default`` queue) on the control host; checkpoints land in S3 and verify.
- A host dies mid-run (every process in its namespace SIGKILLed, its Celery worker among
  them, and the run's local checkpoints deleted with it): Airflow notices the lost task by
  its heartbeat, retries it on the spare host of the queue, which resumes from the newest
  verified copy in S3; the final weights equal the clean run's.
- The broker (a Redis server of the test's own, append-only file on, as a production broker
  runs) restarts while a gang trains: the run still completes.
- Placement on hosts by rack (a DAG admitted from the pool of the registered ``cpu`` hosts,
  two racks of two): a 2-node run gets one rack, a 1-node run the other; each node task
  runs on the host it was placed on (the executor routes it to ``cpu@<host>``); when a
  placed host dies, the retry goes to the rack's free host, and the run ends with the clean
  run's weights.

A machine where namespaces cannot be made fails this module with the reason."""

from __future__ import annotations

import uuid
from contextlib import closing
from pathlib import Path

import pytest

from trainflow.checkpoint.s3 import S3Store
from trainflow.cluster.allocator import Allocator
from trainflow.launch.local import free_port
from trainflow.stack import EmbeddedStack
from trainflow.testing.netns import HostNetwork, NetnsUnavailable

pytestmark = pytest.mark.e2e
DAG = "train_digits"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
HOSTS = ("host-a", "host-b", "host-c", "host-d")
RACKS = {"host-a": "r1", "host-b": "r1", "host-c": "r2", "host-d": "r2"}
# train_digits admitted from the pool of the registered ``cpu`` hosts, placed on them.
PLACED = "train_digits_placed"
# (The docstring's words "Airflow" and "DAG" make Airflow's safe mode parse the file.)
PLACED_DAG = f"""\"\"\"Airflow DAG: train_digits placed on the registered cpu hosts.\"\"\"

from operators.dag_factory import training_dag

dag = training_dag("{PLACED}", defaults={{"workload": "digits", "nodes": 2, "steps": 300, "batch_size": 32,
                                        "lr": 0.003, "checkpoint_interval": 50}},
                   node_pool="cpu", description="train_digits, placed on registered hosts")
"""
# The clean run and the run that loses a host: same conf, so the same final weights.
CONF = {
    "steps": 600,
    "checkpoint_interval": 100,
    "keep_last": 2,
    "seed": 5,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 10.0,
    "startup_timeout": 240.0,
}


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

        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.root),
                "--appendonly",
                "yes",
                "--save",
                "",
            ],
            stdout=open(self.root / "redis.log", "ab"),
            stderr=subprocess.STDOUT,
        )
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
    dags = root / "dags"
    dags.mkdir()
    (dags / "train_digits.py").symlink_to(Path(__file__).resolve().parents[2] / "dags" / "train_digits.py")
    (dags / f"{PLACED}.py").write_text(PLACED_DAG)
    broker = RedisServer(root).start()
    port = free_port()
    try:
        net = HostNetwork(HOSTS, ports=(port, 5432, broker.port, s3_server.port)).create()
    except NetnsUnavailable as exc:
        broker.stop()
        pytest.fail(f"the distributed e2e needs network namespaces for its hosts: {exc}")
    stack = EmbeddedStack(
        home=root / "airflow",
        trainflow_home=root / "trainflow",
        port=port,
        dags_folder=dags,
        database_url=f"postgresql+psycopg2://postgres@127.0.0.1:5432/{meta}",
        broker_url=broker.url,
        state_db=f"postgresql://postgres@127.0.0.1:5432/{state}",
        workers=tuple(
            {"name": h, "queues": "cpu", "concurrency": 1, "wrap": net.wrap(h), "env": net.env(h)} for h in HOSTS
        )
        + ({"name": "control", "queues": "default", "concurrency": 4},),
        task_heartbeat_timeout=20,
        allow_faults=True,
        extra_env={"AIRFLOW_CONN_TRAINFLOW_S3": s3_server.airflow_connection()},
    )
    stack.broker, stack.net = broker, net
    try:
        stack.up(timeout=300)
        yield stack
    finally:
        stack.stop()
        net.destroy()
        broker.stop()
        for db in (meta, state):
            admin.cursor().execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        admin.close()


def _s3_conf(s3_server, tenant: str) -> dict:
    return {**CONF, "tenant": tenant, "store_uri": f"s3://{s3_server.bucket}/dist"}


@pytest.fixture(scope="module")
def clean(dist_stack, s3_server, run_to_end):
    client = dist_stack.client()
    run_to_end(client, DAG, _s3_conf(s3_server, "dist"), "dist-clean", timeout=900)
    return client, "dist-clean"


def test_a_gang_runs_across_namespaced_hosts_on_postgres_redis_and_s3(dist_stack, s3_server, clean):
    client, run_id = clean
    tis = client.task_instances(DAG, run_id)
    queues = {(t["task_id"], t["map_index"]): t["queue"] for t in tis}
    assert queues[("shard_train", 0)] == queues[("shard_train", 1)] == "cpu"
    assert queues[("provision", -1)] == queues[("evaluate", -1)] == "default"
    nodes = [client.xcom(DAG, run_id, "shard_train", map_index=i) for i in (0, 1)]
    hosts = {n["host"] for n in nodes}
    assert len(hosts) == 2 and hosts <= set(HOSTS)  # two hosts, two addresses
    metrics = client.xcom(DAG, run_id, "evaluate", "metrics")
    assert metrics["step"] == 600 and metrics["accuracy"] > 0.9
    pointer = client.xcom(DAG, run_id, "checkpoint_sync", "checkpoint")
    assert pointer["uri"].startswith(f"s3://{s3_server.bucket}/dist/dist/{DAG}/{run_id}/step-00000600")
    store = S3Store(s3_server.client(), s3_server.bucket, "dist", tenant="dist", dag_id=DAG, run_id=run_id)
    assert store.steps()[0] == 600 and len(store.steps()) <= 2
    assert store.read_manifest(600)["world_size"] == 2
    # trainflow's state lived in its own PostgreSQL database, and the lease is released.
    allocator = Allocator(dist_stack.state_db)
    assert allocator.leases() == []
    plan = client.xcom(DAG, run_id, "provision", "plan")
    assert plan["rendezvous"]["endpoint"] == dist_stack.state_db


def _diagnosis(client, allocator, stack, dag_id: str, run_id: str, run_dir: Path) -> str:
    """What a stuck run looked like: its task tries (state, queue, host), the host leases with
    the try each slot was last routed for, the node markers and the tail of each agent log."""
    lines = [
        f"{t['task_id']}[{t['map_index']}] {t['state']} try={t['try_number']} queue={t['queue']} host={t['hostname']}"
        for t in client.task_instances(dag_id, run_id)
    ]
    with closing(allocator._connect()) as con:
        lines += [f"host_lease {row}" for row in con.execute("SELECT * FROM host_leases")]
        lines += [f"cordon {row}" for row in con.execute("SELECT * FROM cordons")]
    for path in sorted((run_dir / "nodes").glob("*.json")) + sorted((run_dir / "logs").glob("*.log")):
        lines += [f"--- {path.name}", *path.read_text(errors="replace").splitlines()[-15:]]
    log = Path(stack.home) / "logs" / "scheduler.log"
    if log.exists():
        lines += [
            "--- scheduler.log (placement)",
            *[
                x
                for x in log.read_text(errors="replace").splitlines()
                if "placed by trainflow" in x or "placement of" in x
            ][-20:],
        ]
    return "\n".join(lines)


def _host_of_node(net: HostNetwork, node: int, run_id: str) -> str | None:
    """The host whose namespace runs ``node``'s agent for ``run_id``."""
    for host in HOSTS:
        for pid in net.pids(host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                b"trainflow.launch.agent" in argv
                and argv[argv.index(b"--node") + 1] == str(node).encode()
                and run_id.encode() in b" ".join(argv)
            ):
                return host
    return None


def test_a_host_dies_mid_run_and_its_node_resumes_from_s3_on_the_spare_host(dist_stack, s3_server, clean, run_to_end):
    """Rank 0's node (the one uploading checkpoints) loses its host: every process in the
    namespace is killed, its Celery worker with them, and the run's local checkpoints go
    with it. The lost task instance fails by its heartbeat (20 s here), Airflow retries it
    on the spare ``cpu`` host, which fetches the newest verified checkpoint from S3; the
    gang resumes there and ends with the clean run's weights."""
    import os
    import shutil
    import signal
    import threading
    import time

    client, clean_id = clean
    run_id = "dist-host-dies"
    net = dist_stack.net
    store = S3Store(s3_server.client(), s3_server.bucket, "dist", tenant="dist-kill", dag_id=DAG, run_id=run_id)
    run_dir = Path(dist_stack.trainflow_home) / "runs" / "dist-kill" / DAG / run_id
    killed: dict = {}

    def kill_host_once_in_s3() -> None:
        deadline = time.time() + 600
        while time.time() < deadline and not (store.steps() and store.steps()[0] >= 200):
            time.sleep(0.5)
        host = _host_of_node(net, 0, run_id)
        if host is None:
            return
        pids = net.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for step_dir in (run_dir / "checkpoints").glob("step-*"):
            shutil.rmtree(step_dir, ignore_errors=True)
        killed.update(host=host, processes=len(pids), s3_steps=store.steps(), at=time.time())

    killer = threading.Thread(target=kill_host_once_in_s3, daemon=True)
    killer.start()
    run_to_end(client, DAG, _s3_conf(s3_server, "dist-kill"), run_id, timeout=1200)
    killer.join(timeout=5)
    assert killed.get("host"), "the run ended before a checkpoint reached S3"
    assert killed["processes"] >= 3  # the Celery worker, its task, the agent and workers
    assert dist_stack.pid(f"worker-{killed['host']}") is None  # the host's worker is gone

    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    assert tis[("shard_train", 0)]["try_number"] >= 2
    final = client.xcom(DAG, run_id, "shard_train", map_index=0)
    assert final["host"] != killed["host"]  # retried on another worker of the queue
    log = client.task_log(DAG, run_id, "shard_train", tis[("shard_train", 0)]["try_number"], map_index=0)
    resumed = [line for line in log.splitlines() if "resume point: verified checkpoint step" in line]
    assert resumed and any(f"step {s} " in resumed[0] for s in killed["s3_steps"]), (resumed, killed)
    assert (
        client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"]
        == client.xcom(DAG, clean_id, "evaluate", "metrics")["weights_sha256"]
    )
    dist_stack.start()  # the host comes back for the next test


def test_a_redis_restart_mid_run_does_not_lose_the_run(dist_stack, run_to_end):
    """The broker goes down while the gang trains and comes back on the same port: the
    running node tasks never needed it, the workers reconnect, and the tasks queued after
    the restart (checkpoint sync, evaluate, release) still run."""
    import threading
    import time

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


def _live_run_processes(run_dirs) -> list[int]:
    """Pids of the runs' agents and workers still alive (from their heartbeats and node
    records), zombies excluded."""
    import json

    import psutil

    pids = set()
    for run_dir in run_dirs:
        for f in [*(run_dir / "heartbeats").glob("rank-*.json"), *(run_dir / "nodes").glob("node-*.json")]:
            try:
                pid = json.loads(f.read_text()).get("pid")
            except (OSError, ValueError):
                continue
            if isinstance(pid, int):
                pids.add(pid)
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_the_whole_stack_stops_twice_mid_run_and_every_run_resumes(dist_stack, s3_server, clean):
    """Two 2-node runs of two tenants in flight (one checkpointing to S3, one locally: all
    four ``cpu`` hosts busy). Every Airflow and trainflow process is stopped — first with
    SIGTERM (the stack's stop), later with SIGKILL (a crash) — and the stack is started
    again as the demo starts it. Both times nothing of the runs survives the stop, each run
    keeps exactly its lease (nothing double-allocated), resumes from a verified checkpoint at
    least as new as the newest before the stop, and completes with the weights of a clean
    run of the same spec (nothing lost, nothing trained twice); every lease is released.

    The runs train 1500 steps, not the module's 600: each stop must find both runs under way,
    and a 600-step run ends ~15 s after its first checkpoint — less than the gap between the
    two runs' starts can be on a loaded machine (CI saw one run finish before the other had
    its first checkpoint). Their clean reference is the same spec trained by a local gang
    (the trainer Airflow's node tasks launch, without Airflow)."""
    import json
    import signal
    import time

    from trainflow.checkpoint import manifest
    from trainflow.launch.local import run_local
    from trainflow.spec import TrainingSpec
    from trainflow.timeline import read
    from trainflow.worker.evaluate import evaluate

    client, _ = clean
    # Each stop costs every node task one try; on a loaded machine a try started as the
    # stack comes back can be lost too (CI: node 0's first try after the restart stopped
    # logging at once and the scheduler retried it, the 20-s task heartbeat timeout of this
    # stack), so the runs get a retry budget of five instead of the default two.
    steps, retries = 1500, 5
    runs = {
        "dist-stop-a": {**_s3_conf(s3_server, "stop-a"), "steps": steps, "retries": retries},
        "dist-stop-b": {**CONF, "tenant": "stop-b", "steps": steps, "retries": retries},
    }
    keys = {f"{c['tenant']}/{DAG}/{r}": 2 for r, c in runs.items()}
    dirs = {r: Path(dist_stack.trainflow_home) / "runs" / c["tenant"] / DAG / r for r, c in runs.items()}
    for run_id, conf in runs.items():
        client.trigger(DAG, conf, run_id=run_id)
    allocator = Allocator(dist_stack.state_db)

    def newest(run_id) -> int:
        ref = manifest.newest_verified(dirs[run_id] / "checkpoints")
        return ref.step if ref else -1

    floor = {r: 0 for r in runs}
    for round_, sig in enumerate((signal.SIGTERM, signal.SIGKILL)):
        deadline = time.time() + 600
        while time.time() < deadline and not all(newest(r) > floor[r] for r in runs):
            time.sleep(0.2)
        before = {r: newest(r) for r in runs}
        assert all(before[r] > floor[r] for r in runs), before
        assert max(before.values()) < steps, before  # training still under way
        assert {lease.run_key: lease.nodes for lease in allocator.leases()} == keys
        stopped = dist_stack.stop(grace=15, sig=sig)
        assert set(stopped) == set(dist_stack.components)
        time.sleep(1)
        assert _live_run_processes(dirs.values()) == [], f"round {round_}: processes outlived the stack"
        dist_stack.start()
        dist_stack.wait_healthy(timeout=300)
        leases = {lease.run_key: lease.nodes for lease in allocator.leases()}
        assert all(leases.get(k, n) == n for k, n in keys.items()) and set(leases) <= set(keys), leases
        floor = before
        if round_ == 0:
            first = dict(before)

    for run_id in runs:
        client.wait_run(DAG, run_id, timeout=1200)
    # The clean reference: the spec run B trained (its workspace's spec.json), trained again
    # from step 0 without a stop, once both runs are over (the two cores are free).
    spec = TrainingSpec.from_mapping(json.loads((dirs["dist-stop-b"] / "spec.json").read_text()))
    reference = Path(dist_stack.trainflow_home) / "stop-reference"
    assert run_local(spec, reference) == [0] * spec.nodes
    clean_weights = evaluate(reference)["weights_sha256"]
    for run_id in runs:
        run = client.wait_run(DAG, run_id, timeout=60)
        tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
        assert run["state"] == "success", {k: (t["state"], t["try_number"]) for k, t in tis.items()}
        resumed = [e["step"] for e in read(dirs[run_id]) if e["event"] == "resumed"]
        # One resume per stop, each from a checkpoint at least as new as the newest before it.
        assert len(resumed) >= 2 and resumed[0] >= first[run_id] and resumed[-1] >= floor[run_id], (
            run_id,
            resumed,
            first,
            floor,
        )
        assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean_weights, run_id
    assert allocator.leases() == []


def test_gangs_are_placed_on_hosts_by_rack_and_a_dead_host_retry_moves_to_a_free_host(dist_stack, clean, run_to_end):
    """The ``cpu`` hosts are registered in two racks. Run A (2 nodes) is placed in one rack,
    then run B (1 node) on a host of the other; every node task runs on its placed host
    (routed to ``cpu@<host>`` by the executor), never on another run's. A's node 1 host then
    dies (every process in its namespace SIGKILLed): Airflow retries the task, the executor
    moves the try to the one free host (in the other rack: A's own rack has none), and A
    ends with the clean run's weights; every host lease is released."""
    import json
    import os
    import signal
    import threading
    import time
    from types import SimpleNamespace

    from trainflow.checkpoint import manifest
    from trainflow.cli_runs import cmd_cancel
    from trainflow.cluster.hosts import HostRegistry

    client, clean_id = clean
    registry = HostRegistry(dist_stack.state_db)
    cpus = os.cpu_count() or 1
    for host, rack in RACKS.items():
        # The earlier tests' kills and whole-stack stops charged failures to these hosts
        # (three in ten minutes cordon one): this test starts from four healthy hosts.
        registry.uncordon(host)
        registry.register(host, queue="cpu", family="cpu", devices=cpus, pool="cpu", labels={"rack": rack})
    allocator = Allocator(dist_stack.state_db)
    client.wait_for_dag(PLACED, timeout=180)
    client.unpause(PLACED)
    a, b = "placed-a", "placed-b"
    client.trigger(PLACED, {**CONF, "tenant": "place-a"}, run_id=a)
    deadline = time.time() + 300
    while time.time() < deadline and len(allocator.placement(f"place-a/{PLACED}/{a}")) < 2:
        time.sleep(0.5)
    a_hosts = allocator.placement(f"place-a/{PLACED}/{a}")
    assert len(a_hosts) == 2 and len({RACKS[h] for h in a_hosts.values()}) == 1, a_hosts
    # B trains until it is cancelled, so it holds its host through A's retry.
    client.trigger(PLACED, {**CONF, "tenant": "place-b", "nodes": 1, "steps": 10**6}, run_id=b)

    run_dir = Path(dist_stack.trainflow_home) / "runs" / "place-a" / PLACED / a
    killed: dict = {}

    def kill_node_1_host() -> None:
        deadline = time.time() + 600
        while time.time() < deadline and not (
            (ref := manifest.newest_verified(run_dir / "checkpoints")) and ref.step >= 200
        ):
            time.sleep(0.5)
        host = _host_of_node(dist_stack.net, 1, a)
        if host is None:
            return
        killed["free"] = sorted(
            set(HOSTS)
            - set(allocator.placement(f"place-a/{PLACED}/{a}").values())
            - set(allocator.placement(f"place-b/{PLACED}/{b}").values())
        )
        for pid in dist_stack.net.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed["host"] = host

    killer = threading.Thread(target=kill_node_1_host, daemon=True)
    killer.start()

    def stuck(why: str) -> None:
        pytest.fail(
            f"{why}; killed {killed}; placement {a_hosts}\n"
            + _diagnosis(client, allocator, dist_stack, PLACED, a, run_dir)
        )

    try:
        try:
            run = client.wait_run(PLACED, a, timeout=1200)
        except TimeoutError as exc:
            stuck(str(exc))
        killer.join(timeout=5)
        states = {
            (t["task_id"], t["map_index"]): (t["state"], t["try_number"]) for t in client.task_instances(PLACED, a)
        }
        if run["state"] != "success":
            stuck(f"run {a} {run['state']}")
        b_marker = json.loads((run_dir.parents[2] / "place-b" / PLACED / b / "nodes" / "task-0000.json").read_text())
        assert b_marker["try"] == 1 and "ended" not in b_marker  # B still trains, on its first try
    finally:
        cmd_cancel(client, SimpleNamespace(dag=PLACED, run_id=b))
        dist_stack.start()  # the dead host comes back for the next test
    assert client.wait_run(PLACED, b, timeout=300)["state"] == "failed"
    assert killed.get("host") == a_hosts[1], (killed, a_hosts)

    b_admission = client.xcom(PLACED, b, "provision", "admission")
    (b_host,) = b_admission["hosts"]
    assert RACKS[b_host] != RACKS[a_hosts[0]]  # the other rack
    assert client.xcom(PLACED, a, "provision", "admission")["hosts"] == [a_hosts[0], a_hosts[1]]
    # Each node task ran on its placed host: node 0 of A, B's node, and A's node 1 after the
    # retry on the one host that was free when its host died.
    assert client.xcom(PLACED, a, "shard_train", map_index=0)["host"] == a_hosts[0]
    assert b_marker["host"] == b_host
    assert killed["free"] and len(killed["free"]) == 1 and RACKS[killed["free"][0]] != RACKS[a_hosts[1]]
    assert states[("shard_train", 1)][1] >= 2
    retried_on = client.xcom(PLACED, a, "shard_train", map_index=1)["host"]
    assert retried_on == killed["free"][0] and retried_on not in (*a_hosts.values(), b_host)
    assert (
        client.xcom(PLACED, a, "evaluate", "metrics")["weights_sha256"]
        == client.xcom(DAG, clean_id, "evaluate", "metrics")["weights_sha256"]
    )
    deadline = time.time() + 120  # B's release teardown runs after the cancel
    while time.time() < deadline and allocator.leases():
        time.sleep(1)
    assert allocator.leases() == [] and allocator.placement(f"place-a/{PLACED}/{a}") == {}
    assert allocator.placement(f"place-b/{PLACED}/{b}") == {}
