"""The embedded stack: Airflow (SQLite + LocalExecutor) with trainflow, on one machine.

It writes an Airflow home (settings tuned for a small machine), starts
api-server, scheduler, dag-processor and triggerer as background processes with pid
files, waits until they are healthy, and stops them again. Starting twice is harmless:
live components are kept. It drives the ``airflow`` command and never imports airflow.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
# On one machine the control plane and the training share the cores: Airflow's components
# run at a lower CPU priority and the node agents restore normal priority for the workers
# (measured: training under Airflow ran ~15% slower per step without it, 2 cores).
CONTROL_PLANE_NICE = 10
REPO = Path(__file__).resolve().parents[1]


@dataclass
class EmbeddedStack:
    """One embedded Airflow + trainflow installation.

    Attributes:
        home: the Airflow home (config, SQLite DB, logs, pid files).
        trainflow_home: trainflow's state (workspaces, allocator DB).
        dags_folder: folder of DAG files.
        port: api-server port on 127.0.0.1.
        parallelism: LocalExecutor slots (each pre-forks a process: keep it small).
        node_slots: nodes the embedded allocator pool may hand out at once.
        database_url: Airflow's metadata database (empty: SQLite in ``home``), e.g.
            ``postgresql+psycopg2://airflow@127.0.0.1:5432/airflow``.
        broker_url: a Celery broker (``redis://127.0.0.1:6379/0``): the CeleryExecutor with
            ``workers`` instead of the LocalExecutor (needs ``database_url``, which also
            holds Celery's results).
        state_db: trainflow's own database (``TRAINFLOW_STATE_DB``; empty: SQLite in
            ``trainflow_home``).
        workers: Celery workers to run, each ``{"name", "queues", "concurrency", "env",
            "wrap"}``; ``name`` becomes the worker's ``TRAINFLOW_HOST`` (a "host" of the
            cluster); ``wrap`` is an argv prefix the worker runs under (e.g. ``ip netns exec
            <ns>``: a host with a network of its own, ``trainflow.testing.netns``).
        task_heartbeat_timeout: seconds without a task heartbeat after which the scheduler
            fails the task instance (``[scheduler] task_instance_heartbeat_timeout``; 0 keeps
            Airflow's 300 s). A worker host that dies with its tasks is noticed this way.
        allow_faults: a rehearsal deployment: every training DAG accepts fault schedules
            (``TRAINFLOW_ALLOW_FAULTS=1``); off, only DAGs built with ``allow_faults=True``.
    """

    home: Path = field(default_factory=lambda: REPO / ".airflow")
    trainflow_home: Path = field(default_factory=lambda: REPO / ".trainflow")
    dags_folder: Path = field(default_factory=lambda: REPO / "dags")
    plugins_folder: Path = field(default_factory=lambda: REPO / "plugins")
    port: int = 8080
    parallelism: int = 8
    node_slots: int = 4
    extra_env: dict[str, str] = field(default_factory=dict)
    database_url: str = ""
    broker_url: str = ""
    state_db: str = ""
    workers: tuple = ()
    task_heartbeat_timeout: int = 0
    allow_faults: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kw) -> "EmbeddedStack":
        """The profile the environment selects: ``TRAINFLOW_PROFILE=embedded`` (default:
        SQLite + LocalExecutor) or ``distributed``: Airflow on ``TRAINFLOW_AIRFLOW_DB``
        (``postgresql+psycopg2://…``), the CeleryExecutor on ``TRAINFLOW_BROKER_URL``
        (``redis://…``), trainflow's state on ``TRAINFLOW_STATE_DB`` (``postgresql://…``),
        and ``TRAINFLOW_WORKERS`` local Celery workers (``name=queues`` words, default
        ``control=default cpu-1=cpu cpu-2=cpu``; on a cluster, workers run on their hosts).

        Raises:
            ValueError: an unknown profile, or a distributed one missing a URL (named).
        """
        env = os.environ if env is None else env
        profile = env.get("TRAINFLOW_PROFILE", "embedded")
        if profile == "embedded":
            return cls(**kw)
        if profile != "distributed":
            raise ValueError(f"TRAINFLOW_PROFILE={profile!r}: use embedded or distributed")
        missing = [k for k in ("TRAINFLOW_AIRFLOW_DB", "TRAINFLOW_BROKER_URL", "TRAINFLOW_STATE_DB") if not env.get(k)]
        if missing:
            raise ValueError(
                f"TRAINFLOW_PROFILE=distributed needs {', '.join(missing)} (e.g. "
                f"postgresql+psycopg2://postgres@127.0.0.1:5432/airflow, redis://127.0.0.1:6379/0, "
                f"postgresql://postgres@127.0.0.1:5432/trainflow)"
            )
        workers = []
        for word in env.get("TRAINFLOW_WORKERS", "control=default cpu-1=cpu cpu-2=cpu").split():
            name, _, queues = word.partition("=")
            if not name or not queues:
                raise ValueError(f"TRAINFLOW_WORKERS: {word!r} is not name=queue[,queue]")
            workers.append({"name": name, "queues": queues, "concurrency": 4 if "default" in queues.split(",") else 1})
        return cls(
            database_url=env["TRAINFLOW_AIRFLOW_DB"],
            broker_url=env["TRAINFLOW_BROKER_URL"],
            state_db=env["TRAINFLOW_STATE_DB"],
            workers=tuple(workers),
            **kw,
        )

    def __post_init__(self) -> None:
        if self.broker_url and not self.database_url:
            raise ValueError(
                "the CeleryExecutor (broker_url) needs database_url: Celery keeps its "
                "results there, and SQLite cannot serve several worker hosts"
            )
        if self.workers and not self.broker_url:
            raise ValueError("workers are Celery workers: set broker_url")

    @property
    def components(self) -> tuple[str, ...]:
        return COMPONENTS + tuple(f"worker-{w['name']}" for w in self.workers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def secrets_file(self) -> Path:
        return self.home / "trainflow-secrets.json"

    def credentials(self) -> tuple[str, str]:
        return "admin", self._secrets()["admin_password"]

    def _secrets(self) -> dict[str, str]:
        if not self.secrets_file.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            data = {
                "admin_password": secrets.token_urlsafe(12),
                "jwt_secret": secrets.token_urlsafe(32),
                "secret_key": secrets.token_urlsafe(32),
            }
            fd = os.open(self.secrets_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh)
        return json.loads(self.secrets_file.read_text())

    def env(self) -> dict[str, str]:
        """The environment every component (and every task process) runs with."""
        s = self._secrets()
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "TRAINFLOW_HOME": str(self.trainflow_home),
            "TRAINFLOW_EMBEDDED_NODES": str(self.node_slots),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.plugins_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": s["secret_key"],
            "AIRFLOW__API_AUTH__JWT_SECRET": s["jwt_secret"],
            # ~0.2 s between a task's end and the next one's start (Airflow's 1 s: ~1 s);
            # the environment's value wins (an idle stack's scheduler costs more the shorter).
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": os.environ.get(
                "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME", "0.25"
            ),
            # After a scheduler crash the tasks it had queued are adopted (and a lost one then
            # fails by its heartbeat and is retried) at this interval: Airflow's 300 s default
            # left a whole-stack SIGKILL's runs idle for 5 minutes.
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "30",
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            # A task that starts while the api-server is restarting or swamped (a whole-stack
            # restart on a busy host) waits for it instead of failing its try: Airflow's 5
            # calls with a 5 s timeout gave up after ~12 s, and each such start spent one of
            # the run's retries (seen in CI: two stops cost four tries).
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "30",
            "AIRFLOW__WORKERS__EXECUTION_API_RETRIES": "8",
            "AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX": "30",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
            "AIRFLOW__TRIGGERER__DEFAULT_CAPACITY": "100",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        }
        if self.database_url:
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = self.database_url
        # Grants the maintenance DAG `airflow db clean` (operators/maintenance.py): tasks have
        # no metadata database access of their own in Airflow 3.
        metadata = self.database_url or f"sqlite:///{self.home / 'airflow.db'}"
        env["AIRFLOW_CONN_TRAINFLOW_METADATA_DB"] = json.dumps(
            {"conn_type": "generic", "extra": {"sql_alchemy_conn": metadata}}
        )
        if self.broker_url:
            env.update(
                {
                    # the CeleryExecutor, routing node tasks to the hosts trainflow placed them on
                    "AIRFLOW__CORE__EXECUTOR": "executors.placement.PlacementCeleryExecutor",
                    "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
                    # SQLAlchemy 2.1 needs the driver named.
                    "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.database_url,
                    # Longer than the longest training task, or Redis redelivers a running node task.
                    "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "604800",
                    "AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER": "1",
                }
            )
        if self.state_db:
            env["TRAINFLOW_STATE_DB"] = self.state_db
        if self.allow_faults:
            env["TRAINFLOW_ALLOW_FAULTS"] = "1"
        if self.task_heartbeat_timeout:
            env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"] = str(self.task_heartbeat_timeout)
            env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL"] = str(
                max(1.0, self.task_heartbeat_timeout / 5)
            )
        env.update(self.extra_env)
        return env

    def _airflow(self) -> str:
        return str(Path(sys.executable).parent / "airflow")

    def _pidfile(self, component: str) -> Path:
        return self.home / "run" / f"{component}.pid"

    def pid(self, component: str) -> int | None:
        """The component's live process, or None (a dead one is reaped if it is ours)."""
        try:
            pid = int(self._pidfile(component).read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return None
        except ChildProcessError:
            pass  # not our child (another process started it)
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        except (OSError, IndexError):
            pass
        return pid

    def prepare(self) -> None:
        """Write the home and passwords, migrate the database (idempotent)."""
        (self.home / "run").mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        self.trainflow_home.mkdir(parents=True, exist_ok=True)
        user, password = self.credentials()
        (self.home / "passwords.json").write_text(json.dumps({user: password}))
        subprocess.run(
            [self._airflow(), "db", "migrate"],
            env=self.env(),
            check=True,
            stdout=open(self.home / "logs" / "db-migrate.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        self.register_hosts()

    def register_hosts(self) -> None:
        """Record the stack's hosts in trainflow's inventory: this machine in the embedded
        pool (its node slots share it), and each Celery worker as a host of its queues'
        pool (they are processes on this machine, so they count its CPUs)."""
        from trainflow.cluster.allocator import Allocator
        from trainflow.cluster.hosts import HostRegistry, host_name

        db = self.state_db or self.trainflow_home / "state.db"
        Allocator(db).set_pool("embedded", self.node_slots)
        hosts = HostRegistry(db)
        cpus = os.cpu_count() or 1
        hosts.register(
            host_name(),
            queue="cpu",
            family="cpu",
            devices=cpus,
            pool="embedded",
            labels={"profile": "embedded", "node-slots": str(self.node_slots)},
        )
        for w in self.workers:
            queue = next((q for q in w["queues"].split(",") if q != "default"), None)
            if queue is not None:
                hosts.register(w["name"], queue=queue, family="cpu", devices=cpus, labels={"profile": "distributed"})

    def _command(self, component: str) -> tuple[list[str], dict[str, str]]:
        env = self.env()
        if not component.startswith("worker-"):
            return [self._airflow(), component], env
        worker = next(w for w in self.workers if f"worker-{w['name']}" == component)
        from trainflow.launch.local import free_port

        env.update(
            {
                "TRAINFLOW_HOST": worker["name"],
                # each worker serves its task logs on a port of its own
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                **worker.get("env", {}),
            }
        )
        from trainflow.cli import with_host_queues

        # and its own queue of each chip queue, where trainflow's placement sends node tasks
        queues = with_host_queues(worker["queues"], worker["name"])
        return [
            *worker.get("wrap", ()),
            self._airflow(),
            "celery",
            "worker",
            "--queues",
            queues,
            "--concurrency",
            str(worker.get("concurrency", 4)),
            "--celery-hostname",
            f"{worker['name']}@%h",
            "--pid",
            str(self.home / "run" / f"celery-{worker['name']}.pid"),
        ], env

    def start(self) -> list[str]:
        """Start every component that is not running; return the ones started."""
        started = []
        for component in self.components:
            if self.pid(component):
                continue
            cmd, env = self._command(component)
            log = open(self.home / "logs" / f"{component}.log", "ab")
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.home,
                preexec_fn=lambda: os.nice(CONTROL_PLANE_NICE),
            )
            self._pidfile(component).write_text(str(proc.pid))
            started.append(component)
        return started

    def supervise(self, stop, *, interval: float = 5.0, on_restart=None) -> list[dict]:
        """Keep every component running until ``stop`` (a ``threading.Event``) is set:
        every ``interval`` seconds, start what is not running (a crashed or killed
        component, as systemd's ``Restart=always`` would). Returns the restarts made,
        ``{"time", "components"}`` each; ``on_restart(components)`` hears of each."""
        restarts: list[dict] = []
        while not stop.wait(interval):
            try:
                started = self.start()
            except OSError as exc:  # e.g. a log folder removed under us: try again next round
                started = []
                print(f"supervisor: could not start components: {exc}", file=sys.stderr, flush=True)
            if started:
                restarts.append({"time": time.time(), "components": started})
                with open(self.home / "logs" / "supervisor.log", "a") as log:
                    log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} restarted {', '.join(started)}\n")
                if on_restart is not None:
                    on_restart(started)
        return restarts

    def health(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def healthy(self) -> bool:
        h = self.health()
        if not h:
            return False
        parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
        return all((h.get(p) or {}).get("status") == "healthy" for p in parts)

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while not self.healthy():
            dead = [c for c in self.components if not self.pid(c)]
            if dead:
                raise RuntimeError(f"components exited: {dead}; see {self.home / 'logs'}")
            if time.time() > deadline:
                raise TimeoutError(f"stack not healthy after {timeout}s: {self.health()}")
            time.sleep(0.5)

    def up(self, timeout: float = 180) -> None:
        self.prepare()
        self.start()
        self.wait_healthy(timeout)

    def stop_component(self, component: str, grace: float = 15) -> bool:
        """SIGTERM one component (then SIGKILL after ``grace``); True if it was running."""
        from trainflow.proctree import signal_tree

        pid = self.pid(component)
        if pid is None:
            return False
        signal_tree(pid, signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and self.pid(component):
            time.sleep(0.2)
        if (pid := self.pid(component)) is not None:
            signal_tree(pid, signal.SIGKILL)
        self._pidfile(component).unlink(missing_ok=True)
        return True

    def stop(self, grace: float = 15, sig: int = signal.SIGTERM) -> list[str]:
        """Send ``sig`` (SIGTERM; SIGKILL for a crash) to every component's process tree,
        then SIGKILL what is left after ``grace``."""
        from trainflow.proctree import signal_tree

        stopped = []
        for component in self.components:
            pid = self.pid(component)
            if pid is None:
                self._pidfile(component).unlink(missing_ok=True)
                continue
            signal_tree(pid, sig)
            stopped.append(component)
        deadline = time.time() + grace
        while time.time() < deadline and any(self.pid(c) for c in stopped):
            time.sleep(0.2)
        for component in stopped:
            if (pid := self.pid(component)) is not None:
                signal_tree(pid, signal.SIGKILL)
            self._pidfile(component).unlink(missing_ok=True)
        return stopped

    def client(self):
        from trainflow.rest import AirflowClient

        return AirflowClient(self.url, *self.credentials())
