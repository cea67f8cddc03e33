#!/usr/bin/env python3
"""A plain PyTorch DDP script that knows nothing of trainflow: it saves a distributed
checkpoint (``torch.distributed.checkpoint``) every ``--every`` steps into ``--out``/``ckpt-<step>``
and resumes from ``--resume`` when given one.

trainflow runs it unchanged (``program``: ``["python", "/path/examples/dcp_program.py",
"--out", "{checkpoint_dir}", "--resume", "{resume_from}"]``): it recognises each complete
DCP folder (``.metadata`` present), seals it with a verified manifest and passes the newest
as ``{resume_from}`` after a restart.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--out", default="checkpoints")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.003)
    from sklearn.datasets import load_digits

    ds = load_digits()
    data = TensorDataset(torch.tensor(ds.data / 16.0, dtype=torch.float32), torch.tensor(ds.target))
    sampler = DistributedSampler(data, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    step = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(ddp, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if dist.get_rank() == 0:
            print(f"resumed at step {step} from {args.resume}", flush=True)
    while step < args.steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            loss = nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.every == 0 or step == args.steps:
                model_sd, optim_sd = get_state_dict(ddp, optimizer)
                dcp.save(
                    {"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=Path(args.out) / f"ckpt-{step}"
                )
            if step == args.steps:
                break
    # Free the model, optimizer and data before tearing the group down: with gloo a rank
    # otherwise hangs at exit in a fraction of runs, after its work is done.
    ddp = model = optimizer = loader = None
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    raise SystemExit(main())
