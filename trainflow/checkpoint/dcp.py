"""Sharded save/load with torch.distributed.checkpoint (runs inside the workers).

The same code serves DDP and FSDP2: ``get_state_dict`` gives the model and optimizer
state in DCP form whatever the wrapping, and DCP writes each rank's shards in parallel.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainflow.checkpoint import manifest

if TYPE_CHECKING:
    import torch


def _state(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer") -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(model, optimizer, *, root: Path, step: int, world_size: int, training_hash: str,
         keep_last: int, extra: dict | None = None) -> manifest.CheckpointRef | None:
    """Collective: every rank saves its shards; rank 0 commits and prunes.

    Returns the committed ``CheckpointRef`` on rank 0, None elsewhere.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    partial = manifest.partial_dir(root, step)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # leftover of a crashed attempt
        partial.mkdir(parents=True)
    dist.barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=str(partial))
    ref = None
    if rank == 0:
        ref = manifest.commit(root, step, world_size=world_size, training_hash=training_hash,
                              extra=extra)
        manifest.prune(root, keep_last)
    dist.barrier()
    return ref


def load(model, optimizer, path: str) -> None:
    """Collective: load the checkpoint at ``path`` into ``model`` and ``optimizer`` in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_model_only(model, path: str) -> None:
    """Load only the model weights (no process group needed), e.g. for evaluation."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])


def weights_digest(model) -> str:
    """SHA-256 over every tensor of ``model``'s state dict in key order (bit-exact identity)."""
    import hashlib

    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class AsyncCheckpointer:
    """Asynchronous sharded saves: training stalls only for the in-memory copy.

    Each save stages the state into CPU buffers that DCP's stager caches per storage (no
    allocation after the first save) and writes it from a background thread
    over a gloo group of its own (sharing the training group crashed with a collective
    mismatch, DESIGN.md §2). When the write completes, rank 0 commits the manifest and
    prunes in that thread. One save is in flight at a time; a failed save (ENOSPC, I/O
    error) leaves the previous checkpoint the newest verified one.
    """

    def __init__(self, *, root: Path, world_size: int, training_hash: str, keep_last: int,
                 on_commit=None, on_error=None) -> None:
        import threading

        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.world_size = Path(root), world_size
        self.training_hash, self.keep_last = training_hash, keep_last
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo")
        # Synchronous staging into CPU buffers cached per storage (reused by every save);
        # pinned only where there is a CUDA device to copy from.
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
            use_async_staging=False, use_non_blocking_copy=False))
        self.on_commit, self.on_error = on_commit, on_error
        self._idle = threading.Event()
        self._idle.set()

    def save(self, model, optimizer, *, step: int) -> None:
        """Collective: start saving ``step``; returns once the state is staged."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        partial = manifest.partial_dir(self.root, step)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        self._idle.clear()
        future = dcp.async_save(_state(model, optimizer), checkpoint_id=str(partial),
                                process_group=self.group, async_stager=self.stager)
        future.add_done_callback(lambda f: self._finish(f, step))

    def _finish(self, future, step: int) -> None:
        try:
            future.result()
            if self.rank == 0:
                ref = manifest.commit(self.root, step, world_size=self.world_size,
                                      training_hash=self.training_hash)
                manifest.prune(self.root, self.keep_last)
                if self.on_commit is not None:
                    self.on_commit(ref)
        except Exception as exc:  # noqa: BLE001 - a failed save must not kill training
            if self.on_error is not None:
                self.on_error(step, exc)
        finally:
            self._idle.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no save is in flight; True if idle."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Wait for the last save (and its commit) and release the staging buffers."""
        self.wait()
        self.stager.close()
