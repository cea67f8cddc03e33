"""One rank of the user's own program: ``python -m trainflow.launch.program --run-dir DIR``.

The node agent starts this on every rank where the built-in loop would start; it

1. agrees with the gang on where to resume: rank 0 picks the newest *verified* checkpoint
   (and counts the gang starts so far: ``TRAINFLOW_ATTEMPT``, and the crash loop), records
   the gang's start in the timeline and writes its decision to ``control/gang.json`` keyed
   by the gang (``TRAINFLOW_GANG``, set by the agent per rendezvous round); the other ranks
   wait for that decision, so every rank resumes from the same checkpoint even while one
   is being sealed;
2. becomes what the run's worker must be: the tenant's OS user, the chip's visibility
   variables, the spec's resource limits, dying with its agent;
3. sets the launch contract's variables (``trainflow.program.CONTRACT``), resolves the
   placeholders of ``program`` and ``exec``s it in the run's ``working_dir``, so the process
   torch elastic watches is the program itself (its exit code, its signal); its output
   passes through a tap (``tap_output``) that tells the node agent when the rank last
   printed: a program without the SDK is alive while it prints or checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainflow.errors import CrashLoopError
from trainflow.workspace import write_json_atomic

GANG_FILE = "gang.json"
# Where each rank's tap marks its last output (the file's mtime): ``output/rank-<r>``.
OUTPUT_DIR = "output"


def output_mark(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / OUTPUT_DIR / f"rank-{rank:05d}"


def tap_output(mark: Path, every: float = 1.0) -> int:
    """Route this process's stdout and stderr (the program's, once it is exec'd) through
    pipes read by a forked tap that copies every byte to where it went before and touches
    ``mark`` at most every ``every`` seconds. The tap ignores the signals that stop a gang
    (the program gets them) and ends when the program and its children close the pipes.
    Returns the tap's pid."""
    import selectors
    import signal

    mark.parent.mkdir(parents=True, exist_ok=True)
    pipes = {fd: os.pipe() for fd in (1, 2)}
    pid = os.fork()
    if pid == 0:  # the tap
        try:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            sel = selectors.DefaultSelector()
            for fd, (r, w) in pipes.items():
                os.close(w)
                sel.register(r, selectors.EVENT_READ, fd)
            last, open_ = 0.0, len(pipes)
            while open_:
                for key, _ in sel.select():
                    try:
                        data = os.read(key.fd, 65536)
                    except InterruptedError:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        open_ -= 1
                        continue
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(key.data, view) :]
                    except OSError:
                        pass  # nobody reads the output any more: keep draining the program's
                    if (now := time.time()) - last >= every:
                        last = now
                        try:
                            mark.touch()
                        except OSError:
                            pass
        finally:
            os._exit(0)
    for fd, (r, w) in pipes.items():
        os.close(r)
        os.dup2(w, fd)
        os.close(w)
    return pid


def gang_key(env=os.environ) -> str:
    """This gang's identity, the same on every rank: the agent's rendezvous round, or the
    gang's store address (a fresh store per round)."""
    return env.get("TRAINFLOW_GANG") or f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"


def decide(run_dir: Path, spec, world: int, gang: str) -> dict:
    """Rank 0: the gang's resume point, attempt number, and its start in the timeline.

    Raises:
        CrashLoopError: the gang restarted ``crash_loop_limit`` times from the same step.
    """
    from trainflow import timeline
    from trainflow.checkpoint import manifest
    from trainflow.worker.train import crash_restarts

    ref = manifest.newest_verified(
        run_dir / "checkpoints", training_hash=spec.training_hash(), world_size=None if spec.elastic else world
    )
    start = ref.step if ref else 0
    events = timeline.read(run_dir)
    attempt = sum(1 for e in events if e["event"] == "gang_start")
    earlier = crash_restarts(events, start)
    timeline.record(run_dir, "gang_start", step=start, world=world, attempt=attempt, program=True)
    if ref is not None:
        timeline.record(run_dir, "resumed", step=start, checkpoint=ref.path)
    if earlier >= spec.crash_loop_limit:
        raise CrashLoopError(
            f"crash loop: the gang restarted {earlier} times from step {start} without "
            f"reaching a newer checkpoint (crash_loop_limit={spec.crash_loop_limit}); "
            f"stopping instead of retrying"
        )
    decision = {
        "gang": gang,
        "attempt": attempt,
        "resume_from": ref.path if ref else "",
        "step": start,
        "time": time.time(),
    }
    write_json_atomic(run_dir / "control" / GANG_FILE, decision)
    return decision


def await_decision(run_dir: Path, gang: str, timeout: float) -> dict:
    """The other ranks: rank 0's decision for this gang."""
    path = run_dir / "control" / GANG_FILE
    deadline = time.time() + timeout
    while True:
        try:
            decision = json.loads(path.read_text())
            if decision.get("gang") == gang:
                return decision
        except (OSError, ValueError):
            pass
        if time.time() > deadline:
            raise TimeoutError(f"rank 0 of gang {gang} did not decide the resume point within {timeout:.0f}s")
        time.sleep(0.05)


def contract(run_dir: Path, spec, decision: dict, plan_run_id: str) -> dict[str, str]:
    """The ``TRAINFLOW_*`` variables of the launch contract for this gang."""
    return {
        "TRAINFLOW_RUN_ID": plan_run_id,
        "TRAINFLOW_RUN_DIR": str(run_dir),
        "TRAINFLOW_ATTEMPT": str(decision["attempt"]),
        "TRAINFLOW_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
        "TRAINFLOW_RESUME_FROM": decision["resume_from"],
        "TRAINFLOW_RESUME_STEP": str(decision["step"]),
        "TRAINFLOW_PROGRESS": str(run_dir / "heartbeats"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    from trainflow.proctree import die_with_parent

    die_with_parent(int(os.environ.get("TRAINFLOW_AGENT_PID", "0")))
    from trainflow.launch.runas import drop_privileges
    from trainflow.program import resolve
    from trainflow.remediation import abort
    from trainflow.spec import TrainingSpec
    from trainflow.worker.train import apply_limits, apply_visibility

    drop_privileges()
    apply_visibility(run_dir)
    spec = TrainingSpec.from_json((run_dir / "spec.json").read_text())
    apply_limits(spec)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from trainflow.remediation import aborted

    if aborted(run_dir) is not None:  # a user error stopped the run: no new gang
        print(f"[rank {rank}] the run was aborted; not starting the program", file=sys.stderr, flush=True)
        return 3
    gang = gang_key()
    try:
        plan_run_id = json.loads((run_dir / "plan.json").read_text()).get("run_id", run_dir.name)
    except (OSError, ValueError):
        plan_run_id = run_dir.name
    try:
        decision = (
            decide(run_dir, spec, world, gang)
            if rank == 0
            else await_decision(run_dir, gang, timeout=spec.startup_timeout)
        )
    except CrashLoopError as exc:
        from trainflow.bounds import clip
        from trainflow.timeline import record

        record(run_dir, "crash_loop", rank=rank, message=clip(exc))
        abort(
            run_dir,
            {"rank": rank, "kind": "crash_loop", "type": "CrashLoopError", "message": clip(exc), "time": time.time()},
        )
        print(f"[rank {rank}] {exc}", file=sys.stderr, flush=True)
        return 3
    env = {**os.environ, **spec.program_env, **contract(run_dir, spec, decision, plan_run_id)}
    values = {
        "checkpoint_dir": env["TRAINFLOW_CHECKPOINT_DIR"],
        "resume_from": env["TRAINFLOW_RESUME_FROM"],
        "run_id": plan_run_id,
        "attempt": env["TRAINFLOW_ATTEMPT"],
    }
    command = resolve(spec.program, values)
    if rank == 0 and decision["resume_from"]:
        print(
            f"[rank 0] resuming from verified checkpoint step {decision['step']} ({decision['resume_from']})",
            flush=True,
        )
    os.chdir(spec.working_dir or run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    tap_output(output_mark(run_dir, rank), every=min(1.0, spec.heartbeat_interval))
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:  # not found, not executable: the user's to fix, no retry helps
        from trainflow.bounds import clip

        message = f"cannot start program {command[0]!r}: {exc}"
        abort(
            run_dir,
            {"rank": rank, "kind": "user", "type": type(exc).__name__, "message": clip(message), "time": time.time()},
        )
        print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
        return 3
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
