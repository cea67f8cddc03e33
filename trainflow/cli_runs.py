"""The run commands of ``trainflow``: submit, status, watch, runs, logs, cancel — over
Airflow's REST API v2 (triggering, states, logs) and the training page's JSON API
(progress, node health).

Where the server is: ``--url`` or ``TRAINFLOW_URL`` (default ``http://127.0.0.1:8080``).
Who you are: ``TRAINFLOW_USER``/``TRAINFLOW_PASSWORD``, else the embedded stack's generated
admin credentials (``.airflow/trainflow-secrets.json`` of this checkout, or ``AIRFLOW_HOME``).

Exit codes: 0 success (or, for ``status``, still running), 1 the run failed, 2 bad input or
an unknown run (the server's message is printed, never a traceback), 3 the server could not
be reached.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from trainflow.errors import SpecError
from trainflow.rest import _q

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_DAG = "train_digits"
DONE = ("success", "failed")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNREACHABLE = 0, 1, 2, 3


def add_parsers(sub) -> None:
    """Register the run commands on ``trainflow``'s subparsers."""

    def common(p, run: bool = True) -> None:
        p.add_argument("--url", default=None, help=f"Airflow api-server (default $TRAINFLOW_URL or {DEFAULT_URL})")
        p.add_argument("--dag", default=DEFAULT_DAG, help=f"the training DAG (default {DEFAULT_DAG})")
        p.add_argument("--json", action="store_true", help="print JSON for scripts")
        if run:
            p.add_argument("run_id", help="the DAG run id")

    p = sub.add_parser("submit", help="start a run: a spec file and/or --set field=value, validated first")
    p.add_argument("spec", nargs="?", help="spec JSON file (optional)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a spec field (JSON value or plain string); repeatable",
    )
    p.add_argument("--run-id", help="the DAG run id (default: Airflow's)")
    p.add_argument("--watch", action="store_true", help="then watch it to the end (exit 1 if it fails)")
    common(p, run=False)
    p = sub.add_parser("status", help="a run's state, tasks, progress and node health")
    common(p)
    p = sub.add_parser("watch", help="follow a run to its end with a progress line (exit 1 if it fails)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between updates")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="give up after this many seconds")
    common(p)
    p = sub.add_parser("runs", help="the DAG's recent runs")
    p.add_argument("--limit", type=int, default=20, help="at most this many runs, newest first")
    common(p, run=False)
    p = sub.add_parser("logs", help="a task's log of a run")
    p.add_argument("--task", default="shard_train", help="the task id")
    p.add_argument("--map-index", type=int, default=None, help="node (default: 0 for shard_train)")
    p.add_argument("--try", dest="try_number", type=int, default=None, help="try (default: the latest)")
    common(p)
    p = sub.add_parser("cancel", help="stop a run: Airflow marks it failed and kills its tasks")
    common(p)


COMMANDS = ("submit", "status", "watch", "runs", "logs", "cancel")


def run(args) -> int:
    """Dispatch a run command; map every error to a message and an exit code."""
    from trainflow.rest import RestError

    try:
        client = connect(args.url)
        return globals()[f"cmd_{args.command}"](client, args)
    except SpecError as exc:
        print(f"trainflow: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RestError as exc:
        print(f"trainflow: {_server_message(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT if 400 <= exc.status < 500 else EXIT_UNREACHABLE
    except (OSError, TimeoutError) as exc:
        print(f"trainflow: cannot reach the server: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE


def _server_message(exc) -> str:
    detail = exc.detail
    if isinstance(detail, list):  # FastAPI validation errors
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" for d in detail)
    return f"{exc.method} {exc.path}: HTTP {exc.status}: {detail}"


def credentials(env=None) -> tuple[str, str]:
    """``TRAINFLOW_USER``/``TRAINFLOW_PASSWORD``, else the embedded stack's admin."""
    env = os.environ if env is None else env
    if env.get("TRAINFLOW_USER") and env.get("TRAINFLOW_PASSWORD"):
        return env["TRAINFLOW_USER"], env["TRAINFLOW_PASSWORD"]
    homes = [Path(env["AIRFLOW_HOME"])] if env.get("AIRFLOW_HOME") else []
    homes.append(Path(__file__).resolve().parents[1] / ".airflow")
    for home in homes:
        secrets = home / "trainflow-secrets.json"
        if secrets.exists():
            return "admin", json.loads(secrets.read_text())["admin_password"]
    raise SpecError(
        "credentials",
        None,
        "set TRAINFLOW_USER and TRAINFLOW_PASSWORD (no embedded stack secrets found to use instead)",
    )


def connect(url: str | None):
    from trainflow.rest import AirflowClient

    return AirflowClient(url or os.environ.get("TRAINFLOW_URL") or DEFAULT_URL, *credentials())


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``field=value`` words → a conf (values parsed as JSON where they are JSON)."""
    conf: dict[str, Any] = {}
    for item in items:
        field, sep, raw = item.partition("=")
        if not sep or not field:
            raise SpecError("--set", item, "write field=value, e.g. --set steps=300")
        try:
            conf[field] = json.loads(raw)
        except ValueError:
            conf[field] = raw
    return conf


def cmd_submit(client, args) -> int:
    from trainflow.spec import TrainingSpec

    conf = json.loads(Path(args.spec).read_text()) if args.spec else {}
    if not isinstance(conf, dict):
        raise SpecError("spec", args.spec, "the file must hold a JSON object of spec fields")
    conf.update(parse_sets(args.set))
    TrainingSpec.from_mapping(conf)  # refused here, with the field, before the server sees it
    client.unpause(args.dag)
    out = client.trigger(args.dag, conf, run_id=args.run_id)
    run_id = out["dag_run_id"]
    print(
        json.dumps({"dag_id": args.dag, "run_id": run_id, "state": out.get("state")})
        if args.json
        else f"submitted {args.dag}/{run_id}"
    )
    if args.watch:
        args.run_id, args.interval, args.timeout = run_id, 2.0, 24 * 3600.0
        return cmd_watch(client, args)
    return EXIT_OK


def status(client, dag: str, run_id: str) -> dict[str, Any]:
    """The run's Airflow state, its task states, and its progress from the training API."""
    from trainflow.rest import RestError

    run = client.run(dag, run_id)
    tis = client.task_instances(dag, run_id)
    tasks = {
        f"{t['task_id']}[{t['map_index']}]" if t["map_index"] >= 0 else t["task_id"]: {
            "state": t["state"],
            "try": t["try_number"],
        }
        for t in tis
    }
    tenant = (run.get("conf") or {}).get("tenant", "default")
    try:
        detail = client.call("GET", f"/trainflow/api/runs/{tenant}/{dag}/{run_id}")
    except RestError as exc:
        if exc.status != 404:  # no workspace yet (provision has not run): no progress
            raise
        detail = None
    shards = {t["map_index"]: t for t in tis if t["task_id"] == "shard_train" and t["map_index"] >= 0}
    return {
        "dag_id": dag,
        "run_id": run_id,
        "state": run["state"],
        "tasks": tasks,
        "progress": detail,
        "nodes": node_rows(shards, detail),
        "reason": (detail or {}).get("state_reason"),
    }


def node_rows(shards: dict[int, dict], detail: dict | None) -> list[dict[str, Any]]:
    """Per node: its ``shard_train`` task instance's Airflow state and try (``shards``, by map
    index), and from the run's workspace (``detail``, the training API's run) its agent's
    state, host, try within the run's retry budget, tries left and the host's cordon."""
    agents = {a.get("node"): a for a in ((detail or {}).get("node_agents") or [])}
    rows = []
    for i in sorted(set(shards) | set(agents)):
        task, agent = shards.get(i) or {}, agents.get(i) or {}
        rows.append(
            {
                "node": i,
                "task_state": task.get("state"),
                "airflow_try": task.get("try_number"),
                "agent_state": agent.get("state"),
                "host": agent.get("host"),
                "try": agent.get("try"),
                "tries_left": agent.get("tries_left"),
                "cordoned": agent.get("cordoned"),
            }
        )
    return rows


def progress_line(st: dict[str, Any], started: float | None = None, now: float | None = None) -> str:
    """One line: state, a bar of steps, loss, samples/s, ETA, node health."""
    detail = st.get("progress") or {}
    step, total = detail.get("step") or 0, detail.get("total_steps") or 0
    width = 24
    filled = min(width, int(width * step / total)) if total else 0
    bar = "#" * filled + "." * (width - filled)
    parts = [f"{st['state']:<8}", f"[{bar}] {step}/{total or '?'}"]
    if detail.get("loss") is not None:
        parts.append(f"loss {detail['loss']:.4f}")
    if detail.get("samples_per_s"):
        parts.append(f"{detail['samples_per_s']:.0f} samples/s")
    now = time.time() if now is None else now
    if started is not None and total and 0 < step < total:
        eta = (now - started) / step * (total - step)
        parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    ranks = [r for r in detail.get("ranks") or [] if r.get("in_gang", True)]
    if ranks:
        parts.append(f"ranks {sum(1 for r in ranks if r.get('healthy'))}/{len(ranks)} healthy")
    return "  ".join(parts)


def cmd_status(client, args) -> int:
    st = status(client, args.dag, args.run_id)
    if args.json:
        print(json.dumps(st, indent=1, sort_keys=True))
    else:
        print(f"{args.dag}/{args.run_id}: {progress_line(st)}")
        if st.get("reason"):
            print(f"  why: {st['reason']}")
        for n in st["nodes"]:
            left = "" if n["tries_left"] is None else f", {n['tries_left']} left"
            cordon = f"  CORDONED: {n['cordoned'].get('reason')}" if n.get("cordoned") else ""
            print(
                f"  node {n['node']:<3} task {n['task_state'] or 'none':<12} agent {n['agent_state'] or '-':<10} "
                f"host {n['host'] or '-':<16} try {n['try'] if n['try'] is not None else n['airflow_try']}{left}{cordon}"
            )
        for name, t in sorted(st["tasks"].items()):
            print(f"  {name:<24} {t['state'] or 'none':<14} try {t['try']}")
    return EXIT_FAILED if st["state"] == "failed" else EXIT_OK


def cmd_watch(client, args) -> int:
    started, deadline = time.time(), time.time() + args.timeout
    interactive = sys.stdout.isatty() and not args.json
    while True:
        st = status(client, args.dag, args.run_id)
        line = progress_line(st, started=started)
        if args.json:
            detail = st["progress"] or {}
            print(
                json.dumps(
                    {
                        "state": st["state"],
                        "step": detail.get("step"),
                        "total_steps": detail.get("total_steps"),
                        "loss": detail.get("loss"),
                    }
                ),
                flush=True,
            )
        else:
            print(("\r" if interactive else "") + line, end="" if interactive else "\n", flush=True)
        if st["state"] in DONE:
            if interactive:
                print()
            return EXIT_OK if st["state"] == "success" else EXIT_FAILED
        if time.time() > deadline:
            print(f"\ntrainflow: still {st['state']} after {args.timeout:.0f} s", file=sys.stderr)
            return EXIT_FAILED
        time.sleep(args.interval)


def cmd_runs(client, args) -> int:
    runs = client.call("GET", f"/api/v2/dags/{_q(args.dag)}/dagRuns?limit={int(args.limit)}&order_by=-run_after")[
        "dag_runs"
    ]
    rows = [
        {
            "run_id": r["dag_run_id"],
            "state": r["state"],
            "tenant": (r.get("conf") or {}).get("tenant", "default"),
            "start": r.get("start_date"),
            "end": r.get("end_date"),
        }
        for r in runs
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['run_id']:<40} {r['state']:<8} {r['tenant']:<12} {r['start'] or ''}")
    return EXIT_OK


def cmd_logs(client, args) -> int:
    map_index = args.map_index if args.map_index is not None else (0 if args.task == "shard_train" else -1)
    tis = [
        t
        for t in client.task_instances(args.dag, args.run_id)
        if t["task_id"] == args.task and t["map_index"] == map_index
    ]
    if not tis:
        raise SpecError("--task", f"{args.task}[{map_index}]", f"no such task instance in run {args.run_id}")
    try_number = args.try_number or max(1, tis[0]["try_number"])
    text = client.task_log(args.dag, args.run_id, args.task, try_number, map_index=map_index)
    lines = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
            lines.append(
                f"{event.get('timestamp', '')} {event.get('event', line)}" if isinstance(event, dict) else line
            )
        except ValueError:
            lines.append(line)
    print("\n".join(lines))
    return EXIT_OK


# Task states that cancelling ends (the release teardown is left to run: it frees the lease).
ACTIVE = ("running", "queued", "scheduled", "deferred", "up_for_retry", "up_for_reschedule", "restarting")


def cmd_cancel(client, args, *, recheck: int = 3, interval: float = 1.0) -> int:
    """Fail the run's active task instances (Airflow kills the running ones; no retry
    follows an externally set state); downstream tasks then fail upstream and the run fails,
    while the release teardown still frees its nodes. A run with no active task yet is
    marked failed directly.

    A task failed while it is deferring (the heartbeat sensor just after it starts) can
    have its deferral land after the new state and stay deferred, its trigger holding the
    run open until it fires (seen: five minutes). So the run is looked at ``recheck`` more
    times, ``interval`` seconds apart, and whatever is active again is failed again."""
    run = client.run(args.dag, args.run_id)
    if run["state"] in DONE:
        print(f"{args.dag}/{args.run_id} already ended: {run['state']}")
        return EXIT_OK
    base = f"/api/v2/dags/{_q(args.dag)}/dagRuns/{_q(args.run_id)}"

    def fail_active() -> int:
        active = [
            t
            for t in client.task_instances(args.dag, args.run_id)
            if t["state"] in ACTIVE and t["task_id"] != "release"
        ]
        for t in active:
            path = f"{base}/taskInstances/{_q(t['task_id'])}" + (f"/{t['map_index']}" if t["map_index"] >= 0 else "")
            client.call("PATCH", path, {"new_state": "failed", "note": "cancelled with trainflow cancel"})
        return len(active)

    active = fail_active()
    if not active:
        client.call("PATCH", base, {"state": "failed"})
    else:
        for _ in range(recheck):
            time.sleep(interval)
            if client.run(args.dag, args.run_id)["state"] in DONE:
                break
            fail_active()
    print(f"cancelled {args.dag}/{args.run_id}" + (f" ({active} task instances failed)" if active else ""))
    return EXIT_OK
