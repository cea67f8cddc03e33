"""A plain PyTorch DDP training script, written as a user would: the baseline of
bench/throughput.py. Run under torchrun::

    torchrun --standalone --nproc-per-node 2 bench/plain_ddp.py --workload tinylm --steps 400

Same model, data, loss, batch and optimizer as trainflow's built-in workloads; default
bucketed DDP (or FSDP2 ``fully_shard``), ``DistributedSampler`` + ``DataLoader``, AdamW.
Rank 0 prints one JSON line: steady steps/s after ``--warmup`` steps, wall and CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tinylm", choices=("tinylm", "digits"))
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.004)
    args = parser.parse_args()
    t_start = time.perf_counter()

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from trainflow.spec import TrainingSpec
    from trainflow.workloads import load_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    workload = load_workload(
        TrainingSpec(workload=args.workload, nodes=world, steps=args.steps, batch_size=args.batch_size)
    )
    model = workload.model
    if args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in workload.shard_modules:
            fully_shard(module)
        model = fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = DistributedSampler(workload.train, seed=0)
    loader = DataLoader(workload.train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step, epoch, t_steady = 0, 0, None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = workload.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.warmup:
                t_steady = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    final_loss = float(loss.detach())
    t_end = time.perf_counter()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        print(
            json.dumps(
                {
                    "side": "plain_ddp",
                    "steps_per_s": (args.steps - args.warmup) / (t_end - t_steady),
                    "wall_s": t_end - t_start,
                    "user_s": usage.ru_utime,
                    "sys_s": usage.ru_stime,
                    "loss": final_loss,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
