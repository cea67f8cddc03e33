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
