"""bench/checkpoint: async vs sync checkpoint stall, steady-state overhead, and save/load
throughput vs a raw sequential write/read of the same bytes on the same disk.

Runs under torchrun (2 ranks, gloo, DDP) with trainflow's own save/load code:

    .venv/bin/python bench/checkpoint.py [--params-m 25] [--rounds 3]

Goals (issue 3): async stall ≤ 1/20 of sync; steady-state overhead ≤ 2% of step time at
the default interval (50 steps); save/load throughput ≥ 0.8 × raw.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(REPO))
    from trainflow.checkpoint import dcp, manifest

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = 1024
    layers = max(1, int(args.params_m * 1e6 / (width * width)))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, width)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    root = Path(args.dir) / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"params": sum(p.numel() for p in model.parameters()), "world_size": world}

    sync = []
    for i in range(args.rounds):
        dist.barrier()
        t = time.perf_counter()
        dcp.save(model, opt, root=root, step=100 + i, world_size=world, training_hash="b", keep_last=2)
        sync.append(time.perf_counter() - t)
    ref = manifest.newest_verified(root)
    state_bytes = ref.bytes if ref else 0
    ckpt = dcp.AsyncCheckpointer(root=root, world_size=world, training_hash="b", keep_last=2)
    stall, total = [], []
    for i in range(args.rounds):
        dist.barrier()
        t = time.perf_counter()
        ckpt.save(model, opt, step=200 + i)
        stall.append(time.perf_counter() - t)
        ckpt.wait()
        total.append(time.perf_counter() - t)
    dist.barrier()
    t = time.perf_counter()
    dcp.load(model, opt, str(manifest.newest_verified(root).path))
    load_s = time.perf_counter() - t

    # Raw sequential write + fsync and read of the same bytes (this rank's share).
    share = state_bytes // world
    blob = os.urandom(min(share, 64 << 20)) * max(1, share // (64 << 20))
    raw_path = Path(args.dir) / f"raw-{rank}"
    dist.barrier()
    t = time.perf_counter()
    with open(raw_path, "wb") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    dist.barrier()
    raw_write_s = time.perf_counter() - t
    os.system("sync")
    t = time.perf_counter()
    raw_path.read_bytes()
    dist.barrier()
    raw_read_s = time.perf_counter() - t

    # Steady-state overhead: N steps with an async checkpoint every 50 vs none.
    def timed(n: int, every: int | None) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(1, n + 1):
            step()
            if every and s % every == 0:
                ckpt.save(model, opt, step=1000 + s)
        ckpt.wait()
        dist.barrier()
        return time.perf_counter() - t0

    n = args.steps
    base = [timed(n, None) for _ in range(2)]
    with_ckpt = [timed(n, 50) for _ in range(2)]
    ckpt.close()
    if rank == 0:
        out.update({
            "state_bytes": state_bytes,
            "sync_stall_s": sync, "async_stall_s": stall, "async_total_s": total,
            "stall_ratio_async_over_sync": statistics.median(stall) / statistics.median(sync),
            "save_throughput_MBps": state_bytes / statistics.median(sync) / 1e6,
            "load_s": load_s, "load_throughput_MBps": state_bytes / load_s / 1e6,
            "raw_write_MBps": len(blob) * world / raw_write_s / 1e6,
            "raw_read_MBps": len(blob) * world / raw_read_s / 1e6,
            "steps": n, "no_ckpt_s": base, "ckpt_every_50_s": with_ckpt,
            "steady_overhead": min(with_ckpt) / min(base) - 1,
        })
        out["save_vs_raw"] = out["save_throughput_MBps"] / out["raw_write_MBps"]
        out["load_vs_raw"] = out["load_throughput_MBps"] / out["raw_read_MBps"]
        Path(args.result).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--dir")
    parser.add_argument("--result")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="tf-ckpt-bench-", dir=os.environ.get("TRAINFLOW_BENCH_DIR")))
    result = work / "result.json"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
                    __file__, "--worker", "--dir", str(work), "--result", str(result),
                    "--params-m", str(args.params_m), "--rounds", str(args.rounds), "--steps", str(args.steps)],
                   env=env, check=True)
    data = json.loads(result.read_text())
    shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(json.dumps({k: data[k] for k in ("state_bytes", "stall_ratio_async_over_sync", "steady_overhead",
                                           "save_vs_raw", "load_vs_raw")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
