"""The node agent: starts one node's workers under torch.distributed.elastic.

Run as ``python -m trainflow.launch.agent --plan PLAN --node I`` (the shard_train task
does this in its own process session). The elastic agent joins the gang's rendezvous,
spawns ``nproc_per_node`` workers, restarts them together with the rest of the gang on a
worker failure (up to ``max_restarts``), and exits non-zero if they cannot recover.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainflow.workspace import write_json_atomic


def restore_priority() -> None:
    """Run the gang at normal CPU priority even under a niced control plane (where the OS
    allows raising it back; otherwise keep the inherited one)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


def agent_env(plan: dict, node: int) -> dict[str, str]:
    """Environment the agent and its workers need (pure)."""
    return {
        **plan.get("env", {}),
        "TRAINFLOW_NODE": str(node),
        "TRAINFLOW_AGENT_PID": str(os.getpid()),
        "OMP_NUM_THREADS": "1",
        # Fresh worker store each round: the shared one caches stale addresses after
        # restarts (DESIGN.md §2).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def launch_config(plan: dict):
    from torch.distributed.launcher.api import LaunchConfig

    spec, rdzv = plan["spec"], plan["rendezvous"]
    return LaunchConfig(
        min_nodes=spec["nodes"], max_nodes=spec["nodes"], nproc_per_node=spec["nproc_per_node"],
        run_id=rdzv["id"], rdzv_backend=rdzv["backend"], rdzv_endpoint=rdzv["endpoint"],
        rdzv_configs={"timeout": rdzv["timeout"], "last_call_timeout": 1},
        max_restarts=plan["max_restarts"], monitor_interval=0.2, start_method="spawn",
        role="trainer",
    )


ABORT_EXIT_CODE = 3


def _watch_abort(run_dir: Path, node: int, status_file: Path, started: float) -> None:
    """Stop this agent at once when the run is aborted (a user-code error somewhere).

    torch elastic would otherwise restart the workers, burning restarts on a bug that
    fails the same way every time.
    """
    import threading

    from trainflow.proctree import signal_tree

    from trainflow.remediation import aborted

    def loop() -> None:
        while (reason := aborted(run_dir)) is None:
            time.sleep(0.2)
        write_json_atomic(status_file, {"node": node, "state": "aborted", "pid": os.getpid(),
                                        "started": started, "ended": time.time(), "error": reason.get("message")})
        print(f"[node {node}] run aborted by rank {reason.get('rank')}: {reason.get('message')}",
              file=sys.stderr, flush=True)
        for child in _children():
            signal_tree(child)
        os._exit(ABORT_EXIT_CODE)

    threading.Thread(target=loop, name="abort-watch", daemon=True).start()


def _children() -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process().children()]


def run(plan_path: Path, node: int) -> int:
    from trainflow.proctree import die_with_parent

    # The agent lives in its own session; without this it would outlive a killed
    # shard_train task and keep training beside the task's replacement.
    die_with_parent(os.getppid())
    restore_priority()
    plan = json.loads(Path(plan_path).read_text())
    os.environ.update(agent_env(plan, node))
    status_file = Path(plan["run_dir"]) / "nodes" / f"node-{node:04d}.json"
    status_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    write_json_atomic(status_file, {"node": node, "state": "running", "pid": os.getpid(),
                                    "started": started})
    _watch_abort(Path(plan["run_dir"]), node, status_file, started)
    os.environ.setdefault("LOGLEVEL", "INFO")  # torch elastic's own loggers read it
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(launch_config(plan), entrypoint=sys.executable)(
            "-u", "-m", "trainflow.worker.train", "--run-dir", plan["run_dir"])
    except BaseException as exc:  # noqa: BLE001 - recorded, then the agent fails
        write_json_atomic(status_file, {"node": node, "state": "failed", "pid": os.getpid(),
                                        "started": started, "ended": time.time(),
                                        "error": f"{type(exc).__name__}: {exc}"[:4000]})
        print(f"[node {node}] agent failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    write_json_atomic(status_file, {"node": node, "state": "succeeded", "pid": os.getpid(),
                                    "started": started, "ended": time.time()})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trainflow node agent")
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--node", required=True, type=int)
    args = parser.parse_args(argv)
    return run(args.plan, args.node)


if __name__ == "__main__":
    sys.exit(main())
