"""bench/soak: the stack unattended for a while, under load and faults, with retention on.

On the real embedded stack (api-server, scheduler, dag-processor, triggerer; LocalExecutor;
Airflow's metadata on PostgreSQL — SQLite's single writer killed the scheduler under load in
bench/concurrency — and a pool of 4 node slots): three tenants each keep one 2-node digits run
in flight, submitting the next as soon as one ends, so one run waits for nodes most of the
time. Runs carry faults in rotation — none, a killed rank, a hung rank (SIGSTOP), a killed
node task, a corrupt checkpoint, withheld heartbeats — so a fault lands every minute or so.
Half-way every Airflow component is stopped (SIGTERM) and started again. Every few minutes
retention runs with short bounds (`trainflow retention --airflow-db`: finished workspaces,
task logs, stale rows and Airflow's metadata rows older than a few minutes).

Recorded: runs submitted / succeeded / failed, faults survived, steps lost, each run's final
weights against a clean run of the same spec, and every 15 s: RSS and open file descriptors
of each long-lived Airflow process, Airflow's metadata rows (dag_run, task_instance, xcom,
log, job), trainflow's table rows, and disk use of the workspaces and the logs. A series is
called bounded when its mean over the last quarter of the soak is at most 1.25× its mean over
the second quarter (after warm-up).

    .venv/bin/python bench/soak.py --minutes 10

Writes bench/results/soak.json and soak.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
CONF = {"nodes": 2, "steps": 400, "checkpoint_interval": 50, "batch_size": 16, "seed": 7,
        "heartbeat_interval": 0.5, "heartbeat_timeout": 8.0, "startup_timeout": 120.0,
        "admission_timeout": 3600}
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

    def __init__(self, stack: EmbeddedStack, meta_url: str) -> None:
        super().__init__(daemon=True)
        self.stack, self.meta_url = stack, meta_url
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        self.t0 = time.time()

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
        s["trainflow_rows"] = sum(state_rows(self.stack.trainflow_home / "state.db").values())
        s["workspaces_mb"] = round(du(self.stack.trainflow_home / "runs") / 2**20, 2)
        s["logs_mb"] = round(du(self.stack.home / "logs") / 2**20, 2)
        return s

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.samples.append(self.sample())
            except Exception as exc:  # noqa: BLE001 - a restart mid-sample: note it, go on
                self.samples.append({"t": round(time.time() - self.t0, 1), "error": str(exc)[:200]})
            self.stop_event.wait(SAMPLE_S)


def bounded(samples: list[dict], get) -> dict:
    """Second-quarter vs last-quarter mean of a series."""
    pts = [(s["t"], get(s)) for s in samples if "error" not in s]
    pts = [(t, v) for t, v in pts if v is not None]
    if len(pts) < 8:
        return {"bounded": None}
    end = pts[-1][0]
    q2 = [v for t, v in pts if end / 4 <= t < end / 2]
    q4 = [v for t, v in pts if t >= 3 * end / 4]
    a, b = statistics.fmean(q2), statistics.fmean(q4)
    return {"q2_mean": round(a, 2), "q4_mean": round(b, 2), "max": max(v for _, v in pts),
            "ratio": round(b / a, 3) if a else None, "bounded": b <= 1.25 * a if a else b == 0}


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--retention-every", type=float, default=120.0, metavar="S")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    args = parser.parse_args()
    import psycopg2

    work = Path(tempfile.mkdtemp(prefix="tf-soak-"))
    meta = f"tf_soak_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {meta}")
    meta_url = f"postgresql://postgres@127.0.0.1:5432/{meta}"
    stack = EmbeddedStack(home=work / "airflow", trainflow_home=work / "trainflow", port=free_port(),
                          node_slots=4, parallelism=12,
                          database_url=f"postgresql+psycopg2://postgres@127.0.0.1:5432/{meta}")
    stack.up(timeout=300)
    result: dict = {"bench": "soak", "minutes": args.minutes, "conf": CONF, "tenants": TENANTS,
                    "faults": [f[0]["kind"] if f else None for f in FAULTS], "pool_nodes": 4}
    events: list[dict] = []
    runs: list[dict] = []
    sampler = Sampler(stack, meta_url)
    try:
        client = stack.client()
        client.wait_for_dag(DAG, timeout=180)
        client.unpause(DAG)
        client.trigger(DAG, {**CONF, "tenant": "ref"}, run_id="soak-clean")
        assert client.wait_run(DAG, "soak-clean", timeout=900)["state"] == "success"
        clean = client.xcom(DAG, "soak-clean", "evaluate", "metrics")["weights_sha256"]
        sampler.start()
        t0 = sampler.t0
        end = t0 + args.minutes * 60
        restarted = False
        next_retention = t0 + args.retention_every
        inflight: dict[str, dict] = {}
        n = 0
        while time.time() < end or inflight:
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
                        run.update(weights_ok=metrics["weights_sha256"] == clean,
                                   steps_lost=goodput.get("steps_lost"), goodput=goodput.get("goodput"))
                    print(f"[{(time.time() - t0) / 60:5.1f} min] {run['run_id']} {state} "
                          f"fault={run['fault']} weights_ok={run.get('weights_ok')}", flush=True)
                    del inflight[tenant]
                if tenant not in inflight and now < end:
                    faults = FAULTS[n % len(FAULTS)]
                    run_id = f"soak-{tenant}-{n:03d}"
                    n += 1
                    try:
                        client.trigger(DAG, {**CONF, "tenant": tenant, "faults": faults}, run_id=run_id)
                    except Exception as exc:  # noqa: BLE001 - recorded as a failed submission
                        runs.append({"run_id": run_id, "tenant": tenant, "state": f"not submitted: {exc}"})
                        continue
                    inflight[tenant] = {"run_id": run_id, "tenant": tenant, "started": now - t0,
                                        "fault": faults[0]["kind"] if faults else None}
                    runs.append(inflight[tenant])
            if not restarted and now >= t0 + args.minutes * 30:
                events.append({"t": now - t0, "what": "restart"})
                print(f"[{(now - t0) / 60:5.1f} min] stopping every Airflow component (SIGTERM)", flush=True)
                stack.stop()
                stack.start()
                stack.wait_healthy(timeout=300)
                events[-1]["healthy_after_s"] = round(time.time() - now, 1)
                restarted = True
            if now >= next_retention:
                env = {**stack.env(), "TRAINFLOW_RETAIN_WORKSPACE_DAYS": str(180 / 86400),
                       "TRAINFLOW_RETAIN_ABANDONED_DAYS": str(1800 / 86400),
                       "TRAINFLOW_RETAIN_LOG_DAYS": str(300 / 86400),
                       "TRAINFLOW_RETAIN_AIRFLOW_DAYS": str(300 / 86400)}
                done = subprocess.run([sys.executable, "-m", "trainflow.cli", "retention", "--airflow-db",
                                       "--logs", str(stack.home / "logs")],
                                      env=env, capture_output=True, text=True, timeout=600)
                swept = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
                events.append({"t": now - t0, "what": "retention", "exit_code": done.returncode,
                               "workspaces_removed": (swept.get("workspaces") or {}).get("removed"),
                               "log_files_removed": (swept.get("logs") or {}).get("files")})
                next_retention = now + args.retention_every
            time.sleep(2)
    finally:
        sampler.stop_event.set()
        sampler.join(timeout=60)
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {meta} WITH (FORCE)")
        admin.close()
    samples = sampler.samples
    done_runs = [r for r in runs if r.get("state") in ("success", "failed")]
    result["runs"] = {
        "submitted": len(runs), "succeeded": sum(r["state"] == "success" for r in done_runs),
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
        "workspaces_mb": bounded(samples, lambda s: s["workspaces_mb"]),
        "logs_mb": bounded(samples, lambda s: s["logs_mb"]),
    }
    result["events"], result["samples"], result["time"] = events, samples, time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(samples, events, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result["runs"].items() if k != "per_run"}, indent=1))
    print(json.dumps({k: (v.get("q2_mean"), v.get("q4_mean"), v.get("bounded")) for k, v in result["bounds"].items()},
                     indent=1))
    ok = not result["runs"]["failed"] and result["runs"]["weights_equal_clean"] == len(done_runs)
    return 0 if ok and all(v.get("bounded") in (True, None) for v in result["bounds"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
