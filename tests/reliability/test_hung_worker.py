"""A worker hangs (SIGSTOP): the asynchronous algorithms drop it a few seconds after its heartbeat
stops and finish their budget; one that resumes (SIGCONT) later leaves with one line."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.reliability.common import (
    QUICK,
    injected_at,
    injected_pid,
    kill_tagged,
    run_cli,
    start_cli,
    tagged,
    wait_for,
)
from tests.reliability.test_adpsgd_dead_worker import finite_final_models

pytestmark = pytest.mark.timeout(400)

PEER_TIMEOUT = 5  # --peer-timeout in QUICK
HANG_S = PEER_TIMEOUT + 10  # the fault: longer than the peer timeout and the heartbeat's staleness (3 s)
BUDGET_S = 40  # each worker trains this long: the hang is well inside it


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize(("algorithm", "victim"), [
    ("adpsgd", 1),
    ("prague", 0),  # the group generator, which every worker asks
    pytest.param("prague", 2, marks=pytest.mark.slow),  # a member its groups' rings wait for: `make test-all`
])
def test_a_hung_gossip_worker_is_dropped_within_seconds_of_its_last_heartbeat(tmp_path, algorithm, victim):
    """A worker stops (SIGSTOP) and stays stopped, its connections open: under AD-PSGD a passive
    worker its callers wait for; under Prague worker 0, the group generator, which every worker
    asks for its groups, or worker 2, which its groups' rings wait for. With --peer-timeout 60,
    the others give up on it a few seconds after its heartbeat's last stamp (not after the peer
    timeout, when a gloo timeout also closed the Prague group's connections of the survivors),
    finish their training and leave it out of the consensus; the launcher stops it as the run
    ends. --max-lag 1: a worker's training waits for an averaging after each step, so the
    exchange that failed must not count as its step's averaging (else both wait for each other
    until the peer timeout)."""
    mark, run_dir = tmp_path / "stopped-at", tmp_path / "run"
    run = run_cli([*QUICK, "--peer-timeout", "60", "--max-lag", "1", "--algorithm", algorithm, "--workers", "4",
                   "--epochs", "2", "--run-dir", str(run_dir)], timeout=120, DISTRAIN_INJECT_STOP=f"{victim}:10",
                  DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    assert "no averaging for" not in run.stderr, run.stderr  # (a training thread given up waiting for its gossip)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["lost_workers"]) == [str(victim)], summary["lost_workers"]
    detection = summary["lost_workers"][str(victim)] - injected_at(mark)
    assert detection < 10, detection  # the heartbeat's staleness (3 s) and a poll; the peer timeout is 60 s
    survivors = [r for r in range(4) if r != victim]
    assert summary["workers_at_end"] == 3
    assert all(summary["steps_per_worker"][r] > 0 for r in survivors), summary["steps_per_worker"]
    finite_final_models(run_dir, survivors)


@pytest.mark.parametrize("mode,restarts", [("sync", 1), pytest.param("async", 0, marks=pytest.mark.slow)])
def test_parameter_servers_have_a_hung_worker_stopped_and_go_on(tmp_path, mode, restarts):
    """Worker 2 of 4 stops (SIGSTOP) at step 10 under 2 parameter servers: alive, its connections
    open, silent. The servers waiting for its push find its heartbeat stopped and ask the
    launcher to stop it; killed, it is lost as a dead worker is, within seconds (before: the
    servers waited out the 60 s --timeout, whose expiry closed every connection of the group, and
    the run stopped), and with --max-restarts 1 it is started again and joins."""
    run, summary, detection = _hang_under_servers(tmp_path, 2, mode, restarts)
    assert "worker 2 failed: fell silent and was stopped: server " in run.stderr, run.stderr
    assert list(summary["lost_workers"]) == ["2"], summary["lost_workers"]
    assert detection("lost_workers", "2") < 10  # the heartbeat's staleness (3 s) and the watch's and the launcher's polls
    assert list(summary["joined_workers"]) == (["2"] if restarts else [])
    assert summary["workers_at_end"] == (4 if restarts else 3)
    steps = summary["steps_per_worker"]
    assert all(steps[r] == steps[0] > 10 for r in (1, 3)) or mode == "async", steps
    assert (0 < steps[2] < steps[0]) if restarts else steps[2] == 0, steps


@pytest.mark.parametrize("mode,restarts", [("sync", 1), pytest.param("async", 0, marks=pytest.mark.slow)])
def test_a_hung_parameter_server_is_stopped_and_taken_over(tmp_path, mode, restarts):
    """Server 0 of 2 (rank 4) stops (SIGSTOP) at its step 10: the workers waiting for its answer
    find its heartbeat stopped and ask the launcher to stop it; killed, it is taken over by server
    1 as a dead server is (before: the workers waited out the 60 s --timeout and the run stopped),
    and with --max-restarts 1 (synchronous servers) it comes back with its parameters."""
    run, summary, detection = _hang_under_servers(tmp_path, 4, mode, restarts)
    assert "server 0 (rank 4) failed: fell silent and was stopped: worker " in run.stderr, run.stderr
    assert list(summary["lost_servers"]) == ["0"], summary["lost_servers"]
    assert detection("lost_servers", "0") < 10
    assert list(summary.get("returned_servers") or {}) == (["0"] if restarts else [])
    assert summary["workers_at_end"] == 4 and summary["lost_workers"] == {}
    assert len(set(summary["steps_per_worker"])) == 1 or mode == "async", summary["steps_per_worker"]


def test_a_hung_single_parameter_server_stops_the_run_within_seconds(tmp_path):
    """The only server (rank 4) stops (SIGSTOP) at its step 10: nobody can take its parameters
    over, so the run stops, in one line naming it, a few seconds after its heartbeat's last
    stamp (before: the workers waited out the 60 s --timeout, with the server still stopped)."""
    mark, run_dir = tmp_path / "stopped-at", tmp_path / "run"
    run = run_cli([*QUICK, "--timeout", "60", "--algorithm", "ps", "--servers", "1", "--workers", "4",
                   "--epochs", "2", "--run-dir", str(run_dir)], timeout=120, DISTRAIN_INJECT_STOP="4:10",
                  DISTRAIN_INJECT_MARK=str(mark))
    ended = time.time()
    assert run.returncode == 1, run.stderr
    assert run.orphans == []
    last = run.stderr.strip().splitlines()[-1]
    assert "server 0 (rank 4) failed: fell silent and was stopped: worker " in last, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    # the heartbeat's staleness (3 s), the watch's and the launcher's polls, the others' stop
    assert ended - injected_at(mark) < 20, ended - injected_at(mark)


@pytest.mark.slow  # `make test-all`; CI: the test above, through distrain train
def test_a_hung_single_parameter_server_of_a_users_script_stops_the_launch_naming_why(tmp_path):
    """The same through ``distrain launch`` and ``wrap()`` (examples/custom_loop.py): the
    launcher's last line names the server and why it was stopped (it said only "killed by
    SIGKILL", the stop it made itself)."""
    import subprocess
    import sys

    from tests.reliability.common import cli_env

    root = Path(__file__).resolve().parents[2]
    mark, tag = tmp_path / "stopped-at", uuid.uuid4().hex
    env = {**cli_env(tag), "DISTRAIN_INJECT_STOP": "4:10", "DISTRAIN_INJECT_MARK": str(mark)}
    try:
        done = subprocess.run([sys.executable, "-m", "distrain", "launch", "--workers", "4", "--servers", "1",
                               "--timeout", "60", str(root / "examples" / "custom_loop.py"), "--algorithm", "ps"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        ended, orphans = time.time(), tagged(tag)
    finally:
        kill_tagged(tag)
    assert done.returncode == 1, done.stderr
    assert orphans == []
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("distrain: rank 4 failed: fell silent and was stopped (worker "), done.stderr
    assert ended - injected_at(mark) < 20, ended - injected_at(mark)


def _hang_under_servers(tmp_path, rank, mode, restarts):  # noqa: ANN001, ANN202
    """``distrain train`` under 2 servers with process ``rank`` stopped (SIGSTOP) at step 10: the
    run, its summary and how long after the stop a record of it was made (seconds)."""
    mark, run_dir = tmp_path / "stopped-at", tmp_path / "run"
    run = run_cli([*QUICK, "--timeout", "60", "--algorithm", "ps", "--servers", "2", "--ps-mode", mode,
                   "--workers", "4", "--epochs", "2", "--max-restarts", str(restarts), "--run-dir", str(run_dir)],
                  timeout=120, DISTRAIN_INJECT_STOP=f"{rank}:10", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    assert run.wall < 60, run.wall  # nobody waited for the --timeout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.8
    return run, summary, lambda key, who: summary[key][who] - injected_at(mark)


@pytest.mark.slow  # `make test-all`; CI: the test above
@pytest.mark.parametrize("victim", [1, 2])  # passive (its callers find it silent), active (it stops calling)
def test_a_hung_adpsgd_worker_is_dropped_and_leaves_when_it_resumes(tmp_path, victim):
    tag, mark, run_dir = uuid.uuid4().hex, tmp_path / "stopped-at", tmp_path / "run"
    proc = start_cli([*QUICK, "--algorithm", "adpsgd", "--topology", "bipartite", "--workers", "4", "--num-samples",
                      "9600", "--budget", "time", "--time-budget", str(BUDGET_S), "--run-dir", str(run_dir)], tag,
                     DISTRAIN_INJECT_STOP=f"{victim}:30", DISTRAIN_INJECT_MARK=str(mark))
    try:
        wait_for(mark.exists, 180, "the worker to stop itself")
        pid = injected_pid(mark)
        wait_for(lambda: state_of(pid) == "T", 10, "the stopped state")
        time.sleep(max(0.0, injected_at(mark) + HANG_S - time.time()))  # the hang itself, not a synchronisation
        os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=BUDGET_S + 120)
        orphans = tagged(tag)
    finally:
        proc.kill()
        kill_tagged(tag)
    assert proc.returncode == 0, err  # the survivors finished
    assert orphans == []
    line = f"worker {victim} was silent (no heartbeat) and its peers went on without it; leaving"
    assert f"worker {victim} failed: {line}; the other workers finished without it" in err, err
    assert (run_dir / "failures" / f"rank-{victim}.txt").read_text().strip() == line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["lost_workers"]) == [str(victim)]
    detection = summary["lost_workers"][str(victim)] - injected_at(mark)
    assert detection <= 15, detection
    survivors = [r for r in range(4) if r != victim]
    assert all(summary["steps_per_worker"][r] > 100 for r in survivors), summary["steps_per_worker"]
    assert summary["final_test_accuracy"] > 0.9
    finite_final_models(run_dir, survivors)


@pytest.mark.slow  # `make test-all`
def test_a_stuck_adpsgd_worker_is_dropped_by_those_it_holds_up_and_leaves_when_it_moves_again(tmp_path):
    """Worker 2 (active: it calls 1 and 3) alive but with its training thread blocked (its
    heartbeat thread runs on): past its stuck deadline (1 s here) its heartbeat stops, its passive
    peers find their caller silent and drop it, and when the thread moves again it finds itself
    left behind and leaves with one line. (A stuck passive worker holds nobody up: its gossip
    thread answers its callers, who go on averaging with it; it trains on when it moves.)"""
    victim = 2
    mark, run_dir = tmp_path / "wedged-at", tmp_path / "run"
    run = run_cli([*QUICK, "--algorithm", "adpsgd", "--topology", "bipartite", "--workers", "4", "--num-samples",
                   "9600", "--budget", "time", "--time-budget", str(BUDGET_S), "--run-dir", str(run_dir)],
                  timeout=BUDGET_S + 180, DISTRAIN_INJECT_WEDGE=f"{victim}:30:{HANG_S}", DISTRAIN_INJECT_MARK=str(mark),
                  DISTRAIN_STUCK_FLOOR_S="1")
    err = run.stderr
    assert run.returncode == 0, err
    assert run.orphans == []
    assert f"worker {victim}: its training thread has stood still for" in err
    line = f"worker {victim} was silent (no heartbeat) and its peers went on without it; leaving"
    assert f"worker {victim} failed: {line}; the other workers finished without it" in err, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["lost_workers"]) == [str(victim)]
    assert summary["lost_workers"][str(victim)] - injected_at(mark) <= 15
    survivors = [r for r in range(4) if r != victim]
    assert all(summary["steps_per_worker"][r] > 100 for r in survivors), summary["steps_per_worker"]
    finite_final_models(run_dir, survivors)


@pytest.mark.parametrize("algorithm", [
    ["allreduce"],
    ["adpsgd"],  # its passive threads' any-source receives waited for the stopped caller for ever
    pytest.param(["dpsgd"], marks=pytest.mark.slow),
    pytest.param(["diloco", "--sync-every", "4"], marks=pytest.mark.slow),
    pytest.param(["prague"], marks=pytest.mark.slow),  # waited out --peer-timeout
    pytest.param(["ps", "--servers", "2"], marks=pytest.mark.slow),
], ids=lambda a: a[0])
def test_a_hung_worker_stops_a_run_that_survives_no_loss_within_seconds(tmp_path, algorithm):
    """--min-workers 4 of 4: worker 2 stops (SIGSTOP) at step 12, alive, its connections open.
    The others' waits end a few seconds after its heartbeat's last stamp, with one line naming
    it, and the launcher stops it at once rather than after the others' grace (before: the
    synchronous algorithms waited out the 60 s --timeout, and the run ended 98 s after the stop;
    AD-PSGD did not end)."""
    mark = tmp_path / "stopped-at"
    run = run_cli([*QUICK, "--timeout", "60", "--peer-timeout", "60", "--algorithm", *algorithm, "--workers", "4",
                   "--min-workers", "4", "--epochs", "4", "--run-dir", str(tmp_path / "run")], timeout=150,
                  DISTRAIN_INJECT_STOP="2:12", DISTRAIN_INJECT_MARK=str(mark))
    ended = time.time()
    assert run.returncode == 1, run.stderr
    assert run.orphans == []
    last = run.stderr.strip().splitlines()[-1]
    assert "lost contact with rank 2 at step " in last and "the run was stopped" in last, run.stderr
    assert ended - injected_at(mark) < 20, ended - injected_at(mark)  # staleness (3 s), polls, the stop
