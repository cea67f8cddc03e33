#!/usr/bin/env python3
"""A plain PyTorch DDP training script, as a team already has one, with trainflow's SDK.

Runs unchanged under ``torchrun`` (the SDK calls do nothing there)::

    torchrun --standalone --nproc-per-node 2 examples/ddp_program.py --steps 300 --out /tmp/ckpt

and as a trainflow run (``program`` in the spec), where it resumes from the newest
*verified* checkpoint trainflow hands it, reports progress and commits its checkpoints::

    {"program": ["python", "/path/to/examples/ddp_program.py", "--steps", "300",
                 "--out", "{checkpoint_dir}", "--resume", "{resume_from}"], "steps": 300}

The model is a small MLP on scikit-learn's digits (on every machine, no download); the data
order is a ``DistributedSampler`` per epoch, so a resumed run sees exactly the batches an
uninterrupted one would and ends with the same weights.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainflow import sdk


def data() -> TensorDataset:
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = torch.tensor(ds.data / 16.0, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(ds.target, dtype=torch.long))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--every", type=int, default=50, help="checkpoint every this many steps")
    parser.add_argument("--out", default="checkpoints", help="checkpoint directory (plain torchrun)")
    parser.add_argument("--resume", default="", help="a checkpoint directory to resume from")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    dataset = data()
    sampler = DistributedSampler(dataset, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    per_epoch = len(loader)

    step = 0
    if args.resume:
        state = torch.load(Path(args.resume) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed at step {step} from {args.resume}", flush=True)

    def save(step: int) -> None:
        if sdk.active():
            with sdk.checkpoint(step) as path:  # every rank commits; rank 0 writes the state
                if rank == 0:
                    torch.save(
                        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                        path / "state.pt",
                    )
        elif rank == 0:
            path = Path(args.out) / f"step-{step:08d}"
            path.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path / "state.pt"
            )

    loss = torch.zeros(())
    while step < args.steps:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue  # batches this epoch already trained before the checkpoint
            loss = nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            sdk.report(step, loss=float(loss))
            stop = sdk.should_stop()
            if step % args.every == 0 or step == args.steps or stop:
                save(step)
            if stop:
                print(f"[rank {rank}] asked to stop at step {step}: checkpoint committed, exiting", flush=True)
                dist.destroy_process_group()
                return 0
            if step == args.steps:
                break
    sdk.done(step, loss=float(loss))
    # Free the model, optimizer and data before tearing the group down: with gloo a rank
    # otherwise hangs at exit in a fraction of runs, after its work is done.
    ddp = model = optimizer = loader = None
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    raise SystemExit(main())
