"""The per-rank training loop: init, parse spec, build, resume, train, checkpoint, close.

Run as ``python -m trainflow.worker.train --run-dir DIR`` under torchrun or trainflow's
node agent (both set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT).

Bit-identical results for a given seed and world size come from: a stateless sampler
(the data position is the step), every rank's RNG reseeded from (seed, rank, step) at
each step, the LR computed from the step, one intra-op thread, and a gradient reduction
whose summation order does not depend on DDP's bucket layout (``_canonical_allreduce``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

from trainflow import timeline
from trainflow.bounds import clip
from trainflow.checkpoint import manifest
from trainflow.errors import ChipUnavailableError, CrashLoopError, UserCodeError
from trainflow.heartbeat import HeartbeatWriter, RankState
from trainflow.remediation import abort
from trainflow.spec import TrainingSpec
from trainflow.timeline import record
from trainflow.workspace import COMPLETE, GROW_ACK, GROW_REQUEST_GLOB, PREEMPT_REQUEST, PREEMPTED, write_json_atomic

ABORT_EXIT_CODE = 3
# How long a gang that opened a grow window waits for the joining node before it trains on.
GROW_WINDOW_S = 20.0
# A preemptible gang asks rank 0 whether it is to stop every this many steps (and at every
# checkpoint): one 4-byte broadcast, so it stops within a few steps of the order.
PREEMPT_CHECK_STEPS = 10


def data_position(spec: TrainingSpec, ref) -> int:
    """Samples taken before checkpoint ``ref``'s step: recorded in its manifest since elastic
    runs exist; older checkpoints were all written at a fixed size (step × global batch)."""
    extra = manifest.read_manifest(Path(ref.path)) or {}
    position = (extra.get("extra") or {}).get("position")
    return int(position) if position is not None else ref.step * spec.global_batch_at(ref.world_size)


def membership_change(events: list[dict], members: list[int], world: int, *, run_dir: Path) -> dict | None:
    """How this gang differs from the previous one (``gang_start`` events), or None.

    ``change`` is ``shrink``/``grow`` when the world size changed, ``replaced`` when the
    same number of nodes has other members; a joining node whose agent was already up
    before the previous gang formed was a standing hot spare (``spare_used``).
    """
    previous = [e for e in events if e["event"] == "gang_start" and "nodes" in e]
    if not previous:
        return None
    last = previous[-1]
    if last["nodes"] == members and last.get("world") == world:
        return None
    joined = sorted(set(members) - set(last["nodes"]))
    spares = []
    for n in joined:
        try:
            status = json.loads((run_dir / "nodes" / f"node-{n:04d}.json").read_text())
        except (OSError, ValueError):
            continue
        if float(status.get("started", time.time())) < float(last["time"]):
            spares.append(n)
    world_from = int(last.get("world", world))
    change = (
        "shrink" if world < world_from else "grow" if world > world_from else "spare_used" if spares else "replaced"
    )
    return {
        "change": change,
        "world_from": world_from,
        "world_to": world,
        "nodes_from": last["nodes"],
        "nodes_to": members,
        "joined": joined,
        "left": sorted(set(last["nodes"]) - set(members)),
        "spares_used": spares,
    }


def grow_window(run_dir: Path, spec: TrainingSpec, rank: int, step: int, checkpointer, beat, say) -> None:
    """Collective, at a checkpoint step of a gang below its full size: if a node asked to
    join (``control/grow-request-<n>.json``), let the checkpoint of ``step`` commit, tell it
    (``control/grow-ack.json``) and wait: its agent joins the rendezvous, every agent
    restarts its workers into the larger gang, and they resume from this very step (no
    work lost). Trains on if nobody came within ``GROW_WINDOW_S``."""
    import torch
    import torch.distributed as dist

    control = run_dir / "control"
    flag = torch.tensor([1.0 if rank == 0 and any(control.glob(GROW_REQUEST_GLOB)) else 0.0])
    dist.broadcast(flag, src=0)
    if not flag.item():
        return
    if checkpointer is not None:
        checkpointer.wait()
    dist.barrier()
    if rank == 0:
        newest = manifest.list_checkpoints(run_dir / "checkpoints")
        if not newest or newest[0][0] != step:  # the save failed: growing now would lose work
            flag.zero_()
    dist.broadcast(flag, src=0)
    if not flag.item():
        return
    if rank == 0:
        write_json_atomic(control / GROW_ACK, {"step": step, "time": time.time()})
        record(run_dir, "grow_window", step=step)
        say(f"checkpoint of step {step} committed; waiting up to {GROW_WINDOW_S:.0f}s for joining nodes")
    beat.set_phase("growing")
    deadline = time.time() + GROW_WINDOW_S
    while time.time() < deadline:  # the agents restart us into the larger gang
        beat.beat(step=step, total=spec.steps, state=RankState.CHECKPOINTING, checkpoint_step=step, force=True)
        time.sleep(0.2)
    dist.barrier()
    if rank == 0:
        (control / GROW_ACK).unlink(missing_ok=True)
        say("no node joined in the grow window; training on")


def preempt_point(run_dir: Path, rank: int, step: int, checkpoint, say) -> bool:
    """Collective, every ``PREEMPT_CHECK_STEPS`` steps of a preemptible gang: if its node
    tasks asked it to stop (``control/preempt-request.json``, the allocator's order), commit
    a checkpoint of ``step`` (``checkpoint(step)``: saves unless that step's save already
    started, and waits for the commit) and, once it is the newest verified one, return True
    on every rank with rank 0 having written ``control/preempted.json``. If the save did
    not commit, train on: the next check tries again."""
    import torch
    import torch.distributed as dist

    control = run_dir / "control"
    flag = torch.tensor([1.0 if rank == 0 and (control / PREEMPT_REQUEST).exists() else 0.0])
    dist.broadcast(flag, src=0)
    if not flag.item():
        return False
    checkpoint(step)
    dist.barrier()
    if rank == 0:
        newest = manifest.list_checkpoints(run_dir / "checkpoints")
        if not newest or newest[0][0] != step:
            flag.zero_()
    dist.broadcast(flag, src=0)
    if not flag.item():
        say(
            f"asked to stop for a preemption, but the checkpoint of step {step} did not commit; "
            f"training on (the next check tries again)"
        )
        return False
    if rank == 0:
        try:
            order = json.loads((control / PREEMPT_REQUEST).read_text())
        except (OSError, ValueError):
            order = {}
        write_json_atomic(control / PREEMPTED, {"step": step, "time": time.time(), "by": order.get("by")})
        record(run_dir, "preempted", step=step, by=order.get("by"), reason=clip(order.get("reason", "")))
        say(
            f"preempted for {order.get('by')!r}: checkpoint of step {step} committed; the gang stops "
            f"and resumes from it when admitted again"
        )
    return True


def crash_restarts(events: list[dict], step: int) -> int:
    """Gang starts from the checkpoint of ``step`` so far, not counting the restart a grow
    window or a preemption planned there (they follow no failure; the crash-loop limit is
    about failures), nor those before the run was cleared and provisioned again."""
    count, planned = 0, False
    for e in events:
        if e["event"] == "provisioned_again":
            count, planned = 0, False
            continue
        if e.get("step") != step:
            continue
        if e["event"] in ("grow_window", "preempted"):
            planned = True
        elif e["event"] == "gang_start":
            count += not planned
            planned = False
    return count


def lr_at(spec: TrainingSpec, step: int) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, spec.steps // 20)
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec.steps - warmup)
    return spec.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def step_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank * 10_007 + step) % (2**63 - 1)


def _canonical_allreduce(process_group, bucket):
    """DDP comm hook: one all-reduce of the bucket's gradients laid out in the model's
    parameter order, whatever order the bucket holds them in.

    DDP rebuilds its buckets after the first step (ordered by when gradients became
    ready), and with three or more ranks a ring all-reduce sums an element in an order
    set by its offset in the buffer: a resumed run would differ from an uninterrupted one
    in the last bits. ``wrap`` keeps every gradient in one bucket (so a rebuild only
    reorders it) and this hook undoes the order: the offsets, and so the sums, are the
    same before and after a rebuild, at one collective per step.
    """
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    params, grads = bucket.parameters(), bucket.gradients()
    offsets, offset = [], 0
    for grad in grads:
        offsets.append(offset)
        offset += grad.numel()
    order = sorted(range(len(params)), key=lambda i: params[i]._trainflow_index)
    flat = torch.cat([grads[i].reshape(-1) for i in order])
    flat.div_(dist.get_world_size(process_group))

    def scatter_back(fut):
        reduced, at = fut.value()[0], 0
        for i in order:
            n = grads[i].numel()
            buf[offsets[i] : offsets[i] + n].copy_(reduced[at : at + n])
            at += n
        return buf

    return dist.all_reduce(flat, group=process_group, async_op=True).get_future().then(scatter_back)


def wrap(model, spec: TrainingSpec, shard_modules, device):
    """Wrap ``model`` for data parallelism: DDP (default) or FSDP2 ``fully_shard``.

    DDP gets a single bucket sized to the model and ``_canonical_allreduce``: bit-exact
    resumes at the speed of DDP's own all-reduce (no overlap of the reduction with the
    backward pass, which on CPU ranks gains nothing measurable; see bench/throughput.py).
    """
    if spec.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in shard_modules:
            fully_shard(module)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    params = [p for p in model.parameters() if p.requires_grad]
    for index, param in enumerate(params):
        param._trainflow_index = index
    size_mb = sum(p.numel() * p.element_size() for p in params) / 2**20 + 1.0
    ddp = DDP(model, device_ids=None if device.type == "cpu" else [device.index], bucket_cap_mb=size_mb)
    ddp.register_comm_hook(None, _canonical_allreduce)
    return ddp


def pick_device(torch, family):
    """This rank's device: index 0 of what it sees (``apply_visibility`` gave each rank its
    own share of the node's devices before torch was imported); generic over families."""
    if not family.has_devices:
        return torch.device("cpu")
    device = torch.device(family.device_type, 0)
    module = torch.get_device_module(device)
    if module.device_count() < 1:
        raise ChipUnavailableError(
            f"chip family {family.name!r}: no {family.device_type} device is visible to this rank "
            f"({family.visible_env}={os.environ.get(family.visible_env or '', '<unset>')}); check the "
            f"node's driver with `trainflow doctor`"
        )
    module.set_device(device)
    return device


def amp_precision(torch, family, precision: str, device):
    """The autocast dtype for the spec's precision (``auto``: the family's bf16 rule,
    asked of the device module generically where it can answer)."""
    if precision == "fp32":
        return torch.float32
    if precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    from trainflow.chips.registry import amp_dtype

    module = torch.get_device_module(device)
    probe = {}
    if device.type != "cpu":
        if hasattr(module, "get_device_capability"):
            probe["capability"] = tuple(module.get_device_capability(device))
        if hasattr(module, "get_device_name"):
            probe["device_name"] = module.get_device_name(device)
    if hasattr(module, "is_bf16_supported"):
        probe["runtime_bf16"] = bool(module.is_bf16_supported())
    return getattr(torch, amp_dtype(family, **probe))


def extra_state(position: int, scaler) -> dict:
    """What a checkpoint's manifest records beside the tensors: the data position and,
    with fp16 loss scaling, the scaler (so a resumed run scales exactly as before)."""
    extra = {"position": position}
    if scaler.is_enabled():
        extra["grad_scaler"] = scaler.state_dict()
    return extra


def apply_visibility(run_dir: Path, env=os.environ) -> dict[str, str]:
    """Give this rank its share of the node's devices, before torch is imported."""
    from trainflow.chips.registry import get_family, worker_env

    chip = json.loads((run_dir / "spec.json").read_text()).get("chip", "cpu")
    node_devices = env.get("TRAINFLOW_NODE_DEVICES")
    try:
        update = worker_env(
            get_family(chip),
            env,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world=int(env.get("LOCAL_WORLD_SIZE", "1")),
            node_devices=int(node_devices) if node_devices else None,
        )
    except ValueError as exc:  # too few devices for nproc_per_node: no retry can help
        raise ChipUnavailableError(f"chip family {chip!r}: {exc}") from exc
    env.update(update)
    return update


def _collate(train, indices, device):
    from torch.utils.data import default_collate

    batch = default_collate([train[i] for i in indices])
    return tuple(t.to(device) for t in batch) if isinstance(batch, (tuple, list)) else batch.to(device)


class StepProfiler:
    """``TRAINFLOW_STEP_PROFILE=<file>``: rank 0 runs ``torch.profiler`` over ``STEPS`` steady steps
    (from the 20th after the start) and writes the top operators by self CPU time to the
    file (bench/throughput.py --profile)."""

    STEPS = 20
    SKIP = 20

    def __init__(self, path: str, start: int) -> None:
        self.path, self.begin = path, start + self.SKIP
        self.prof = None

    @classmethod
    def from_env(cls, rank: int, start: int, steps: int) -> "StepProfiler | None":
        path = os.environ.get("TRAINFLOW_STEP_PROFILE")
        if not path or rank != 0 or start + cls.SKIP + cls.STEPS > steps:
            return None
        return cls(path, start)

    def at(self, step: int) -> None:
        import torch

        if step == self.begin:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        elif step == self.begin + self.STEPS and self.prof is not None:
            self.prof.__exit__(None, None, None)
            table = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            Path(self.path).write_text(f"{self.STEPS} steps from step {self.begin}\n{table}")
            self.prof = None


def user_code(rank: int, fn, *args):
    """Call workload code; its exceptions become ``UserCodeError`` (never retried)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - classified, the original chained
        raise UserCodeError(rank, f"{type(exc).__name__}: {exc}") from exc


def save_error(exc: BaseException) -> str:
    """One line per failing rank for a failed save (DCP wraps them with their tracebacks)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(failures.items()))[:1000]
    return f"{type(exc).__name__}: {exc}"[:1000]


def apply_limits(spec: TrainingSpec, resource=None) -> dict[str, int]:
    """Set this worker's resource limits from the spec (``memory_limit_mb`` → RLIMIT_DATA,
    ``open_files_limit`` → RLIMIT_NOFILE, never above the hard limits the host set);
    returns what was set."""
    if resource is None:
        import resource
    done = {}
    for field_name, which, scale in (
        ("memory_limit_mb", resource.RLIMIT_DATA, 1 << 20),
        ("open_files_limit", resource.RLIMIT_NOFILE, 1),
    ):
        want = getattr(spec, field_name)
        if not want:
            continue
        _, hard = resource.getrlimit(which)
        value = want * scale if hard == resource.RLIM_INFINITY else min(want * scale, hard)
        resource.setrlimit(which, (value, hard))
        done[field_name] = value
    return done


def run(run_dir: Path) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from trainflow.checkpoint import dcp
    from trainflow.chips.registry import get_family
    from trainflow.data import indices_at, rank_positions
    from trainflow.faults import FaultInjector
    from trainflow.workloads import load_workload

    spec = TrainingSpec.from_json((run_dir / "spec.json").read_text())
    apply_limits(spec)
    for sub in ("checkpoints", "heartbeats", "control"):  # plain torchrun needs only spec.json
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ.get("TRAINFLOW_NODE", os.environ.get("GROUP_RANK", "0")))
    if not (spec.min_world_size <= world <= spec.world_size and world % spec.nproc_per_node == 0):
        raise RuntimeError(
            f"launched with WORLD_SIZE={world}, spec wants {spec.world_size}"
            + (f" (at least {spec.min_world_size})" if spec.elastic else "")
        )
    torch.set_num_threads(1)
    family = get_family(spec.chip)
    if family.extension:
        import importlib

        try:
            importlib.import_module(family.extension)
        except ImportError as exc:
            raise ChipUnavailableError(
                f"chip family {family.name!r} needs the {family.extension!r} extension "
                f"(pip package {family.package!r}), which is not installed on this worker ({exc}); "
                f"install it, or serve queue {spec.queue!r} only from workers that have it"
            ) from exc
    device = pick_device(torch, family)
    precision = amp_precision(torch, family, spec.precision, device)
    beat = HeartbeatWriter(run_dir / "heartbeats", rank=rank, node=node, interval=spec.heartbeat_interval, world=world)
    beat.beat(step=0, total=spec.steps, state=RankState.STARTING, force=True)
    beat.start_pulse()
    dist.init_process_group(backend=family.composite_backend)

    def say(*parts) -> None:
        print(f"[rank {rank}]", *parts, flush=True)

    injector = FaultInjector(spec.faults, run_dir=run_dir, rank=rank, heartbeat=beat)
    workload = user_code(rank, load_workload, spec)
    model = wrap(workload.model.to(device), spec, workload.shard_modules, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    # fp16 autocast needs loss scaling; bf16 and fp32 do not (the scaler is then a no-op).
    scaler = torch.amp.GradScaler(device.type, enabled=precision == torch.float16)
    ckpt_root = run_dir / "checkpoints"
    thash = spec.training_hash()

    # Rank 0 decides the resume point so every rank loads the same checkpoint. An elastic
    # gang loads checkpoints of any world size (DCP reshards them on load).
    choice = [None]
    nodes = [None] * world
    dist.all_gather_object(nodes, node)
    if rank == 0:
        ref = manifest.newest_verified(ckpt_root, training_hash=thash, world_size=None if spec.elastic else world)
        choice = [ref.to_dict() if ref else None]
        if ref is not None:
            choice[0]["position"] = data_position(spec, ref)
    dist.broadcast_object_list(choice, src=0)
    start = choice[0]["step"] if choice[0] else 0
    position = choice[0]["position"] if choice[0] else 0
    if rank == 0:
        events = timeline.read(run_dir)
        earlier = crash_restarts(events, start)
        members = sorted(set(nodes))
        change = membership_change(events, members, world, run_dir=run_dir)
        record(run_dir, "gang_start", step=start, world=world, nodes=members)
        if change is not None:
            record(run_dir, "membership", step=start, **change)
            say(
                f"gang {change['change']}: world {change['world_from']} → {world}, nodes "
                f"{change['nodes_from']} → {members}, resuming at step {start} "
                f"(batch policy {spec.batch_policy}, global batch {spec.global_batch_at(world)})"
            )
        if earlier >= spec.crash_loop_limit:
            raise CrashLoopError(
                f"crash loop: the gang restarted {earlier} times from step {start} "
                f"without reaching a newer checkpoint (crash_loop_limit="
                f"{spec.crash_loop_limit}); stopping instead of retrying"
            )
    if choice[0]:
        dcp.load(model, optimizer, choice[0]["path"])
        if scaler.is_enabled():
            scale_state = (manifest.read_manifest(Path(choice[0]["path"])) or {}).get("extra", {}).get("grad_scaler")
            if scale_state:
                scaler.load_state_dict(scale_state)
        say(f"resumed from verified checkpoint step {start} ({choice[0]['path']})")
        if rank == 0:
            record(run_dir, "resumed", step=start, checkpoint=choice[0]["path"])

    committed: list = []

    save_started: dict[int, float] = {}

    def on_commit(ref) -> None:
        committed.append(ref)
        injector.save_finished(ref.step, ok=True)
        if ref.step in save_started:  # rank 0: how far the newest verified checkpoint lagged
            record(
                run_dir,
                "checkpoint_committed",
                step=ref.step,
                latency_s=round(time.time() - save_started.pop(ref.step), 3),
            )

    def on_error(step: int, exc: BaseException) -> None:
        error = save_error(exc)
        say(f"WARNING checkpoint of step {step} failed ({error}); the previous verified checkpoint stays the newest")
        record(run_dir, "checkpoint_failed", step=step, rank=rank, error=error)
        injector.save_finished(step, ok=False)

    checkpointer = None
    if spec.checkpoint_mode == "async":
        checkpointer = dcp.AsyncCheckpointer(
            root=ckpt_root,
            world_size=world,
            training_hash=thash,
            keep_last=spec.keep_last,
            on_commit=on_commit,
            on_error=on_error,
        )
    n, window_t, window_s = len(workload.train), time.time(), start
    loss_value, samples_per_s, last_ckpt, compute_ewma = float("nan"), 0.0, start, None
    curve_t = 0.0
    global_batch = spec.global_batch_at(world)
    samples_log = None
    if spec.record_samples:
        (run_dir / "samples").mkdir(exist_ok=True)
        samples_log = open(run_dir / "samples" / f"rank-{rank:05d}.jsonl", "a", buffering=1)

    def save(done: int) -> None:
        nonlocal last_ckpt
        beat.beat(
            step=done,
            total=spec.steps,
            state=RankState.CHECKPOINTING,
            loss=loss_value,
            checkpoint_step=last_ckpt,
            force=True,
        )
        t_save = time.perf_counter()
        if rank == 0:
            save_started[done] = time.time()
        if checkpointer is not None:
            if injector.ballast_outlived(last_ckpt) and checkpointer.wait():
                # Only rank 0 hears of a committed save; a failed one would have
                # released the ballast already, so the previous save succeeded.
                injector.save_finished(last_ckpt, ok=True)
            checkpointer.save(model, optimizer, step=done, extra=extra_state(position, scaler))
        else:
            try:
                ref = dcp.save(
                    model,
                    optimizer,
                    root=ckpt_root,
                    step=done,
                    world_size=world,
                    training_hash=thash,
                    keep_last=spec.keep_last,
                    extra=extra_state(position, scaler),
                )
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - keep the old one
                on_error(done, exc)
            else:
                on_commit(ref) if ref is not None else injector.save_finished(done, ok=True)
        stall_ms = 1000 * (time.perf_counter() - t_save)
        last_ckpt = done
        if rank == 0:
            record(run_dir, "checkpoint_stall", step=done, mode=spec.checkpoint_mode, stall_ms=round(stall_ms, 3))

    def save_and_wait(done: int) -> None:
        if last_ckpt != done:
            save(done)
        if checkpointer is not None:
            checkpointer.wait()

    preempted_at = None
    profiler = StepProfiler.from_env(rank, start, spec.steps)
    for step in range(start, spec.steps):
        if profiler is not None:
            profiler.at(step)
        torch.manual_seed(step_seed(spec.seed, rank, step))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(spec, step)
        mine = rank_positions(position=position, global_batch=global_batch, world_size=world, rank=rank)
        idx = indices_at(n=n, seed=spec.seed, positions=mine)
        model.train()
        beat.set_phase("forward")
        user_code(rank, injector.before_step, step + 1)
        t_compute = time.perf_counter()
        with torch.autocast(device.type, dtype=precision, enabled=precision != torch.float32):
            loss = user_code(rank, workload.loss, model, _collate(workload.train, idx, device))
        injector.slowdown(step + 1, time.perf_counter() - t_compute)
        compute_ms = 1000 * (time.perf_counter() - t_compute)
        compute_ewma = compute_ms if compute_ewma is None else 0.9 * compute_ewma + 0.1 * compute_ms
        optimizer.zero_grad(set_to_none=True)
        beat.set_phase("backward")  # gradient collectives: where a stuck peer's victims wait
        # The gradient collectives average over ranks; when the global batch does not split
        # evenly, weighting each rank's mean loss by its share keeps the step's gradient the
        # mean over the global batch. Even splits (every fixed-size run) skip it: bits unchanged.
        weight = len(mine) * world / global_batch
        scaler.scale(loss * weight if weight != 1 else loss).backward()
        position += global_batch
        if samples_log is not None:
            samples_log.write(
                json.dumps({"step": step + 1, "world": world, "time": time.time(), "indices": idx}) + "\n"
            )
        if checkpointer is not None:
            checkpointer.before_update()  # an async save copies the state during forward/backward
        if scaler.is_enabled():
            scaler.step(optimizer)  # skipped when a gradient overflowed (same on every rank)
            scaler.update()
        else:
            optimizer.step()
        done = step + 1
        loss_value = float(loss.detach())
        if step == start and rank == 0:
            record(run_dir, "first_step", step=done)
        if time.time() - window_t >= spec.heartbeat_interval:
            samples_per_s = (done - window_s) * spec.batch_size / (time.time() - window_t)
            window_t, window_s = time.time(), done
        beat.beat(
            step=done,
            total=spec.steps,
            state=RankState.TRAINING,
            loss=loss_value,
            samples_per_s=samples_per_s,
            checkpoint_step=last_ckpt,
            compute_ms=compute_ewma,
        )
        if rank == 0 and (time.time() - curve_t >= spec.heartbeat_interval or done == spec.steps):
            curve_t = time.time()  # the loss curve of the report's plot, redone steps included
            timeline.append(
                run_dir / "curve.jsonl",
                {"time": curve_t, "step": done, "loss": loss_value, "world": world, "global_batch": global_batch},
            )
        if done % spec.checkpoint_interval == 0 or done == spec.steps:
            save(done)
            if spec.elastic and world < spec.world_size and done < spec.steps:
                grow_window(run_dir, spec, rank, done, checkpointer, beat, say)
        if (
            spec.preemptible
            and done < spec.steps
            and (done % PREEMPT_CHECK_STEPS == 0 or done % spec.checkpoint_interval == 0)
            and preempt_point(run_dir, rank, done, save_and_wait, say)
        ):
            preempted_at = done
            break
        while committed:
            ref = committed.pop(0)
            injector.after_checkpoint(ref.step, Path(ref.path))
            say(
                f"step {ref.step}/{spec.steps} checkpoint verified ({ref.bytes} bytes, "
                f"manifest {ref.manifest_sha256[:12]})"
            )
    if checkpointer is not None:
        checkpointer.close()
        if injector.ballast_outlived(last_ckpt):
            injector.save_finished(last_ckpt, ok=True)
        for ref in committed:
            injector.after_checkpoint(ref.step, Path(ref.path))
    # A preempted gang stopped at a verified checkpoint: its node tasks requeue the run.
    if preempted_at is None:
        beat.beat(
            step=spec.steps,
            total=spec.steps,
            state=RankState.DONE,
            loss=loss_value,
            samples_per_s=samples_per_s,
            checkpoint_step=last_ckpt,
            compute_ms=compute_ewma,
            force=True,
        )
    if rank == 0 and preempted_at is None:  # standing spares and nodes waiting to join end with the run
        write_json_atomic(run_dir / "control" / COMPLETE, {"step": spec.steps, "time": time.time(), "world": world})
    # Free model, optimizer and data before tearing the group down: workers otherwise
    # hang at exit in a fraction of runs.
    model = optimizer = workload = None  # (the closures above hold the cells, not the objects)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    from trainflow.proctree import die_with_parent

    if not os.environ.get("TRAINFLOW_ZYGOTE_CHILD"):  # a zygote's child dies with the zygote
        die_with_parent(int(os.environ.get("TRAINFLOW_AGENT_PID", "0")))
    try:
        from trainflow.launch.runas import drop_privileges

        drop_privileges()  # the tenant's own OS user, before any of its code loads
        apply_visibility(args.run_dir)
        return run(args.run_dir)
    except BaseException as exc:  # noqa: BLE001 - report every failure, then re-raise
        rank = int(os.environ.get("RANK", "-1"))
        user = isinstance(exc, UserCodeError)
        fatal = user or isinstance(exc, (CrashLoopError, ChipUnavailableError))
        kind = (
            "user"
            if user
            else "crash_loop"
            if isinstance(exc, CrashLoopError)
            else "chip_unavailable"
            if fatal
            else "infrastructure"
        )
        error = {
            "rank": rank,
            "kind": kind,  # bounded: it reaches XComs, the report, the page
            "type": type(exc.__cause__ or exc).__name__,
            "message": clip(exc),
            "traceback": traceback.format_exc()[-8000:],
            "time": time.time(),
        }
        err_dir = args.run_dir / "errors"
        err_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(err_dir / f"rank-{rank:05d}.json", error)
        if fatal:
            # A deterministic bug or a crash loop: restarting cannot help. Stop every agent.
            record(args.run_dir, "user_error" if user else kind, rank=rank, message=clip(exc))
            abort(args.run_dir, error)
            print(f"[rank {rank}] {kind} failure, run aborted:\n{error['traceback']}", file=sys.stderr, flush=True)
            return ABORT_EXIT_CODE
        raise


if __name__ == "__main__":
    sys.exit(main())
