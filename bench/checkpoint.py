"""bench/checkpoint: async vs sync checkpoint stall, steady-state overhead, and save/load
throughput vs a raw sequential write/read of the same bytes on the same disk.

Runs under torchrun (2 ranks, gloo, DDP) with trainflow's own save/load code:

    .venv/bin/python bench/checkpoint.py [--params-m 25] [--rounds 5] [--steps 200]
    .venv/bin/python bench/checkpoint.py --smoke    # seconds: what the test suite runs

Writes bench/results/checkpoint.json (checkpoint_smoke.json with --smoke).

Goals (issue 3): async stall ≤ 1/20 of sync; steady-state overhead ≤ 2% of step time at
the default interval (50 steps); save/load throughput ≥ 0.8 × raw. The steady-state
overhead is the median over ``--pairs`` pairs of adjacent ``--steps``-step blocks, one
starting with an async save and one without, in alternating order, of their time ratio
(and, as a check, the ratio of their sums).

What is compared, so that the ratios are fair (all figures are medians over ``--rounds``
rounds that interleave the baselines with the measured operations, because the CPU is
shared with other work):

- Save vs raw write: ``dcp.save`` fsyncs every file it writes, so the raw baseline
  fsyncs too: each rank writes its share (state bytes / world size) to a new file with a
  single ``write`` and ``fsync``, keeping the two newest as the checkpoints are kept, and
  the clock stops when the slowest rank is done, as for the save. The page cache is
  warmed first (``warm_page_cache``). A second raw baseline writes the share with
  ``O_DIRECT`` from one aligned buffer (no page cache, as trainflow's writer does);
  ``save_vs_raw`` is against the faster of the two. The save's time is what the training loop waits for: writing, hashing,
  the manifest commit (fsyncs of the manifest and directories), barriers. Deleting the
  checkpoints beyond ``keep_last`` runs in the background after a sync save; it is
  drained outside the timed sections and reported as ``sync_prune_s``.
- Load vs raw read: a DDP load brings the whole (replicated) state into every rank, so
  in the raw baseline every rank reads all ranks' raw files, i.e. the same bytes per
  rank, into a buffer that already exists (as the load reads into existing tensors).
  Both read from the disk: every file of both is dropped from the page cache before each
  timed read (the checkpoint's data files are written with ``O_DIRECT`` and were never
  cached, while the raw files were written through the cache). The load is
  ``dcp.load`` (read plus ``set_state_dict``); the manifest verification that a resume
  runs before it is timed separately as ``verify_s`` (rank 0, one pass over every file).
- Async stall: what the training loop is blocked by an async save, the slowest rank's:
  the time in ``AsyncCheckpointer.save`` plus the wait in ``before_update()`` after the
  next step's forward and backward (the copy into the cached staging buffers overlaps
  them). The copy alone, which the stall was before the overlap, is timed as
  ``stage_copy_floor_s``.
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
    from _results import drop_from_page_cache

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

    def step(ckpt=None):
        opt.zero_grad()
        model(x).square().mean().backward()
        if ckpt is not None:
            ckpt.before_update()  # as the training loop does: an async save's copy overlaps
        opt.step()

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    step()
    work = Path(args.dir)
    root = work / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"params": sum(p.numel() for p in model.parameters()), "world_size": world}

    # One sync save first: it sizes the raw baseline and warms the process groups.
    dcp.save(model, opt, root=root, step=1, world_size=world, training_hash="b", keep_last=2)
    dcp.wait_for_prune()
    state_bytes = manifest.newest_verified(root).bytes if rank == 0 else 0
    sizes = [state_bytes]
    dist.broadcast_object_list(sizes, src=0)
    state_bytes = sizes[0]
    share = os.urandom(state_bytes // world)
    raw_paths = [work / f"raw-{r}" for r in range(world)]

    ckpt = dcp.AsyncCheckpointer(root=root, world_size=world, training_hash="b", keep_last=2)
    ckpt.save(model, opt, step=2)  # the first async save allocates the staging buffers
    ckpt.wait()
    # The strictest raw baseline: the share, already in one page-aligned buffer, written
    # with O_DIRECT in one call (no page cache), the padding trimmed, fsynced.
    import mmap

    aligned = mmap.mmap(-1, -(-len(share) // 4096) * 4096)
    aligned[: len(share)] = share
    raw_direct = []
    raw_write, sync, prune, stall, total = [], [], [], [], []
    for i in range(args.rounds):
        dist.barrier()
        t = time.perf_counter()
        fd = os.open(f"{raw_paths[rank]}.direct.{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        os.write(fd, aligned)
        os.ftruncate(fd, len(share))
        os.fsync(fd)
        os.close(fd)
        dist.barrier()
        raw_direct.append(time.perf_counter() - t)
        Path(f"{raw_paths[rank]}.direct.{i - 2}").unlink(missing_ok=True)

        # A new file each round, the two newest kept, as the checkpoints are (keep_last=2).
        dist.barrier()
        t = time.perf_counter()
        with open(f"{raw_paths[rank]}.{i}", "wb") as fh:
            fh.write(share)
            fh.flush()
            os.fsync(fh.fileno())
        dist.barrier()
        raw_write.append(time.perf_counter() - t)
        Path(f"{raw_paths[rank]}.{i - 2}").unlink(missing_ok=True)
        if i == args.rounds - 1:
            os.replace(f"{raw_paths[rank]}.{i}", raw_paths[rank])  # what the read baseline reads

        dist.barrier()
        t = time.perf_counter()
        dcp.save(model, opt, root=root, step=100 + i, world_size=world, training_hash="b", keep_last=2)
        sync.append(time.perf_counter() - t)
        t = time.perf_counter()
        dcp.wait_for_prune()
        prune.append(time.perf_counter() - t)

        dist.barrier()
        t = time.perf_counter()
        ckpt.save(model, opt, step=200 + i)
        blocked = time.perf_counter() - t
        # The next step, as in the loop: its forward and backward overlap the copy; the
        # stall is what save() and the wait before the optimizer update block.
        opt.zero_grad()
        model(x).square().mean().backward()
        t_fence = time.perf_counter()
        ckpt.before_update()
        blocked += time.perf_counter() - t_fence
        opt.step()
        stall.append(slowest(blocked))
        ckpt.wait()
        dist.barrier()
        total.append(time.perf_counter() - t)

    # The stall's floor: copying this rank's share into buffers that already exist.
    staged = [
        t
        for d in dcp._share(dcp._state(model, opt), model, rank, world).values()
        for t in torch.utils._pytree.tree_leaves(d)
        if isinstance(t, torch.Tensor)
    ]
    buffers = [torch.empty_like(t).copy_(t) for t in staged]  # touched, as the stager's are
    copy_floor = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for buf, src in zip(buffers, staged):
            buf.copy_(src)
        copy_floor.append(slowest(time.perf_counter() - t))
    del buffers

    path = [str(manifest.newest_verified(root).path) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    load, raw_read, verify = [], [], []
    into = memoryview(bytearray(len(share)))
    ckpt_files = [f for f in Path(path[0]).iterdir() if f.is_file()]
    for i in range(args.rounds):
        # Both sides read from the disk: the checkpoint's data files were written with
        # O_DIRECT and are not in the page cache, the raw files were written through it.
        # Comparing a cached raw read with an uncached load measured the cache, not the load.
        if rank == 0:
            drop_from_page_cache([Path(p) for p in raw_paths] + ckpt_files)
        dist.barrier()
        t = time.perf_counter()
        for p in raw_paths:
            with open(p, "rb", buffering=0) as fh:
                got = 0
                while n := fh.readinto(into[got:]):
                    got += n
        dist.barrier()
        raw_read.append(time.perf_counter() - t)

        if rank == 0:
            drop_from_page_cache([Path(p) for p in raw_paths] + ckpt_files)
        dist.barrier()
        t = time.perf_counter()
        dcp.load(model, opt, path[0])
        dist.barrier()
        load.append(time.perf_counter() - t)

        if rank == 0:
            t = time.perf_counter()
            assert manifest.verify(Path(path[0])) is not None
            verify.append(time.perf_counter() - t)

    # Steady-state overhead at the default interval (one async save per 50 steps): pairs of
    # adjacent 50-step blocks, one that starts with a save and one without, in alternating
    # order. A save's background work (copy, write, hash, commit) ends well inside its
    # block, and the block waits for it if not, so the save block carries the whole cost;
    # blocks of one pair are seconds apart, so the machine's drift (several percent within
    # minutes here) cancels, which whole runs compared one after another did not.
    def block(n: int, save_at: int | None) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if save_at is not None:
            ckpt.save(model, opt, step=save_at)
        for _ in range(n):
            step(ckpt)
        ckpt.wait()
        dist.barrier()
        return time.perf_counter() - t0

    n = args.steps
    base, with_ckpt = [], []
    block(n, None)  # warm-up
    for i in range(args.pairs):
        if i % 2 == 0:
            base.append(block(n, None))
            with_ckpt.append(block(n, 1000 + i))
        else:
            with_ckpt.append(block(n, 1000 + i))
            base.append(block(n, None))
    ckpt.close()
    if rank == 0:
        med = statistics.median
        out.update(
            {
                "state_bytes": state_bytes,
                "rounds": args.rounds,
                "sync_stall_s": sync,
                "sync_prune_s": prune,
                "async_stall_s": stall,
                "async_total_s": total,
                "stage_copy_floor_s": copy_floor,
                "stall_ratio_async_over_sync": med(stall) / med(sync),
                "stage_copy_floor_over_sync": med(copy_floor) / med(sync),
                "raw_write_s": raw_write,
                "save_throughput_MBps": state_bytes / med(sync) / 1e6,
                "raw_write_MBps": state_bytes / med(raw_write) / 1e6,
                "raw_direct_write_s": raw_direct,
                "raw_direct_write_MBps": state_bytes / med(raw_direct) / 1e6,
                "load_s": load,
                "raw_read_s": raw_read,
                "verify_s": verify,
                "load_throughput_MBps": state_bytes / med(load) / 1e6,
                "raw_read_MBps": state_bytes / med(raw_read) / 1e6,
                "verify_MBps": state_bytes / med(verify) / 1e6,
                "block_steps": n,
                "pairs": args.pairs,
                "block_no_save_s": base,
                "block_with_save_s": with_ckpt,
                "steady_overhead": med([c / b for c, b in zip(with_ckpt, base)]) - 1,
                "steady_overhead_pooled": sum(with_ckpt) / sum(base) - 1,
            }
        )
        # against the faster of the two raw writes (buffered, O_DIRECT): the physical limit
        out["save_vs_raw"] = out["save_throughput_MBps"] / max(out["raw_write_MBps"], out["raw_direct_write_MBps"])
        out["load_vs_raw"] = out["load_throughput_MBps"] / out["raw_read_MBps"]
        Path(args.result).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def warm_page_cache(work: Path, size: int) -> None:
    """Write and delete ``size`` bytes once before measuring.

    On these VMs the first time the guest touches a page of its memory costs a fault on
    the host: writing into page cache that grows into untouched memory ran at ~135 MB/s
    (measured), later writes into freed pages at ~3 GB/s. Whichever side of the
    comparison grew the page cache first paid for it; after this pass neither does.
    """
    chunk = os.urandom(64 << 20)
    path = work / "warm-up"
    with open(path, "wb") as fh:
        for _ in range(max(1, size // len(chunk))):
            fh.write(chunk)
    path.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=25)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=50, help="steps per block (the save interval)")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--dir")
    parser.add_argument("--result")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/checkpoint.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: 1 M parameters, one round, one pair of 2-step blocks (the suite runs it)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.params_m, args.rounds, args.steps, args.pairs = 1, 1, 2, 1
    args.out = args.out or REPO / "bench" / "results" / ("checkpoint_smoke.json" if args.smoke else "checkpoint.json")
    work = Path(tempfile.mkdtemp(prefix="tf-ckpt-bench-", dir=os.environ.get("TRAINFLOW_BENCH_DIR")))
    result = work / "result.json"
    warm_page_cache(work, int(args.params_m * 1e6 * 4 * 3 * 8))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            "--worker",
            "--dir",
            str(work),
            "--result",
            str(result),
            "--params-m",
            str(args.params_m),
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--pairs",
            str(args.pairs),
        ],
        env=env,
        check=True,
    )
    data = json.loads(result.read_text())
    shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(
        json.dumps(
            {
                k: data[k]
                for k in (
                    "state_bytes",
                    "stall_ratio_async_over_sync",
                    "async_total_s",
                    "stage_copy_floor_over_sync",
                    "steady_overhead",
                    "steady_overhead_pooled",
                    "save_vs_raw",
                    "load_vs_raw",
                )
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
