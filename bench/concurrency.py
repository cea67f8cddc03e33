"""bench/concurrency: 21 runs from 3 tenants queued at once, fair share vs first come first served.

On the real embedded stack (api-server, scheduler, dag-processor, triggerer; LocalExecutor
with Airflow's metadata on PostgreSQL, a pool of 4 node slots): one DAG per tenant (``training_dag(tenants=[...])``), 21 one-node
digits runs triggered at once over REST — tenant ``a`` first with 13 runs, then ``b`` with 4
and ``c`` with 4. Twice in one stack: first with no quotas (admission by priority: first come,
first served), then with quotas a=2, b=1, c=1 (fair share). Reported per tenant: time from
trigger to the run's first training step (the rank's ``first_step`` timeline event), p50 and
p95, and whether every run completed.

    .venv/bin/python bench/concurrency.py
    .venv/bin/python bench/concurrency.py --smoke    # run by TRAINFLOW_LONG_SMOKES=1 scripts/test

Writes bench/results/concurrency.json (concurrency_smoke.json with --smoke); goal: every run
completes, no tenant starves (b's and c's runs do not wait for all of a's), p50/p95 reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainflow.launch.local import free_port  # noqa: E402
from trainflow.stack import EmbeddedStack  # noqa: E402
from trainflow.timeline import read as read_timeline  # noqa: E402

TENANTS = {"a": 13, "b": 4, "c": 4}  # runs per tenant, triggered in this order
QUOTAS = {"a": 2, "b": 1, "c": 1}
CONF = {
    "nodes": 1,
    "steps": 40,
    "checkpoint_interval": 20,
    "batch_size": 16,
    "heartbeat_interval": 0.5,
    "admission_timeout": 3600,
}
# --smoke: 6 runs of 10 steps, a's first: still more runs than the pool's 4 nodes, so runs
# queue in both modes.
SMOKE_TENANTS = {"a": 4, "b": 1, "c": 1}
SMOKE_CONF = {**CONF, "steps": 10, "checkpoint_interval": 5}
DAG_FILE = '''"""Airflow DAGs: one training DAG per tenant (Airflow's safe mode reads files naming both words)."""
from operators.dag_factory import training_dag

for tenant in {tenants!r}:
    globals()["dag_" + tenant] = training_dag(
        f"train_{{tenant}}", defaults={{"workload": "digits", "tenant": tenant}}, tenants=[tenant],
        max_active_runs=32)
'''


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def wave(client, label: str, tenants: dict[str, int] = TENANTS, conf: dict = CONF) -> dict:
    """Trigger every tenant's runs at once; wait for all; each run's trigger → first step."""
    triggered = {}
    for tenant, n in tenants.items():
        for i in range(n):
            run_id = f"{label}-{tenant}-{i:02d}"
            triggered[(tenant, run_id)] = time.time()
            client.trigger(f"train_{tenant}", {**conf, "tenant": tenant}, run_id=run_id)
    out: dict = {"per_tenant": {}, "failed": []}
    waits: dict[str, list[float]] = {t: [] for t in tenants}
    for (tenant, run_id), t0 in triggered.items():
        run = client.wait_run(f"train_{tenant}", run_id, timeout=3600, poll=2)
        if run["state"] != "success":
            out["failed"].append(run_id)
            continue
        run_dir = client.xcom(f"train_{tenant}", run_id, "provision", "run_dir")
        first = min(e["time"] for e in read_timeline(run_dir) if e["event"] == "first_step")
        waits[tenant].append(first - t0)
    for tenant, w in waits.items():
        out["per_tenant"][tenant] = {
            "runs": tenants[tenant],
            "completed": len(w),
            "p50_s": round(statistics.median(w), 1) if w else None,
            "p95_s": round(pct(w, 0.95), 1) if w else None,
            "waits_s": [round(x, 1) for x in w],
        }
    every = [x for w in waits.values() for x in w]
    out["all"] = {"p50_s": round(statistics.median(every), 1), "p95_s": round(pct(every, 0.95), 1)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/concurrency.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="both modes with 6 runs (a=4, b=1, c=1) of 10 steps on the same pool and quotas (run by TRAINFLOW_LONG_SMOKES=1 scripts/test)",
    )
    args = parser.parse_args()
    tenants, conf = (SMOKE_TENANTS, SMOKE_CONF) if args.smoke else (TENANTS, CONF)
    args.out = args.out or REPO / "bench" / "results" / ("concurrency_smoke.json" if args.smoke else "concurrency.json")
    work = Path(tempfile.mkdtemp(prefix="tf-concurrency-bench-"))
    (work / "dags").mkdir()
    (work / "dags" / "tenant_dags.py").write_text(DAG_FILE.format(tenants=list(tenants)))
    # Airflow's metadata on PostgreSQL: with 21 runs in flight, SQLite's single writer made
    # the scheduler die of "database is locked" (measured here, session 8).
    import uuid

    import psycopg2

    meta = f"tf_bench_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {meta}")
    stack = EmbeddedStack(
        home=work / "airflow",
        trainflow_home=work / "trainflow",
        port=free_port(),
        dags_folder=work / "dags",
        node_slots=4,
        parallelism=12,
        allow_faults=True,
        database_url=f"postgresql+psycopg2://postgres@127.0.0.1:5432/{meta}",
    )
    stack.up(timeout=300)
    result: dict = {"bench": "concurrency", "tenants": tenants, "quotas": QUOTAS, "conf": conf, "pool_nodes": 4}
    try:
        client = stack.client()
        for tenant in tenants:
            client.wait_for_dag(f"train_{tenant}", timeout=180)
            client.unpause(f"train_{tenant}")
        t0 = time.time()
        result["fifo"] = wave(client, "fifo", tenants, conf)
        result["fifo"]["wall_s"] = round(time.time() - t0, 1)
        print(
            "fifo",
            json.dumps({t: (v["p50_s"], v["p95_s"]) for t, v in result["fifo"]["per_tenant"].items()}),
            flush=True,
        )
        from trainflow.cluster.allocator import Allocator

        alloc = Allocator(stack.trainflow_home / "state.db")
        for tenant, nodes in QUOTAS.items():
            alloc.set_quota("embedded", tenant, nodes)
        t0 = time.time()
        result["fairshare"] = wave(client, "fair", tenants, conf)
        result["fairshare"]["wall_s"] = round(time.time() - t0, 1)
        print(
            "fairshare",
            json.dumps({t: (v["p50_s"], v["p95_s"]) for t, v in result["fairshare"]["per_tenant"].items()}),
            flush=True,
        )
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {meta} WITH (FORCE)")
        admin.close()
    result["time"] = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0 if not result["fifo"]["failed"] and not result["fairshare"]["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
