"""The node agent: starts one node's workers under torch.distributed.elastic.

Run as ``python -m trainflow.launch.agent --plan PLAN --node I`` (the shard_train task
does this in its own process session). The elastic agent joins the gang's rendezvous,
spawns ``nproc_per_node`` workers, restarts them together with the rest of the gang on a
worker failure (up to ``max_restarts``), and exits non-zero if they cannot recover.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from trainflow.workspace import COMPLETE, GROW_ACK, completed, preempted, write_json_atomic

log = logging.getLogger(__name__)


def restore_priority() -> None:
    """Run the gang at normal CPU priority even under a niced control plane (where the OS
    allows raising it back; otherwise keep the inherited one)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


# Variables that name this host's own network interfaces: the value the node's host sets
# wins over the one provision propagated from its host (interface names differ by host).
HOST_LOCAL_SUFFIXES = ("_SOCKET_IFNAME", "_IB_HCA", "_HOST_ADDR")


def agent_env(plan: dict, node: int, host_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment the agent and its workers need (pure but for ``host_env``, default
    ``os.environ``)."""
    host_env = os.environ if host_env is None else host_env
    propagated = {
        k: v for k, v in plan.get("env", {}).items() if not (k.endswith(HOST_LOCAL_SUFFIXES) and host_env.get(k))
    }
    run_dir = plan.get("run_dir")
    # The launch contract's run-wide part (trainflow.program.CONTRACT); the rest is per gang.
    contract = (
        {
            "TRAINFLOW_RUN_ID": str(plan.get("run_id", "")),
            "TRAINFLOW_RUN_DIR": str(run_dir),
            "TRAINFLOW_CHECKPOINT_DIR": os.path.join(run_dir, "checkpoints"),
            "TRAINFLOW_PROGRESS": os.path.join(run_dir, "heartbeats"),
        }
        if run_dir
        else {}
    )
    return {
        **propagated,
        **contract,
        "TRAINFLOW_NODE": str(node),
        "TRAINFLOW_AGENT_PID": str(os.getpid()),
        "OMP_NUM_THREADS": "1",
        # Fresh worker store each round: the shared one caches stale addresses after
        # restarts.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }


# How often the agent checks its workers and, while they run, whether a peer waits in the
# rendezvous (torchrun's default).
MONITOR_INTERVAL_S = 0.1

# What torch elastic sleeps between reads of the rendezvous state while it waits for other
# nodes (``_delay(seconds=1)`` in ``_DistributedRendezvousOpExecutor.run``, torch 2.13.0).
TORCH_SYNC_DELAY_S = 1


def fast_rendezvous_polling(poll_s: float) -> bool:
    """Pace torch elastic's rendezvous in this process by ``poll_s`` instead of 1 s.

    Why: ``DynamicRendezvousHandler`` waits for other nodes by sleeping 1 s between reads
    of the shared state, serves reads from a 1 s cache (``_BackendRendezvousStateHolder``,
    ``cache_duration=1``), and skews the joins of round 0 by a random 0-0.3 s; it lets
    callers configure none of them. A worker restart in a multi-node gang waits on the
    sleep twice in a row (the restarted node for the round to reopen, the other for it to
    fill) after the peers noticed the waiting node through the cache. Measured on
    torch==2.13.0 with two real handlers on a c10d store: the waiting node was noticed
    after 1.04 s and the gang re-formed after 2.34 s; with ``poll_s=0.1``, 0.11 s and
    0.27 s. ``torchrun --standalone`` pays none of it (its one node fills its round alone).

    Every sleep of the rendezvous module is scaled by ``poll_s / 1 s`` (the SYNC poll and
    the skew alike, so torch's pacing keeps its proportions) and the cache lasts
    ``poll_s``; the protocol, its timeouts and keep-alives stay torch's. Each agent then
    reads the state once per ``poll_s`` while it waits or monitors its workers, which
    ``plan.rendezvous_poll_interval`` keeps affordable for the store. Only this agent
    process is changed.

    Fails safe: if this torch lacks either internal (renamed in a later release), nothing
    is changed, a warning says so, and the rendezvous keeps torch's default pace.

    Returns:
        Whether the pace was changed.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    delay = getattr(dr, "_delay", None)
    holder = getattr(dr, "_BackendRendezvousStateHolder", None)
    try:
        has_cache = holder is not None and "cache_duration" in inspect.signature(holder).parameters
    except (TypeError, ValueError):
        has_cache = False
    if not callable(delay) or not has_cache:
        log.warning(
            "torch %s: rendezvous internals changed (_delay, _BackendRendezvousStateHolder"
            "(cache_duration=)); keeping torch's 1 s rendezvous polling",
            _torch_version(),
        )
        return False
    scale = poll_s / TORCH_SYNC_DELAY_S

    def scaled_delay(seconds):
        delay(tuple(s * scale for s in seconds) if isinstance(seconds, tuple) else seconds * scale)

    class PolledStateHolder(holder):
        def __init__(self, backend, settings, cache_duration=poll_s):
            super().__init__(backend, settings, cache_duration)

    dr._delay = scaled_delay
    dr._BackendRendezvousStateHolder = PolledStateHolder
    return True


def observe_worker_exits(run_dir: Path, node: int, no_retry: frozenset[int] = frozenset()) -> bool:
    """Record every worker failure this agent sees in the run's timeline (``worker_exited``:
    rank, exit code, signal, the rank's last reported step), whatever caused it: a fault
    trainflow injected, a signal from outside, an OOM kill, a crash. The goodput books and
    the training page count faults from these observations.

    Why here: torch elastic's agent is the one process that reaps the workers and learns
    how they ended; it restarts them without telling anyone. Its monitor
    (``LocalElasticAgent._monitor_workers``) is wrapped in this process only; if this torch
    lacks it, nothing changes and a warning says so.

    An exit code in ``no_retry`` (the spec's ``exit_codes_no_retry``: the program's own word
    for a user error) aborts the run instead: no restart, no retry.

    Returns:
        Whether the monitor is observed.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from trainflow.heartbeat import read_all
    from trainflow.timeline import record

    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    if not callable(monitor):
        log.warning(
            "torch %s: LocalElasticAgent._monitor_workers is gone; worker exits are not "
            "recorded (faults from outside go uncounted)",
            _torch_version(),
        )
        return False

    def observed(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED:
            beats = read_all(Path(run_dir) / "heartbeats")
            for rank, failure in sorted(result.failures.items()):
                sig = failure.signal_name() if failure.exitcode < 0 else None
                record(
                    run_dir,
                    "worker_exited",
                    node=node,
                    rank=int(rank),
                    exitcode=int(failure.exitcode),
                    signal=None if sig in (None, "<N/A>") else sig,
                    pid=int(failure.pid),
                    step=(beats.get(int(rank)) or {}).get("step"),
                )
                if failure.exitcode in no_retry:
                    from trainflow.remediation import abort

                    message = (
                        f"rank {rank} exited with code {failure.exitcode}, which exit_codes_no_retry "
                        f"names a user error: the run stops instead of restarting"
                    )
                    record(run_dir, "user_error", rank=int(rank), message=message)
                    abort(
                        run_dir,
                        {
                            "rank": int(rank),
                            "kind": "user",
                            "type": "ExitCode",
                            "message": message,
                            "time": time.time(),
                        },
                    )
        return result

    LocalElasticAgent._monitor_workers = observed
    return True


def note_restarts(status_file: Path) -> bool:
    """Write the time into this node's status file (``restarted``) whenever the agent stops
    its workers to form a new round: after a worker failure, or to admit a node that waits
    in the rendezvous. The heartbeat watch gives the node's ranks the startup window from
    then (``heartbeat.node_starts``): the gang is recovering, not hung, while the round
    waits for a replacement node. The restart method is wrapped in this process only; if
    this torch lacks it, nothing changes and a warning says so.

    Returns:
        Whether restarts are noted.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    restart = getattr(SimpleElasticAgent, "_restart_workers", None)
    if not callable(restart):
        log.warning(
            "torch %s: SimpleElasticAgent._restart_workers is gone; a gang waiting for a "
            "replacement node may be judged hung",
            _torch_version(),
        )
        return False

    def noted(self, worker_group):
        try:
            status = json.loads(status_file.read_text())
            write_json_atomic(status_file, {**status, "restarted": time.time()})
        except (OSError, ValueError):
            pass  # the record is advisory: the restart goes on
        return restart(self, worker_group)

    SimpleElasticAgent._restart_workers = noted
    return True


def _gang_nonce(worker_group) -> str:
    """A token drawn once per gang and shared through the round's store: a relaunched gang
    (new agents, a new store, rounds counted from 0 again) never takes an old gang's name.
    Empty where the rendezvous gave no store."""
    store = getattr(worker_group, "store", None)
    if store is None:
        return ""
    if worker_group.group_rank == 0:
        store.set("trainflow/gang", uuid.uuid4().hex)
    return store.get("trainflow/gang").decode()


def name_each_gang() -> bool:
    """Give every gang an identity its ranks share (``TRAINFLOW_GANG``: the rendezvous id
    and round), set in this agent after each rendezvous so the workers it starts inherit
    it. A program's ranks key their agreement on the resume point by it
    (``launch.program``). Falls back to the gang's store address where this torch hides
    the round (a fresh store per round: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    rendezvous = getattr(SimpleElasticAgent, "_rendezvous", None)
    if not callable(rendezvous):
        log.warning(
            "torch %s: SimpleElasticAgent._rendezvous is gone; gangs are named by their store address", _torch_version()
        )
        return False

    def named(self, worker_group):
        result = rendezvous(self, worker_group)
        handler = worker_group.spec.rdzv_handler
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        round_ = getattr(state, "round", None)
        name = (
            f"{handler.get_run_id()}:{round_}"
            if round_ is not None
            else f"{worker_group.master_addr}:{worker_group.master_port}"
        )
        os.environ["TRAINFLOW_GANG"] = f"{name}:{_gang_nonce(worker_group)}"
        return result

    SimpleElasticAgent._rendezvous = named
    return True


def cheap_rendezvous_records() -> bool:
    """Name torch elastic's rendezvous events from one frame instead of ``inspect.stack()``.

    Why: every rendezvous action and keep-alive records an event named by
    ``dynamic_rendezvous.get_method_name()``, which calls ``inspect.stack()`` twice (source
    context for every frame), ~45 ms of CPU per call in an agent, even though the default
    event handler discards the event. Measured on torch==2.13.0 (2 nodes, 2 shared cores
    under load ~10): a restart's ``next_rendezvous`` took 0.25-0.64 s of CPU and 0.9-3.5 s
    of wall time per agent, almost all of it naming events; with this change 3-10 ms of
    CPU and 0.03-0.59 s of wall time (the rest is waiting for the peer). The keep-alive
    thread records while holding the handler's lock, which the monitor loop's check for
    waiting nodes needs too.

    The replacement returns the same name (the function ``depth`` frames up). Only this
    agent process is changed. Fails safe: if torch no longer has ``get_method_name``,
    nothing is changed and a warning says so.

    Returns:
        Whether the naming was replaced.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    if not callable(getattr(dr, "get_method_name", None)):
        log.warning(
            "torch %s: dynamic_rendezvous.get_method_name is gone; keeping torch's rendezvous event naming",
            _torch_version(),
        )
        return False

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    dr.get_method_name = get_method_name
    return True


def _torch_version() -> str:
    import torch

    return torch.__version__


def launch_config(plan: dict):
    from torch.distributed.launcher.api import LaunchConfig

    spec, rdzv = plan["spec"], plan["rendezvous"]
    nodes = int(spec["nodes"]) if str(spec["nodes"]).isdigit() else None  # plans before elastic gangs
    return LaunchConfig(
        min_nodes=rdzv.get("min_nodes", nodes),
        max_nodes=rdzv.get("max_nodes", nodes),
        nproc_per_node=spec["nproc_per_node"],
        run_id=rdzv["id"],
        rdzv_backend=rdzv["backend"],
        rdzv_endpoint=rdzv["endpoint"],
        rdzv_configs={
            "timeout": rdzv["timeout"],
            "join_timeout": rdzv["timeout"],
            "last_call_timeout": rdzv.get("last_call_timeout", 1),
            **{k: rdzv[k] for k in ("keep_alive_interval", "keep_alive_max_attempt") if k in rdzv},
        },
        max_restarts=plan["max_restarts"],
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
        role="trainer",
        # The address peers reach this node at (the gang's store when it holds group rank
        # 0); default: torch's lookup of the hostname, wrong where hostnames do not resolve
        # to the node's network (containers, namespaces, multi-homed hosts).
        local_addr=os.environ.get("TRAINFLOW_HOST_ADDR") or None,
    )


ABORT_EXIT_CODE = 3
# A completed run releases agents that are still running this long after its last step.
RELEASE_AFTER_S = 3.0


def gang_below_full_size(plan: dict, node: int, *, now: float) -> bool:
    """Whether an elastic gang is training without this node and short of its full size:
    joining now would restart it mid-interval, so the node asks for a grow window at the
    next checkpoint instead (``await_grow_window``)."""
    from trainflow.heartbeat import RankState, current_gang, read_all

    spec = plan["spec"]
    full = plan["rendezvous"].get("max_nodes", 0) * spec["nproc_per_node"]
    beats, world = current_gang(read_all(Path(plan["run_dir"]) / "heartbeats"), plan["world_size"])
    if not beats or world >= full or any(int(b.get("node", -1)) == node for b in beats.values()):
        return False
    fresh = 3 * float(spec["heartbeat_interval"])
    return len(beats) == world and all(
        b.get("state") in (RankState.TRAINING.value, RankState.CHECKPOINTING.value)
        and now - float(b.get("alive", b.get("time", 0))) <= fresh
        for b in beats.values()
    )


def await_grow_window(plan: dict, node: int) -> str:
    """Ask the running gang to let this node in at its next checkpoint and wait for it.

    Returns why the wait ended: ``ack`` (the gang committed a checkpoint and waits for
    joiners), ``stopped`` (the gang is not training now: it re-forms anyway, join at once)
    or ``complete`` (the run ended).
    """
    control = Path(plan["run_dir"]) / "control"
    control.mkdir(parents=True, exist_ok=True)
    asked = time.time()
    request = control / f"grow-request-{node:04d}.json"
    write_json_atomic(request, {"node": node, "time": asked})
    print(
        f"[node {node}] the gang trains without this node; asking to join at its next checkpoint",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            if completed(plan["run_dir"]):
                return "complete"
            try:
                ack = json.loads((control / GROW_ACK).read_text())
            except (OSError, ValueError):
                ack = None
            if ack is not None and float(ack.get("time", 0)) >= asked:
                print(f"[node {node}] joining at the checkpoint of step {ack.get('step')}", file=sys.stderr, flush=True)
                return "ack"
            if not gang_below_full_size(plan, node, now=time.time()):
                return "stopped"
            time.sleep(0.2)
    finally:
        request.unlink(missing_ok=True)


def _watch_abort(run_dir: Path, node: int, status_file: Path, started: float) -> None:
    """Stop this agent at once when the run is aborted (a user-code error somewhere).

    torch elastic would otherwise restart the workers, burning restarts on a bug that
    fails the same way every time.
    """
    import threading

    from trainflow.proctree import signal_tree
    from trainflow.remediation import abort_source, aborted

    complete = run_dir / "control" / COMPLETE

    def loop() -> None:
        done_since = None
        while (reason := aborted(run_dir)) is None:
            time.sleep(0.2)
            if not complete.exists():
                continue
            # The run trained to the end without this agent's workers finishing here:
            # a standing hot spare, or a node still waiting to join. Members end by
            # themselves within moments of the last step; whoever still waits is released.
            done_since = done_since or time.time()
            if time.time() - done_since >= RELEASE_AFTER_S:
                write_json_atomic(
                    status_file,
                    {"node": node, "state": "released", "pid": os.getpid(), "started": started, "ended": time.time()},
                )
                print(
                    f"[node {node}] the run completed without this node's workers; released",
                    file=sys.stderr,
                    flush=True,
                )
                for child in _children():
                    signal_tree(child)
                os._exit(0)
        write_json_atomic(
            status_file,
            {
                "node": node,
                "state": "aborted",
                "pid": os.getpid(),
                "started": started,
                "ended": time.time(),
                "error": reason.get("message"),
            },
        )
        print(
            f"[node {node}] run aborted by {abort_source(reason)}: {reason.get('message')}", file=sys.stderr, flush=True
        )
        for child in _children():
            signal_tree(child)
        os._exit(ABORT_EXIT_CODE)

    threading.Thread(target=loop, name="abort-watch", daemon=True).start()


def warm_starts(plan: dict) -> bool:
    """Workers start from a warm zygote unless ``TRAINFLOW_WARM_STARTS=0`` or the chip's
    runtime must see its environment before torch is imported (``launch.zygote``)."""
    from trainflow.launch import zygote

    return os.environ.get("TRAINFLOW_WARM_STARTS", "1") != "0" and zygote.usable(plan["spec"]["chip"])


def start_zygote(plan: dict, node: int) -> tuple[str, ...]:
    """Start this node's zygote (it imports the training stack while the gang forms);
    returns the worker command that torch elastic runs to have it fork a worker."""
    import subprocess

    from trainflow.launch import zygote

    path = zygote.socket_path(plan["run_dir"], node)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "trainflow.launch.zygote", "serve", path, str(os.getpid())])
    os.environ["TRAINFLOW_ZYGOTE_SOCKET"] = path
    os.environ["TRAINFLOW_ZYGOTE_PID"] = str(proc.pid)
    return ("-u", "-m", "trainflow.launch.zygote", "run", "trainflow.worker.train")


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
    # The workers run the user's code: they get only what training needs, none of the
    # task's secrets (Airflow's configuration, cloud credentials; ``launch.envtrim``).
    from trainflow.launch.envtrim import trim_this_process

    dropped = trim_this_process()
    if dropped:
        print(
            f"[node {node}] {len(dropped)} environment variables kept from the workers "
            f"(TRAINFLOW_WORKER_ENV_ALLOW adds names)",
            flush=True,
        )
    os.environ.update(agent_env(plan, node))
    # A tenant mapped to an OS user of its own (TRAINFLOW_TENANT_USERS): the workspace
    # becomes that user's (0700) and the workers drop to it before loading the workload.
    from trainflow.launch import runas

    os.environ.update(runas.hand_over(Path(plan["run_dir"]), plan["spec"]["tenant"]))
    status_file = Path(plan["run_dir"]) / "nodes" / f"node-{node:04d}.json"
    status_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    write_json_atomic(status_file, {"node": node, "state": "running", "pid": os.getpid(), "started": started})
    _watch_abort(Path(plan["run_dir"]), node, status_file, started)
    os.environ.setdefault("LOGLEVEL", "INFO")  # torch elastic's own loggers read it
    from torch.distributed.launcher.api import elastic_launch

    if (poll_s := plan["rendezvous"].get("poll_interval")) is not None:  # older plans: torch's pace
        fast_rendezvous_polling(poll_s)
    cheap_rendezvous_records()
    observe_worker_exits(Path(plan["run_dir"]), node, no_retry=frozenset(plan["spec"].get("exit_codes_no_retry") or ()))
    note_restarts(status_file)
    if plan["rendezvous"]["backend"] == "trainflow-db":
        from trainflow.launch import rdzv_db

        rdzv_db.register()

    name_each_gang()
    program = bool(plan["spec"].get("program"))
    sealer = None
    if program:  # the user's own program: each rank starts through launch.program
        from trainflow.launch.seal import Sealer

        worker = ("-u", "-m", "trainflow.launch.program")
        ranks = plan["nodes"][node]["ranks"] if node < len(plan["nodes"]) else []
        sealer = Sealer(Path(plan["run_dir"]), plan["spec"], ranks=ranks, node=node).start()
    else:
        worker = ("-u", "-m", "trainflow.worker.train")
    if not program and warm_starts(plan):
        worker = start_zygote(plan, node)
    if gang_below_full_size(plan, node, now=time.time()):
        # Ask to join only once this node's workers can start warm: the gang pauses for us.
        if "TRAINFLOW_ZYGOTE_SOCKET" in os.environ:
            from trainflow.launch import zygote

            zygote.wait_ready(os.environ["TRAINFLOW_ZYGOTE_SOCKET"], int(os.environ["TRAINFLOW_ZYGOTE_PID"]))
    if gang_below_full_size(plan, node, now=time.time()) and await_grow_window(plan, node) == "complete":
        write_json_atomic(
            status_file,
            {"node": node, "state": "released", "pid": os.getpid(), "started": started, "ended": time.time()},
        )
        return 0
    try:
        elastic_launch(launch_config(plan), entrypoint=sys.executable)(*worker, "--run-dir", plan["run_dir"])
        if sealer is not None:
            sealer.finish(node)  # the last commits sealed; a short or checkpoint-less program fails here
    except BaseException as exc:  # noqa: BLE001 - recorded, then the agent fails
        write_json_atomic(
            status_file,
            {
                "node": node,
                "state": "failed",
                "pid": os.getpid(),
                "started": started,
                "ended": time.time(),
                "error": f"{type(exc).__name__}: {exc}"[:4000],
            },
        )
        print(f"[node {node}] agent failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    stop = preempted(plan["run_dir"])  # the workers stopped at a checkpoint for a preemption
    write_json_atomic(
        status_file,
        {
            "node": node,
            "state": "preempted" if stop and "step" in stop else "succeeded",
            "pid": os.getpid(),
            "started": started,
            "ended": time.time(),
        },
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trainflow node agent")
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--node", required=True, type=int)
    parser.add_argument(
        "--preflight-try",
        type=int,
        metavar="TRY",
        help="run the node's preflight first, as try TRY (pods: the agent runs "
        "on the chip host, where the Airflow task does not)",
    )
    args = parser.parse_args(argv)
    if args.preflight_try is None:
        return run(args.plan, args.node)
    from trainflow.cluster.nodes import NodeTry
    from trainflow.errors import ChipUnavailableError, PreflightError

    attempt = NodeTry(json.loads(args.plan.read_text()), args.node, args.preflight_try)
    try:
        for check in attempt.begin():
            print(f"preflight {check.name}: {check.detail}", flush=True)
    except (PreflightError, ChipUnavailableError) as exc:
        print(f"preflight failed: {exc}", file=sys.stderr, flush=True)
        return PREFLIGHT_EXIT_CODE
    rc = run(args.plan, args.node)
    attempt.end(
        "succeeded" if rc == 0 else f"exit {rc}",
        failure=None if rc == 0 else f"node {args.node} agent exited with code {rc}",
    )
    return rc


# A pod whose preflight failed exits with this (EX_TEMPFAIL): Airflow's retry places it again.
PREFLIGHT_EXIT_CODE = 75


if __name__ == "__main__":
    sys.exit(main())
