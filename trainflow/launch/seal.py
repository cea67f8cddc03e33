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
checkpoint: a run ends "success" only with a resume point of its last state.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from trainflow.checkpoint import manifest
from trainflow.errors import CheckpointError
from trainflow.heartbeat import RankState, read_all
from trainflow.timeline import record
from trainflow.workspace import COMPLETE, write_json_atomic

log = logging.getLogger(__name__)
COMMITS = ".commits"  # trainflow.sdk.COMMITS
POLL_S = 0.2
# How long ``finish`` waits for other ranks' commits still on their way.
FINISH_WAIT_S = 60.0


class Sealer:
    """Seals the run's fully committed checkpoints from a daemon thread (``start``)."""

    def __init__(self, run_dir: Path, spec: dict) -> None:
        from trainflow.spec import TrainingSpec

        self.run_dir = Path(run_dir)
        self.spec = TrainingSpec.from_mapping(spec)
        self.root = self.run_dir / "checkpoints"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Sealer":
        self._thread = threading.Thread(target=self._loop, name="checkpoint-sealer", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.seal_ready()
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
                ref = manifest.commit(self.root, step, world_size=len(ranks),
                                      training_hash=self.spec.training_hash(), extra={"program": True})
            except (CheckpointError, OSError) as exc:
                record(self.run_dir, "checkpoint_failed", step=step, error=str(exc)[:500])
                log.warning("checkpoint of step %s not sealed: %s", step, exc)
            else:
                sealed.append(ref)
                record(self.run_dir, "checkpoint_committed", step=step,
                       latency_s=round(time.time() - began, 3), bytes=ref.bytes)
                print(f"step {step}/{self.spec.steps} checkpoint verified ({ref.bytes} bytes, manifest "
                      f"{ref.manifest_sha256[:12]})", flush=True)
                self.prune()
            finally:
                shutil.rmtree(marks, ignore_errors=True)
        return sealed

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
        for _, path in manifest.list_checkpoints(self.root)[self.spec.keep_last:]:
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
        beats = read_all(self.run_dir / "heartbeats")
        for rank, beat in beats.items():
            if beat.get("node") == node and beat.get("state") != RankState.DONE.value:
                write_json_atomic(self.run_dir / "heartbeats" / f"rank-{rank:05d}.json",
                                  {**beat, "state": RankState.DONE.value, "time": time.time(),
                                   "alive": time.time()})
        reported = max((int(b.get("step", 0)) for b in beats.values()), default=None)
        problem = None
        if reported is not None and reported < self.spec.steps:
            problem = (f"the program exited 0 after reporting step {reported} of the {self.spec.steps} "
                       f"the spec asks for; make it train every step, or lower steps")
        elif manifest.newest_verified(self.root, training_hash=self.spec.training_hash()) is None:
            problem = ("the program exited 0 but left no verified checkpoint: save with "
                       "trainflow.sdk.checkpoint(step) (every rank commits) at least at the end")
        if problem:
            abort(self.run_dir, {"node": node, "kind": "user", "type": "ProgramOutcome", "message": problem,
                                 "time": time.time()})
            record(self.run_dir, "user_error", node=node, message=problem)
            raise RuntimeError(problem)
        write_json_atomic(self.run_dir / "control" / COMPLETE, {"step": reported or self.spec.steps,
                                                                "time": time.time(), "program": True})
