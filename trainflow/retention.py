"""Retention: what trainflow keeps, for how long, so nothing grows without bound 7×24.

Checkpoints inside a run are already bounded (``keep_last``, pruned as each one commits and
again by checkpoint-sync). Everything else that accumulates across runs is swept here:

- **run workspaces** of finished runs (the release teardown wrote ``nodes/released.json``)
  older than ``workspace_days``; workspaces nobody has written to for ``abandoned_days``
  (a run whose teardown never ran, e.g. its stack was killed) go too. The durable copy of a
  run's checkpoints is the store checkpoint-sync published to, not the workspace;
- **Airflow task and DAG-processor logs** older than ``log_days`` (files under the logs
  folder; the components' own logs at its top level are rotated instead);
- **component logs** (``scheduler.log`` …) past ``log_max_bytes``: rotated by copy and
  truncate, since the component holds them open (``O_APPEND``, so writing goes on at the
  new end), keeping ``log_keep`` old parts;
- **trainflow's tables**: host failure records older than ``host_failure_days``, offline
  marks whose time passed, expired leases;
- **Airflow's metadata rows** (``dag_run``, ``task_instance``, ``xcom``, ``log``, ``job`` …)
  older than ``airflow_days`` via ``airflow db clean`` (``db_clean_argv``; the maintenance
  DAG runs it), never past the start of a run still in flight (``running_since``).

Pure functions of (paths, database, clock); the ``trainflow_maintenance`` DAG calls
``sweep`` on a schedule, ``trainflow retention`` from a shell.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import closing
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

from trainflow.errors import SpecError

DAY = 86400.0

# Environment variable → field; every bound can be set where the stack runs.
_ENV = {
    "workspace_days": "TRAINFLOW_RETAIN_WORKSPACE_DAYS",
    "abandoned_days": "TRAINFLOW_RETAIN_ABANDONED_DAYS",
    "log_days": "TRAINFLOW_RETAIN_LOG_DAYS",
    "airflow_days": "TRAINFLOW_RETAIN_AIRFLOW_DAYS",
    "host_failure_days": "TRAINFLOW_RETAIN_HOST_FAILURE_DAYS",
    "log_max_bytes": "TRAINFLOW_LOG_MAX_BYTES",
    "log_keep": "TRAINFLOW_LOG_KEEP",
}


@dataclass(frozen=True)
class Retention:
    """How long each kind of state is kept (days) and how large a component log grows."""

    workspace_days: float = 7.0
    abandoned_days: float = 30.0
    log_days: float = 14.0
    airflow_days: float = 30.0
    host_failure_days: float = 7.0
    log_max_bytes: int = 64 * 2**20
    log_keep: int = 3

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
                raise SpecError(f"retention.{f.name}", value, "must be a number >= 0")
        if self.abandoned_days < self.workspace_days:
            raise SpecError(
                "retention.abandoned_days",
                self.abandoned_days,
                f"must be >= workspace_days ({self.workspace_days}): an unfinished "
                "run is kept at least as long as a finished one",
            )
        if self.log_max_bytes < 4096:
            raise SpecError("retention.log_max_bytes", self.log_max_bytes, "must be >= 4096")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "Retention":
        """The defaults, then ``TRAINFLOW_RETAIN_*`` / ``TRAINFLOW_LOG_*``, then ``overrides``."""
        env = os.environ if env is None else env
        kw: dict = {}
        for name, var in _ENV.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                kw[name] = int(raw) if name in ("log_max_bytes", "log_keep") else float(raw)
            except ValueError:
                raise SpecError(var, raw, "must be a number") from None
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


def _newest_mtime(path: Path) -> float:
    """The newest modification time of ``path`` and anything under it (not following links)."""
    newest = path.lstat().st_mtime
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
            except FileNotFoundError:  # removed while we walk (a live run pruning)
                continue
    return newest


def run_dirs(root: Path):
    """Every run workspace under ``root`` (``<tenant>/<dag>/<run>``), links not followed."""
    root = Path(root)
    if not root.is_dir():
        return
    for tenant in sorted(root.iterdir()):
        if tenant.is_symlink() or not tenant.is_dir():
            continue
        for dag in sorted(tenant.iterdir()):
            if dag.is_symlink() or not dag.is_dir():
                continue
            for run in sorted(dag.iterdir()):
                if not run.is_symlink() and run.is_dir():
                    yield run


def prune_workspaces(root: Path, policy: Retention, now: float | None = None, dry_run: bool = False) -> list[dict]:
    """Delete the workspaces of runs released more than ``workspace_days`` ago, and of runs
    nothing was written to for ``abandoned_days``. Returns what was (or would be) removed."""
    now = time.time() if now is None else now
    root = Path(root).resolve()
    removed = []
    for run in list(run_dirs(root)):
        released = run / "nodes" / "released.json"
        try:
            if released.is_file() and not released.is_symlink():
                age, why = now - released.stat().st_mtime, "released"
                if age < policy.workspace_days * DAY:
                    continue
            else:
                age, why = now - _newest_mtime(run), "abandoned"
                if age < policy.abandoned_days * DAY:
                    continue
            nbytes = sum(f.stat().st_size for f in run.rglob("*") if f.is_file() and not f.is_symlink())
        except FileNotFoundError:
            continue
        if root not in run.resolve().parents:  # never outside the root, whatever links say
            continue
        if not dry_run:
            shutil.rmtree(run, ignore_errors=True)
            for parent in (run.parent, run.parent.parent):  # empty DAG / tenant folders
                try:
                    parent.rmdir()
                except OSError:
                    break
        removed.append({"path": str(run), "why": why, "age_days": round(age / DAY, 2), "bytes": nbytes})
    return removed


def prune_logs(logs: Path, policy: Retention, now: float | None = None, dry_run: bool = False) -> dict:
    """Delete log files under ``logs``' subfolders older than ``log_days`` (Airflow's
    ``dag_id=…/run_id=…`` task logs, the DAG processor's dated folders) and the folders
    that leaves empty. Files at the top level are the components' own: see ``rotate``."""
    now = time.time() if now is None else now
    logs = Path(logs)
    cutoff = now - policy.log_days * DAY
    files = nbytes = 0
    if not logs.is_dir():
        return {"files": 0, "bytes": 0}
    for sub in logs.iterdir():
        if sub.is_symlink() or not sub.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(sub, topdown=False):
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if st.st_mtime < cutoff:
                    files += 1
                    nbytes += st.st_size
                    if not dry_run:
                        os.unlink(path)
            if not dry_run and dirpath != str(sub):
                try:
                    os.rmdir(dirpath)  # only when empty
                except OSError:
                    pass
    return {"files": files, "bytes": nbytes}


def rotate(path: Path, max_bytes: int, keep: int) -> bool:
    """Copy-and-truncate rotation of a log a live process holds open in append mode:
    ``path`` → ``path.1`` (older parts shift up, beyond ``keep`` dropped), then ``path`` is
    truncated to 0. Returns whether it rotated. Lines written between the copy and the
    truncate are lost — the price of not restarting the writer (logrotate's copytruncate)."""
    path = Path(path)
    try:
        if path.is_symlink() or path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    if keep < 1:
        os.truncate(path, 0)
        return True
    oldest = path.with_name(f"{path.name}.{keep}")
    oldest.unlink(missing_ok=True)
    for i in range(keep - 1, 0, -1):
        part = path.with_name(f"{path.name}.{i}")
        if part.exists():
            part.rename(path.with_name(f"{path.name}.{i + 1}"))
    shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    os.truncate(path, 0)
    return True


def rotate_component_logs(logs: Path, policy: Retention) -> list[str]:
    """Rotate every ``*.log`` at the top of ``logs`` past ``log_max_bytes``."""
    logs = Path(logs)
    if not logs.is_dir():
        return []
    return [p.name for p in sorted(logs.glob("*.log")) if rotate(p, policy.log_max_bytes, policy.log_keep)]


def prune_state(db=None, policy: Retention | None = None, now: float | None = None) -> dict:
    """Delete trainflow's rows that only accumulate: host failure records older than
    ``host_failure_days``, and the allocator's expired leases, past offline marks, abandoned
    waits and the marks of runs gone (``Allocator.prune``). Returns counts."""
    from trainflow.cluster.allocator import Allocator
    from trainflow.cluster.hosts import HostRegistry

    policy = policy or Retention()
    now = time.time() if now is None else now
    alloc, hosts = Allocator(db), HostRegistry(db)  # both create their tables
    out = alloc.prune(now)
    with closing(hosts._connect()) as con:
        out["host_failures"] = con.execute(
            "DELETE FROM host_failures WHERE time < ?", (now - policy.host_failure_days * DAY,)
        ).rowcount
    return out


def state_rows(db=None) -> dict[str, int]:
    """Row count of each of trainflow's tables (the soak's bound check)."""
    from trainflow.cluster.allocator import Allocator
    from trainflow.cluster.hosts import HostRegistry

    alloc, hosts = Allocator(db), HostRegistry(db)
    out = {}
    for store, tables in (
        (
            alloc,
            (
                "pools",
                "leases",
                "offline",
                "quotas",
                "waiting",
                "pool_policies",
                "estimates",
                "run_history",
                "preemptible",
                "preemptions",
                "host_leases",
            ),
        ),
        (hosts, ("host_failures", "cordons", "inventory")),
    ):
        with closing(store._connect()) as con:
            for t in tables:
                out[t] = con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
    return out


# What ``airflow db clean`` may cut: the history runs leave (Airflow 3.3's table names; the
# Celery result tables only exist under the CeleryExecutor, and db clean skips absent
# tables). Not ``dag``: those rows are the DAGs themselves (cut by last parse time, which
# fails on a DAG whose versions runs still reference), and not the archive tables.
AIRFLOW_TABLES = (
    "dag_run",
    "task_instance",
    "task_instance_history",
    "task_reschedule",
    "task_state_store",
    "xcom",
    "log",
    "job",
    "trigger",
    "callback",
    "deadline",
    "asset_event",
    "partitioned_asset_key_log",
    "dag_version",
    "import_error",
    "revoked_token",
    "connection_test_request",
    "celery_taskmeta",
    "celery_tasksetmeta",
)

# The youngest metadata rows `airflow db clean` may cut: well past any live component's
# heartbeat (seconds) and Airflow's own health threshold (30 s).
AIRFLOW_MIN_AGE_S = 120.0


def running_since(sql_alchemy_conn: str, ended_after: float | None = None) -> float | None:
    """When the oldest DAG run still running — or, with ``ended_after``, that ended after
    it — started (Airflow's metadata database), or None. ``airflow db clean`` cuts runs by
    their start, so a run training longer than the bound would lose its rows mid-flight, and
    a run that just ended would lose them before anyone read its result: the cut never
    passes this."""
    from datetime import datetime, timezone

    import sqlalchemy

    engine = sqlalchemy.create_engine(sql_alchemy_conn)
    try:
        with engine.connect() as con:
            if ended_after is None:
                oldest = con.execute(
                    sqlalchemy.text("SELECT MIN(start_date) FROM dag_run WHERE state = 'running'")
                ).scalar()
            else:
                since = datetime.fromtimestamp(ended_after, tz=timezone.utc)
                if engine.dialect.name == "sqlite":  # naive UTC text, compared as text
                    since = since.replace(tzinfo=None).isoformat(sep=" ")
                oldest = con.execute(
                    sqlalchemy.text("SELECT MIN(start_date) FROM dag_run WHERE state = 'running' OR end_date > :since"),
                    {"since": since},
                ).scalar()
    finally:
        engine.dispose()
    if oldest is None:
        return None
    if isinstance(oldest, str):  # SQLite hands the timestamp back as text
        oldest = datetime.fromisoformat(oldest)
    if oldest.tzinfo is None:  # Airflow stores UTC
        oldest = oldest.replace(tzinfo=timezone.utc)
    return oldest.timestamp()


def db_clean_argv(
    policy: Retention,
    now: float | None = None,
    airflow: str = "airflow",
    dry_run: bool = False,
    keep_after: float | None = None,
) -> list[str]:
    """``airflow db clean`` for metadata rows older than ``airflow_days`` (no archive tables:
    archiving would only move the growth). Nothing at or after ``keep_after`` is cut (the
    runs still in flight: see ``running_since``)."""
    now = time.time() if now is None else now
    # Never closer to now than AIRFLOW_MIN_AGE_S, whatever the bound: `job` rows are cut by
    # their last heartbeat, and a live scheduler whose row was cut crashes on its next one.
    cut = now - max(policy.airflow_days * DAY, AIRFLOW_MIN_AGE_S)
    if keep_after is not None:
        cut = min(cut, keep_after)
    cutoff = datetime.fromtimestamp(cut, tz=timezone.utc)
    argv = [
        airflow,
        "db",
        "clean",
        "--clean-before-timestamp",
        cutoff.isoformat(timespec="seconds"),
        "--tables",
        ",".join(AIRFLOW_TABLES),
        "--skip-archive",
        "--yes",
        "--error-on-cleanup-failure",
    ]
    return argv + (["--dry-run"] if dry_run else [])


def clean_airflow_db(
    policy: Retention,
    sql_alchemy_conn: str,
    *,
    airflow: str,
    dry_run: bool = False,
    keep_after: float | None = None,
    now: float | None = None,
) -> dict:
    """Run ``airflow db clean`` on the metadata database at ``sql_alchemy_conn`` (a
    subprocess: Airflow's own code does the deleting), never past the start of a run still in
    flight or that ended within ``airflow_days`` (a run is kept that long after it ends), nor
    past ``keep_after``. Returns the argv, exit code and the output's tail."""
    import subprocess

    now = time.time() if now is None else now
    ended_after = now - policy.airflow_days * DAY
    bounds = [t - 1 for t in (running_since(sql_alchemy_conn, ended_after),) if t is not None]
    if keep_after is not None:
        bounds.append(keep_after)
    argv = db_clean_argv(policy, now, airflow=airflow, dry_run=dry_run, keep_after=min(bounds, default=None))
    done = subprocess.run(
        argv,
        env={**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sql_alchemy_conn},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    return {
        "argv": argv,
        "before": argv[argv.index("--clean-before-timestamp") + 1],
        "exit_code": done.returncode,
        "output": (done.stdout + done.stderr)[-4000:],
    }


def sweep(
    *,
    workspaces: Path | None,
    logs: Path | None,
    db=None,
    policy: Retention | None = None,
    now: float | None = None,
    dry_run: bool = False,
) -> dict:
    """One retention pass over everything but Airflow's metadata (see ``db_clean_argv``)."""
    policy = policy or Retention.from_env()
    now = time.time() if now is None else now
    out: dict = {"policy": asdict(policy), "time": now, "dry_run": dry_run}
    if workspaces is not None:
        gone = prune_workspaces(workspaces, policy, now, dry_run)
        out["workspaces"] = {
            "removed": len(gone),
            "bytes": sum(g["bytes"] for g in gone),
            "runs": [g["path"] for g in gone][:100],
        }
    if logs is not None:
        out["logs"] = prune_logs(logs, policy, now, dry_run)
        out["rotated"] = [] if dry_run else rotate_component_logs(logs, policy)
    out["state"] = {} if dry_run else prune_state(db, policy, now)
    return out
