"""Sharded save/load with torch.distributed.checkpoint (runs inside the workers).

The same code serves DDP and FSDP2: ``get_state_dict`` gives the model and optimizer
state in DCP form whatever the wrapping, and DCP writes each rank's shards in parallel.

DCP's planning, metadata and file layout are kept; the storage layer is ours
(``_writer``/``_reader``), for costs measured with bench/checkpoint.py:

- Each tensor is stored as its raw bytes instead of one ``torch.save`` zip record
  (pickling, CRC-32, and on load an unpickle and a second copy): a load reads straight
  into the target tensor. The items carry the transform descriptor ``trainflow-raw``,
  so stock DCP refuses them instead of misreading them, while ``_reader`` still reads
  checkpoints written by stock DCP.
- Each rank hashes its file from the buffers it writes, in a second thread that runs
  while the first waits in ``fsync``, and DCP's gather of write results brings every
  digest to rank 0: the manifest commit no longer reads the checkpoint back (twice).
- Data files are written with ``O_DIRECT`` where the filesystem allows it (no page cache
  growth, no kernel copy: ``_write_direct``), large tensors straight from their own
  memory (``_layout`` places them so that their aligned middle can be).
- Saves plan locally and exchange one gather and one broadcast (``_save``) where
  ``dcp.save`` runs four collectives.
- Replicated tensors are split between ranks before staging (``_share``): DCP would
  write each once anyway, but only after every rank had copied all of them.
- Loads skip DCP's plan exchange and sync saves delete old checkpoints in the
  background (``load``, ``wait_for_prune``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from trainflow.checkpoint import manifest
from trainflow.errors import CheckpointError

if TYPE_CHECKING:
    import torch

_RAW = "trainflow-raw"


def _state(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer") -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _share(state: dict, model: "torch.nn.Module", rank: int, world: int) -> dict:
    """This rank's part of ``state`` (from ``_state(model, ...)``) for a save.

    Plain tensors are replicated on every rank (DDP, and FSDP2's unsharded leftovers such
    as Adam's ``step``); DCP keeps one copy of each. They are dealt out greedily by size,
    identically on every rank, so each rank stages and writes only its part. Model
    buffers (BatchNorm statistics) are the exception: each DDP rank updates its own in
    the forward and DDP broadcasts rank 0's at the start of the next one, so rank 0's
    copy is the one that keeps a resume bit-identical, and rank 0 saves them all.
    Sharded tensors (DTensor) and non-tensor values stay on every rank.
    """
    import torch

    params = {p.data_ptr() for p in model.parameters() if type(p) is torch.nn.Parameter}
    plain = []

    def walk(d: dict, path: tuple) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value, (*path, key))
            elif type(value) is torch.Tensor:
                plain.append(((*path, key), value))

    walk(state, ())
    load = [0] * world
    owner = {}
    for path, tensor in plain:
        if path[0] == "model" and tensor.data_ptr() not in params:
            owner[path] = 0
            load[0] += tensor.nbytes
    for path, tensor in sorted(plain, key=lambda item: (-item[1].nbytes, repr(item[0]))):
        if path not in owner:
            owner[path] = load.index(min(load))
            load[owner[path]] += tensor.nbytes

    def keep(d: dict, path: tuple) -> dict:
        out = {}
        for key, value in d.items():
            if isinstance(value, dict):
                out[key] = keep(value, (*path, key))
            elif type(value) is not torch.Tensor or owner[(*path, key)] == rank:
                out[key] = value
        return out

    return keep(state, ())


def _as_bytes(tensor: "torch.Tensor") -> memoryview:
    """The raw bytes of a tensor (moved to CPU and made contiguous if it is not already)."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _write_file(path: Path, buffers: list[memoryview]) -> tuple[list[int], int, str]:
    """Write ``buffers`` to ``path`` and fsync it; return where each buffer starts in the
    file, the file's size and its digest (``manifest.DIGEST``).

    The file holds the buffers in order, each where ``_layout`` puts it (a large one may
    follow up to 4 KiB of zeros, so that its memory can go to the disk without a copy). A
    second thread hashes the same bytes while this one writes and then waits in
    ``fsync``, so the digest costs no extra pass over the file and overlaps the flush.
    The bytes go to the disk with ``O_DIRECT`` where the filesystem allows it
    (``_write_direct``), else through the page cache.
    """
    offsets, pieces, size = _layout(buffers)
    h = manifest.hasher()
    pending: queue.SimpleQueue = queue.SimpleQueue()

    def digest() -> None:
        while (buf := pending.get()) is not None:
            h.update(buf)

    hasher = threading.Thread(target=digest, name="trainflow-ckpt-digest")
    hasher.start()
    try:
        for _, data, _ in pieces:
            pending.put(data)
        if not _write_direct(path, pieces, size):
            _write_buffered(path, pieces)
    finally:
        pending.put(None)
        hasher.join()
    return offsets, size, h.hexdigest()


_ALIGN = 4096  # O_DIRECT: file offsets, lengths and memory addresses (512 on most disks; 4096 on all)
_DIRECT_MIN = 1 << 16  # smaller buffers are copied: their padding and extra write would cost more
_BOUNCE_BYTES = 8 << 20
_IOV_BATCH = 1000  # iovecs per pwritev (Linux takes up to 1024)
_BATCH_BYTES = 1 << 30  # bytes per pwritev (Linux writes at most 2 GiB - 4 KiB per call)
_ZEROS = memoryview(bytes(_ALIGN))
_bounce = threading.local()


def _address(view: memoryview) -> int | None:
    """Where ``view``'s bytes start in memory; None for a read-only buffer."""
    import ctypes

    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _layout(buffers: list[memoryview]) -> tuple[list[int], list[tuple[int, memoryview, bool]], int]:
    """Place ``buffers`` one after another in a file: (each buffer's offset, the pieces to
    write in file order as ``(offset, bytes, direct)``, the file's size).

    ``O_DIRECT`` needs the memory address, the file offset and the length of a write
    aligned to the disk's block. A buffer of at least ``_DIRECT_MIN`` bytes is placed at
    an offset congruent to its address modulo ``_ALIGN`` (zeros fill the gap before it),
    so that its aligned middle is one ``direct`` piece, written from the buffer's own
    memory; its unaligned head and tail, small buffers and the gaps are copied into the
    bounce buffer. The copy this avoids ran at ~1.7 GB/s here, slower than the disk.
    """
    offsets: list[int] = []
    pieces: list[tuple[int, memoryview, bool]] = []
    pos = 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        n = len(view)
        addr = _address(view) if n >= _DIRECT_MIN else None
        if addr is None:
            start = pos
            if n:
                pieces.append((start, view, False))
        else:
            start = pos + (addr - pos) % _ALIGN
            head = -addr % _ALIGN
            body = (n - head) // _ALIGN * _ALIGN
            if start > pos:
                pieces.append((pos, _ZEROS[: start - pos], False))
            if head:
                pieces.append((start, view[:head], False))
            pieces.append((start + head, view[head : head + body], True))
            if head + body < n:
                pieces.append((start + head + body, view[head + body :], False))
        offsets.append(start)
        pos = start + n
    return offsets, pieces, pos


def _write_buffered(path: Path, pieces: list[tuple[int, memoryview, bool]]) -> None:
    with open(path, "wb", buffering=0) as fh:
        for _, data, _ in pieces:
            _write_all(fh.fileno(), data)
        os.fsync(fh.fileno())


def _write_direct(path: Path, pieces: list[tuple[int, memoryview, bool]], size: int) -> bool:
    """Write ``pieces`` (from ``_layout``) to ``path`` with ``O_DIRECT``: ``direct`` ones
    from their own memory, the others gathered in a reused, page-aligned 8 MiB buffer;
    then trim the padding of the last block and fsync. False where the platform or
    filesystem does not take ``O_DIRECT`` (tmpfs: EINVAL), for a buffered write instead.

    Why: a checkpoint is written once and read only at a resume, yet a buffered write
    copies it into page cache that grows by the checkpoint's size each save (the kept
    checkpoints stay cached). Measured on these VMs, whose memory the host reclaims, that
    growth cost 1.2–2.5 s and ~1.5 s of kernel CPU per 145 MB file, on the cores training
    uses; the same file with O_DIRECT: 0.12–0.15 s and ~0.01 s of CPU.
    """
    import errno
    import mmap

    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    bounce = getattr(_bounce, "buf", None)
    if bounce is None:
        bounce = _bounce.buf = memoryview(mmap.mmap(-1, _BOUNCE_BYTES))  # page-aligned
    # The pieces go to the disk in as few ``pwritev`` calls as the bounce buffer allows
    # (each direct piece and each run of gathered bytes one aligned iovec): one call for the
    # whole file when its small pieces fit the buffer. A write per piece waited for each
    # piece's DMA before issuing the next (0.128 vs 0.105 s for 145 MB in one write here).
    batch: list[memoryview] = []
    batch_bytes = offset = 0
    start = filled = 0  # the bounce buffer's bytes [start, filled) are not in the batch yet

    def take_run(end: int) -> None:
        nonlocal start, batch_bytes
        if start < end:
            batch.append(bounce[start:end])
            batch_bytes += end - start
        start = end

    def flush() -> None:
        nonlocal offset, batch_bytes, start, filled
        take_run(filled)
        if batch:
            _pwritev_all(fd, batch, offset)
        offset += batch_bytes
        batch.clear()
        batch_bytes = start = filled = 0

    try:
        for _, data, direct in pieces:
            if direct:  # starts at an aligned offset, so the gathered bytes are whole blocks
                take_run(filled)
                batch.append(data)
                batch_bytes += len(data)
                if len(batch) >= _IOV_BATCH or batch_bytes >= _BATCH_BYTES:
                    flush()
                continue
            pos = 0
            while pos < len(data):
                k = min(len(bounce) - filled, len(data) - pos)
                bounce[filled : filled + k] = data[pos : pos + k]
                filled, pos = filled + k, pos + k
                if filled == len(bounce):
                    flush()
        if filled > start:
            padded = -(-filled // _ALIGN) * _ALIGN
            bounce[filled:padded] = _ZEROS[: padded - filled]
            filled = padded
        flush()
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # a filesystem that opens with O_DIRECT but will not write so
            return False
        raise
    finally:
        os.close(fd)
    return True


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``os.pwritev`` of ``views`` at ``offset`` until every byte is written."""
    views = list(views)
    first = 0
    while first < len(views):
        n = os.pwritev(fd, views[first:], offset)
        offset += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]


def _write_all(fd: int, data: memoryview) -> None:
    """``os.write`` until all of ``data`` is written (a write may be partial)."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


class _Written(list):
    """One rank's ``WriteResult``s plus ``digests``, {file name: (size, digest)} of the
    files it wrote; DCP gathers these to rank 0 for ``finish`` unchanged."""

    digests: dict


def _writer(path: Path):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class _Writer(FileSystemWriter):
        """One raw file per rank, hashed while written; rank 0 ends with every digest.

        After ``dcp.save`` returns, ``digests`` on rank 0 maps each data file's name to
        ``(size, digest)`` (the ``.metadata`` file DCP adds last is not in it).
        """

        def __init__(self, path: Path) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True)
            self.digests: dict[str, tuple[int, str]] = {}

        def write_data(self, plan, planner):
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            buffers = []
            for item in plan.items:
                data = planner.resolve_data(item)
                buffers.append(data.getbuffer() if item.type == WriteItemType.BYTE_IO else _as_bytes(data))
            offsets, size, sha = _write_file(Path(self.path) / name, buffers)
            results = _Written(
                WriteResult(
                    index=item.index, size_in_bytes=len(buf), storage_data=_StorageInfo(name, offset, len(buf), [_RAW])
                )
                for item, buf, offset in zip(plan.items, buffers, offsets)
            )
            results.digests = {name: (size, sha)}
            fut: Future = Future()
            fut.set_result(results)
            return fut

        def finish(self, metadata, results) -> None:
            for rank_results in results:
                self.digests.update(rank_results.digests)
            super().finish(metadata, results)

    return _Writer(path)


def _save(state: dict, writer, group=None) -> None:
    """Collective: ``dcp.save(state, storage_writer=writer, process_group=group)`` with
    one gather and one broadcast where DCP runs four collectives.

    DCP gathers every rank's plan to rank 0, which deduplicates replicated items and
    hands each rank its file prefix back (scatter); after the writes it gathers the
    results, writes ``.metadata`` and broadcasts it. Here each rank writes its own plan
    at once under the prefix DCP would give it (``__<rank>_``): ``_share`` has already
    dealt every replicated tensor to one rank. Rank 0 then builds the global plan and the
    metadata from the gathered local plans exactly as DCP does (its deduplication only
    drops the copies of small non-tensor values, such as ``param_groups``, that every
    rank wrote) and writes ``.metadata``. Measured with bench/checkpoint.py: DCP's
    exchange cost 30–40 ms per save here, a quarter of a 290 MB save.

    Raises:
        CheckpointException: on every rank if any rank failed, as ``dcp.save`` does.
    """
    import traceback

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    planner = DefaultSavePlanner()
    error: BaseException | None = None
    try:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(dataclasses.replace(local, storage_data=_StoragePrefix(f"__{rank}_")))
        mine = (local, writer.write_data(plan, planner).value())
    except BaseException as exc:  # noqa: BLE001 - every rank learns of it below
        error, mine = exc, "".join(traceback.format_exception_only(exc)).strip()
    everyone = [None] * world if rank == 0 else None
    dist.gather_object(mine, everyone, group=group, group_dst=0)
    failures = [None]
    if rank == 0:
        failed = {r: got for r, got in enumerate(everyone) if isinstance(got, str)}
        if not failed:
            try:
                _, metadata = planner.create_global_plan([got[0] for got in everyone])
                writer.finish(metadata=metadata, results=[got[1] for got in everyone])
            except BaseException as exc:  # noqa: BLE001 - every rank learns of it below
                error, failed = exc, {0: "".join(traceback.format_exception_only(exc)).strip()}
        failures = [failed or None]
    dist.broadcast_object_list(failures, group=group, group_src=0)
    if failures[0]:
        raise CheckpointException(
            "checkpoint save failed",
            {
                r: (error, traceback.extract_tb(error.__traceback__))
                if r == rank and error is not None
                else (RuntimeError(f"rank {r}: {text}"), traceback.StackSummary())
                for r, text in failures[0].items()
            },
        )


# What a DCP ``.metadata`` pickle may name: DCP's own metadata classes, torch.Size, dtypes
# and layouts, and the path of the checkpoint. Anything else (os.system, builtins.eval,
# a class with a hostile __reduce__ ...) is refused before it runs.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


def safe_metadata(fh):
    """Unpickle a DCP ``.metadata`` file allowing only the globals DCP's metadata uses.

    Raises:
        CheckpointError: the file names anything else (it is never executed).
    """
    import pickle

    import torch

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            ok = (module, name) in _METADATA_GLOBALS or (
                module in _METADATA_MODULES
                and isinstance(getattr(__import__(module, fromlist=[name]), name, None), type)
            )
            if module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
            ):
                ok = True
            if not ok:
                raise CheckpointError(
                    f"checkpoint metadata names {module}.{name}, which a DCP checkpoint never does; refusing to load it"
                )
            return super().find_class(module, name)

    try:
        return _Unpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError) as exc:
        raise CheckpointError(f"checkpoint metadata is not DCP metadata: {type(exc).__name__}: {exc}") from exc


def _safe_planner():
    """DCP's default load planner with non-tensor items read by ``torch.load(weights_only=True)``
    (DCP's own uses ``weights_only=False``: arbitrary code from a crafted checkpoint)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()


def _reader(path: str):
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class _Reader(FileSystemReader):
        """Reads raw items straight into their target tensors; other items go to DCP."""

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as fh:
                metadata = safe_metadata(fh)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self.tensors = metadata.state_dict_metadata

        def read_data(self, plan, planner):
            raw, other = {}, []
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                if info.transform_descriptors == [_RAW]:
                    raw.setdefault(info.relative_path, []).append((info, req))
                else:
                    other.append(req)
            for rel, reqs in raw.items():
                with open(Path(self.path) / rel, "rb", buffering=0) as fh:
                    for info, req in sorted(reqs, key=lambda r: r[0].offset):
                        fh.seek(info.offset)
                        self._read_item(fh, info, req, planner)
            if other:
                return super().read_data(dataclasses.replace(plan, items=other), planner)
            fut: Future = Future()
            fut.set_result(None)
            return fut

        def _read_item(self, fh, info, req, planner) -> None:
            import io

            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(_read_exactly(fh, bytearray(info.length))))
                return
            md = self.tensors[req.storage_index.fqn]
            chunk = next(c for c in md.chunks if c.offsets == req.storage_index.offset)
            target = planner.resolve_tensor(req).detach()
            whole = list(req.lengths) == list(chunk.sizes)
            if whole and target.device.type == "cpu" and target.dtype == md.properties.dtype and target.is_contiguous():
                _read_exactly(fh, _as_bytes_view(target))
            else:
                stored = torch.empty(chunk.sizes, dtype=md.properties.dtype)
                _read_exactly(fh, _as_bytes_view(stored))
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    stored = stored.narrow(dim, start, length)
                target.copy_(stored)
            planner.commit_tensor(req, target)

    return _Reader(path)


def _as_bytes_view(tensor: "torch.Tensor") -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _read_exactly(fh, buf) -> bytearray | memoryview:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = fh.readinto(view[done:])
        if not n:
            raise EOFError(f"{fh.name}: checkpoint item ends early")
        done += n
    return buf


_pruning: threading.Thread | None = None


def wait_for_prune() -> None:
    """Block until the deletion of old checkpoints started by the last sync ``save`` ends.

    Deleting is mostly waiting on the filesystem (unlinking a 290 MB checkpoint takes
    ~0.3 s on the ext4 disk here, about as long as writing it), so a sync save leaves it
    to a thread and returns once its checkpoint is committed. The next save waits for it
    before touching the directory, and the interpreter waits for it at exit.
    """
    if _pruning is not None:
        _pruning.join()


def _prepare(root: Path, step: int, group=None) -> Path:
    """Collective: rank 0 empties ``step-<step>.partial``; every rank learns whether it could.

    Raises:
        CheckpointError: on every rank, if rank 0 could not create the directory (a full
            disk), so that no rank is left waiting for it.
    """
    import torch.distributed as dist

    partial = manifest.partial_dir(root, step)
    status = [None]
    if dist.get_rank() == 0:
        wait_for_prune()
        try:
            shutil.rmtree(partial, ignore_errors=True)  # leftover of a crashed attempt
            partial.mkdir(parents=True)
        except OSError as exc:
            status = [f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(status, src=0, group=group)
    if status[0] is not None:
        raise CheckpointError(f"cannot prepare {partial}: {status[0]}")
    return partial


def save(
    model,
    optimizer,
    *,
    root: Path,
    step: int,
    world_size: int,
    training_hash: str,
    keep_last: int,
    extra: dict | None = None,
) -> manifest.CheckpointRef | None:
    """Collective: every rank saves its shards; rank 0 commits and prunes.

    Returns the committed ``CheckpointRef`` on rank 0, None elsewhere. Checkpoints beyond
    ``keep_last`` are deleted in the background (``wait_for_prune``).
    """
    global _pruning
    import torch.distributed as dist

    rank = dist.get_rank()
    partial = _prepare(root, step)
    writer = _writer(partial)
    _save(_share(_state(model, optimizer), model, rank, dist.get_world_size()), writer)
    ref = None
    try:
        if rank == 0:
            ref = manifest.commit(
                root, step, world_size=world_size, training_hash=training_hash, extra=extra, digests=writer.digests
            )
            _pruning = threading.Thread(target=manifest.prune, args=(root, keep_last), name="trainflow-ckpt-prune")
            _pruning.start()
    finally:
        dist.barrier()  # also when rank 0's commit failed: the other ranks wait here
    return ref


def _load_local(state: dict, path: str) -> None:
    """Fill ``state`` in place from the checkpoint at ``path``, without collectives."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with open(Path(path) / ".metadata", "rb") as fh:
        safe_metadata(fh)  # a clear CheckpointError here, not one wrapped by DCP's gather
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_reader(path), planner=_safe_planner(), no_dist=True)


def load(model, optimizer, path: str) -> None:
    """Collective: load the checkpoint at ``path`` into ``model`` and ``optimizer`` in place.

    Each rank plans and reads what it holds on its own: a DDP rank needs every tensor and
    an FSDP2 rank its shards whatever the others do, so DCP's plan exchange (three
    collectives of pickled plans) bought nothing. One all-reduce keeps its other effect:
    every rank fails if one does.

    Raises:
        CheckpointError: on the ranks that read fine, when another rank could not.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    failed = torch.zeros(1)
    try:
        _load_local(state, path)
    except BaseException:  # noqa: BLE001 - re-raised once the other ranks know
        failed += 1
        dist.all_reduce(failed)
        raise
    dist.all_reduce(failed)
    if failed.item():
        raise CheckpointError(f"{int(failed.item())} rank(s) could not read checkpoint {path}")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_model_only(model, path: str) -> None:
    """Load only the model weights (no process group needed), e.g. for evaluation."""
    state = {"model": model.state_dict()}
    _load_local(state, path)
    model.load_state_dict(state["model"])


def weights_digest(model) -> str:
    """SHA-256 over every tensor of ``model``'s state dict in key order (bit-exact identity)."""
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class AsyncCheckpointer:
    """Asynchronous sharded saves: training stalls for little more than nothing.

    ``save`` takes this rank's share of the state (references, no copy) and hands it to one
    background thread, which copies it into CPU buffers that the stager caches per storage
    (no allocation after the first save) and then writes: preparing the directory, the DCP
    write over a gloo group of its own (sharing the training group crashed with a
    collective mismatch), and on rank 0 the manifest commit and pruning.

    The copy overlaps the next step's forward and backward, which read the parameters but
    do not change them: the loop calls ``before_update()`` before ``optimizer.step()``, and
    only waits there if the copy is not done yet. A model with buffers (batch-norm
    statistics change in the forward pass, DDP broadcasts them) is copied inside ``save``
    instead. One save is in flight at a time; a failed save (ENOSPC, I/O error) leaves the
    previous checkpoint the newest verified one.
    """

    def __init__(
        self, *, root: Path, world_size: int, training_hash: str, keep_last: int, on_commit=None, on_error=None
    ) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.world_size = Path(root), world_size
        self.training_hash, self.keep_last = training_hash, keep_last
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo")
        # Synchronous staging into CPU buffers cached per storage (reused by every save);
        # pinned only where there is an accelerator to copy from (any family).
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.accelerator.current_accelerator() is not None,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.on_commit, self.on_error = on_commit, on_error
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainflow-ckpt")
        self._idle = threading.Event()  # no save in flight
        self._staged = threading.Event()  # the save in flight no longer reads the live state
        self._idle.set()
        self._staged.set()

    def save(self, model, optimizer, *, step: int, extra: dict | None = None) -> None:
        """Collective: start saving ``step`` (``extra``: recorded in its manifest).

        Returns at once; the state must not change until ``before_update()`` returns
        (for a model with buffers, ``save`` returns once the state is copied).
        """
        self.wait()
        self._idle.clear()
        self._staged.clear()
        try:
            state = _share(_state(model, optimizer), model, self.rank, self.world_size)
            if next(iter(model.buffers()), None) is not None:
                staged = self.stager.stage(state)
                self._staged.set()
                self._executor.submit(self._write, staged, step, extra)
            else:
                self._executor.submit(self._stage_and_write, state, step, extra)
        except BaseException:
            self._staged.set()
            self._idle.set()
            raise

    def before_update(self) -> None:
        """Block until the save in flight has copied the state: call before anything
        changes parameters or optimizer state (``optimizer.step()``, a load)."""
        self._staged.wait()

    def _stage_and_write(self, state: dict, step: int, extra: dict | None) -> None:
        try:
            staged = self.stager.stage(state)
        except BaseException as exc:  # noqa: BLE001 - reported like a failed write
            self._staged.set()
            if self.on_error is not None:
                self.on_error(step, exc)
            self._idle.set()
            return
        self._staged.set()
        self._write(staged, step, extra)

    def _write(self, staged: dict, step: int, extra: dict | None) -> None:
        """Background: write ``staged`` as checkpoint ``step``; rank 0 commits and prunes."""
        try:
            writer = _writer(_prepare(self.root, step, self.group))
            _save(staged, writer, self.group)
            if self.rank == 0:
                ref = manifest.commit(
                    self.root,
                    step,
                    world_size=self.world_size,
                    training_hash=self.training_hash,
                    extra=extra,
                    digests=writer.digests,
                )
                manifest.prune(self.root, self.keep_last)
                if self.on_commit is not None:
                    self.on_commit(ref)
        except BaseException as exc:  # noqa: BLE001 - a failed save must not kill training
            # BaseException: DCP's CheckpointException is one.
            if self.on_error is not None:
                self.on_error(step, exc)
        finally:
            self._idle.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no save is in flight; True if idle."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Wait for the last save (and its commit) and release the thread and staging buffers."""
        self.wait()
        self._executor.shutdown()
        self.stager.close()
