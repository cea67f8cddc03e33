"""How bench/soak judges a soak: whether a series stayed bounded, how the smoke run scales
its faults, and what a smoke result is judged by."""

from __future__ import annotations

import os
import time


def _series(values, **extra):
    return [{"t": 15.0 * i, "logs_mb": v, **extra} for i, v in enumerate(values)]


def test_the_last_quarter_against_the_second_quarters_peak(soak_bench):
    soak = soak_bench
    level = lambda s: s["logs_mb"]  # noqa: E731
    assert soak.bounded(_series([1.0 + 0.1 * i for i in range(40)]), level)["bounded"] is False
    # A leak on top of a base level fails once it adds more than that level over the soak.
    assert soak.bounded(_series([5.0 + 0.15 * i for i in range(40)]), level)["bounded"] is False
    assert soak.bounded(_series([1.0, 1.1, 0.9, 1.0] * 10), level)["bounded"] is True
    # A saw-tooth under retention whose second quarter caught mostly troughs (few runs ended
    # in it, as on a slow machine): its mean is low, its peak is the level retention holds.
    slow = _series([0.0] * 10 + [0.2, 0.2, 0.2, 0.2, 3.0, 0.2, 0.2, 0.2, 0.2, 0.2] + [2.0, 3.0, 0.5, 2.5, 1.0] * 4)
    verdict = soak.bounded(slow, level)
    assert verdict["bounded"] is True and verdict["q4_mean"] > 1.25 * verdict["q2_mean"]
    assert soak.bounded(_series([1.0] * 5), level)["bounded"] is None  # too few samples


def test_log_state_reads_the_oldest_task_log_and_the_rotated_parts(tmp_path, soak_bench):
    soak = soak_bench
    task_log = tmp_path / "dag_id=d" / "run_id=r" / "task_id=t" / "attempt=1.log"
    task_log.parent.mkdir(parents=True)
    task_log.write_text("x")
    old = time.time() - 500
    os.utime(task_log, (old, old))
    for name in ("scheduler.log", "scheduler.log.1", "scheduler.log.2", "triggerer.log", "notes.log.bak"):
        (tmp_path / name).write_text("x")
    oldest, parts = soak.log_state(tmp_path)
    assert abs(oldest - old) < 1e-3 and parts == 2
    assert soak.log_state(tmp_path / "missing") == (None, 0)


def test_logs_are_bounded_by_retention_invariants_not_by_swinging_means(soak_bench):
    soak = soak_bench
    # Run completions make the level swing (second quarter low, last quarter high) while
    # retention keeps every promise: bounded, with the swing reported beside the verdict.
    swinging = _series([0.6] * 10 + [0.6] * 10 + [1.0] * 10 + [1.2] * 10, log_parts=1, task_logs_past_cutoff_s=0.0)
    verdict = soak.logs_bounded(swinging, log_keep=1)
    assert verdict["bounded"] is True and verdict["last_quarter_within_1.25"] is False
    # A task log that survived a sweep it should not have: not bounded, whatever the means.
    stale = _series([1.0] * 40, log_parts=1, task_logs_past_cutoff_s=0.0)
    stale[25]["task_logs_past_cutoff_s"] = 30.0
    assert soak.logs_bounded(stale, log_keep=1)["bounded"] is False
    # More rotated parts than kept: rotation is not pruning.
    assert (
        soak.logs_bounded(_series([1.0] * 40, log_parts=3, task_logs_past_cutoff_s=0.0), log_keep=1)["bounded"] is False
    )


def test_the_smoke_moves_each_fault_to_the_same_fraction_of_a_shorter_run(soak_bench):
    rotation = [soak_bench.scaled(f, soak_bench.SMOKE_STEPS) for f in soak_bench.FAULTS]
    kinds = [f[0]["kind"] if f else None for f in rotation]
    assert kinds == [f[0]["kind"] if f else None for f in soak_bench.FAULTS]
    for faults in rotation:
        for fault in faults:
            assert 0 < fault["step"] < soak_bench.SMOKE_STEPS
            if fault["kind"] == "corrupt_checkpoint":
                assert fault["step"] % soak_bench.CONF["checkpoint_interval"] == 0
    # every scaled schedule is one the spec accepts for the smoke's runs
    from trainflow.spec import TrainingSpec

    for faults in rotation:
        TrainingSpec.from_mapping({**soak_bench.CONF, "steps": soak_bench.SMOKE_STEPS, "faults": faults})


def test_a_smoke_result_is_judged_by_its_runs_and_retentions_invariants(soak_bench):
    runs = {"failed": [], "weights_equal_clean": 7, "succeeded": 7}
    leaky = {"bounded": False}
    result = {
        "smoke": True,
        "runs": runs,
        "bounds": {"history_rows_max": 1, "rss_mb:scheduler": leaky, "logs_mb": {"bounded": True}},
    }
    assert soak_bench.healthy(result)  # quarter means of a 2-minute run say nothing
    assert not soak_bench.healthy({**result, "smoke": False})
    assert not soak_bench.healthy({**result, "bounds": {**result["bounds"], "logs_mb": {"bounded": False}}})
    assert not soak_bench.healthy({**result, "runs": {**runs, "weights_equal_clean": 6}})
