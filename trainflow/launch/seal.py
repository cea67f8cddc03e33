"""Sealing a program's checkpoints, and judging how the program ended (the node agent's side
of ``trainflow.sdk``).

A program's ranks write the checkpoint of step s into ``checkpoints/step-<s>.partial`` and
each marks its commit (``checkpoints/.commits/step-<s>/rank-<r>.json``). Once every rank of
the gang has, one agent (whichever takes the ``sealing`` lock first) writes the manifest
(size and digest of every file: ``checkpoint.manifest.commit``), renames the directory to
``step-<s>`` (a resume point from then on), records it in the timeline and prunes to
``keep_last``. Off the program's critical path: the ranks go on training meanwhile.

When the program's ranks exit 0, ``finish`` seals what is left and fails the node if the
program reported fewer steps than the spec asks (an SDK program) or left no verified
checkpoint: a run ends "success" only with a resume point of its last state. A program
that stopped because a preemption asked it to (``sdk.should_stop``) at a verified
checkpoint is preempted instead (``control/preempted.json``, as the built-in loop answers).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

from trainflow.checkpoint import manifest
from trainflow.errors import CheckpointError
from trainflow.heartbeat import RankState, read_all
from trainflow.timeline import record
from trainflow.workspace import COMPLETE, PREEMPT_REQUEST, PREEMPTED, write_json_atomic

log = logging.getLogger(__name__)
COMMITS = ".commits"  # trainflow.sdk.COMMITS
POLL_S = 0.2
# How long ``finish`` waits for other ranks' commits still on their way.
FINISH_WAIT_S = 60.0


# A Lightning checkpoint file counts as complete once it has not changed for this long.
QUIET_S = 2.0
_STEP_SUFFIX = re.compile(r"(\d+)$")
_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_OWN = re.compile(r"^step-\d{8,}(\.partial)?$")


def layout_of(path: Path, *, world: int, now: float) -> tuple[int, str] | None:
    """``(step, layout)`` when ``path`` is a complete checkpoint of a layout trainflow knows
    (``Sealer.adopt_layouts``), else None (unknown, or still being written)."""
    name = path.name
    if path.is_dir():
        if (m := _HF_DIR.match(name)) and (path / "trainer_state.json").is_file():
            if len(list(path.glob("rng_state*.pth"))) >= max(world, 1):
                return int(m.group(1)), "huggingface"
            return None
        if (path / ".metadata").is_file() and (m := _STEP_SUFFIX.search(name)):
            return int(m.group(1)), "dcp"
        return None
    if path.suffix == ".ckpt" and path.is_file() and (m := _STEP_SUFFIX.search(path.stem)):
        if now - path.stat().st_mtime >= QUIET_S:
            return int(m.group(1)), "lightning"
    return None


class Sealer:
    """Seals the run's fully committed checkpoints from a daemon thread (``start``)."""

    def __init__(self, run_dir: Path, spec: dict, ranks: list[int] | None = None, node: int = 0) -> None:
        from trainflow.spec import TrainingSpec

        self.run_dir = Path(run_dir)
        self.spec = TrainingSpec.from_mapping(spec)
        self.root = self.run_dir / "checkpoints"
        self.ranks, self.node = list(ranks or []), node
        self._started = time.time()
        self._pulse_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Sealer":
        self._thread = threading.Thread(target=self._loop, name="checkpoint-sealer", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.adopt_layouts()
                self.seal_ready()
                self.pulse()
            except Exception:  # noqa: BLE001 - never let the sealer kill the agent
                log.exception("sealing the program's checkpoints failed; trying again")

    def pending(self) -> list[Path]:
        return sorted((self.root / COMMITS).glob("step-*")) if (self.root / COMMITS).is_dir() else []

    def seal_ready(self) -> list[manifest.CheckpointRef]:
        """Seal every checkpoint all of whose ranks committed; returns what was sealed."""
        sealed = []
        for marks in self.pending():
            try:
                step = int(marks.name.split("-", 1)[1])
                ranks = [json.loads(p.read_text()) for p in marks.glob("rank-*.json")]
            except (OSError, ValueError):
                continue
            if not ranks or len(ranks) < int(ranks[0].get("world", 1)):
                continue
            try:
                fd = os.open(marks / "sealing", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.close(fd)
            began = max(float(r.get("time", time.time())) for r in ranks)
            try:
                self._adopt(step, {r["source"] for r in ranks if r.get("source")})
                ref = manifest.commit(
                    self.root,
                    step,
                    world_size=len(ranks),
                    training_hash=self.spec.training_hash(),
                    extra={"program": True},
                )
            except (CheckpointError, OSError) as exc:
                record(self.run_dir, "checkpoint_failed", step=step, error=str(exc)[:500])
                log.warning("checkpoint of step %s not sealed: %s", step, exc)
            else:
                sealed.append(ref)
                record(
                    self.run_dir,
                    "checkpoint_committed",
                    step=step,
                    latency_s=round(time.time() - began, 3),
                    bytes=ref.bytes,
                )
                print(
                    f"step {step}/{self.spec.steps} checkpoint verified ({ref.bytes} bytes, manifest "
                    f"{ref.manifest_sha256[:12]})",
                    flush=True,
                )
                self.prune()
            finally:
                shutil.rmtree(marks, ignore_errors=True)
        return sealed

    def adopt_layouts(self, now: float | None = None) -> list[manifest.CheckpointRef]:
        """Seal complete checkpoints a program wrote in a layout trainflow knows, without the
        SDK, straight into the checkpoint directory:

        - Hugging Face ``checkpoint-<N>/`` once its ``trainer_state.json`` and every rank's
          ``rng_state`` file are there;
        - a DCP folder (any name ending in its step number) once its ``.metadata`` is there
          (DCP writes it last, after every rank's data);
        - a Lightning ``*.ckpt`` whose name ends in ``step=<N>`` (or any number), once it
          has not changed for ``QUIET_S``.

        Each becomes ``step-<N>`` with a verified manifest: a resume point the next gang
        gets as ``{resume_from}`` / ``TRAINFLOW_RESUME_FROM``."""
        now = time.time() if now is None else now
        sealed = []
        if not self.root.is_dir():
            return sealed
        for entry in sorted(self.root.iterdir()):
            name = entry.name
            if name.startswith(".") or name == "hf" or _OWN.match(name):
                continue
            found = layout_of(entry, world=self._world(), now=now)
            if found is None:
                continue
            step, kind = found
            target = manifest.partial_dir(self.root, step)
            if manifest.step_dir(self.root, step).exists():
                continue
            if target.exists():
                shutil.rmtree(target)
            if entry.is_dir():
                os.rename(entry, target)
            else:
                target.mkdir()
                os.rename(entry, target / name)
            try:
                ref = manifest.commit(
                    self.root,
                    step,
                    world_size=self._world(),
                    training_hash=self.spec.training_hash(),
                    extra={"program": True, "layout": kind},
                )
            except (CheckpointError, OSError) as exc:
                record(self.run_dir, "checkpoint_failed", step=step, error=str(exc)[:500], layout=kind)
                continue
            sealed.append(ref)
            record(self.run_dir, "checkpoint_committed", step=step, bytes=ref.bytes, layout=kind)
            print(
                f"step {step} {kind} checkpoint verified ({ref.bytes} bytes, manifest {ref.manifest_sha256[:12]})",
                flush=True,
            )
            self.prune()
        return sealed

    def pulse(self, now: float | None = None) -> None:
        """Heartbeats for this node's ranks whose program does not report through the SDK
        (no heartbeat of its own): the step is the newest verified checkpoint's, and the
        rank progressed when it last printed (its output tap) or checkpointed, so the hang
        watch sees a program silent on both for ``stall_timeout`` as stalled. A rank whose
        program reports for itself is left alone."""
        now = time.time() if now is None else now
        if now - self._pulse_at < self.spec.heartbeat_interval:
            return
        self._pulse_at = now
        from trainflow.launch.program import output_mark

        refs = manifest.list_checkpoints(self.root)
        step = refs[0][0] if refs else 0
        saved = refs[0][1].stat().st_mtime if refs else 0.0
        for rank in self.ranks:
            try:  # when the rank last printed (its output tap)
                printed = output_mark(self.run_dir, rank).stat().st_mtime
            except OSError:
                printed = 0.0
            since = max(saved, printed)
            # Nothing printed or saved since this agent started: still starting (the watch
            # gives it the startup window), not silent.
            starting = since < self._started
            path = self.run_dir / "heartbeats" / f"rank-{rank:05d}.json"
            try:
                mine = json.loads(path.read_text()).get("source") == "agent"
            except (OSError, ValueError):
                mine = not path.exists()
            if not mine:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                path,
                {
                    "rank": rank,
                    "node": self.node,
                    "step": step,
                    "total": self.spec.steps,
                    "state": (RankState.STARTING if starting else RankState.TRAINING).value,
                    "time": now,
                    "alive": now,
                    "progress_time": self._started if starting else since,
                    "started": self._started,
                    "phase": "starting" if starting else "program",
                    "phase_since": self._started,
                    "source": "agent",
                },
            )

    def _world(self) -> int:
        return int(os.environ.get("TRAINFLOW_WORLD_SIZE") or self.spec.world_size)

    def _adopt(self, step: int, sources: set[str]) -> None:
        """Move a folder a trainer saved on its own (``sdk.commit_dir``) into the place of
        the checkpoint of ``step``, inside the checkpoint directory only."""
        if not sources:
            return
        if len(sources) > 1:
            raise CheckpointError(f"the ranks committed different folders for step {step}: {sorted(sources)}")
        source = Path(sources.pop())
        if self.root.resolve() not in source.parents:
            raise CheckpointError(f"{source} is outside the run's checkpoint directory {self.root}")
        target = manifest.partial_dir(self.root, step)
        if target.exists():
            shutil.rmtree(target)
        os.rename(source, target)

    def prune(self) -> None:
        """Keep the ``keep_last`` newest sealed checkpoints (partials of later steps, still
        being written, are left alone)."""
        for _, path in manifest.list_checkpoints(self.root)[self.spec.keep_last :]:
            shutil.rmtree(path, ignore_errors=True)

    def finish(self, node: int) -> None:
        """The program's ranks on this node exited 0: seal what the gang committed, mark
        this node's ranks done, and judge the run.

        Raises:
            RuntimeError: the program reported fewer steps than ``steps`` or left no
                verified checkpoint (retrying would end the same way: the run is aborted).
        """
        from trainflow.remediation import abort

        self._stop.set()
        deadline = time.time() + FINISH_WAIT_S
        while self.pending() and time.time() < deadline:
            self.seal_ready()
            time.sleep(POLL_S)
        self.adopt_layouts(now=time.time() + QUIET_S)  # the program has exited: its files are final
        beats = read_all(self.run_dir / "heartbeats")
        reported = max((int(b.get("step", 0)) for b in beats.values() if b.get("source") != "agent"), default=None)
        newest = manifest.newest_verified(self.root, training_hash=self.spec.training_hash())
        request = self.run_dir / "control" / PREEMPT_REQUEST
        if request.exists() and newest is not None and (reported is None or reported < self.spec.steps):
            # Asked to stop (sdk.should_stop) and stopped at a verified checkpoint: the node
            # tasks requeue the run, which resumes from it when admitted again.
            try:
                order = json.loads(request.read_text())
            except (OSError, ValueError):
                order = {}
            if not (self.run_dir / "control" / PREEMPTED).exists():
                write_json_atomic(
                    self.run_dir / "control" / PREEMPTED,
                    {"step": newest.step, "time": time.time(), "by": order.get("by")},
                )
                record(self.run_dir, "preempted", step=newest.step, by=order.get("by"), program=True)
            return
        for rank, beat in beats.items():  # this node's ranks are done (the hang watch reads it)
            if beat.get("node") == node and beat.get("state") != RankState.DONE.value:
                write_json_atomic(
                    self.run_dir / "heartbeats" / f"rank-{rank:05d}.json",
                    {**beat, "state": RankState.DONE.value, "time": time.time(), "alive": time.time()},
                )
        problem = None
        if reported is not None and reported < self.spec.steps:
            problem = (
                f"the program exited 0 after reporting step {reported} of the {self.spec.steps} "
                f"the spec asks for; make it train every step, or lower steps"
            )
        elif newest is None:
            problem = (
                "the program exited 0 but left no verified checkpoint: save with "
                "trainflow.sdk.checkpoint(step) (every rank commits) at least at the end"
            )
        if problem:
            abort(
                self.run_dir,
                {"node": node, "kind": "user", "type": "ProgramOutcome", "message": problem, "time": time.time()},
            )
            record(self.run_dir, "user_error", node=node, message=problem)
            raise RuntimeError(problem)
        write_json_atomic(
            self.run_dir / "control" / COMPLETE,
            {"step": reported or self.spec.steps, "time": time.time(), "program": True},
        )
