"""bench/scaling: how trainflow's costs grow with scale (issue 9 item 4), each a curve with
its fitted growth exponent (cost ∝ size^k from a least-squares line in log-log space):

- ``sim``: simulator wall time vs trace size, 1k → 60k jobs (the ITP traces, concatenated
  and shifted in time past 45k jobs), FIFO and EASY backfill on a pool where FIFO saturates;
- ``admission``: one admission decision (``Allocator.request``, the code provision runs)
  vs the number of runs already queued in the pool (SQLite, as embedded);
- ``heartbeat``: one poll of the heartbeat watch (read every rank's file, classify) vs
  the number of ranks;
- ``checkpoint``: save and load of a model with Adam state vs parameters (1M → 100M),
  trainflow's DCP code in a one-rank gloo group;
- ``dag``: the DAG's own overhead vs node tasks (1, 2, 4, 8) on the embedded stack: the
  run's wall time from trigger to success minus the slowest node task's training time.

    .venv/bin/python bench/scaling.py [sim admission heartbeat checkpoint dag]
    .venv/bin/python bench/scaling.py --smoke    # every part, tiny sizes: run by TRAINFLOW_LONG_SMOKES=1 scripts/test

Writes ``bench/results/scaling.json`` (merging with earlier parts) and ``scaling.png``.
``--smoke`` runs every part's code with three tiny sizes (two node-task counts for ``dag``;
the simulator on one trace, cluster06, repeated past its end) and writes a fresh
``bench/results/scaling_smoke.json``; its figures are not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "results" / "scaling.json"
TRACES = REPO.parent / "shared" / "traces" / "itp"
# Each part's arguments under --smoke: every part's code, sizes that take seconds.
SMOKE = {
    "sim": {"sizes": [300, 1000, 3000], "traces": "cluster06.csv"},
    "admission": {"sizes": [1, 10, 30]},
    "heartbeat": {"sizes": [2, 8, 32]},
    "checkpoint": {"sizes_m": [1, 2, 3]},
    "dag": {"sizes": [1, 2]},
}


def _slope(xs, ys) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares ``log y = k log x + c`` over the three largest sizes: the growth
    exponent ``k`` where fixed costs no longer hide it (1: linear); ``exponent_all`` over
    every size."""
    k = _slope(xs[-3:], ys[-3:])
    return {
        "exponent": round(k, 3),
        "exponent_all": round(_slope(xs, ys), 3),
        "growth": "sublinear" if k < 0.9 else "linear" if k <= 1.15 else "superlinear",
    }


def _best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_sim(sizes=(1000, 3000, 10000, 30000, 60000), traces: str = "cluster*.csv") -> dict:
    from dataclasses import replace

    from trainflow.sched.model import Pool
    from trainflow.sched.simulate import simulate
    from trainflow.sched.trace import load

    def shifted(j, tag: str, at: float):
        return replace(j, request=replace(j.request, id=f"{tag}-{j.request.id}", submitted=at))

    base = []
    for csv in sorted(TRACES.glob(traces)):
        jobs = load(csv)
        offset = (max(j.request.submitted for j in base) + 1) if base else 0.0
        start = min(j.request.submitted for j in jobs)
        base += [shifted(j, csv.stem, j.request.submitted - start + offset) for j in jobs]
    sizes = list(sizes)
    span = max(j.request.submitted for j in base) - min(j.request.submitted for j in base)
    # The pool that the traces' work fills to ~90% on average: queues form, none grows forever.
    nodes = max(1, round(sum(j.duration * j.request.chips for j in base) / (8 * span * 0.9)))
    pool = Pool.uniform(nodes)
    out = {"sizes": sizes, "pool_nodes": nodes, "traces_jobs": len(base)}
    for policy in ("fifo", "backfill"):
        secs = []
        for n in sizes:
            jobs = list(base[:n])
            while len(jobs) < n:  # past the traces' jobs: the traces again, later
                shift = max(j.request.submitted for j in jobs) + 1
                jobs += [shifted(j, f"r{len(jobs)}", j.request.submitted + shift) for j in base[: n - len(jobs)]]
            t0 = time.perf_counter()
            simulate(jobs, pool=pool, policy=policy)
            secs.append(time.perf_counter() - t0)
            print(f"sim {policy} {n} jobs {secs[-1]:.2f}s", flush=True)
        out[policy] = {"seconds": secs, **fit(sizes, secs)}
    return out


def bench_admission(sizes=(1, 10, 100, 1000, 3000)) -> dict:
    from trainflow.cluster.allocator import Allocator

    sizes = list(sizes)
    out = {"queued": sizes, "seconds": []}
    for n in sizes:
        with tempfile.TemporaryDirectory() as d:
            alloc = Allocator(Path(d) / "state.db")
            alloc.set_pool("p", 8)
            now = time.time()
            alloc.admit("t/d/holder", tenant="t", pool="p", nodes=8, ttl=3600, now=now)  # pool full
            for i in range(n):
                alloc.request(
                    f"t{i % 3}/d/r{i}", tenant=f"t{i % 3}", pool="p", nodes=1 + i % 4, ttl=3600, now=now + i * 1e-3
                )
            probe = n // 2  # a run in the middle of the queue renews its wait (what a deferred provision does)
            out["seconds"].append(
                _best(
                    lambda: alloc.request(
                        f"t{probe % 3}/d/r{probe}",
                        tenant=f"t{probe % 3}",
                        pool="p",
                        nodes=1 + probe % 4,
                        ttl=3600,
                        now=now + 1,
                    ),
                    rounds=20,
                )
            )
            print(f"admission with {n} queued: {out['seconds'][-1] * 1e3:.2f} ms", flush=True)
    return {**out, **fit(sizes, out["seconds"])}


def bench_heartbeat(sizes=(2, 8, 32, 128, 512, 2048)) -> dict:
    from trainflow.heartbeat import HeartbeatPolicy, HeartbeatWriter, RankState, classify, read_all

    sizes = list(sizes)
    out = {"ranks": sizes, "seconds": []}
    for n in sizes:
        with tempfile.TemporaryDirectory() as d:
            for r in range(n):
                HeartbeatWriter(Path(d), rank=r, node=r // 8, interval=1, world=n).beat(
                    step=100, total=1000, state=RankState.TRAINING, loss=0.1
                )
            policy = HeartbeatPolicy(timeout=60, startup_timeout=300)

            def poll():
                beats = read_all(Path(d))
                assert len(beats) == n
                classify(beats, now=time.time(), world_size=n, started_at=time.time() - 10, policy=policy)

            out["seconds"].append(_best(poll, rounds=10))
            print(f"heartbeat poll {n} ranks: {out['seconds'][-1] * 1e3:.2f} ms", flush=True)
    return {**out, **fit(sizes, out["seconds"])}


def bench_checkpoint(sizes_m=(1, 3, 10, 30, 100)) -> dict:
    import torch
    import torch.distributed as dist

    from trainflow.checkpoint import dcp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
    sizes_m = list(sizes_m)
    out = {"params_m": sizes_m, "save_s": [], "load_s": [], "bytes": []}
    try:
        for m in sizes_m:
            width = 1024
            layers = max(1, round(m * 1e6 / (width * width + width)))
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            model(torch.randn(2, width)).sum().backward()
            opt.step()  # Adam's state exists: 3 × the parameters' bytes
            with tempfile.TemporaryDirectory(dir=REPO / "bench") as root:
                saves, loads = [], []
                for step in range(1, 3):
                    t0 = time.perf_counter()
                    ref = dcp.save(
                        model, opt, root=Path(root), step=step, world_size=1, training_hash="scaling", keep_last=1
                    )
                    saves.append(time.perf_counter() - t0)
                    dcp.wait_for_prune()
                    t0 = time.perf_counter()
                    dcp.load(model, opt, str(ref.path))
                    loads.append(time.perf_counter() - t0)
                out["save_s"].append(min(saves))
                out["load_s"].append(min(loads))
                out["bytes"].append(ref.bytes)
            params = sum(p.numel() for p in model.parameters())
            print(
                f"checkpoint {params / 1e6:.1f}M params ({ref.bytes / 2**20:.0f} MiB): "
                f"save {out['save_s'][-1]:.2f}s load {out['load_s'][-1]:.2f}s",
                flush=True,
            )
            del model, opt
    finally:
        dist.destroy_process_group()
    return {**out, "save": fit(sizes_m, out["save_s"]), "load": fit(sizes_m, out["load_s"])}


def bench_dag(sizes=(1, 2, 4, 8)) -> dict:
    from trainflow.launch.local import free_port
    from trainflow.stack import EmbeddedStack

    sizes = list(sizes)
    out = {"nodes": sizes, "wall_s": [], "train_s": [], "overhead_s": []}
    with tempfile.TemporaryDirectory() as d:
        stack = EmbeddedStack(
            home=Path(d) / "airflow",
            trainflow_home=Path(d) / "trainflow",
            port=free_port(),
            node_slots=8,
            parallelism=16,
        )
        stack.up(timeout=240)
        try:
            client = stack.client()
            client.wait_for_dag("train_digits", timeout=180)
            client.unpause("train_digits")
            for n in sizes:
                conf = {"nodes": n, "steps": 20, "checkpoint_interval": 10, "tenant": "scaling"}
                t0 = time.time()
                run_id = client.trigger("train_digits", conf, run_id=f"scaling-{n}")["dag_run_id"]
                run = client.wait_run("train_digits", run_id, timeout=900)
                wall = time.time() - t0
                assert run["state"] == "success", run
                train = max(
                    float(t["duration"] or 0)
                    for t in client.task_instances("train_digits", run_id)
                    if t["task_id"] == "shard_train"
                )
                out["wall_s"].append(wall)
                out["train_s"].append(train)
                out["overhead_s"].append(wall - train)
                print(
                    f"dag {n} node tasks: wall {wall:.1f}s, slowest node task {train:.1f}s, "
                    f"overhead {wall - train:.1f}s",
                    flush=True,
                )
        finally:
            stack.stop()
    return {**out, **fit(sizes, out["overhead_s"])}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "sim" in result:
        r = result["sim"]
        panels.append(
            (
                "simulator",
                "jobs",
                "s",
                [(r["sizes"], r[p]["seconds"], f"{p} (k={r[p]['exponent']})") for p in ("fifo", "backfill")],
            )
        )
    if "admission" in result:
        r = result["admission"]
        panels.append(("admission decision", "queued runs", "s", [(r["queued"], r["seconds"], f"k={r['exponent']}")]))
    if "heartbeat" in result:
        r = result["heartbeat"]
        panels.append(("heartbeat poll", "ranks", "s", [(r["ranks"], r["seconds"], f"k={r['exponent']}")]))
    if "checkpoint" in result:
        r = result["checkpoint"]
        panels.append(
            (
                "checkpoint",
                "parameters (M)",
                "s",
                [
                    (r["params_m"], r["save_s"], f"save (k={r['save']['exponent']})"),
                    (r["params_m"], r["load_s"], f"load (k={r['load']['exponent']})"),
                ],
            )
        )
    if "dag" in result:
        r = result["dag"]
        panels.append(("DAG overhead", "node tasks", "s", [(r["nodes"], r["overhead_s"], f"k={r['exponent']}")]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, xl, yl, series) in zip(axes[0], panels):
        for xs, ys, label in series:
            ax.loglog(xs, ys, "o-", label=label)
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parts = {
        "sim": bench_sim,
        "admission": bench_admission,
        "heartbeat": bench_heartbeat,
        "checkpoint": bench_checkpoint,
        "dag": bench_dag,
    }
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # No ``choices``: Python 3.11's argparse checks the default list as one value against them.
    p.add_argument("parts", nargs="*", metavar="part", help=f"any of {', '.join(parts)} (default: every part)")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/scaling.json; the plot beside it")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every part with tiny sizes, a fresh result (run by TRAINFLOW_LONG_SMOKES=1 scripts/test)",
    )
    args = p.parse_args(argv)
    if unknown := [name for name in args.parts if name not in parts]:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(parts)}")
    args.parts = args.parts or list(parts)
    out = args.out or (OUT.with_name("scaling_smoke.json") if args.smoke else OUT)
    result = json.loads(out.read_text()) if out.exists() and not args.smoke else {"bench": "scaling"}
    if args.smoke:
        result["smoke"] = True
    for name in args.parts:
        result[name] = {**parts[name](**(SMOKE[name] if args.smoke else {})), "time": time.time()}
        result["machine"] = {"cpus": os.cpu_count()}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(
        json.dumps(
            {
                k: {kk: v.get(kk) for kk in ("exponent", "growth", "save", "load")}
                for k, v in result.items()
                if isinstance(v, dict) and k != "machine"
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
