"""``distrain train --algorithm allreduce`` losing a worker outright (SIGKILL), rank 0 included:
the survivors agree on the members, rebuild the group, redo the step and finish; the summary,
the metrics and the console say what happened; nothing is left running."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from distrain.runtime.checkpoint import CheckpointStore
from tests.reliability.common import QUICK, run_cli, run_losing_worker

pytestmark = pytest.mark.timeout(180)

RUN = [*QUICK, "--workers", "4", "--epochs", "4"]


def check_rank0_lost(run: Any, summary: dict, run_dir: Path) -> None:
    """Worker 0, killed at step 12, was left behind: the console, the summary and the survivors'
    metrics say so, and nobody lost a step or took one twice."""
    assert "worker 0 was killed by SIGKILL; the other workers finished without it" in run.stderr
    [change] = summary["membership"]
    assert change["workers"] == [0] and change["members"] == [1, 2, 3] and change["lost_at_step"] == 12
    assert change["recovery_s"] < 3.0
    assert summary["workers_at_end"] == 3
    total = summary["steps"]
    assert summary["steps_per_worker"] == [0, total, total, total]  # nobody lost a step or took one twice
    sent = summary["bytes_sent_per_worker"]
    assert sent[0] == 0 and sent[1] == sent[2] == sent[3] > 0
    # the survivors' metrics carry the event, once each, on the step after it was redone
    for worker in (1, 2, 3):
        lines = [json.loads(line) for line in (run_dir / "metrics" / f"rank{worker}.jsonl").read_text().splitlines()]
        events = [line for line in lines if line.get("event") == "lost"]
        assert len(events) == 1 and events[0]["step"] == 13 and events[0]["workers"] == [0]
        assert [line["step"] for line in lines if "loss" in line] == list(range(1, total + 1))
    # (accuracy against the run without the fault: benchmarks/bench_churn.py, 20 seeds)
    assert re.search(r"worker [123]: lost worker\(s\) \[0\] at step 12; 3 workers go on", run.stderr)


@pytest.mark.slow  # CI: the resume test below loses worker 0 the same way first
def test_rank0_lost_and_the_others_finish(tmp_path):
    run, summary = run_losing_worker(tmp_path / "run", RUN, rank=0, step=12)
    check_rank0_lost(run, summary, tmp_path / "run")


def assert_same_checkpoints(run_dir: Path, step: int, workers: Sequence[int], processes: int = 4) -> None:
    """The last checkpoints (of ``step``) of ``workers`` hold the same parameters, bit for bit:
    none of them lost a step or took one twice."""
    models = {r: CheckpointStore(run_dir, r, processes).load(step)["model"] for r in workers}
    first = models[workers[0]]
    for r in workers[1:]:
        for name, tensor in first.items():
            torch.testing.assert_close(models[r][name], tensor, rtol=0, atol=0, msg=f"worker {r}: {name}")


def check_worker_0_came_back(run_dir: Path, total: int, back: int, processes: int) -> None:
    """Worker 0, killed at step 12, joined after step ``back`` of ``total``: every worker's last
    checkpoint holds the same parameters (so none lost or took a step twice), and worker 0's
    metrics have its first life's steps, then those after its return, and the join."""
    assert_same_checkpoints(run_dir, total, range(4), processes)
    lines = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "loss" in line]
    first_life = [s for s in steps if s <= 12]  # what its first life had flushed before SIGKILL
    assert steps == [*range(1, len(first_life) + 1), *range(back + 1, total + 1)]
    assert [line["event"] for line in lines if "event" in line] == ["joined"]


@pytest.mark.slow  # the join through wrap() (tests/distributed/test_elastic.py) runs in CI
def test_a_restarted_worker_joins_and_ends_with_the_same_parameters(tmp_path):
    """--max-restarts 1: worker 0, killed at step 12, starts again, joins the others at a step's end
    with their state, and every worker ends with the same parameters (so it stayed in step)."""
    run_dir = tmp_path / "run"
    run = run_cli([*RUN, "--latency", "10ms", "--max-restarts", "1", "--checkpoint-every", "1000",
                   "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL="0:12")  # 10 ms links: long enough to rejoin
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    assert "worker 0 was killed by SIGKILL; started again, it joins the others with their state" in run.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    lost, joined = summary["membership"]
    assert lost["event"] == "lost" and lost["workers"] == [0] and lost["lost_at_step"] == 12
    assert joined["event"] == "joined" and joined["workers"] == [0] and joined["members"] == [1, 2, 3, 0]
    total, back = summary["steps"], joined["joined_at_step"]
    assert 12 < back < total and summary["workers_at_end"] == 4
    assert list(summary["joined_workers"]) == list(summary["lost_workers"]) == ["0"]
    assert summary["steps_per_worker"] == [total - back, total, total, total]  # its second life's steps
    # the run's wall time is a member's from the start, not the second life's of the worker that joined
    # (its waits for worker 0's evaluations are exposed communication, and evaluation time, not training)
    assert summary["wall_time_s"] + summary["eval_time_s"] >= (summary["compute_s_per_worker"][1]
                                                               + summary["exposed_comm_s_per_worker"][1])
    check_worker_0_came_back(run_dir, total, back, processes=4)


@pytest.mark.slow  # CI: a worker lost and started again, through wrap() (tests/distributed/test_elastic.py)
def test_a_member_lost_while_a_worker_joins_leaves_the_joiner_on_the_members_data_plan(tmp_path):
    """Worker 0, killed at step 12, starts again; worker 2 dies once the group with it is open,
    before it took the members' state. The joiner takes it in the agreement that follows, and its
    data plan is the one the members published at its admission with the loss applied after it
    (as the members apply both): the run ends with three, all on the same parameters."""
    run_dir = tmp_path / "run"
    run = run_cli([*RUN, "--latency", "10ms", "--max-restarts", "1", "--checkpoint-every", "1000",
                   "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL="0:12", DISTRAIN_INJECT_KILL_IN="handover:2",
                  DISTRAIN_INJECT_MARK=str(tmp_path / "mark"))
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [(c["event"], c["workers"], c["members"]) for c in summary["membership"]]
    assert events == [("lost", [0], [1, 2, 3]), ("joined", [0], [1, 2, 3, 0]), ("lost", [2], [1, 3, 0])]
    assert summary["workers_at_end"] == 3
    total = summary["steps"]
    assert_same_checkpoints(run_dir, total, (0, 1, 3))


@pytest.mark.slow  # the join through wrap() (tests/distributed/test_elastic.py) runs in CI
def test_a_restarted_worker_joins_the_parameter_servers_again(tmp_path):
    """--algorithm ps --servers 2 --max-restarts 1: worker 0, killed at step 12, starts again and the
    servers admit it at a step's end with their parameters; every worker then pushes again, all end
    with the same parameters (so none lost or took a step twice), and the run ends with four."""
    run_dir = tmp_path / "run"
    run = run_cli([*RUN, "--algorithm", "ps", "--servers", "2", "--latency", "50ms", "--max-restarts", "1",
                   "--checkpoint-every", "1000", "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL="0:12")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    assert "worker 0 was killed by SIGKILL; started again, it joins the others with their state" in run.stderr
    assert len(re.findall(r"worker 0 joined the run at step \d+ with 4 workers", run.stderr)) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    lost, joined = summary["membership"]
    assert lost["event"] == "lost" and lost["workers"] == [0] and lost["members"] == [1, 2, 3]
    assert lost["lost_at_step"] >= 12  # the workers read it from the store, up to a second later
    assert joined["event"] == "joined" and joined["workers"] == [0] and joined["members"] == [0, 1, 2, 3]
    total, back = summary["steps"], joined["joined_at_step"]
    assert 12 < back < total and summary["workers_at_end"] == 4 and list(summary["lost_workers"]) == ["0"]
    assert summary["steps_per_worker"] == [total - back, total, total, total]  # its second life's steps
    # (its waits for worker 0's evaluations are exposed communication, and evaluation time, not training)
    assert summary["wall_time_s"] + summary["eval_time_s"] >= (summary["compute_s_per_worker"][1]
                                                               + summary["exposed_comm_s_per_worker"][1])
    sent = summary["bytes_sent_per_worker"]
    assert 0 < sent[0] < sent[1] == sent[2] == sent[3]  # every step's push, the joiner's since it joined
    check_worker_0_came_back(run_dir, total, back, processes=6)
    for worker in (1, 2, 3):
        lines = [json.loads(line) for line in (run_dir / "metrics" / f"rank{worker}.jsonl").read_text().splitlines()]
        assert [(line["event"], line["workers"]) for line in lines if "event" in line] == [("lost", [0]), ("joined", [0])]
        assert [line["step"] for line in lines if "loss" in line] == list(range(1, total + 1))


@pytest.mark.slow  # CI: distrain train's resume from the sets saved after a server's takeover (test_resume.py)
def test_a_server_lost_as_a_joiner_comes_lets_the_joiner_leave_and_the_others_go_on(tmp_path):
    """--algorithm ps --servers 2 --max-restarts 1: worker 0, killed at step 12, starts again, and
    server 1 dies as the servers open the link with it (``link``). The joiner and server 0 see the
    server gone before the link's rendezvous (instead of waiting --timeout for it there): the
    joiner leaves, left out (its one restart is spent), server 0 serves the others, and they take
    server 1 over (its own restart returns it) and finish with three, on the same parameters."""
    run_dir = tmp_path / "run"
    run = run_cli([*RUN, "--algorithm", "ps", "--servers", "2", "--latency", "50ms", "--max-restarts", "1",
                   "--checkpoint-every", "1000", "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL="0:12",
                  DISTRAIN_INJECT_KILL_IN="link:5", DISTRAIN_INJECT_MARK=str(tmp_path / "mark"))
    assert run.returncode == 0, run.stderr
    assert run.orphans == [] and (tmp_path / "mark").exists()
    assert "worker 0: server(s) [1] lost as this worker joined; it leaves the run, the others go on" in run.stderr
    assert "server 0: server(s) [1] lost as worker 0, admitted after step" in run.stderr
    assert "servers [0] take over its parameters" in run.stderr
    assert "never met it" not in run.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workers_at_end"] == 3
    total = summary["steps"]
    assert_same_checkpoints(run_dir, total, (1, 2, 3))


@pytest.mark.slow  # CI: the kill through wrap() (tests/distributed/test_elastic.py)
def test_a_restarted_worker_joins_asynchronous_parameter_servers_again(tmp_path):
    """--ps-mode async --max-restarts 1: worker 0, killed at step 12, starts again; the servers
    admit it as soon as it asks, it trains on its own shard again from then on (no data plan to
    wait for: the others are at no common step) and the run ends with four, each on the servers'
    final parameters."""
    run_dir = tmp_path / "run"
    run = run_cli([*RUN, "--algorithm", "ps", "--servers", "2", "--ps-mode", "async", "--latency", "50ms",
                   "--max-restarts", "1", "--checkpoint-every", "1000", "--run-dir", str(run_dir)],
                  DISTRAIN_INJECT_KILL="0:12")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    assert "worker 0 was killed by SIGKILL; started again, it joins the others with their state" in run.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [(c["event"], c["workers"], c["members"]) for c in summary["membership"]]
    assert events == [("lost", [0], [1, 2, 3]), ("joined", [0], [0, 1, 2, 3])]
    assert summary["workers_at_end"] == 4 and list(summary["lost_workers"]) == ["0"]
    assert list(summary["joined_workers"]) == ["0"]
    final = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in final.values())


@pytest.mark.slow  # in CI the stuck worker below takes the same way out (its heartbeat stops)
def test_a_hung_worker_is_found_by_its_silence_and_left_behind(tmp_path):
    """Worker 2 stops (SIGSTOP) at step 12: its connections stay open, but its heartbeat stops; the
    others find it silent within a few seconds of waiting, go on without it, and when they have
    finished the launcher removes it."""
    run_dir = tmp_path / "run"
    mark = tmp_path / "stopped-at"
    run = run_cli([*RUN, "--run-dir", str(run_dir)], DISTRAIN_INJECT_STOP="2:12", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    [change] = summary["membership"]
    assert change["workers"] == [2] and change["members"] == [0, 1, 3] and change["lost_at_step"] == 12
    stopped_at = float(mark.read_text().split()[0])
    assert change["unix_time"] - stopped_at < 8.0  # heartbeats every second, silent after 3 s of waiting
    assert summary["workers_at_end"] == 3


# `make test-all`: CI keeps the stuck thread stopping its heartbeat (tests/unit/test_health.py) and a
# silent worker left behind through wrap() (test_elastic's hung worker)
@pytest.mark.slow
def test_a_stuck_worker_stops_vouching_for_itself_and_is_left_behind_long_before_the_timeout(tmp_path):
    """Worker 2's training thread blocks at step 12 (a deadlock: its heartbeat thread runs on,
    its connections stay open). Once the thread has stood still past its deadline (the floor,
    1 s here, over steps of milliseconds), its heartbeat stops; the others find it silent, go
    on without it and finish, long before the 60 s --timeout would have ended their wait."""
    run_dir = tmp_path / "run"
    mark = tmp_path / "wedged-at"
    run = run_cli([*RUN, "--epochs", "2", "--timeout", "60", "--run-dir", str(run_dir)], DISTRAIN_INJECT_WEDGE="2:12:600",
                  DISTRAIN_INJECT_MARK=str(mark), DISTRAIN_STUCK_FLOOR_S="1")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    assert "worker 2: its training thread has stood still for" in run.stderr and "<injected wedge>" in run.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    [change] = summary["membership"]
    assert change["workers"] == [2] and change["members"] == [0, 1, 3] and change["lost_at_step"] == 12
    wedged_at = float(mark.read_text().split()[0])
    assert change["unix_time"] - wedged_at < 10.0  # 1 s still, 3 s of stale heartbeat, then the agreement
    assert summary["workers_at_end"] == 3 and run.wall < 60  # the command too: nobody waited for the timeout


# `make test-all` (about 16 s): in CI test_resize.py resumes a set saved by other members and
# test_resume.py a finished run, the two halves of this case
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [["--algorithm", "allreduce"], ["--algorithm", "ps", "--servers", "2"]],
                         ids=["allreduce", "ps"])
def test_resume_after_a_loss_keeps_the_result_and_brings_the_lost_worker_back(tmp_path, algorithm):
    """Worker 0 is lost at step 12 and the others (and the servers) save their checkpoints
    without it. Resuming the finished run touches nothing; resuming it for another epoch starts
    worker 0 again from a member's checkpoint, and every worker ends with the same parameters (it
    stayed in step). The summary keeps the loss, adds the return and counts the whole run."""
    run_dir = tmp_path / "run"
    args = [*QUICK, *algorithm, "--workers", "4", "--checkpoint-every", "4", "--run-dir", str(run_dir)]
    processes = 4 if "ps" not in algorithm else 6
    first, summary = run_losing_worker(run_dir, [*args, "--epochs", "1"], rank=0, step=12)
    if "ps" not in algorithm:  # (parameter-server workers learn of the loss within a second)
        check_rank0_lost(first, summary, run_dir)
    before = (run_dir / "summary.json").read_text()
    total = json.loads(before)["steps"]
    store = CheckpointStore(run_dir, 1, processes)
    assert store.latest_complete() == total and store.members(total) == list(range(1, processes))
    assert not store.rank_file(total, 0).exists()
    # a survivor pruned the sets (rank 0 did): the 3 newest complete ones are kept, and a newer one
    # may have been incomplete at the last pruning, when its last files were still being written
    assert len(store.steps()) <= 4 and store.steps()[0] > 12

    again = run_cli([*args, "--epochs", "1", "--resume", "auto"])
    assert again.returncode == 0, again.stderr
    assert "has already trained" in again.stderr + again.stdout
    assert (run_dir / "summary.json").read_text() == before  # nothing retrained, nothing rewritten

    longer = run_cli([*args, "--epochs", "2", "--resume", "auto"])
    assert longer.returncode == 0, longer.stderr
    assert f"worker 0 was lost before the checkpoint of step {total}; it resumes from worker 1's state" in longer.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    end = summary["steps"]
    lost, back = summary["membership"]
    assert lost["event"] == "lost" and lost["workers"] == [0]
    # parameter-server workers learn of it from the store, up to a second later
    assert lost["lost_at_step"] == 12 or ("ps" in algorithm and lost["lost_at_step"] > 12)
    assert back["event"] == "joined" and back["workers"] == [0] and back["joined_at_step"] == total
    assert back["from_checkpoint"] and back["members"] == [0, 1, 2, 3]
    assert list(summary["lost_workers"]) == ["0"] and summary["workers_at_end"] == 4
    assert summary["joined_workers"] == {"0": back["unix_time"]}
    assert summary["steps_per_worker"] == [end - total, end, end, end]
    assert summary["segments"] == 2 and summary["resumed_from_step"] == total
    assert summary["wall_time_s"] == pytest.approx(sum(summary["segment_wall_time_s"]))
    assert_same_checkpoints(run_dir, end, range(4), processes)
    lines = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines if "event" in line] == ["joined"]
    resumed = [line for line in lines if "loss" in line and line["step"] > total]
    assert [line["step"] for line in resumed] == list(range(total + 1, end + 1))
    sent = summary["bytes_sent_per_worker"]  # its own bytes, not a member's (ps: its STOP comes after)
    assert 0 < resumed[-1]["bytes_sent"] <= sent[0] < sent[1]


@pytest.mark.slow  # the AD-PSGD and Prague joins through wrap() (tests/distributed/test_elastic.py) run in CI
@pytest.mark.parametrize("algorithm", ["adpsgd", "prague"])
def test_a_restarted_worker_0_joins_asynchronous_gossip_again_and_the_summary_keeps_its_loss(tmp_path, algorithm):
    """--algorithm adpsgd or prague --max-restarts 1: worker 0 (Prague's first group generator),
    killed at step 12, starts again and joins (Prague: worker 1 takes over the groups, and worker
    0 is grouped again); the summary is written by a worker that trained from the start (the
    first, 1), so it records the loss and the join, and the run ends with four."""
    run_dir = tmp_path / "run"
    slow = ",".join(f"{r}:50x" for r in range(4))  # steps of about 50 ms: the run outlasts the restart
    run = run_cli([*RUN, "--algorithm", algorithm, "--max-restarts", "1", "--epochs", "8", "--slow-worker", slow,
                   "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL="0:12")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(c["event"], c["workers"]) for c in summary["membership"]] == [("lost", [0]), ("joined", [0])]
    assert summary["membership"][1]["members"] == [0, 1, 2, 3]
    assert summary["workers_at_end"] == 4 and list(summary["lost_workers"]) == ["0"]
    if algorithm == "prague":
        assert "worker 1 forms the groups from now on" in run.stderr
        lines = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
        assert [line["event"] for line in lines if "event" in line] == ["joined"]
        back = next(i for i, line in enumerate(lines) if "event" in line)
        assert max(line.get("groups", 0) for line in lines[back:]) >= 1  # grouped again (counted from its return)


@pytest.mark.slow  # about 20 s; CI loses workers at the start through wrap() (tests/distributed/test_elastic.py)
def test_a_worker_lost_as_the_run_resumes_leaves_the_others_going_on_from_the_checkpoint(tmp_path):
    """A one-epoch run of hierarchical all-reduce is resumed for a second epoch, and worker 1
    dies as the node groups are made, before the first step: the three others go on from the
    checkpoint's step without it (it was lost there, not at step 0), end at the run's planned
    length with the same parameters, and the summary keeps the first segment's counters."""
    run_dir = tmp_path / "run"
    args = [*QUICK, "--workers", "4", "--workers-per-node", "2", "--checkpoint-every", "4", "--run-dir", str(run_dir)]
    first = run_cli([*args, "--epochs", "1"])
    assert first.returncode == 0, first.stderr
    total = json.loads((run_dir / "summary.json").read_text())["steps"]
    longer = run_cli([*args, "--epochs", "2", "--resume", "auto"], DISTRAIN_INJECT_KILL_IN="node-groups:1")
    assert longer.returncode == 0, longer.stderr
    assert longer.orphans == []
    assert "worker 1 was killed by SIGKILL; the other workers finished without it" in longer.stderr
    assert re.search(r"worker [023]: lost worker\(s\) \[1\] as the run started; 3 workers go on", longer.stderr)
    summary = json.loads((run_dir / "summary.json").read_text())
    end = summary["steps"]
    assert end == 2 * total  # the length the four workers planned
    [lost] = summary["membership"]
    assert lost["event"] == "lost" and lost["workers"] == [1] and lost["members"] == [0, 2, 3]
    assert lost["lost_at_step"] == total
    assert summary["workers_at_end"] == 3 and list(summary["lost_workers"]) == ["1"]
    assert summary["steps_per_worker"] == [end, 0, end, end]  # a lost worker's row is empty, the others' whole
    assert summary["segments"] == 2 and summary["resumed_from_step"] == total
    assert_same_checkpoints(run_dir, end, [0, 2, 3])
    assert CheckpointStore(run_dir, 0, 4).members(end) == [0, 2, 3]
    for worker in (0, 2, 3):  # every survivor trained every step of the second epoch, the loss noted at its start
        lines = [json.loads(line) for line in (run_dir / "metrics" / f"rank{worker}.jsonl").read_text().splitlines()]
        events = [line for line in lines if line.get("event") == "lost"]
        assert len(events) == 1 and events[0]["step"] == total and events[0]["workers"] == [1]
        assert [line["step"] for line in lines if "loss" in line and line["step"] > total] == list(range(total + 1, end + 1))
    # and resumed again, worker 1 returns from a member's checkpoint and all four end in step
    third = run_cli([*args, "--epochs", "3", "--resume", "auto"])
    assert third.returncode == 0, third.stderr
    assert f"worker 1 was lost before the checkpoint of step {end}; it resumes from worker 0's state" in third.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 * total and summary["workers_at_end"] == 4 and summary["segments"] == 3
    assert [c["event"] for c in summary["membership"]] == ["lost", "joined"]
    assert_same_checkpoints(run_dir, 3 * total, range(4))


@pytest.mark.slow  # about 15 s; CI: a restarted worker joins through wrap() (tests/distributed/test_elastic.py)
def test_a_worker_lost_while_the_others_load_their_data_is_started_again_and_joins(tmp_path):
    """Worker 1 dies as its training begins, while the others load their data (each knows every
    shard without a word to the others, so nothing waits for it there): the others go on
    without it from step 0, and its new life, asking to join before they even saw the loss,
    stays alive to them (the loss they agree on is its last life's), joins and ends with their
    parameters."""
    run_dir = tmp_path / "run"
    run = run_cli([*QUICK, "--workers", "4", "--epochs", "2", "--max-restarts", "1", "--checkpoint-every", "4",
                   "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL_AFTER="1:0.0")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    lost, joined = summary["membership"]
    assert lost["event"] == "lost" and lost["workers"] == [1] and lost["lost_at_step"] == 0
    assert joined["event"] == "joined" and joined["workers"] == [1] and joined["joined_at_step"] > 0
    assert summary["workers_at_end"] == 4
    end = summary["steps"]
    assert summary["steps_per_worker"] == [end, end - joined["joined_at_step"], end, end]
    assert_same_checkpoints(run_dir, end, range(4))


def test_a_gossip_worker_started_again_takes_part_in_the_evaluation_after_its_admission(tmp_path):
    """--algorithm dpsgd with an evaluation after every step (the consensus: collective): worker 2,
    killed at step 12, starts again and is admitted after a step the members evaluate at, over the
    group with it in it. It takes part in that evaluation; before, the members waited for it there
    while it waited for them in its first exchange, until the group's timeout, and they recovered
    with nobody lost (bench_churn's dpsgd, seed 5: 13.7 s)."""
    run_dir = tmp_path / "run"
    run = run_cli([*QUICK, "--workers", "4", "--epochs", "8", "--algorithm", "dpsgd", "--eval-every", "0.02",
                   "--latency", "10ms", "--max-restarts", "1", "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL="2:12")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(c["event"], c["workers"]) for c in summary["membership"]] == [("lost", [2]), ("joined", [2])]
    assert summary["workers_at_end"] == 4
