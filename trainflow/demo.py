"""The README's demo: start the embedded stack, train digits over REST, show progress.

``python -m trainflow.demo`` (what ``scripts/demo`` runs) starts Airflow (or reuses the
running one), triggers ``train_digits`` over the REST API v2 with a conf, prints live
progress (step, loss, nodes) from the run's heartbeats, then the metrics, the checkpoint,
the UI address and the login. ``python -m trainflow.demo stop`` stops the stack;
``python -m trainflow.demo supervise`` runs it in the foreground, restarting any component
that exits, until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainflow import timeline
from trainflow.heartbeat import read_all
from trainflow.stack import EmbeddedStack

DEMO_CONF = {
    "nodes": 2,
    "steps": 300,
    "checkpoint_interval": 50,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 5.0,
    # one injected fault, to show self-healing: rank 1 is killed with SIGKILL
    "faults": [{"kind": "kill_rank", "rank": 1, "step": 120}],
}


_DESCRIBE = {
    "fault_injected": "FAULT     {kind} on rank {rank} at step {step}",
    "stall_detected": "DETECTED  {message} → replacing nodes {nodes}",
    "gang_start": "GANG      all ranks (re)started at step {step}",
    "resumed": "RESUMED   the gang restarted together from verified checkpoint step {step}",
    "crash_loop": "STOPPED   {message}",
    "user_error": "USER BUG  rank {rank}: {message} (run aborted, no retries)",
    "straggler": "STRAGGLER rank {rank} computes {compute_ms} ms/step vs peers' {median_ms} ms",
    "membership": "MEMBERS   gang {change} at step {step}: world {world_from} → {world_to}, "
    "nodes {nodes_from} → {nodes_to}",
}


def describe(event: dict) -> str | None:
    """A timeline event as one terminal line; None for events the demo does not show."""
    template = _DESCRIBE.get(event["event"])
    return template.format(**event) if template else None


def _stack(port: int) -> EmbeddedStack:
    # The demo rehearses a fault (a killed rank), so its stack allows fault schedules; the
    # checkout's examples/ are allowed programs unless TRAINFLOW_PROGRAM_ROOTS says otherwise.
    examples = Path(__file__).resolve().parents[1] / "examples"
    roots = os.environ.get("TRAINFLOW_PROGRAM_ROOTS") or str(examples)
    return EmbeddedStack.from_env(
        port=port,
        allow_faults=True,  # TRAINFLOW_PROFILE=embedded|distributed
        extra_env={"TRAINFLOW_PROGRAM_ROOTS": roots},
    )


def progress_line(beats: dict[int, dict], world: int) -> str:
    if not beats:
        return "waiting for the first heartbeats"
    steps = [b["step"] for b in beats.values()]
    total = max(b.get("total", 0) for b in beats.values())
    losses = [b["loss"] for b in beats.values() if isinstance(b.get("loss"), (int, float))]
    nodes = {b["node"] for b in beats.values()}
    states = sorted({b["state"] for b in beats.values()})
    ckpt = max((b.get("checkpoint_step", 0) for b in beats.values()), default=0)
    loss = f"loss {sum(losses) / len(losses):.4f}" if losses else "loss -"
    sps = sum(b.get("samples_per_s", 0.0) for b in beats.values())
    return (
        f"step {min(steps)}/{total}  {loss}  {sps:,.0f} samples/s  ranks {len(beats)}/{world} on "
        f"{len(nodes)} nodes ({', '.join(states)})  last checkpoint {ckpt}"
    )


def watch(client, dag_id: str, run_id: str, *, timeout: float, out=sys.stdout) -> dict:
    """Print task transitions and training progress until the run ends."""
    start, seen, run_dir, world, last_line, shown = time.time(), {}, None, 0, "", 0

    def on_poll(run: dict) -> None:
        nonlocal run_dir, world, last_line, shown
        for ti in sorted(client.task_instances(dag_id, run_id), key=lambda t: (t["task_id"], t["map_index"])):
            key = (ti["task_id"], ti["map_index"])
            if ti["state"] and seen.get(key) != ti["state"]:
                seen[key] = ti["state"]
                name = ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")
                print(f"[{time.time() - start:6.1f}s] {name:<20} {ti['state']}", file=out, flush=True)
        if run_dir is None and seen.get(("provision", -1)) == "success":
            run_dir = Path(client.xcom(dag_id, run_id, "provision", "run_dir"))
            world = client.xcom(dag_id, run_id, "provision", "plan")["world_size"]
        if run_dir is not None:
            events = timeline.read(run_dir)
            for event in events[shown:]:
                if (text := describe(event)) is not None:
                    print(f"[{time.time() - start:6.1f}s] ! {text}", file=out, flush=True)
            shown = len(events)
            line = progress_line(read_all(run_dir / "heartbeats"), world)
            if line != last_line:
                print(f"[{time.time() - start:6.1f}s]   {line}", file=out, flush=True)
                last_line = line

    return client.wait_run(dag_id, run_id, timeout=timeout, poll=1.0, on_poll=on_poll)


def demo(args) -> int:
    stack = _stack(args.port)
    print(f"starting the embedded stack (Airflow home {stack.home}) ...", flush=True)
    t0 = time.time()
    stack.up(timeout=300)
    print(f"stack healthy in {time.time() - t0:.1f}s at {stack.url}", flush=True)
    client = stack.client()
    client.wait_for_dag(args.dag, timeout=180)
    client.unpause(args.dag)
    conf = json.loads(args.conf)
    run = client.trigger(args.dag, conf)
    run_id = run["dag_run_id"]
    print(f"triggered {args.dag} run {run_id} over REST with conf {json.dumps(conf)}", flush=True)
    final = watch(client, args.dag, run_id, timeout=args.timeout)
    user, password = stack.credentials()
    print(f"\nrun {run_id}: {final['state'].upper()}")
    if final["state"] == "success":
        metrics = client.xcom(args.dag, run_id, "evaluate", "metrics")
        ckpt = client.xcom(args.dag, run_id, "checkpoint_sync", "checkpoint")
        shown = {k: v for k, v in metrics.items() if k not in ("report",)}
        print(f"metrics    {json.dumps(shown)}")
        print(f"checkpoint step {ckpt['step']} verified ({ckpt['bytes']:,} bytes) {ckpt['path']}")
        print(f"report     {metrics['report']}")
        report = json.loads(Path(metrics["report"]).read_text())
        for f in (report.get("goodput") or {}).get("faults", []):
            print(
                f"healed     {f['kind']} at step {f.get('step')}: training resumed {f.get('recovery_s')}s "
                f"later from step {f.get('resumed_from_step')}, {f.get('steps_lost')} steps redone"
            )
        if report.get("goodput"):
            print(f"goodput    {report['goodput']['goodput']:.1%} of {report['goodput']['wall_s']:.1f}s")
    print(f"\nAirflow UI {stack.url}/dags/{args.dag}   login: {user} / {password}")
    print("stop everything with: scripts/demo stop")
    return 0 if final["state"] == "success" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trainflow embedded demo")
    parser.add_argument("action", nargs="?", default="run", choices=["run", "up", "supervise", "stop", "status"])
    parser.add_argument("--port", type=int, default=int(os.environ.get("TRAINFLOW_PORT", "8080")))
    parser.add_argument("--dag", default="train_digits")
    parser.add_argument("--conf", default=json.dumps(DEMO_CONF))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    stack = _stack(args.port)
    if args.action == "stop":
        stopped = stack.stop()
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
        return 0
    if args.action == "status":
        print(
            json.dumps(
                {
                    "url": stack.url,
                    "health": stack.health(),
                    "pids": {c: stack.pid(c) for c in ("api-server", "scheduler", "dag-processor", "triggerer")},
                },
                indent=1,
            )
        )
        return 0
    if args.action == "up":
        stack.up(timeout=300)
        user, password = stack.credentials()
        print(f"Airflow UI {stack.url}   login: {user} / {password}")
        return 0
    if args.action == "supervise":
        return supervise(stack)
    return demo(args)


def supervise(stack: EmbeddedStack, interval: float = 5.0) -> int:
    """Start the stack and keep it running in the foreground (for systemd, a container's
    init, or nohup): a component that exits is started again within ``interval`` seconds
    (``EmbeddedStack.supervise``). SIGTERM or Ctrl-C stops the stack and returns."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stack.up(timeout=300)
    user, password = stack.credentials()
    print(f"Airflow UI {stack.url}   login: {user} / {password}; supervising (SIGTERM stops)", flush=True)
    try:
        stack.supervise(
            stop, interval=interval, on_restart=lambda started: print(f"restarted {', '.join(started)}", flush=True)
        )
    finally:
        stopped = stack.stop()
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
