from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from trainflow.cli import main
from trainflow.errors import SpecError
from trainflow.sched import Pool, Request
from trainflow.sched.simulate import percentile, plot, simulate
from trainflow.sched.trace import TraceError, TraceJob, load

ITP = Path("/work/shared/traces/itp/cluster04.csv")
HEADER = "job_id,submission_time,duration,num_gpu\n"


def job(id, gpus, duration, t, *, tenant="a", prio=0, chips=8):
    nodes = 1 if gpus <= chips else -(-gpus // chips)
    return TraceJob(
        request=Request(
            id=id,
            nodes=nodes,
            chips_per_node=min(gpus, chips),
            submitted=t,
            estimate=duration,
            tenant=tenant,
            priority=prio,
        ),
        duration=duration,
        gpus=gpus,
    )


@pytest.fixture
def tiny(tmp_path):
    """One node of 4 chips: j1 (2 chips, 10 s), then j2 (4 chips, 10 s) blocks j3 (2 chips, 5 s)."""
    path = tmp_path / "tiny.csv"
    path.write_text(HEADER + "j1,0,10,2\nj2,1,10,4\nj3,2,5,2\n")
    return path


def test_trace_rows_become_gangs_with_tenants_and_estimates(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + "a,0,100,1\nb,5,200,8\nc,9,300,12\nd,9,50,64\n")
    jobs = load(path, chips_per_node=8, tenants=3)
    assert [(j.request.nodes, j.request.chips_per_node, j.gpus) for j in jobs] == [
        (1, 1, 1),
        (1, 8, 8),
        (2, 8, 12),
        (8, 8, 64),
    ]
    assert [j.request.estimate for j in jobs] == [100, 200, 300, 50] == [j.duration for j in jobs]
    assert [j.request.tenant for j in jobs] == [j.request.tenant for j in load(path, tenants=3)]
    assert {j.request.tenant for j in jobs} <= {"tenant-0", "tenant-1", "tenant-2"}
    assert len(load(path, limit=2)) == 2
    noisy = load(path, estimate_noise=0.5, seed=7)
    assert noisy == load(path, estimate_noise=0.5, seed=7)
    assert [j.request.estimate for j in noisy] != [j.duration for j in noisy]
    with_cols = tmp_path / "w.csv"
    with_cols.write_text("job_id,submission_time,duration,num_gpu,tenant,priority\nx,0,10,2,research,3\n")
    assert (load(with_cols)[0].request.tenant, load(with_cols)[0].request.priority) == ("research", 3)


def test_the_itp_trace_loads():
    jobs = load(ITP, limit=500)
    assert len(jobs) == 500 and jobs[0].gpus == 16 and jobs[0].request.nodes == 2


@pytest.mark.parametrize(
    "rows,line,message",
    [
        pytest.param("a,0,10,1\nb,1,10,x\n", 3, "invalid num_gpu='x': a whole number ≥ 1", id="num_gpu"),
        pytest.param("a,0,10,0\n", 2, "invalid num_gpu='0'", id="zero-gpus"),
        pytest.param("a,0,-5,1\n", 2, "invalid duration='-5': a number of seconds > 0", id="duration"),
        pytest.param("a,soon,5,1\n", 2, "invalid submission_time='soon'", id="submission_time"),
        pytest.param("a,0,5\n", 2, "invalid row='a,0,5': expected 4 fields, got 3", id="short-row"),
        pytest.param("a,0,5,1\na,1,5,1\n", 3, "invalid job_id='a': duplicate of line 2", id="duplicate"),
        pytest.param(",0,5,1\n", 2, "invalid job_id=''", id="no-id"),
    ],
)
def test_malformed_traces_name_the_file_line_and_field(tmp_path, rows, line, message):
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + rows)
    with pytest.raises(TraceError) as exc:
        load(path)
    assert str(exc.value).startswith(f"{path}:{line}: ")
    assert message in str(exc.value)
    assert str(pickle.loads(pickle.dumps(exc.value))) == str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_a_trace_without_a_column_is_refused_at_line_1(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("job_id,submission_time,num_gpu\na,0,1\n")
    with pytest.raises(TraceError, match=r"cols.csv:1: invalid header=.*missing column\(s\) duration"):
        load(path)


@pytest.mark.parametrize(
    "policy,expected",
    [
        # fifo: j1 [0,10) 2 chips; j2 [10,20) 4; j3 waits behind j2: [20,25) 2. 70 chip-s over 25 s × 4.
        # Saturated [1,20): 2×9 + 4×10 = 58 chip-s over 19 s. JCT 10, 19, 23; waits 0, 9, 18.
        pytest.param(
            "fifo",
            dict(
                span_s=25,
                utilization=70 / 100,
                saturated_utilization=58 / 76,
                saturated_fraction=19 / 25,
                jct_mean_s=52 / 3,
                jct_p50_s=19,
                jct_p95_s=23,
                queue_delay_mean_s=9,
            ),
            id="fifo",
        ),
        # backfill: j3 ends at 7, before j2's reservation at 10: [2,7). j2 still starts at 10.
        # Saturated [1,10): 2 + 4×5 + 2×3 = 28 chip-s over 9 s. JCT 10, 19, 5; waits 0, 9, 0.
        pytest.param(
            "backfill",
            dict(
                span_s=20,
                utilization=70 / 80,
                saturated_utilization=28 / 36,
                saturated_fraction=9 / 20,
                jct_mean_s=34 / 3,
                jct_p50_s=10,
                jct_p95_s=19,
                queue_delay_mean_s=3,
            ),
            id="backfill",
        ),
    ],
)
def test_utilization_and_jct_match_the_hand_computed_schedule(tiny, policy, expected):
    report = simulate(load(tiny, tenants=1), pool=Pool.uniform(1, chips=4), policy=policy)
    got = report.to_dict(series=False)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert report.preemptions == 0 and report.tenant_share == {"tenant-0": pytest.approx(1.0)}


def test_tenant_share_is_chip_time():
    jobs = [job("j1", 2, 10, 0, tenant="a"), job("j2", 4, 10, 1, tenant="b"), job("j3", 2, 5, 2, tenant="a")]
    report = simulate(jobs, pool=Pool.uniform(1, chips=4), policy="fifo")
    assert report.tenant_share == {"a": pytest.approx(30 / 70), "b": pytest.approx(40 / 70)}


@pytest.mark.parametrize(
    "interval,kept,low_finish",
    [
        pytest.param(20, 20, 125, id="checkpoint-every-20s"),
        pytest.param(10, 30, 115, id="checkpoint-every-10s"),
        pytest.param(None, 0, 145, id="no-checkpoints"),
    ],
)
def test_a_preempted_job_resumes_from_its_last_checkpoint(interval, kept, low_finish):
    # low runs [0, 35) and is preempted by high (runs [35, 45)); it resumes at 45 with
    # 100 - kept seconds left. Lost: 35 - kept ≤ the checkpoint interval.
    jobs = [job("low", 4, 100, 0, prio=0, chips=4), job("high", 4, 10, 35, prio=5, chips=4)]
    report = simulate(jobs, pool=Pool.uniform(1, chips=4), policy="priority", checkpoint_interval=interval)
    assert report.preemptions == 1
    assert report.lost_chip_s == pytest.approx((35 - kept) * 4)
    assert 35 - kept <= (interval or 35)
    assert report.span_s == low_finish
    assert report.jct_mean_s == pytest.approx((low_finish + 10) / 2)
    assert report.queue_delay_mean_s == pytest.approx(10 / 2)  # low waited [35, 45)


def test_fairshare_reclaims_at_once_and_never_starves_a_tenant_under_quota():
    # hog floods the pool with 1-chip jobs at t=0; b's whole-node job arrives at 10 and
    # gets its quota back by preempting 8 of hog's borrowed jobs (no checkpoints: 10 s each lost).
    jobs = [job(f"hog{i}", 1, 100, 0, tenant="hog") for i in range(40)] + [job("b", 8, 50, 10, tenant="b")]
    report = simulate(jobs, pool=Pool.uniform(2, chips=8), policy="fairshare", quotas={"hog": 8, "b": 8})
    assert report.preemptions == 8
    assert report.lost_chip_s == pytest.approx(8 * 10)
    assert report.tenant_queue_delay_s["b"] == 0
    # fifo makes b wait behind 24 of hog's jobs: until t=200.
    fifo = simulate(jobs, pool=Pool.uniform(2, chips=8), policy="fifo")
    assert fifo.tenant_queue_delay_s["b"] == 190


def test_a_job_larger_than_the_pool_is_refused_not_left_waiting():
    with pytest.raises(SpecError, match=r"invalid nodes=8: request 'big'.*ask for at most 4 nodes"):
        simulate([job("big", 64, 10, 0)], pool=Pool.uniform(4), policy="backfill")


def test_percentile_is_nearest_rank():
    assert [percentile([5, 1, 3, 2, 4], p) for p in (0, 20, 50, 95, 100)] == [1, 1, 3, 5, 5]


def test_on_the_itp_trace_every_chip_second_is_accounted_and_backfill_beats_fifo():
    jobs = load(ITP, limit=1500)
    work = sum(j.duration * j.request.chips for j in jobs)
    reports = {p: simulate(jobs, pool=Pool.uniform(48), policy=p) for p in ("fifo", "backfill")}
    for r in reports.values():
        assert r.utilization * r.chips * r.span_s == pytest.approx(work)
        assert r.saturated_fraction > 0.3
        assert 0 < r.utilization <= 1 and max(u for _, u, _ in r.series) <= 1 + 1e-9
    assert reports["backfill"].jct_mean_s < reports["fifo"].jct_mean_s
    assert reports["backfill"].saturated_utilization >= reports["fifo"].saturated_utilization


def test_plot_writes_a_png(tiny, tmp_path):
    jobs = load(tiny, tenants=1)
    reports = [simulate(jobs, pool=Pool.uniform(1, chips=4), policy=p, bins=10) for p in ("fifo", "backfill")]
    out = plot(reports, tmp_path / "u.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_prints_the_report_or_the_error(tiny, tmp_path, capsys):
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(tiny),
                "--capacity",
                "1",
                "--chips",
                "4",
                "--policy",
                "backfill",
                "--tenants",
                "1",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["utilization"] == pytest.approx(0.875) and report["jct_p95_s"] == 19
    assert main(["simulate", "--trace", str(tiny), "--capacity", "1", "--chips", "4", "--policy", "fifo"]) == 0
    assert "utilization 70.0% overall, 76.3% while saturated" in capsys.readouterr().out
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "a,0,10,1\nb,1,ten,1\n")
    assert main(["simulate", "--trace", str(bad), "--capacity", "1", "--policy", "fifo"]) == 2
    assert f"{bad}:3: invalid duration='ten'" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tiny), "--capacity", "1", "--chips", "2", "--policy", "fifo"]) == 2
    assert "invalid nodes=2: request 'j2'" in capsys.readouterr().err


def test_the_core_imports_neither_airflow_nor_matplotlib():
    code = (
        "import sys, trainflow.sched, trainflow.sched.simulate, trainflow.sched.trace; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'airflow', 'matplotlib', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
