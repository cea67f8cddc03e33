"""bench/soak: the stack unattended for a while, under load and faults, with retention on.

On the real embedded stack (api-server, scheduler, dag-processor, triggerer; LocalExecutor;
Airflow's metadata on PostgreSQL — SQLite's single writer killed the scheduler under load in
bench/concurrency — and a pool of 4 node slots): three tenants each keep one 2-node digits run
in flight, submitting the next as soon as one ends, so one run waits for nodes most of the
time. Runs carry faults in rotation — none, a killed rank, a hung rank (SIGSTOP), a killed
node task, a corrupt checkpoint, withheld heartbeats — so a fault lands every minute or so.
At 45 % of the time every Airflow component is stopped (SIGTERM) and started again; at 35 %
the triggerer is killed (SIGKILL) and the stack's supervisor (`EmbeddedStack.supervise`, what
`scripts/demo supervise` runs) starts it again. Every ``--retention-every`` seconds retention
runs with short bounds (`trainflow retention --airflow-db`: finished workspaces, task logs,
stale rows and Airflow's metadata rows older than ``--retain`` seconds; component logs
rotated past ``--log-max-bytes``).

Recorded: runs submitted / succeeded / failed, faults survived, steps lost, each run's final
weights against a clean run of the same spec (a local gang without faults or Airflow,
trained while the stack starts), and every 15 s: RSS and open file descriptors
of each long-lived Airflow process, Airflow's metadata rows (dag_run, task_instance, xcom,
log, job), trainflow's table rows, and disk use of the workspaces and the logs. A series is
called bounded when its mean over the last quarter of the soak is at most 1.25× the highest
value it reached in the second quarter (after warm-up: ``bounded``); the completed-run history (runtime estimates) is capped at
``HISTORY_KEEP`` rows per scope instead, and log disk use is judged by what retention
promises (no task log older than the last sweep's cutoff, no more rotated parts than kept:
``logs_bounded``), its quarter means reported beside it.

    .venv/bin/python bench/soak.py --minutes 10
    .venv/bin/python bench/soak.py --smoke      # what the test suite runs

Writes bench/results/soak.json and soak.png. ``--smoke`` is a short soak (one 200-step run
per fault kind of the rotation, one whole-stack restart, the triggerer killed once,
retention every 30 s, three sweeps at least; samples every 5 s) whose result ``tests/e2e/test_soak.py`` checks
with what a short run can show: every run healed to the clean weights, every fault kind
ran, every event happened, retention's invariants held. The growth bounds (quarter
means) need the long run: the smoke reports them and ``healthy`` ignores them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainflow.launch.local import free_port  # noqa: E402
from trainflow.stack import EmbeddedStack  # noqa: E402

DAG = "train_digits"
TENANTS = ("a", "b", "c")
# retries 4: a run can meet its own fault and the stack's restart (its node tasks die with
# the executor) in one life.
CONF = {
    "nodes": 2,
    "steps": 400,
    "checkpoint_interval": 50,
    "batch_size": 16,
    "seed": 7,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 8.0,
    "startup_timeout": 120.0,
    "admission_timeout": 3600,
    "retries": 4,
}
# After the soak's time, runs still in flight get this long to end; the rest count as failed.
DRAIN_S = 600.0
FAULTS = [
    [],
    [{"kind": "kill_rank", "rank": 1, "step": 150}],
    [{"kind": "stop_rank", "rank": 1, "step": 150}],
    [{"kind": "kill_node", "rank": 1, "step": 150}],
    [{"kind": "corrupt_checkpoint", "rank": 0, "step": 200}],
    [{"kind": "delay_heartbeats", "rank": 1, "step": 150, "seconds": 30}],
]
METADATA_TABLES = ("dag_run", "task_instance", "xcom", "log", "job")
SAMPLE_S = 15.0
# The smoke: runs half as long, each fault at the same fraction of the run.
SMOKE_STEPS = 200
SMOKE_SAMPLE_S = 5.0
SMOKE_SWEEPS = 3


def scaled(faults: list[dict], steps: int) -> list[dict]:
    """``faults`` moved to the same fraction of a ``steps``-step run (checkpoint steps stay
    multiples of the checkpoint interval)."""
    interval = CONF["checkpoint_interval"]
    out = []
    for f in faults:
        step = f["step"] * steps // CONF["steps"]
        if f["kind"] == "corrupt_checkpoint":
            step = max(interval, step // interval * interval)
        out.append({**f, "step": step})
    return out


def clean_weights(conf: dict, work: Path) -> str:
    """The final weights of a clean run of ``conf``: the same spec (train_digits' defaults
    under ``conf``, no faults) trained by a local gang — the trainer the DAG's node tasks
    launch — without Airflow."""
    from dags.train_digits import DEFAULTS
    from trainflow.launch.local import run_local
    from trainflow.spec import TrainingSpec
    from trainflow.worker.evaluate import evaluate

    spec = TrainingSpec.from_mapping({**DEFAULTS, **conf, "faults": []})
    codes = run_local(spec, work)
    if codes != [0] * spec.nodes:
        raise RuntimeError(f"the clean reference gang exited {codes} (logs in {work})")
    return evaluate(work)["weights_sha256"]


def log_state(logs: Path) -> tuple[float | None, int]:
    """The oldest task log's mtime (files under the logs' sub-folders, what retention ages
    out) and the most rotated parts any component log (``*.log`` at the top) has."""
    oldest, parts = None, 0
    if not logs.is_dir():
        return None, 0
    for sub in logs.iterdir():
        if sub.is_symlink() or not sub.is_dir():
            continue
        for dirpath, _, files in os.walk(sub):
            for name in files:
                try:
                    mtime = os.lstat(os.path.join(dirpath, name)).st_mtime
                except OSError:
                    continue
                oldest = mtime if oldest is None else min(oldest, mtime)
    for log in logs.glob("*.log"):
        parts = max(parts, sum(1 for p in logs.glob(f"{log.name}.*") if p.name[len(log.name) + 1 :].isdigit()))
    return oldest, parts


def du(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


class Sampler(threading.Thread):
    """Every ``SAMPLE_S``: the long-lived processes' RSS and fds, the tables' rows, disk use."""

    def __init__(self, stack: EmbeddedStack, meta_url: str, every: float = SAMPLE_S) -> None:
        super().__init__(daemon=True)
        self.stack, self.meta_url, self.every = stack, meta_url, every
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        self.t0 = time.time()
        # The cutoff of the last retention sweep that finished: every task log older than it
        # was deleted by that sweep, so none may be seen afterwards.
        self.log_cutoff: float | None = None

    def sample(self) -> dict:
        import psutil
        import psycopg2

        from trainflow.retention import state_rows

        s: dict = {"t": round(time.time() - self.t0, 1), "rss_mb": {}, "fds": {}}
        for component in self.stack.components:
            pid = self.stack.pid(component)
            if pid is None:
                continue
            try:
                p = psutil.Process(pid)
                # The component's main process; ``airflow ...`` may sit under a wrapper.
                main = next((c for c in [p, *p.children()] if "airflow" in " ".join(c.cmdline())), p)
                s["rss_mb"][component] = round(main.memory_info().rss / 2**20, 1)
                s["fds"][component] = main.num_fds()
            except psutil.Error:
                continue
        with psycopg2.connect(self.meta_url) as con, con.cursor() as cur:
            s["airflow_rows"] = {}
            for table in METADATA_TABLES:
                cur.execute(f"SELECT COUNT(*) FROM {table}")
                s["airflow_rows"][table] = cur.fetchone()[0]
        rows = state_rows(self.stack.trainflow_home / "state.db")
        # Completed runs' history is capped per scope (HISTORY_KEEP), not by age: on its own.
        s["history_rows"] = rows.pop("run_history", 0)
        s["trainflow_rows"] = sum(rows.values())
        s["workspaces_mb"] = round(du(self.stack.trainflow_home / "runs") / 2**20, 2)
        cutoff = self.log_cutoff
        s["logs_mb"] = round(du(self.stack.home / "logs") / 2**20, 2)
        oldest, s["log_parts"] = log_state(self.stack.home / "logs")
        # Seconds by which the oldest task log predates that cutoff (0: retention holds).
        s["task_logs_past_cutoff_s"] = (
            round(max(0.0, cutoff - oldest), 1) if cutoff is not None and oldest is not None else 0.0
        )
        return s

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.samples.append(self.sample())
            except Exception as exc:  # noqa: BLE001 - a restart mid-sample: note it, go on
                self.samples.append({"t": round(time.time() - self.t0, 1), "error": str(exc)[:200]})
            self.stop_event.wait(self.every)


def bounded(samples: list[dict], get) -> dict:
    """A series is bounded when its mean over the last quarter is at most 1.25× the highest
    value it reached in the second quarter (after warm-up). A level that saw-tooths under
    retention passes however few runs ended in a quarter (comparing the two quarters' means
    failed on a slow machine where a quarter held one or two completions); a leak that
    adds more than its base level over the soak (a linear one: last quarter 1.75× the
    half-way value) fails. The quarter means are reported beside it."""
    pts = [(s["t"], get(s)) for s in samples if "error" not in s]
    pts = [(t, v) for t, v in pts if v is not None]
    if len(pts) < 8:
        return {"bounded": None}
    end = pts[-1][0]
    q2 = [v for t, v in pts if end / 4 <= t < end / 2]
    q4 = [v for t, v in pts if t >= 3 * end / 4]
    if not q2 or not q4:
        return {"bounded": None}
    a, b, peak = statistics.fmean(q2), statistics.fmean(q4), max(q2)
    return {
        "q2_mean": round(a, 2),
        "q2_max": peak,
        "q4_mean": round(b, 2),
        "max": max(v for _, v in pts),
        "ratio": round(b / peak, 3) if peak else None,
        "bounded": b <= 1.25 * peak if peak else b == 0,
    }


def logs_bounded(samples: list[dict], log_keep: int) -> dict:
    """Log disk use, judged by the invariants retention promises rather than by quarter
    means: the task logs on disk at any moment are those of the last ``retain`` seconds plus
    one sweep interval, so their total follows how many runs happened to end in that minute
    (in a 10-minute soak the quarter means swing by a third with the run completions and
    with the stop of every component that falls in the second quarter). Bounded: no task log
    older than the last finished sweep's cutoff was ever seen, and no component log kept
    more than ``log_keep`` rotated parts. The quarter verdict of ``bounded`` is reported beside it."""
    ok = [s for s in samples if "error" not in s and "log_parts" in s]
    means = bounded(samples, lambda s: s["logs_mb"])
    if len(ok) < 8:
        return {**means, "bounded": None}
    past = max(s["task_logs_past_cutoff_s"] for s in ok)
    parts = max(s["log_parts"] for s in ok)
    return {
        **means,
        "last_quarter_within_1.25": means["bounded"],
        "task_logs_past_cutoff_s": past,
        "rotated_parts_max": parts,
        "bounded": past <= 1.0 and parts <= log_keep,
    }


def plot(samples: list[dict], events: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in samples if "error" not in s]
    t = [s["t"] / 60 for s in ok]
    fig, axes = plt.subplots(1, 5, figsize=(22, 3.8))
    for comp in sorted({c for s in ok for c in s["rss_mb"]}):
        axes[0].plot(t, [s["rss_mb"].get(comp) for s in ok], label=comp)
        axes[1].plot(t, [s["fds"].get(comp) for s in ok], label=comp)
    for table in METADATA_TABLES:
        axes[2].plot(t, [s["airflow_rows"][table] for s in ok], label=table)
    axes[3].plot(t, [s["trainflow_rows"] for s in ok], label="trainflow tables")
    axes[3].plot(t, [s.get("history_rows", 0) for s in ok], label="run history (capped)")
    axes[4].plot(t, [s["workspaces_mb"] for s in ok], label="workspaces")
    axes[4].plot(t, [s["logs_mb"] for s in ok], label="logs")
    for ax, title in zip(axes, ("RSS (MiB)", "open fds", "Airflow metadata rows", "trainflow rows", "disk (MiB)")):
        ax.set_title(title)
        ax.set_xlabel("minutes")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        for e in events:
            ax.axvline(e["t"] / 60, color="red" if e["what"] == "restart" else "grey", alpha=0.4, lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def soak(
    minutes: float,
    *,
    retention_every: float = 45.0,
    retain_s: float = 60.0,
    log_max_bytes: int = 128 * 2**10,
    log_keep: int = 1,
    smoke: bool = False,
    log=print,
) -> dict:
    """Run the soak for ``minutes`` and return its result (runs, bounds, events, samples).
    ``smoke``: one 200-step run per fault kind (the faults scaled to them), samples every
    5 s; it lasts until those runs ended and the stack's events happened, ``minutes`` times
    the same fractions placing the triggerer's kill and the restart."""
    conf = {**CONF, "steps": SMOKE_STEPS} if smoke else dict(CONF)
    faults_rotation = [scaled(f, conf["steps"]) for f in FAULTS]
    import psycopg2

    from trainflow.proctree import signal_tree

    work = Path(tempfile.mkdtemp(prefix="tf-soak-"))
    meta = f"tf_soak_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {meta}")
    meta_url = f"postgresql://postgres@127.0.0.1:5432/{meta}"
    stack = EmbeddedStack(
        home=work / "airflow",
        trainflow_home=work / "trainflow",
        port=free_port(),
        node_slots=4,
        parallelism=12,
        allow_faults=True,
        database_url=f"postgresql+psycopg2://postgres@127.0.0.1:5432/{meta}",
        # the product's pace, whatever the caller's environment says (the test suite's
        # stacks parse DAG files and idle their scheduler less often)
        extra_env={
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.25",
        },
    )
    # The clean reference trains while the stack starts (its weights are compared at the end).
    reference: dict = {}
    ref_thread = threading.Thread(
        daemon=True,
        target=lambda: reference.update(weights=clean_weights({**conf, "tenant": "ref"}, work / "reference")),
    )
    ref_thread.start()
    stack.up(timeout=300)
    result: dict = {
        "bench": "soak",
        "smoke": smoke,
        "minutes": minutes,
        "conf": conf,
        "tenants": TENANTS,
        "faults": [f[0]["kind"] if f else None for f in FAULTS],
        "pool_nodes": 4,
        "retention": {
            "every_s": retention_every,
            "retain_s": retain_s,
            "log_max_bytes": log_max_bytes,
            "log_keep": log_keep,
        },
    }
    events: list[dict] = []
    runs: list[dict] = []
    sampler = Sampler(stack, meta_url, every=SMOKE_SAMPLE_S if smoke else SAMPLE_S)
    supervisor: tuple[threading.Thread, threading.Event] | None = None

    def supervise() -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()

        def restarted(components: list[str]) -> None:
            events.append({"t": time.time() - sampler.t0, "what": "supervisor restart", "components": components})
            log(f"supervisor: restarted {', '.join(components)}")

        thread = threading.Thread(
            target=stack.supervise, args=(stop,), kwargs={"interval": 2.0, "on_restart": restarted}, daemon=True
        )
        thread.start()
        return thread, stop

    try:
        client = stack.client()
        client.wait_for_dag(DAG, timeout=180)
        client.unpause(DAG)
        sampler.start()
        supervisor = supervise()
        t0 = sampler.t0
        end = t0 + minutes * 60
        restarted = killed = False
        next_retention = t0 + retention_every
        inflight: dict[str, dict] = {}
        n = 0
        # The soak lasts ``minutes`` and at least until every fault kind of the rotation has
        # been submitted once (a slow machine fits fewer runs in the time). The smoke runs
        # each fault kind once, no more, and lasts until its stack events (the triggerer's
        # kill, the restart, SMOKE_SWEEPS retention sweeps) have happened too.

        def smoke_pending() -> bool:
            sweeps = sum(e["what"] == "retention" for e in events)
            return smoke and not (restarted and killed and sweeps >= SMOKE_SWEEPS)

        def more_runs(now: float) -> bool:
            return n < len(FAULTS) or (now < end and not smoke)

        while (more_runs(time.time()) or inflight or smoke_pending()) and time.time() < end + DRAIN_S:
            now = time.time()
            for tenant in TENANTS:  # keep one run per tenant in flight until the end
                run = inflight.get(tenant)
                if run is not None:
                    try:
                        state = client.run(DAG, run["run_id"])["state"]
                    except Exception:  # noqa: BLE001 - the api-server restarting
                        continue
                    if state not in ("success", "failed"):
                        continue
                    run.update(state=state, ended=time.time() - t0)
                    if state == "success":
                        metrics = client.xcom(DAG, run["run_id"], "evaluate", "metrics")
                        goodput = client.xcom(DAG, run["run_id"], "evaluate", "goodput") or {}
                        run.update(
                            weights=metrics["weights_sha256"],
                            steps_lost=goodput.get("steps_lost"),
                            goodput=goodput.get("goodput"),
                        )
                    log(f"[{(time.time() - t0) / 60:5.1f} min] {run['run_id']} {state} fault={run['fault']}")
                    del inflight[tenant]
                if tenant not in inflight and more_runs(now):
                    faults = faults_rotation[n % len(FAULTS)]
                    run_id = f"soak-{tenant}-{n:03d}"
                    n += 1
                    try:
                        client.trigger(DAG, {**conf, "tenant": tenant, "faults": faults}, run_id=run_id)
                    except Exception as exc:  # noqa: BLE001 - recorded as a failed submission
                        runs.append({"run_id": run_id, "tenant": tenant, "state": f"not submitted: {exc}"})
                        continue
                    inflight[tenant] = {
                        "run_id": run_id,
                        "tenant": tenant,
                        "started": now - t0,
                        "fault": faults[0]["kind"] if faults else None,
                    }
                    runs.append(inflight[tenant])
            if not restarted and now >= t0 + minutes * 27:
                events.append({"t": now - t0, "what": "restart"})
                log(f"[{(now - t0) / 60:5.1f} min] stopping every Airflow component (SIGTERM)")
                supervisor[1].set()  # a planned stop: the supervisor must not race it
                supervisor[0].join()
                stack.stop()
                stack.start()
                stack.wait_healthy(timeout=300)
                supervisor = supervise()
                events[-1]["healthy_after_s"] = round(time.time() - now, 1)
                restarted = True
            if not killed and now >= t0 + minutes * 21 and (pid := stack.pid("triggerer")):
                log(f"[{(now - t0) / 60:5.1f} min] SIGKILL to the triggerer; the supervisor restarts it")
                events.append({"t": now - t0, "what": "kill -9 triggerer"})
                signal_tree(pid, signal.SIGKILL)
                killed = True
            if now >= next_retention:
                env = {
                    **stack.env(),
                    "TRAINFLOW_RETAIN_WORKSPACE_DAYS": str(retain_s / 86400),
                    "TRAINFLOW_RETAIN_ABANDONED_DAYS": str(max(1800, retain_s) / 86400),
                    "TRAINFLOW_RETAIN_LOG_DAYS": str(retain_s / 86400),
                    "TRAINFLOW_RETAIN_AIRFLOW_DAYS": str(retain_s / 86400),
                    "TRAINFLOW_LOG_MAX_BYTES": str(log_max_bytes),
                    "TRAINFLOW_LOG_KEEP": str(log_keep),
                }
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "trainflow.cli",
                        "retention",
                        "--airflow-db",
                        "--logs",
                        str(stack.home / "logs"),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                swept = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
                if done.returncode == 0:
                    sampler.log_cutoff = now - retain_s  # the sweep's own clock started later
                events.append(
                    {
                        "t": now - t0,
                        "what": "retention",
                        "exit_code": done.returncode,
                        "workspaces_removed": (swept.get("workspaces") or {}).get("removed"),
                        "log_files_removed": (swept.get("logs") or {}).get("files"),
                    }
                )
                next_retention = now + retention_every
            time.sleep(2)
    finally:
        sampler.stop_event.set()
        sampler.join(timeout=60)
        if supervisor is not None:
            supervisor[1].set()
            supervisor[0].join(timeout=30)
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {meta} WITH (FORCE)")
        admin.close()
    ref_thread.join(timeout=600)
    if "weights" not in reference:
        raise RuntimeError("the clean reference run did not finish")
    for run in runs:
        if "weights" in run:
            run["weights_ok"] = run["weights"] == reference["weights"]
    samples = sampler.samples
    done_runs = [r for r in runs if r.get("state") in ("success", "failed")]
    result["runs"] = {
        "submitted": len(runs),
        "succeeded": sum(r["state"] == "success" for r in done_runs),
        "failed": [r["run_id"] for r in runs if r.get("state") != "success"],
        "weights_equal_clean": sum(bool(r.get("weights_ok")) for r in done_runs),
        "faults_survived": sum(1 for r in done_runs if r["fault"] and r["state"] == "success"),
        "steps_lost": sum(r.get("steps_lost") or 0 for r in done_runs),
        "per_run": runs,
    }
    comps = sorted({c for s in samples if "rss_mb" in s for c in s["rss_mb"]})
    result["bounds"] = {
        **{f"rss_mb:{c}": bounded(samples, lambda s, c=c: s["rss_mb"].get(c)) for c in comps},
        **{f"fds:{c}": bounded(samples, lambda s, c=c: s["fds"].get(c)) for c in comps},
        **{f"airflow_rows:{t}": bounded(samples, lambda s, t=t: s["airflow_rows"][t]) for t in METADATA_TABLES},
        "trainflow_rows": bounded(samples, lambda s: s["trainflow_rows"]),
        "history_rows_max": max((s.get("history_rows", 0) for s in samples if "error" not in s), default=0),
        "workspaces_mb": bounded(samples, lambda s: s["workspaces_mb"]),
        "logs_mb": logs_bounded(samples, log_keep),
    }
    result["events"], result["samples"], result["time"] = events, samples, time.time()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--retention-every", type=float, default=45.0, metavar="S")
    parser.add_argument(
        "--retain",
        type=float,
        default=60.0,
        metavar="S",
        help="finished workspaces, task logs and Airflow rows older than this go",
    )
    parser.add_argument(
        "--log-max-bytes",
        type=int,
        default=128 * 2**10,
        help="component logs rotate past this (TRAINFLOW_LOG_MAX_BYTES)",
    )
    parser.add_argument("--log-keep", type=int, default=1, help="rotated parts kept (TRAINFLOW_LOG_KEEP)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result file (default bench/results/soak.json; soak_smoke.json with --smoke)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a short soak (one 200-step run per fault kind, retention every 30 s)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.minutes, args.retention_every = min(args.minutes, 1.0), min(args.retention_every, 30.0)
    out = args.out or REPO / "bench" / "results" / ("soak_smoke.json" if args.smoke else "soak.json")
    result = soak(
        args.minutes,
        retention_every=args.retention_every,
        retain_s=args.retain,
        log_max_bytes=args.log_max_bytes,
        log_keep=args.log_keep,
        smoke=args.smoke,
        log=lambda line: print(line, flush=True),
    )
    args.out = out
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result["samples"], result["events"], args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result["runs"].items() if k != "per_run"}, indent=1))
    print(
        json.dumps(
            {
                k: (v.get("q2_max"), v.get("q4_mean"), v.get("bounded")) if isinstance(v, dict) else v
                for k, v in result["bounds"].items()
            },
            indent=1,
        )
    )
    return 0 if healthy(result) else 1


def healthy(result: dict) -> bool:
    """Every run succeeded with the clean weights and every series stayed bounded (a smoke
    run is too short for the quarter bounds: there, log disk use by retention's invariants)."""
    runs = result["runs"]
    from trainflow.cluster.allocator import HISTORY_KEEP

    bounds = result["bounds"]
    series = [bounds["logs_mb"]] if result.get("smoke") else [v for v in bounds.values() if isinstance(v, dict)]
    return (
        not runs["failed"]
        and runs["weights_equal_clean"] == runs["succeeded"]
        and bounds["history_rows_max"] <= HISTORY_KEEP  # one history scope in the soak
        and all(v.get("bounded") in (True, None) for v in series)
    )


if __name__ == "__main__":
    sys.exit(main())
