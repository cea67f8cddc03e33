from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainflow.heartbeat import (
    Action,
    HeartbeatPolicy,
    HeartbeatWriter,
    RankState,
    Verdict,
    classify,
    decide,
    read_all,
)

POLICY = HeartbeatPolicy(timeout=10, startup_timeout=60)


def beat(rank, step, state="training", progress=100.0):
    return {"rank": rank, "step": step, "state": state, "time": progress, "progress_time": progress}


def test_waiting_then_startup_timeout():
    assert classify({0: beat(0, 1)}, now=110, world_size=2, started_at=100, policy=POLICY).verdict == Verdict.WAITING
    c = classify({0: beat(0, 1)}, now=161, world_size=2, started_at=100, policy=POLICY)
    assert c.verdict == Verdict.STARTUP_TIMEOUT and c.ranks == (1,)
    assert "ranks [1]" in c.message


def test_healthy_stalled_complete():
    beats = {0: beat(0, 5, progress=100), 1: beat(1, 5, progress=100)}
    assert classify(beats, now=105, world_size=2, started_at=90, policy=POLICY).verdict == Verdict.HEALTHY
    beats[1] = beat(1, 3, progress=90)
    c = classify(beats, now=105, world_size=2, started_at=90, policy=POLICY)
    assert c.verdict == Verdict.STALLED and c.ranks == (1,)
    assert "rank 1" in c.message and "step 3" in c.message
    done = {r: beat(r, 9, "done", 50) for r in (0, 1)}
    assert classify(done, now=500, world_size=2, started_at=0, policy=POLICY).verdict == Verdict.COMPLETE


def test_starting_ranks_get_the_startup_window():
    beats = {0: beat(0, 0, "starting", progress=100), 1: beat(1, 5, progress=100)}
    c = classify(beats, now=130, world_size=2, started_at=99, policy=POLICY)
    assert c.verdict == Verdict.STALLED and c.ranks == (1,)
    c = classify(beats, now=161, world_size=2, started_at=99, policy=POLICY)
    assert c.ranks == (0, 1)


def test_after_a_restart_old_heartbeats_get_the_startup_window():
    beats = {0: beat(0, 40, progress=100)}
    assert classify(beats, now=150, world_size=1, started_at=120, policy=POLICY).verdict == Verdict.HEALTHY
    assert classify(beats, now=181, world_size=1, started_at=120, policy=POLICY).verdict == Verdict.STALLED


def test_watch_start_opens_a_fresh_window():
    # heartbeats older than the start of watching do not count as a stall right away
    beats = {0: beat(0, 5, progress=10)}
    assert classify(beats, now=105, world_size=1, started_at=100, policy=POLICY).verdict == Verdict.HEALTHY


def test_writer_throttles_but_writes_state_changes(tmp_path):
    w = HeartbeatWriter(tmp_path, rank=3, node=1, interval=3600)
    w.beat(step=1, total=10, state=RankState.TRAINING, loss=2.0)
    w.beat(step=2, total=10, state=RankState.TRAINING, loss=1.0)
    assert read_all(tmp_path)[3]["step"] == 1
    w.beat(step=10, total=10, state=RankState.DONE)
    got = read_all(tmp_path)[3]
    assert got["state"] == "done" and got["step"] == 10 and got["node"] == 1


def test_find_stragglers_uses_compute_time_not_step_rate():
    from trainflow.heartbeat import find_stragglers

    beats = {r: {**beat(r, 50), "node": r // 2, "compute_ms": ms} for r, ms in enumerate([2.0, 2.2, 1.9, 7.5])}
    (s,) = find_stragglers(beats, margin=0.5)
    assert s["rank"] == 3 and s["node"] == 1 and s["median_ms"] == 2.0 and s["slower_by"] == 2.75
    assert find_stragglers(beats, margin=5.0) == []
    assert find_stragglers({0: beats[0]}, margin=0.5) == []


def test_decide():
    from trainflow.heartbeat import Action, decide

    assert decide(Verdict.HEALTHY, replacements=0, budget=2) == Action.WAIT
    assert decide(Verdict.WAITING, replacements=0, budget=2) == Action.WAIT
    assert decide(Verdict.COMPLETE, replacements=5, budget=2) == Action.SUCCEED
    assert decide(Verdict.STALLED, replacements=1, budget=2) == Action.REPLACE_NODES
    assert decide(Verdict.STARTUP_TIMEOUT, replacements=0, budget=1) == Action.REPLACE_NODES
    assert decide(Verdict.STALLED, replacements=2, budget=2) == Action.FAIL
    assert decide(Verdict.HEALTHY, replacements=0, budget=2, aborted=True) == Action.FAIL


def _hung(rank, phase, alive):
    return {**beat(rank, 40, progress=100), "phase": phase, "alive": alive}


def test_a_stopped_rank_is_the_culprit_not_its_waiting_peers():
    # Rank 1 was SIGSTOPped in its forward pass: its pulse stopped; ranks 0 and 2 wait in
    # the gradient all-reduce and keep pulsing.
    beats = {0: _hung(0, "backward", 119), 1: _hung(1, "forward", 100), 2: _hung(2, "backward", 119)}
    c = classify(beats, now=120, world_size=3, started_at=0, policy=POLICY)
    assert c.verdict == Verdict.STALLED and c.ranks == (1,)
    assert "culprits [1]: their processes stopped" in c.message


def test_a_stopped_rank_is_told_apart_though_its_last_pulse_followed_its_last_progress():
    # SIGSTOP came just after a pulse: progress is past the timeout, the pulse not quite;
    # the stopped rank's phase still reads as its peers' (it stopped before the next write).
    beats = {0: _hung(0, "backward", 110.0), 1: _hung(1, "backward", 100.5)}
    c = classify(beats, now=110.2, world_size=2, started_at=0, policy=POLICY)
    assert c.ranks == (1,) and "their processes stopped" in c.message


def test_a_rank_stuck_in_its_own_code_is_the_culprit():
    # Every process pulses, but rank 0 never left its forward pass (a deadlock in user code).
    beats = {0: _hung(0, "forward", 119), 1: _hung(1, "backward", 119)}
    c = classify(beats, now=120, world_size=2, started_at=0, policy=POLICY)
    assert c.ranks == (0,) and "stuck outside the collective" in c.message


def test_when_the_culprit_cannot_be_told_every_stalled_rank_is_replaced():
    all_wait = {0: _hung(0, "backward", 119), 1: _hung(1, "backward", 119)}
    assert classify(all_wait, now=120, world_size=2, started_at=0, policy=POLICY).ranks == (0, 1)
    all_dead = {0: _hung(0, "forward", 100), 1: _hung(1, "backward", 100)}
    assert classify(all_dead, now=120, world_size=2, started_at=0, policy=POLICY).ranks == (0, 1)


def test_pulse_keeps_liveness_fresh_while_progress_stands_still(tmp_path):
    import json
    import time

    w = HeartbeatWriter(tmp_path, rank=0, node=0, interval=0.05)
    w.beat(step=7, total=9, state=RankState.TRAINING, force=True)
    w.set_phase("backward")
    w.start_pulse()
    time.sleep(0.3)
    b = json.loads((tmp_path / "rank-00000.json").read_text())
    assert b["step"] == 7 and b["phase"] == "backward"
    assert b["alive"] - b["progress_time"] > 0.15  # pulsing, not progressing


def test_a_shrunk_gang_is_judged_by_its_own_ranks():
    """Rank 2 of a 3-rank gang stays behind as a stale file once the gang shrank to 2; the
    newest worker's world size decides which ranks count."""
    old = {r: {**beat(r, 70, progress=100), "world": 3, "started": 10} for r in range(3)}
    new = {r: {**beat(r, 90, progress=200), "world": 2, "started": 150} for r in range(2)}
    c = classify({**old, **new}, now=205, world_size=3, started_at=90, policy=POLICY)
    assert c.verdict == Verdict.HEALTHY and "2 ranks progressing" in c.message
    # halfway through the restart: rank 1 still carries the old gang's beat → missing
    c = classify({**old, 0: new[0]}, now=160, world_size=3, started_at=150, policy=POLICY)
    assert c.verdict == Verdict.WAITING and c.ranks == (1,)
    done = {r: {**beat(r, 99, "done", 300), "world": 2, "started": 150} for r in range(2)}
    assert classify({**old, **done}, now=400, world_size=3, started_at=0, policy=POLICY).verdict == Verdict.COMPLETE


def test_a_restarted_watch_opens_its_startup_window_again(tmp_path):
    """After a whole-stack stop the triggerer re-creates the watch with its original start,
    and every rank's last beat is minutes old. The watch must not call that a hang (and
    spend its node-replacement budget on nodes Airflow is already retrying): its startup
    window opens again when it starts."""
    import asyncio
    import json
    import time

    from sensors.heartbeat import HeartbeatTrigger

    (tmp_path / "heartbeats").mkdir()
    old = time.time() - 600
    for rank in (0, 1):
        (tmp_path / "heartbeats" / f"rank-{rank:05d}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "node": rank,
                    "step": 200,
                    "total": 600,
                    "state": "training",
                    "time": old,
                    "progress_time": old,
                    "alive": old,
                    "world": 2,
                    "started": old - 60,
                }
            )
        )
    trigger = HeartbeatTrigger(
        run_dir=str(tmp_path),
        world_size=2,
        timeout=10,
        startup_timeout=2,
        started_at=old - 60,
        poll_interval=0.1,
        max_remediations=0,
    )

    async def first_event():
        async for event in trigger.run():
            return event.payload, time.time()

    t0 = time.time()
    payload, at = asyncio.run(asyncio.wait_for(first_event(), timeout=30))
    # With no budget the first stall fails the watch: not before the fresh startup window
    # (2 s) passed — without it, at the first poll.
    assert payload["verdict"] == "stalled" and at - t0 >= 2, (payload, at - t0)


def test_replacement_requests_a_node_task_never_takes_still_count_against_the_budget(tmp_path):
    """A node whose task is gone for good never takes its replacement request; asking again
    must still use up the watch's budget (it used to overwrite the request: the watch asked
    for ever and the run never ended)."""
    from trainflow.heartbeat import Classification, HeartbeatWriter, RankState, Verdict
    from trainflow.remediation import remediations, request_node_restart

    (tmp_path / "heartbeats").mkdir()
    HeartbeatWriter(tmp_path / "heartbeats", rank=1, node=0, interval=1.0, world=2).beat(
        step=5, total=10, state=RankState.TRAINING, force=True
    )
    stalled = Classification(Verdict.STALLED, "rank 1 stalled", ranks=(1,), steps={1: 5})
    for i in range(3):
        assert request_node_restart(tmp_path, stalled, now=100.0 + i) == [0]
        assert remediations(tmp_path) == i + 1
    assert len(list((tmp_path / "control").glob("restart-node-0000.json.unanswered-*"))) == 2


def test_a_rank_whose_node_task_restarted_since_its_last_progress_gets_the_startup_window(tmp_path):
    # Rank 1's node task was killed at t=100 (its last beat stays "training" at step 199) and
    # Airflow's retry started the node's agent again at t=112; its workers start cold.
    beats = {0: {**beat(0, 0, "starting", progress=104), "node": 1}, 1: {**beat(1, 199, progress=100), "node": 0}}
    node_started = {0: 112.0, 1: 50.0}
    assert classify(beats, now=121, world_size=2, started_at=90, policy=POLICY).verdict == Verdict.STALLED
    c = classify(beats, now=121, world_size=2, started_at=90, policy=POLICY, node_started=node_started)
    assert c.verdict == Verdict.HEALTHY, c.message
    # ... but not for ever: the startup window counts from the node's start.
    c = classify(beats, now=173, world_size=2, started_at=90, policy=POLICY, node_started=node_started)
    assert c.verdict == Verdict.STALLED and 1 in c.ranks
    # A node start older than the rank's progress changes nothing (it is the running try).
    c = classify(beats, now=121, world_size=2, started_at=90, policy=POLICY, node_started={0: 95.0, 1: 50.0})
    assert c.verdict == Verdict.STALLED and c.ranks == (1,)


def test_node_starts_takes_the_newest_of_agent_start_worker_restart_and_task_try(tmp_path):
    from trainflow.heartbeat import node_starts
    from trainflow.workspace import write_json_atomic

    assert node_starts(tmp_path) == {}
    (tmp_path / "nodes").mkdir()
    write_json_atomic(tmp_path / "nodes" / "node-0000.json", {"node": 0, "state": "running", "pid": 1, "started": 12.5})
    write_json_atomic(tmp_path / "nodes" / "node-0001.json", {"node": 1, "state": "running"})  # no start
    (tmp_path / "nodes" / "node-0002.json").write_text("{not json")
    write_json_atomic(tmp_path / "nodes" / "task-0000.json", {"host": "vm", "try": 2})
    assert node_starts(tmp_path) == {0: 12.5}
    # the agent restarted its workers (a failure, or a round admitting a node)
    write_json_atomic(
        tmp_path / "nodes" / "node-0000.json", {"node": 0, "state": "running", "started": 12.5, "restarted": 20.0}
    )
    assert node_starts(tmp_path) == {0: 20.0}
    # node 1's task began a new try (preflight, no agent yet), then ended it (a retry follows)
    write_json_atomic(tmp_path / "nodes" / "task-0001.json", {"host": "vm", "try": 2, "began": 30.0})
    assert node_starts(tmp_path) == {0: 20.0, 1: 30.0}
    write_json_atomic(
        tmp_path / "nodes" / "task-0001.json",
        {"host": "vm", "try": 2, "began": 30.0, "ended": "exit 1", "ended_at": 31},
    )
    assert node_starts(tmp_path) == {0: 20.0, 1: 31.0}


# -- the no-hang invariant ----------------------------------------------------------------

_STATES = [s.value for s in RankState]


@st.composite
def _quiet_runs(draw):
    """A run of which no rank has progressed since ``quiet``, whatever its ranks' states,
    missing ranks, node restarts (all before ``quiet``) and elastic world sizes."""
    world = draw(st.integers(1, 4))
    nodes = draw(st.integers(1, world))
    quiet = 1_000.0
    beats = {}
    for rank in range(world):
        if draw(st.booleans()) or rank == 0:
            beats[rank] = {
                "step": draw(st.integers(0, 500)),
                "state": draw(st.sampled_from(_STATES)),
                "progress_time": draw(st.floats(0.0, quiet)),
                "time": quiet,
                "node": rank % nodes,
                "phase": draw(st.sampled_from([None, "starting", "startup", "forward", "checkpoint", "eval"])),
                "phase_since": draw(st.floats(0.0, quiet)),
                **({"world": world, "started": draw(st.floats(0.0, quiet))} if draw(st.booleans()) else {}),
            }
    restarts = {n: draw(st.floats(0.0, quiet)) for n in range(nodes) if draw(st.booleans())}
    started_at = draw(st.floats(0.0, quiet))
    policy = HeartbeatPolicy(
        timeout=draw(st.floats(1.0, 600.0)),
        startup_timeout=draw(st.floats(5.0, 7200.0)),
        checkpoint_timeout=draw(st.none() | st.floats(1.0, 86400.0)),
    )
    return beats, world, restarts, started_at, policy, quiet


@settings(max_examples=200, deadline=None)
@given(_quiet_runs(), st.integers(0, 10), st.integers(0, 10))
def test_a_run_without_progress_always_restarts_or_fails(run, replacements, budget):
    """The watch's invariant: once no rank has made progress for longer than the progress
    timeout, the startup window and the checkpoint timeout (counted from the watch's start and from each
    node's latest restart), the run is never left waiting — it is complete, or its nodes
    are replaced (a restart), or it fails. A restart under way (a node started again, the
    watch started again) only moves that moment, by at most the startup window."""
    beats, world, restarts, started_at, policy, quiet = run
    now = quiet + max(policy.timeout, policy.startup_timeout, policy.checkpoint_timeout or 0.0) + 0.001
    result = classify(beats, now=now, world_size=world, started_at=started_at, policy=policy, node_started=restarts)
    action = decide(result.verdict, replacements=replacements, budget=budget)
    if result.verdict == Verdict.COMPLETE:
        assert all(b["state"] == RankState.DONE.value for b in beats.values())
        return
    assert result.verdict in (Verdict.STALLED, Verdict.STARTUP_TIMEOUT), result
    assert action in (Action.REPLACE_NODES, Action.FAIL)
    assert (action == Action.FAIL) == (replacements >= budget)


def test_a_save_or_evaluation_gets_the_checkpoint_timeout_and_a_step_the_heartbeat_timeout():
    """Phases (``sdk.phase``) set which limit applies: a rank 100 s into a save is fine
    under a 600 s checkpoint timeout and stalled past it; 100 s without a step while
    stepping is a hang under the 60 s heartbeat timeout; a program's start-up section gets
    the startup window."""
    policy = HeartbeatPolicy(timeout=60.0, startup_timeout=300.0, checkpoint_timeout=600.0)

    def beat(phase: str, since: float = 0.0) -> dict:
        return {"step": 10, "state": RankState.TRAINING.value, "progress_time": since, "time": since,
                "node": 0, "phase": phase, "phase_since": since}  # fmt: skip

    def verdict(phase: str, now: float) -> Verdict:
        return classify({0: beat(phase)}, now=now, world_size=1, started_at=-1.0, policy=policy).verdict

    assert verdict("checkpoint", 100.0) == Verdict.HEALTHY
    assert verdict("eval", 599.0) == Verdict.HEALTHY
    assert verdict("checkpoint", 601.0) == Verdict.STALLED
    assert verdict("forward", 100.0) == Verdict.STALLED
    assert verdict("startup", 299.0) == Verdict.HEALTHY
    assert verdict("startup", 301.0) == Verdict.STALLED
    without = HeartbeatPolicy(timeout=60.0, startup_timeout=300.0)
    assert classify({0: beat("checkpoint")}, now=61.0, world_size=1, started_at=-1.0, policy=without).verdict == (
        Verdict.STALLED
    )


def test_a_program_without_the_sdk_is_judged_by_stall_timeout():
    """Its node agent beats for it (``source: agent``): silent for less than
    ``stall_timeout`` is fine however short ``heartbeat_timeout`` is; longer is a stall."""
    from trainflow.heartbeat import HeartbeatPolicy, Verdict, classify

    beat = {"node": 0, "step": 300, "state": "training", "progress_time": 100.0, "alive": 400.0, "source": "agent"}
    policy = HeartbeatPolicy(timeout=10.0, startup_timeout=60.0, stall_timeout=600.0)
    ok = classify({0: beat}, now=400.0, world_size=1, started_at=50.0, policy=policy)
    assert ok.verdict == Verdict.HEALTHY, ok.message
    late = classify({0: beat}, now=701.0, world_size=1, started_at=50.0, policy=policy)
    assert late.verdict == Verdict.STALLED and late.ranks == (0,)
    sdk = classify({0: {**beat, "source": "sdk"}}, now=400.0, world_size=1, started_at=50.0, policy=policy)
    assert sdk.verdict == Verdict.STALLED  # a rank that reports for itself: heartbeat_timeout
