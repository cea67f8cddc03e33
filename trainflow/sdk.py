"""trainflow's SDK for your own training program: progress, verified checkpoints, resume and
preemption, in a few calls. Standard library only: importing it needs neither torch nor
Airflow, and outside a trainflow run every call is a harmless no-op (``active()`` is False),
so the same program still runs under plain ``torchrun``.

::

    from trainflow import sdk

    start = sdk.resume_step()                  # 0 on a fresh start
    if sdk.resume_from():
        load(sdk.resume_from())                # the newest *verified* checkpoint
    for step in range(start, steps):
        loss = train_step()
        sdk.report(step + 1, loss=float(loss))  # progress: heartbeat, hang watch, curve, goodput
        if (step + 1) % 100 == 0 or sdk.should_stop():
            with sdk.checkpoint(step + 1) as path:   # a directory shared by the gang's ranks
                save(path)                           # every rank writes its files, then commits
            if sdk.should_stop():
                break                                # preempted: exit 0, the run resumes later

A checkpoint becomes a resume point only after every rank committed and trainflow wrote
and verified its manifest (size and digest of every file); a crash at any moment leaves
the previous one the newest. ``should_stop`` must be called by every rank at the same
steps (it is a collective every ``STOP_CHECK_EVERY`` calls when torch.distributed is up).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from trainflow.heartbeat import HeartbeatWriter, RankState
from trainflow.timeline import append, record
from trainflow.workspace import PREEMPT_REQUEST

# ``should_stop`` asks rank 0 every this many calls (one 4-byte broadcast).
STOP_CHECK_EVERY = 10
# Where each rank's commit of a checkpoint is marked until the gang's commit is sealed.
COMMITS = ".commits"


def active() -> bool:
    """Whether this process is a rank of a trainflow run (the launch set the contract)."""
    return bool(os.environ.get("TRAINFLOW_RUN_DIR"))


def _run_dir() -> Path:
    return Path(os.environ["TRAINFLOW_RUN_DIR"])


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resume_from() -> str | None:
    """The newest verified checkpoint's directory to resume from, or None on a fresh start.
    The same on every rank of the gang; never a checkpoint some rank had not committed."""
    return os.environ.get("TRAINFLOW_RESUME_FROM") or None


def resume_step() -> int:
    """The step of ``resume_from()`` (0 on a fresh start)."""
    return int(os.environ.get("TRAINFLOW_RESUME_STEP") or 0)


def checkpoint_dir() -> Path | None:
    value = os.environ.get("TRAINFLOW_CHECKPOINT_DIR")
    return Path(value) if value else None


class _Progress:
    """This rank's heartbeat writer and, on rank 0, the loss curve; made on first use."""

    def __init__(self) -> None:
        spec = json.loads((_run_dir() / "spec.json").read_text())
        self.total = int(spec.get("steps", 0))
        self.interval = float(spec.get("heartbeat_interval", 1.0))
        self.batch = int(spec.get("batch_size", 1))
        self.beat = HeartbeatWriter(
            Path(os.environ.get("TRAINFLOW_PROGRESS") or _run_dir() / "heartbeats"),
            rank=rank(),
            node=int(os.environ.get("TRAINFLOW_NODE", "0")),
            interval=self.interval,
            world=world_size(),
        )
        self.beat.beat(step=resume_step(), total=self.total, state=RankState.STARTING, force=True)
        self.beat.start_pulse()
        self.first = True
        self.curve_t = 0.0
        self.window = (time.time(), resume_step())
        self.samples_per_s = 0.0
        self.last_checkpoint = resume_step()


_progress: _Progress | None = None


def _state() -> _Progress | None:
    global _progress
    if _progress is None and active():
        _progress = _Progress()
    return _progress


def report(step: int, **metrics: float) -> None:
    """Progress after ``step`` (the number of steps done) with metrics such as ``loss``:
    refreshes this rank's heartbeat (what the hang watch, straggler detection and goodput
    read) and, on rank 0, the run's loss curve. Cheap: files are written at most once per
    ``heartbeat_interval``; call it every step."""
    p = _state()
    if p is None:
        return
    now = time.time()
    values = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    if now - p.window[0] >= p.interval:
        t0, s0 = p.window
        p.samples_per_s = (step - s0) / (now - t0) * p.batch
        p.window = (now, step)
    p.beat.beat(
        step=int(step),
        total=p.total,
        state=RankState.TRAINING,
        loss=values.get("loss"),
        samples_per_s=p.samples_per_s,
        checkpoint_step=p.last_checkpoint,
        metrics=values,
    )
    if rank() == 0:
        if p.first:
            record(_run_dir(), "first_step", step=int(step))
        if p.first or now - p.curve_t >= p.interval or step >= p.total:
            p.curve_t = now
            append(
                _run_dir() / "curve.jsonl",
                {"time": now, "step": int(step), "world": world_size(), "loss": values.get("loss"), "metrics": values},
            )
    p.first = False


def done(step: int, **metrics: float) -> None:
    """The program trained its last step (``step``): the heartbeat says so at once."""
    p = _state()
    if p is None:
        return
    report(step, **metrics)
    p.beat.beat(step=int(step), total=p.total, state=RankState.DONE, force=True, checkpoint_step=p.last_checkpoint)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a section of the program (``startup``, ``step``, ``checkpoint``, ``eval`` …):
    the heartbeat carries it, so a hang is reported with where it happened, and a
    checkpoint section counts as checkpointing rather than training."""
    p = _state()
    if p is None:
        yield
        return
    before = p.beat._phase
    p.beat.set_phase(name)
    try:
        yield
    finally:
        p.beat.set_phase(before)


class Checkpoint:
    """A checkpoint of ``step`` being written: ``path`` is the gang's shared directory for
    it; every rank writes its files there and calls ``commit()``."""

    def __init__(self, step: int) -> None:
        root = checkpoint_dir()
        if root is None:
            raise RuntimeError("trainflow.sdk.checkpoint needs a trainflow run (TRAINFLOW_CHECKPOINT_DIR is unset)")
        self.step = int(step)
        self.root = root
        self.path = root / f"step-{self.step:08d}.partial"
        self.path.mkdir(parents=True, exist_ok=True)
        self.committed = False
        p = _state()
        if p is not None:
            p.beat.beat(
                step=self.step,
                total=p.total,
                state=RankState.CHECKPOINTING,
                force=True,
                checkpoint_step=p.last_checkpoint,
            )

    def commit(self) -> None:
        """This rank's files are complete. Once every rank committed, trainflow writes the
        manifest (size and digest of every file), verifies it and publishes the step as
        the newest resume point; until then the previous one stays the newest."""
        marks = self.root / COMMITS / f"step-{self.step:08d}"
        marks.mkdir(parents=True, exist_ok=True)
        for f in self.path.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        mark = marks / f"rank-{rank():05d}.json"
        tmp = mark.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": rank(), "world": world_size(), "time": time.time()}))
        os.replace(tmp, mark)
        self.committed = True
        p = _state()
        if p is not None:
            p.last_checkpoint = self.step

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self.committed:
            self.commit()


def commit_dir(step: int, source: str | os.PathLike) -> None:
    """Commit a checkpoint a trainer already wrote into a folder of its own (a Hugging Face
    ``checkpoint-N``): once every rank has committed, trainflow moves ``source`` into place
    as the checkpoint of ``step`` and seals it like any other."""
    root = checkpoint_dir()
    if root is None:
        return
    marks = root / COMMITS / f"step-{int(step):08d}"
    marks.mkdir(parents=True, exist_ok=True)
    mark = marks / f"rank-{rank():05d}.json"
    tmp = mark.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"rank": rank(), "world": world_size(), "time": time.time(), "source": str(Path(source).resolve())})
    )
    os.replace(tmp, mark)
    p = _state()
    if p is not None:
        p.last_checkpoint = int(step)


def checkpoint(step: int) -> Checkpoint:
    """Start the checkpoint of ``step``: ``with sdk.checkpoint(step) as path: save(path)``
    commits on leaving the block (or call ``.commit()`` on the returned object)."""
    return Checkpoint(step)


_stop_calls = 0


def should_stop() -> bool:
    """Whether trainflow asked the run to stop (a preemption): checkpoint now and exit 0;
    the run resumes from that checkpoint when it is admitted again. Every rank must call
    it at the same steps: every ``STOP_CHECK_EVERY`` calls rank 0's answer is broadcast
    (torch.distributed, when the program initialised it), so all ranks agree."""
    global _stop_calls
    if not active():
        return False
    _stop_calls += 1
    if (_stop_calls - 1) % STOP_CHECK_EVERY:
        return False
    asked = (_run_dir() / "control" / PREEMPT_REQUEST).exists()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and world_size() > 1:
        import torch

        backend = str(dist.get_backend())  # a CPU tensor unless only an accelerator backend runs
        device = "cpu" if "gloo" in backend else (torch.accelerator.current_accelerator() or "cpu")
        flag = torch.tensor([1.0 if asked and rank() == 0 else 0.0], device=device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())
    return asked
