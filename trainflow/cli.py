"""``trainflow`` command line.

    trainflow train SPEC.json RUN_DIR      train a spec on this machine, no Airflow
    trainflow evaluate RUN_DIR             score a run's newest verified checkpoint
    trainflow chaos RUN_DIR --kill-rank R  inject a fault into a running run (rehearsal)
    trainflow validate SPEC.json           check a spec; exit 2 with the field, value and fix
    trainflow hosts [--uncordon H | --cordon H --reason R]
                                           host failures and cordons; lift or set one
    trainflow pool [--pool P] [--nodes N] [--policy priority|fifo|backfill]
                                           a node pool: size, admission policy, leases, queue
    trainflow quota [--pool P] [--set TENANT=NODES | --unset TENANT]
                                           a pool's tenant quotas (fair-share admission)
    trainflow retention [--dry-run] [--airflow-db]
                                           delete old finished runs' workspaces, old logs and
                                           stale rows (and Airflow's old metadata rows)
    trainflow doctor [--chip F | --queue Q] [--json] [--register [--pool P] [--label K=V]]
                                           this host's chips, health, queue and worker
                                           command (exit 1: unhealthy); record it
    trainflow worker --queues Q [--pool P] [--label K=V]
                                           register this host, then run its Celery worker
    trainflow pods SPEC.json [--node N]    the Kubernetes pods of a run, as YAML (dry run)
    trainflow helm-values [--family F]     Airflow Helm chart values, a worker set per chip queue
    trainflow simulate --trace CSV --capacity N --policy P
                                           replay a job trace through a scheduling policy
    trainflow submit [SPEC.json] [--set FIELD=VALUE] [--watch]
                                           start a run over REST (validated here first)
    trainflow status|watch|logs|cancel RUN_ID   a run's progress, its end, a task log, stop it
    trainflow runs                         the DAG's recent runs

Exit codes: 0 success, 1 the run failed, 2 bad input (or an unknown run), 3 the server
could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from trainflow.errors import SpecError

_SIGNALS = {"kill_rank": signal.SIGKILL, "stop_rank": signal.SIGSTOP, "cont_rank": signal.SIGCONT}
_SIGNAL_HELP = {
    "kill_rank": "SIGKILL this rank's worker (the gang restarts from its newest verified checkpoint)",
    "stop_rank": "SIGSTOP this rank's worker (a hang: the heartbeat watch replaces its node)",
    "cont_rank": "SIGCONT a stopped rank",
}


def _spec(path: str):
    from trainflow.spec import TrainingSpec

    return TrainingSpec.from_mapping(json.loads(Path(path).read_text()))


def chaos(run_dir: Path, action: str, rank: int) -> dict:
    """Signal one rank of a running run, found through its heartbeat (same host only).

    Raises:
        SpecError: no such rank, or the run is not on this host.
    """
    from trainflow.heartbeat import read_all
    from trainflow.timeline import record

    beat = read_all(run_dir / "heartbeats").get(rank)
    if beat is None:
        raise SpecError("rank", rank, f"no heartbeat for this rank under {run_dir}")
    pid = int(beat["pid"])
    try:
        os.kill(pid, _SIGNALS[action])
    except ProcessLookupError:
        raise SpecError("rank", rank, f"its process {pid} is not running on this host") from None
    if action != "cont_rank":
        record(run_dir, "fault_injected", kind=action, rank=rank, step=int(beat["step"]) + 1, source="chaos")
    return {"action": action, "rank": rank, "pid": pid, "step": beat["step"]}


def quota(pool: str, assign: str | None, unset: str | None) -> int:
    """Set or remove one tenant's quota, then print the pool's quotas and queue."""
    from trainflow.cluster.allocator import Allocator

    alloc = Allocator()
    if assign is not None:
        tenant, sep, nodes = assign.partition("=")
        if not sep or not nodes.strip().isdigit():
            raise SpecError("--set", assign, "TENANT=NODES, e.g. --set vision=4")
        alloc.set_quota(pool, tenant.strip(), int(nodes))
    elif unset is not None:
        alloc.set_quota(pool, unset, None)
    quotas = alloc.quotas(pool)
    print(
        json.dumps({"pool": pool, "policy": alloc.policy(pool), "quotas": quotas, "queue": alloc.queue(pool)}, indent=1)
    )
    return 0


def pool(name: str, nodes: int | None, policy: str | None) -> int:
    """Resize a pool or set its admission policy, then print it: size, policy, leases, queue."""
    from trainflow.cluster.allocator import Allocator, embedded_capacity

    alloc = Allocator()
    if nodes is None and name == "embedded" and name not in alloc.pools():
        nodes = embedded_capacity()  # provision creates it so on a run's first admission
    if nodes is not None or policy is not None:
        alloc.set_pool(name, nodes if nodes is not None else alloc.capacity(name), policy=policy)
    from trainflow.cluster.hosts import HostRegistry

    hosts = [
        {k: h[k] for k in ("host", "queue", "family", "model", "devices", "labels", "cordoned")}
        for h in HostRegistry().inventory(pool=name)
    ]
    print(
        json.dumps(
            {
                "pool": name,
                "nodes": alloc.capacity(name),
                "policy": alloc.policy(name),
                "hosts": hosts,
                "quotas": alloc.quotas(name),
                "leases": [
                    {"run": lease.run_key, "nodes": lease.nodes, "granted": lease.granted}
                    for lease in alloc.leases(name)
                ],
                "queue": alloc.queue(name),
            },
            indent=1,
        )
    )
    return 0


def retention(args) -> int:
    """One retention sweep (workspaces, logs, trainflow's tables) and, with ``--airflow-db``,
    ``airflow db clean`` of metadata rows older than the bound. Prints what it removed."""
    import os
    import subprocess

    from trainflow import retention as ret
    from trainflow.workspace import default_root

    policy = ret.Retention.from_env(
        workspace_days=args.workspace_days, log_days=args.log_days, airflow_days=args.airflow_days
    )
    logs = args.logs
    if logs is None and os.environ.get("AIRFLOW_HOME"):
        logs = Path(os.environ["AIRFLOW_HOME"]) / "logs"
    out = ret.sweep(workspaces=args.workspaces or default_root(), logs=logs, policy=policy, dry_run=args.dry_run)
    code = 0
    if args.airflow_db:
        airflow = Path(sys.executable).parent / "airflow"
        airflow = str(airflow) if airflow.exists() else "airflow"
        url = (
            os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
            or subprocess.run(
                [airflow, "config", "get-value", "database", "sql_alchemy_conn"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        done = ret.clean_airflow_db(policy, url, airflow=airflow, dry_run=args.dry_run)
        out["airflow_db_clean"] = {k: done[k] for k in ("argv", "exit_code", "output")}
        code = 0 if done["exit_code"] == 0 else 1
    print(json.dumps(out, indent=1))
    return code


def hosts(uncordon: str | None, cordon: str | None, reason: str) -> int:
    from trainflow.cluster.hosts import CordonPolicy, HostRegistry

    registry = HostRegistry()
    if uncordon:
        if not registry.uncordon(uncordon):
            raise SpecError("--uncordon", uncordon, "this host is not cordoned; see `trainflow hosts`")
    elif cordon:
        registry.cordon(cordon, reason=reason)
    print(json.dumps(registry.hosts(policy=CordonPolicy.from_env()), indent=1))
    return 0


def doctor(
    chip: str | None,
    queue: str | None,
    model: str | None,
    as_json: bool,
    register: bool,
    pool: str | None = None,
    labels: list[str] | None = None,
) -> int:
    from trainflow.chips.doctor import examine, format_report

    report = examine(explicit=chip, queue=queue, model=model)
    if register:
        report.update(register_host(report, pool=pool, labels=parse_labels(labels or [])))
    print(json.dumps(report, indent=1) if as_json else format_report(report))
    return 0 if report["healthy"] else 1


def parse_labels(words: list[str]) -> dict[str, str]:
    """``["rack=r1", "zone=a"]`` → ``{"rack": "r1", "zone": "a"}``.

    Raises:
        SpecError: a word that is not ``name=value``.
    """
    labels = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise SpecError("--label", word, "name=value, e.g. --label rack=r1")
        labels[key] = value
    return labels


def register_host(report: dict, *, pool: str | None, labels: dict[str, str]) -> dict:
    """Record this host in the inventory from the doctor's ``report``: its queue, family,
    model and chips in ``pool`` (default: its queue) with ``labels``. A host whose chips are
    unhealthy is registered cordoned, with the doctor's reason (its preflight lifts the
    cordon once the chips pass again). Returns what to add to the report."""
    from trainflow.cluster.hosts import HostRegistry, host_name

    registry, host = HostRegistry(), host_name()
    registry.register(
        host,
        queue=report["queue"],
        family=report["family"],
        devices=report["devices"] or 0,
        pool=pool,
        model=report.get("model") or "",
        labels=labels,
    )
    out = {"registered": host, "pool": pool or report["queue"], "labels": labels}
    if not report["healthy"]:
        reason = f"doctor at registration: {report['health'].get('detail') or 'unhealthy chips'}"
        out["cordoned"] = registry.cordon(host, reason=reason).reason
    return out


def worker(queues: str, pool: str | None, labels: list[str], concurrency: int, dry_run: bool) -> int:
    """Register this host (doctor) and become its Celery worker for ``queues``."""
    from trainflow.chips.doctor import examine

    chip_queues = [q for q in queues.split(",") if q and q != "default"]
    report = examine(queue=chip_queues[0]) if chip_queues else None
    if report is not None:
        added = register_host(report, pool=pool, labels=parse_labels(labels))
        print(
            json.dumps({"queue": report["queue"], "devices": report["devices"], "healthy": report["healthy"]} | added),
            flush=True,
        )
    argv = worker_argv(queues, concurrency)
    if dry_run:
        print(" ".join(argv))
        return 0
    os.execvp(argv[0], argv)
    return 1  # not reached


def worker_argv(queues: str, concurrency: int, host: str | None = None) -> list[str]:
    """``airflow celery worker`` for ``queues`` and this host's own queue of each chip queue
    (``<queue>@<host>``: the node tasks trainflow placed on this host), from this Python's
    environment."""
    from trainflow.cluster.hosts import host_name

    airflow = Path(sys.executable).parent / "airflow"
    return [
        str(airflow) if airflow.exists() else "airflow",
        "celery",
        "worker",
        "--queues",
        with_host_queues(queues, host or host_name()),
        "--concurrency",
        str(concurrency),
    ]


def with_host_queues(queues: str, host: str) -> str:
    """``queues`` and, for each chip queue among them, its queue on ``host``."""
    from trainflow.routing import host_queue

    names = [q for q in queues.split(",") if q]
    return ",".join(names + [host_queue(q, host) for q in names if q != "default" and "@" not in q])


def pods(spec_path: str, node: int | None, dag_id: str, run_id: str) -> int:
    from trainflow.cluster.hosts import HostRegistry
    from trainflow.launch.k8s import build_pod, to_yaml
    from trainflow.plan import build_plan
    from trainflow.workspace import Workspace, default_root

    spec = _spec(spec_path)
    ws = Workspace(default_root(), spec.tenant, dag_id, run_id)
    plan = build_plan(
        spec,
        dag_id=dag_id,
        run_id=run_id,
        run_dir=str(ws.dir),
        rdzv_endpoint="trainflow-rdzv:29400",
        rdzv_backend="c10d",
    )
    slots = range(len(plan["nodes"])) if node is None else [node]
    if node is not None and not 0 <= node < len(plan["nodes"]):
        raise SpecError("--node", node, f"the run has slots 0..{len(plan['nodes']) - 1}")
    cordoned = [h["host"] for h in HostRegistry().hosts(policy=_policy()) if h["cordoned"]]
    print(to_yaml([build_pod(plan, i, cordoned=cordoned) for i in slots]), end="")
    return 0


def helm_values(families: tuple[str, ...], image: str, tag: str) -> int:
    import yaml

    from trainflow.launch import helm

    values = helm.chart_values(families or helm.DEFAULT_FAMILIES, image=image, tag=tag)
    print(helm.HEADER + yaml.safe_dump(values, sort_keys=False), end="")
    return 0


def simulate_trace(
    trace: str,
    capacity: int,
    chips: int,
    policy: str,
    limit: int | None,
    plot_path: str | None,
    as_json: bool,
    checkpoint_interval: float | None,
    tenants: int,
) -> int:
    from trainflow.sched.model import Pool
    from trainflow.sched.simulate import format_report, plot, simulate
    from trainflow.sched.trace import load

    jobs = load(trace, chips_per_node=chips, tenants=tenants, limit=limit)
    report = simulate(
        jobs, pool=Pool.uniform(capacity, chips=chips), policy=policy, checkpoint_interval=checkpoint_interval
    )
    if plot_path:
        plot(report, plot_path)
    print(json.dumps(report.to_dict(series=False), indent=1) if as_json else format_report(report))
    return 0


def _policy():
    from trainflow.cluster.hosts import CordonPolicy

    return CordonPolicy.from_env()


def build_parser() -> argparse.ArgumentParser:
    """The ``trainflow`` parser, every subcommand included (the CLI reference is rendered
    from it, so it is built without side effects)."""
    parser = argparse.ArgumentParser(prog="trainflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a spec on this machine, without Airflow")
    p.add_argument("spec", help="the run's spec: a JSON file of TrainingSpec fields")
    p.add_argument("run_dir", type=Path, help="the run's workspace (created; an existing one resumes)")
    p = sub.add_parser("evaluate", help="evaluate a run's newest verified checkpoint")
    p.add_argument("run_dir", type=Path, help="the run's workspace")
    p = sub.add_parser("validate", help="validate a spec file")
    p.add_argument("spec", help="a JSON file of TrainingSpec fields")
    p = sub.add_parser("chaos", help="inject a fault into a running run on this host")
    p.add_argument("run_dir", type=Path, help="the running run's workspace")
    g = p.add_mutually_exclusive_group(required=True)
    for action in _SIGNALS:
        g.add_argument(f"--{action.replace('_', '-')}", type=int, metavar="RANK", help=_SIGNAL_HELP[action])
    p = sub.add_parser("hosts", help="list host failures and cordons; cordon or uncordon a host")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--uncordon", metavar="HOST")
    g.add_argument("--cordon", metavar="HOST")
    p.add_argument("--reason", default="cordoned by an operator")
    p = sub.add_parser("quota", help="list or set a pool's tenant quotas; a pool with quotas admits runs by fair share")
    p.add_argument("--pool", default="embedded", help="allocator pool (default: embedded)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--set", metavar="TENANT=NODES")
    g.add_argument("--unset", metavar="TENANT")
    p = sub.add_parser(
        "pool", help="show a node pool (size, policy, leases, queue); resize it or set its admission policy"
    )
    p.add_argument("--pool", default="embedded", help="allocator pool (default: embedded)")
    p.add_argument("--nodes", type=int, help="the pool's size in nodes")
    p.add_argument(
        "--policy",
        choices=["priority", "fifo", "backfill"],
        help="admission without quotas: priority (default), fifo, or backfill (EASY, on runtime estimates)",
    )
    p = sub.add_parser(
        "retention",
        help="delete what only accumulates: old finished runs' workspaces, "
        "old logs, stale rows; with --airflow-db also `airflow db clean`",
    )
    p.add_argument("--workspaces", type=Path, help="workspace root (default: $TRAINFLOW_HOME/runs)")
    p.add_argument("--logs", type=Path, help="Airflow logs folder (default: $AIRFLOW_HOME/logs)")
    p.add_argument("--workspace-days", type=float, help="keep finished runs' workspaces this long (default 7)")
    p.add_argument("--log-days", type=float, help="keep task logs this long (default 14)")
    p.add_argument("--airflow-days", type=float, help="keep Airflow metadata rows this long (default 30)")
    p.add_argument(
        "--airflow-db",
        action="store_true",
        help="also run `airflow db clean` (needs the metadata database: run it where the "
        "scheduler runs, not from a task)",
    )
    p.add_argument("--dry-run", action="store_true", help="report what would go; delete nothing")
    p = sub.add_parser("doctor", help="this host's chip family, devices, health, queue and worker command")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--chip", help="family to check (default: detected)")
    g.add_argument("--queue", help="queue this host should serve, e.g. ascend-910b")
    p.add_argument("--model", help="chip model for the queue name (default: the family's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--register",
        action="store_true",
        help="record this host in the inventory: queue, chips, pool, labels (provision checks "
        "nproc_per_node; a pool without a set size counts its registered hosts)",
    )
    p.add_argument("--pool", help="with --register: the node pool (default: the queue)")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="with --register: a label, e.g. rack=r1 (repeatable)",
    )
    p = sub.add_parser("worker", help="register this host (doctor --register) and run its Celery worker")
    p.add_argument("--queues", required=True, help="queues to serve, e.g. nvidia-gpu or default,cpu")
    p.add_argument("--pool", help="the node pool (default: the chip queue)")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a label of this host, e.g. rack=r1 (repeatable)",
    )
    p.add_argument("--concurrency", type=int, default=1, help="tasks at once (1 per chip host)")
    p.add_argument("--dry-run", action="store_true", help="register and print the worker command; do not start it")
    p = sub.add_parser("pods", help="print the Kubernetes pods of a run (dry run; applies nothing)")
    p.add_argument("spec", help="a JSON file of TrainingSpec fields")
    p.add_argument("--node", type=int, help="only this slot")
    p.add_argument("--dag-id", default="train_digits", help="the DAG the pods' labels name")
    p.add_argument("--run-id", default="manual__dry-run", help="the run the pods' labels name")
    p = sub.add_parser(
        "helm-values",
        help="values for the official Airflow Helm chart: one Celery "
        "worker set per chip queue (docker/helm/values.yaml)",
    )
    p.add_argument(
        "--family",
        action="append",
        help="chip family to give a worker set (repeatable; "
        "default: cpu nvidia ascend cambricon hygon kunlunxin mthreads)",
    )
    p.add_argument("--image", default="trainflow-airflow", help="the Airflow image the chart runs")
    p.add_argument("--tag", default="0.1.0", help="its tag")
    p = sub.add_parser(
        "simulate",
        help="replay a job trace (CSV) through a scheduling policy on a "
        "virtual clock and report utilization, JCT and queueing",
    )
    p.add_argument("--trace", required=True, help="CSV with job_id,submission_time,duration,num_gpu")
    p.add_argument("--capacity", type=int, required=True, metavar="NODES", help="nodes in the pool")
    p.add_argument("--chips", type=int, default=8, help="chips per node (default 8)")
    p.add_argument(
        "--policy",
        required=True,
        choices=["fifo", "backfill", "priority", "fairshare"],
        help="the admission policy to replay (docs/scheduler.md)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="only the first N jobs")
    p.add_argument("--tenants", type=int, default=4, help="tenants to hash jobs into (default 4)")
    p.add_argument(
        "--checkpoint-interval",
        type=float,
        metavar="S",
        help="seconds between a job's checkpoints (preemption loses the rest; default: none)",
    )
    p.add_argument("--plot", metavar="PNG", help="write utilization and queue length over time")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    from trainflow import cli_runs

    cli_runs.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from trainflow import cli_runs

    args = build_parser().parse_args(argv)
    if args.command in cli_runs.COMMANDS:
        return cli_runs.run(args)
    try:
        if args.command == "simulate":
            return simulate_trace(
                args.trace,
                args.capacity,
                args.chips,
                args.policy,
                args.limit,
                args.plot,
                args.json,
                args.checkpoint_interval,
                args.tenants,
            )
        if args.command == "helm-values":
            return helm_values(tuple(args.family or ()), args.image, args.tag)
        if args.command == "doctor":
            return doctor(args.chip, args.queue, args.model, args.json, args.register, args.pool, args.label)
        if args.command == "worker":
            return worker(args.queues, args.pool, args.label, args.concurrency, args.dry_run)
        if args.command == "pods":
            return pods(args.spec, args.node, args.dag_id, args.run_id)
        if args.command == "hosts":
            return hosts(args.uncordon, args.cordon, args.reason)
        if args.command == "retention":
            return retention(args)
        if args.command == "pool":
            return pool(args.pool, args.nodes, args.policy)
        if args.command == "quota":
            return quota(args.pool, args.set, args.unset)
        if args.command == "validate":
            print(_spec(args.spec).to_json())
            return 0
        if args.command == "train":
            from trainflow.launch.local import run_local

            codes = run_local(_spec(args.spec), args.run_dir)
            print(json.dumps({"exit_codes": codes}))
            return 0 if all(c == 0 for c in codes) else 1
        if args.command == "evaluate":
            from trainflow.worker.evaluate import evaluate

            print(json.dumps(evaluate(args.run_dir), sort_keys=True))
            return 0
        action = next(a for a in _SIGNALS if getattr(args, a) is not None)
        print(json.dumps(chaos(args.run_dir, action, getattr(args, action))))
        return 0
    except SpecError as exc:
        print(f"trainflow: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"trainflow: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
