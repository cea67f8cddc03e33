"""bench/s3_sync: checkpoint upload and download through trainflow's S3 tier vs raw boto3
``TransferManager`` on the same files, and vs a local disk copy, in one run.

A real S3 server on loopback (SeaweedFS ``weed mini``, data on disk). The checkpoint:
``--shards`` rank files of ``--shard-mb`` MiB plus DCP's small metadata, committed with a
manifest. Per round (``--rounds``), alternating which goes first: trainflow's
``S3Store.upload`` (every file hashed with BLAKE3 as it is read and checked against the
manifest, a server-checked CRC32C per part, sizes compared with the manifest, manifest
last) vs a bare ``TransferManager`` upload of the same files with the same transfer
settings (and a third: the bare upload with the same part checksums as ours); and
each after the disk has written out the one before. Then, once the server has written all
of that, ``--down-rounds`` pairs, alternating which goes first: ``S3Store.download`` (every
file's BLAKE3 checked against the manifest as it arrives, partial dir and rename) vs a bare
``TransferManager`` download of the same stored objects. Last, ``--rounds`` times,
``shutil.copytree`` of the checkpoint to another directory on the same disk (what the
``file://`` tier does before verifying).

    .venv/bin/python bench/s3_sync.py [--rounds 3] [--down-rounds 40] [--shards 4] [--shard-mb 64] [--server-cpu 1]
    .venv/bin/python bench/s3_sync.py --smoke    # seconds: what the test suite runs

By default the server and the clients share every CPU (on two cores the server's work and
the download's hashing compete); ``--server-cpu N`` gives the server CPU N alone and the
clients the rest, as a server on hardware of its own would (S3 never runs on the training
node). Writes bench/results/s3_sync.json (``--server-cpu``: s3_sync_server_cpu.json;
``--smoke``: s3_sync_smoke.json); goal: upload and download ≥ 0.9× raw TransferManager.
``--smoke`` runs every side once on 2 shards of 20 MiB (still multipart: two parts each)
without the pauses between transfers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import drop_from_page_cache  # noqa: E402

from trainflow.checkpoint import manifest  # noqa: E402
from trainflow.checkpoint.s3 import S3Store, TransferSettings, part_checksum  # noqa: E402
from trainflow.testing.seaweed import SeaweedS3  # noqa: E402


def make_checkpoint(root: Path, shards: int, shard_mb: int) -> manifest.CheckpointRef:
    src = manifest.partial_dir(root, 100)
    src.mkdir(parents=True)
    chunk = os.urandom(4 * 2**20)
    for r in range(shards):
        with open(src / f"__{r}_0.distcp", "wb") as fh:
            for i in range(shard_mb // 4):
                fh.write(chunk[i % 7 :] + chunk[: i % 7])  # distinct blocks, no dedup by the server
    (src / ".metadata").write_bytes(os.urandom(40_000))
    return manifest.commit(root, 100, world_size=shards, training_hash="bench")


def drop_caches(path: Path) -> None:
    """Evict the checkpoint's files from the page cache (fair cold reads)."""
    drop_from_page_cache(p for p in path.rglob("*") if p.is_file())


def settle(seconds: float = 1.0) -> None:
    """Write out every dirty page (the server's last upload included) and wait, so the
    background writing of one timed transfer does not land on the next: timed back to
    back, whichever upload of a round ran second took ~2.0 s against the first's ~1.5."""
    os.sync()
    time.sleep(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--down-rounds",
        type=int,
        default=40,
        help="timed download pairs (trainflow's, raw), alternating which goes first",
    )
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument(
        "--server-cpu",
        type=int,
        default=None,
        help="run the S3 server on this CPU and both clients on the others (the "
        "server on hardware of its own, as S3 is; default: all share every CPU)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: one round and one download pair of 2 shards of 20 MiB, no pauses (the suite runs it)",
    )
    args = parser.parse_args()
    pause = 1.0
    if args.smoke:
        args.rounds, args.down_rounds, args.shards, args.shard_mb, pause = 1, 1, 2, 20, 0.0
    if args.out is None:
        name = "s3_sync_smoke" if args.smoke else "s3_sync" if args.server_cpu is None else "s3_sync_server_cpu"
        args.out = REPO / "bench" / "results" / f"{name}.json"
    work = Path(tempfile.mkdtemp(prefix="tf-s3-bench-", dir=os.environ.get("TRAINFLOW_BENCH_DIR")))
    settings = TransferSettings()
    server_cpus = None
    if args.server_cpu is not None:
        server_cpus = {args.server_cpu}
        client_cpus = os.sched_getaffinity(0) - server_cpus
        if not client_cpus:
            parser.error(f"--server-cpu {args.server_cpu} leaves no CPU for the clients")
        os.sched_setaffinity(0, client_cpus)  # before any thread starts: they all inherit it
    server = SeaweedS3(work / "s3", cpus=server_cpus).start()
    series: dict[str, list[float]] = {
        k: [] for k in ("ours_up", "raw_up", "raw_checked_up", "ours_down", "raw_down", "local_copy")
    }
    try:
        ref = make_checkpoint(work / "local", args.shards, args.shard_mb)
        files = sorted(manifest.read_manifest(Path(ref.path))["files"])
        s3 = server.client(settings=settings)
        from boto3.s3.transfer import create_transfer_manager

        def raw_up(prefix: str, extra_args: dict | None = None) -> None:
            with create_transfer_manager(s3, settings.transfer_config()) as tm:
                for f in [
                    tm.upload(str(Path(ref.path) / rel), server.bucket, f"{prefix}/{rel}", extra_args=extra_args)
                    for rel in files
                ]:
                    f.result()

        def raw_down(prefix: str, dest: Path) -> None:
            (dest / "x").parent.mkdir(parents=True, exist_ok=True)
            with create_transfer_manager(s3, settings.transfer_config()) as tm:
                for f in [tm.download(server.bucket, f"{prefix}/{rel}", str(dest / rel)) for rel in files]:
                    f.result()

        for i in range(args.rounds):
            store = S3Store(
                s3, server.bucket, "bench", tenant="bench", dag_id="bench", run_id=f"ours-{i}", settings=settings
            )
            if i == 0:
                first = store  # its upload is the one the downloads fetch
            order = ("ours", "raw") if i % 2 == 0 else ("raw", "ours")
            for who in order + ("raw_checked",):
                drop_caches(Path(ref.path))
                settle(pause)
                t0 = time.perf_counter()
                if who == "ours":
                    store.upload(ref)
                elif who == "raw":
                    raw_up(f"bench/raw-{i}")
                else:  # the same server-checked part checksums as ours, nothing else
                    raw_up(f"bench/raw-checked-{i}", {"ChecksumAlgorithm": part_checksum()})
                series[f"{who}_up"].append(time.perf_counter() - t0)
        # The downloads in a phase of their own, once the server has written every upload
        # (timed between the upload rounds, single downloads of either side took 0.4-0.9 s
        # against their usual 0.25 s, a third of them in some runs), after one untimed
        # download.
        settle(5 * pause)
        store = first
        raw_down(store._key(100), work / "warm-up")
        shutil.rmtree(work / "warm-up")
        for i in range(args.down_rounds):
            for who in ("ours", "raw") if i % 2 == 0 else ("raw", "ours"):
                dest = work / f"down-{who}-{i}"
                t0 = time.perf_counter()
                if who == "ours":
                    got = store.download(100, dest, training_hash="bench")
                    assert got.manifest_sha256 == ref.manifest_sha256
                else:  # the very objects ours fetched: the same stored files
                    raw_down(store._key(100), dest)
                series[f"{who}_down"].append(time.perf_counter() - t0)
                shutil.rmtree(dest)
        for i in range(args.rounds):
            drop_caches(Path(ref.path))
            settle(pause)
            t0 = time.perf_counter()
            shutil.copytree(ref.path, work / f"copy-{i}")
            series["local_copy"].append(time.perf_counter() - t0)
            shutil.rmtree(work / f"copy-{i}")
        mb = ref.bytes / 1e6

        def paired(kind: str) -> list[float]:
            return [raw / ours for raw, ours in zip(series[f"raw_{kind}"], series[f"ours_{kind}"])]

        med = {k: statistics.median(v) for k, v in series.items()}
        result = {
            "bench": "s3_sync",
            "server": "SeaweedFS weed mini on 127.0.0.1 (data on local disk)",
            "cpus": (
                {"server": sorted(server_cpus), "clients": sorted(os.sched_getaffinity(0))}
                if server_cpus
                else f"shared: all {os.cpu_count()}"
            ),
            "checkpoint_mb": round(mb, 1),
            "files": len(files),
            "rounds": args.rounds,
            "down_rounds": args.down_rounds,
            "transfer": {"multipart_mb": settings.chunk_size / 2**20, "concurrency": settings.concurrency},
            "seconds": series,
            "median_s": med,
            "mb_per_s": {k: round(mb / v, 1) for k, v in med.items()},
            "upload_vs_raw": round(med["raw_up"] / med["ours_up"], 3),
            "upload_vs_raw_checked": round(med["raw_checked_up"] / med["ours_up"], 3),
            "part_checksum": part_checksum(),
            "download_vs_raw": round(med["raw_down"] / med["ours_down"], 3),
            # Each pair ran back to back: the median of the pairs' ratios is the least moved
            # by the machine's slow spells (single transfers of either side at 2-3x their
            # usual time, several in a row), which the medians of the two series are not.
            "upload_vs_raw_paired": round(statistics.median(paired("up")), 3),
            "download_vs_raw_paired": round(statistics.median(paired("down")), 3),
            "upload_vs_local_copy": round(med["local_copy"] / med["ours_up"], 3),
            "download_vs_local_copy": round(med["local_copy"] / med["ours_down"], 3),
            "machine": {"cpus": os.cpu_count()},
            "time": time.time(),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(
            json.dumps(
                {
                    k: result[k]
                    for k in (
                        "checkpoint_mb",
                        "mb_per_s",
                        "upload_vs_raw",
                        "upload_vs_raw_checked",
                        "download_vs_raw",
                        "upload_vs_raw_paired",
                        "download_vs_raw_paired",
                        "upload_vs_local_copy",
                        "download_vs_local_copy",
                    )
                },
                indent=1,
            )
        )
        return 0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
