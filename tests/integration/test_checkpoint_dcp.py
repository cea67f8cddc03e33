"""trainflow's DCP storage layer on a real 2-rank gloo gang (torchrun, no Airflow).

One gang runs every scenario and reports what it saw; each test asserts on one part:
round trips are bit-exact (sync and async, DDP and FSDP2, a resharded load), the
digests the writers computed are the files' SHA-256, checkpoints written by stock DCP
still load, stock DCP refuses ours instead of misreading it, and a save that fails on
one rank fails on every rank without a hang and leaves the previous checkpoint newest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _digest(state: dict) -> str:
    """SHA-256 over every tensor of a nested state dict (DTensors gathered first)."""
    import torch

    h = hashlib.sha256()

    def walk(obj, path):
        if isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(obj[key], f"{path}/{key}")
        elif isinstance(obj, torch.Tensor):
            t = obj.full_tensor() if hasattr(obj, "full_tensor") else obj
            h.update(path.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    walk(state, "")
    return h.hexdigest()


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as stock
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainflow.checkpoint import dcp, manifest

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict = {}

    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        # Odd sizes shard unevenly under FSDP2; BatchNorm adds int64 and 0-dim buffers.
        return torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(), torch.nn.Linear(256, 7)
        )

    def ddp(seed: int):
        model = DDP(net(seed))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, steps: int, ckpt=None) -> None:
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(16, 32, generator=gen)).square().mean().backward()
            if ckpt is not None:
                ckpt.before_update()  # the async save's copy overlapped forward and backward
            opt.step()

    def full_state(model, opt) -> str:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        return _digest({"model": model_sd, "optim": optim_sd})

    def rank0(value):
        """Rank 0's value on every rank: DDP ranks differ in their BatchNorm statistics
        until the next forward broadcasts rank 0's, so rank 0's state is the one saved."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def newest(root: Path) -> str:
        ref = [str(manifest.newest_verified(root).path) if rank == 0 else None]
        dist.broadcast_object_list(ref, src=0)
        return ref[0]

    # What the writers hand to the commit (rank 0): every data file's digest.
    real_commit, handed = manifest.commit, []

    def commit(*args, digests, **kwargs):
        handed.append(sorted(digests))
        return real_commit(*args, digests=digests, **kwargs)

    manifest.commit = commit

    # Sync save, load into a differently initialised model, train on: identical.
    model, opt = ddp(0)
    train(model, opt, 3)
    sync_root = out / "sync"
    real_load_local = dcp._load_local
    ref = dcp.save(model, opt, root=sync_root, step=3, world_size=world, training_hash="t", keep_last=2)
    saved = rank0(full_state(model, opt))
    path = newest(sync_root)
    other, other_opt = ddp(1)
    dcp.load(other, other_opt, path)
    seen["sync_loaded_equal"] = full_state(other, other_opt) == saved
    train(model, opt, 2)
    train(other, other_opt, 2)
    seen["sync_resume_equal"] = full_state(other, other_opt) == full_state(model, opt)

    # A load that fails on rank 1 fails on rank 0 too, instead of leaving it to train alone.
    def unreadable(state, path):
        raise OSError(errno.EIO, "Input/output error (injected)", path)

    if rank == 1:
        dcp._load_local = unreadable
    try:
        dcp.load(other, other_opt, path)
        seen["load_failure"] = None
    except BaseException as exc:  # noqa: BLE001 - whatever it is, it must be raised
        seen["load_failure"] = type(exc).__name__
    dcp._load_local = real_load_local
    if rank == 0:
        files = manifest.read_manifest(Path(path))["files"]
        seen["sync_ref_is_verified_ref"] = ref == manifest.verify(Path(path))
        seen["manifest_files"] = {
            rel: [meta["size"], meta["blake3"], manifest.file_digest(Path(path) / rel)] for rel, meta in files.items()
        }

    # Older checkpoints are deleted in the background, down to keep_last.
    for step in (4, 5):
        dcp.save(model, opt, root=out / "kept", step=step, world_size=world, training_hash="t", keep_last=1)
    dcp.wait_for_prune()
    seen["kept"] = [p.name for _, p in manifest.list_checkpoints(out / "kept")]

    # Async save while training goes on: the checkpoint holds the state at save().
    commits, errors = [], []
    ckpt = dcp.AsyncCheckpointer(
        root=out / "async",
        world_size=world,
        training_hash="t",
        keep_last=2,
        on_commit=commits.append,
        on_error=lambda step, exc: errors.append([step, type(exc).__name__, str(exc)]),
    )
    at_save = rank0(full_state(model, opt))
    ckpt.save(model, opt, step=10)
    train(model, opt, 3, ckpt)
    ckpt.wait()
    other, other_opt = ddp(2)
    dcp.load(other, other_opt, newest(out / "async"))
    seen["async_loaded_equal"] = full_state(other, other_opt) == at_save
    seen["async_commits"] = [c.step for c in commits]

    # A write that fails on rank 1 only: every rank hears of it, nothing is committed.
    real_write_file = dcp._write_file

    def disk_full(path, buffers):
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    if rank == 1:
        dcp._write_file = disk_full
    ckpt.save(model, opt, step=20)
    ckpt.wait()
    try:
        dcp.save(model, opt, root=out / "async", step=21, world_size=world, training_hash="t", keep_last=2)
        seen["sync_failure"] = None
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        seen["sync_failure"] = type(exc).__name__
    dcp._write_file = real_write_file
    # Rank 0 cannot create the directory (a file is in the way).
    if rank == 0:
        manifest.partial_dir(out / "async", 30).write_text("in the way")
    ckpt.save(model, opt, step=30)
    ckpt.wait()
    if rank == 0:
        manifest.partial_dir(out / "async", 30).unlink()
    ckpt.save(model, opt, step=40)
    ckpt.close()
    seen["async_errors"] = errors
    seen["async_commits_after_failures"] = [c.step for c in commits]
    seen["async_newest"] = Path(newest(out / "async")).name

    # DDP checkpoint into FSDP2 (each rank reads a slice of every saved tensor).
    sharded = net(3)
    fully_shard(sharded)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    dcp.load(sharded, sharded_opt, path)
    seen["ddp_to_fsdp_equal"] = full_state(sharded, sharded_opt) == saved

    # FSDP2 checkpoint (one chunk per rank) into a plain model, without a process group.
    # (No training first: FSDP2 does not sync BatchNorm buffers, which DCP, like us,
    # saves from one rank only.)
    dcp.save(sharded, sharded_opt, root=out / "fsdp", step=1, world_size=world, training_hash="t", keep_last=1)
    fsdp_weights = _digest(dict(sharded.state_dict()))
    fsdp_path = newest(out / "fsdp")
    plain = net(4)
    dcp.load_model_only(plain, fsdp_path)
    seen["fsdp_to_plain_equal"] = _digest(plain.state_dict()) == fsdp_weights

    # Checkpoints written by stock DCP (torch.save records) still load.
    # (An eval forward makes DDP broadcast rank 0's BatchNorm buffers first: stock DCP
    # saves whichever rank's copy balances its plan.)
    stock_dir = out / "stock"
    with torch.no_grad():
        model.eval()
        model(torch.zeros(2, 32))
        model.train()
    stock.save(dcp._state(model, opt), checkpoint_id=str(stock_dir))
    expected = full_state(model, opt)
    other, other_opt = ddp(5)
    dcp.load(other, other_opt, str(stock_dir))
    seen["stock_loaded_equal"] = full_state(other, other_opt) == expected

    # Stock DCP refuses our raw records instead of misreading them.
    try:
        stock.load(dcp._state(other, other_opt), checkpoint_id=path)
        seen["stock_reads_ours"] = "loaded"
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        seen["stock_reads_ours"] = str(exc)

    seen["digests_handed"] = handed
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dcp")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(
    "key",
    [
        "sync_loaded_equal",
        "sync_resume_equal",
        "async_loaded_equal",
        "ddp_to_fsdp_equal",
        "fsdp_to_plain_equal",
        "stock_loaded_equal",
    ],
)
def test_round_trip_is_bit_exact(seen, key):
    assert seen[0][key] is True and seen[1][key] is True


def test_writer_digests_are_the_files_blake3_and_every_rank_writes_its_share(seen):
    files = seen[0]["manifest_files"]
    assert set(files) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    for size, recorded, on_disk in files.values():
        assert recorded == on_disk
    sizes = [files[f"__{r}_0.distcp"][0] for r in range(2)]
    assert min(sizes) > 0.4 * sum(sizes)  # replicated tensors are split, not all on one rank
    assert seen[0]["sync_ref_is_verified_ref"] is True
    # Every commit got both ranks' digests from the writers: none re-read the data files.
    assert seen[0]["digests_handed"] and all(h == ["__0_0.distcp", "__1_0.distcp"] for h in seen[0]["digests_handed"])


def test_a_failed_write_on_one_rank_fails_the_save_everywhere(seen):
    for rank_seen in seen:
        assert rank_seen["async_commits"] == ([10] if rank_seen is seen[0] else [])
        assert [e[0] for e in rank_seen["async_errors"]] == [20, 30]
        assert rank_seen["sync_failure"] == "CheckpointException"
    assert "No space left on device" in json.dumps(seen[0]["async_errors"][0])
    assert "cannot prepare" in seen[1]["async_errors"][1][2]
    assert seen[0]["async_commits_after_failures"] == [10, 40]
    assert seen[0]["async_newest"] == "step-00000040"


def test_a_failed_load_on_one_rank_fails_everywhere(seen):
    assert [s["load_failure"] for s in seen] == ["CheckpointError", "OSError"]


def test_sync_saves_prune_to_keep_last(seen):
    assert seen[0]["kept"] == ["step-00000005"]


def test_stock_dcp_refuses_our_records(seen):
    assert "Unknown extension" in seen[0]["stock_reads_ours"]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
