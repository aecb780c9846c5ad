"""A process killed outright (SIGKILL) in a synchronous run: every survivor leaves with one line
naming the step and the rank that went silent, within --timeout + 30 s, and the launcher reaps
every process."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.reliability.common import QUICK, injected_at, run_cli

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 20  # --timeout in QUICK


@pytest.mark.parametrize("algorithm,workers,victim,what", [
    ("allreduce", 3, 1, "worker 1"),  # with --min-workers 3: any loss stops the run
    pytest.param("ps", 2, 1, "worker 1", marks=pytest.mark.slow),  # a lost worker: allreduce's case in CI
    pytest.param("ps", 2, 2, "server 0 (rank 2)", marks=pytest.mark.slow),  # ranks 0, 1 are workers, rank 2 the server
])
def test_survivors_name_the_step_and_the_lost_rank(tmp_path, algorithm, workers, victim, what):
    mark = tmp_path / "killed-at"
    run = run_cli([*QUICK, "--workers", str(workers), "--epochs", "3", "--algorithm", algorithm,
                   "--min-workers", str(workers), "--run-dir", str(tmp_path / "run")],
                  DISTRAIN_INJECT_KILL=f"{victim}:30", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 1, run.stderr
    assert run.orphans == []
    killed_at = injected_at(mark)
    nprocs = workers + (1 if algorithm == "ps" else 0)
    notes = {int(re.search(r"rank-(\d+)", p.name).group(1)): p for p in (tmp_path / "run" / "failures").glob("rank-*.txt")}
    assert sorted(notes) == sorted(set(range(nprocs)) - {victim})  # every survivor, each one line
    for note in notes.values():
        line = note.read_text().strip()
        assert "\n" not in line
        assert re.search(rf"lost contact with rank [\d, ]*\b{victim}\b", line), line
        assert "at step 30" in line or "at step 29" in line or "at step 31" in line, line  # a server counts its own steps
        assert note.stat().st_mtime - killed_at < TIMEOUT + 30
    last = run.stderr.strip().splitlines()[-1]
    assert f"{what} was killed by SIGKILL" in last, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow  # the run goes on from a loss during training: tests/distributed/test_elastic.py
def test_a_worker_lost_as_hierarchical_servers_start_stops_the_run_at_once(tmp_path):
    """``ps --workers-per-node 2``: worker 3 killed as the run starts, as it is about to make the
    node groups (whose rendezvous would wait for it until the store's two-minute timeout): every
    process sees it declared dead where they meet first and leaves, the last line names it,
    nothing is left running, well within that timeout."""
    mark = tmp_path / "killed-at"
    run = run_cli([*QUICK, "--workers", "4", "--epochs", "3", "--algorithm", "ps", "--servers", "2",
                   "--workers-per-node", "2", "--run-dir", str(tmp_path / "run")],
                  DISTRAIN_INJECT_KILL_IN="node-groups:3", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 1, run.stderr
    assert run.orphans == []
    assert mark.exists()
    last = run.stderr.strip().splitlines()[-1]
    assert "worker 3 was killed by SIGKILL; the run was stopped" in last, run.stderr
    notes = sorted((tmp_path / "run" / "failures").glob("rank-*.txt"))
    assert [p.name for p in notes] == [f"rank-{r}.txt" for r in (0, 1, 2, 4, 5)]  # the others, servers too
    for note in notes:  # not the groups' rendezvous timing out (--timeout later)
        assert "rank(s) [3] lost as the run started, before its node groups were made" in note.read_text(), note


@pytest.mark.parametrize("algorithm,victim,restarts", [
    ("prague", 0, "0"),  # worker 0 also forms the groups: the lowest of the others does instead
    pytest.param("adpsgd", 0, "0", marks=pytest.mark.slow),
    pytest.param("adpsgd", 2, "1", marks=pytest.mark.slow),
    pytest.param("prague", 0, "1", marks=pytest.mark.slow),
])
def test_gossip_goes_on_without_a_worker_lost_before_the_gossip_groups_are_made(tmp_path, algorithm, victim, restarts):
    """A worker killed as the run starts, as it is about to make the gossip groups over every
    worker (whose rendezvous would wait for it a week): the others agree in the launcher's store
    on who came, open their links without it and train the run's whole global budget (worker 0
    lost: the first of the others writes config.json and the summary, and under Prague forms the
    groups); nothing is left running. With ``--max-restarts 1`` its new life joins them."""
    mark = tmp_path / "killed-at"
    epochs = "3" if restarts == "0" else "40"  # (long enough for the new life to start and join)
    run = run_cli([*QUICK, "--workers", "4", "--epochs", epochs, "--algorithm", algorithm, "--max-restarts", restarts,
                   "--run-dir", str(tmp_path / "run")],
                  timeout=120, DISTRAIN_INJECT_KILL_IN=f"gossip-groups:{victim}", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == [] and mark.exists()
    assert f"worker(s) [{victim}] lost as the run started" in run.stderr, run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    lost, *joined = summary["membership"]
    assert lost["event"] == "lost" and lost["workers"] == [victim] and lost["lost_at_step"] <= 1
    assert lost["members"] == [r for r in range(4) if r != victim]
    steps = summary["steps_per_worker"]
    # the global budget (every worker's steps together), taken by the others
    assert sum(steps) >= 4 * config["total_steps"] and all(steps[r] > 0 for r in lost["members"])
    if restarts == "0":
        assert steps[victim] == 0 and summary["workers_at_end"] == 3 and joined == []
    else:
        assert [j["event"] for j in joined] == ["joined"] and summary["workers_at_end"] == 4
    assert summary["final_test_accuracy"] > 0.9  # (the synthetic task: 0.95 or so without a loss)


@pytest.mark.parametrize("mode,victim,restarts", [
    ("sync", 0, "0"),  # worker 0 also sends the servers their start: the first of the others does
    pytest.param("async", 0, "0", marks=pytest.mark.slow),
    pytest.param("sync", 2, "1", marks=pytest.mark.slow),
    pytest.param("async", 2, "1", marks=pytest.mark.slow),
])
def test_ps_goes_on_without_a_worker_lost_as_the_run_starts(tmp_path, mode, victim, restarts):
    """Flat parameter servers, a worker killed as the run starts (in its set-up, before the
    servers' start message and the workers' first barrier, each of which would fail on it): the
    workers and the servers agree in the launcher's store on who came, the first worker that
    came starts the servers, the servers serve the others, every survivor takes the run's steps
    and records the loss at its first step; nothing is left running. With ``--max-restarts 1``
    its new life joins them."""
    mark = tmp_path / "killed-at"
    epochs = "3" if restarts == "0" else "40"  # (long enough for the new life to start and join)
    run = run_cli([*QUICK, "--workers", "4", "--epochs", epochs, "--algorithm", "ps", "--servers", "2",
                   "--ps-mode", mode, "--max-restarts", restarts, "--run-dir", str(tmp_path / "run")],
                  timeout=120, DISTRAIN_INJECT_KILL_IN=f"node-groups:{victim}", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == [] and mark.exists()
    for server in (0, 1):
        assert f"server {server}: lost worker(s) [{victim}] as the run started; serving the other 3" in run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    config = json.loads((tmp_path / "run" / "config.json").read_text())  # (written by the first survivor)
    lost, *joined = summary["membership"]
    assert lost["event"] == "lost" and lost["workers"] == [victim] and lost["lost_at_step"] <= 1
    assert lost["members"] == [r for r in range(4) if r != victim]
    steps = summary["steps_per_worker"]
    assert all(steps[r] == config["total_steps"] for r in lost["members"]), steps
    if restarts == "0":
        assert steps[victim] == 0 and summary["workers_at_end"] == 3 and joined == []
    else:
        assert [j["event"] for j in joined] == ["joined"] and summary["workers_at_end"] == 4
    assert summary["final_test_accuracy"] > 0.9  # (the synthetic task: 0.95 or so without a loss)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ps_goes_on_without_a_server_lost_as_the_run_starts(tmp_path, mode):
    """A parameter server killed as soon as it starts (before the start message it would take):
    the first worker starts the other server only, and the workers' first push to the lost one
    makes the other take its shard over from their copy; every worker finishes."""
    mark = tmp_path / "killed-at"
    run = run_cli([*QUICK, "--workers", "4", "--epochs", "3", "--algorithm", "ps", "--servers", "2",
                   "--ps-mode", mode, "--run-dir", str(tmp_path / "run")],
                  timeout=120, DISTRAIN_INJECT_KILL_AFTER="4:0", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == [] and mark.exists()
    assert "server 1: took over parameters" in run.stderr, run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert list(summary["lost_servers"]) == ["0"] and summary["workers_at_end"] == 4
    assert summary["final_test_accuracy"] > 0.9


@pytest.mark.parametrize("algorithm,victim,operation", [
    # the first worker, which writes the summary, after the consensus's all-reduce (1); Prague's
    # workers end with models of their own, AD-PSGD's with about the same one
    ("prague", 0, 1),
    pytest.param("adpsgd", 2, 1, marks=pytest.mark.slow),
    pytest.param("adpsgd", 1, 0, marks=pytest.mark.slow),  # done training, before the last collectives (0)
    pytest.param("adpsgd", 3, 5, marks=pytest.mark.slow),  # after the summary's rows were gathered (5)
])
def test_gossip_goes_on_without_a_worker_lost_in_the_runs_last_collectives(tmp_path, algorithm, victim, operation):
    """A worker killed after training, between one of the run's last collectives (the consensus,
    the checkpoint's step counts, the summary's rows) and its mark in the launcher's store: the
    others redo that collective without it and finish; the consensus they save is the mean of
    their own final models (in their checkpoint files; lost after the consensus, 2 collectives,
    it is in it, and in the checkpoint), the summary names the lost worker (worker 0 lost: the next
    writes it and the model), and nothing is left running."""
    mark = tmp_path / "killed-at"
    run_dir = tmp_path / "run"
    run = run_cli([*QUICK, "--workers", "4", "--epochs", "3", "--algorithm", algorithm, "--run-dir", str(run_dir)],
                  timeout=120, DISTRAIN_INJECT_KILL_IN=f"closing-{operation}:{victim}", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == [] and mark.exists()
    said = f"lost worker(s) [{victim}] as the run ended" if operation else f"(lost: [{victim}])"
    assert said in run.stderr, run.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["lost_workers"]) == [str(victim)] and summary["workers_at_end"] == 3
    assert summary["final_test_accuracy"] > 0.9
    (final,) = sorted((run_dir / "checkpoints").iterdir())
    files = {int(re.search(r"rank-(\d+)", p.name).group(1)): p for p in final.glob("rank-*.pt")}
    averaged = [r for r in range(4) if r != victim or operation > 2]  # the consensus's workers
    assert sorted(files) == averaged  # (the lost worker saved its file before the summary's rows)
    models = [torch.load(files[r], weights_only=True)["model"] for r in averaged]
    consensus = torch.load(run_dir / "model.pt", weights_only=True)
    for name, value in consensus.items():
        if value.is_floating_point():
            reference = torch.stack([m[name] for m in models]).mean(0)
            assert torch.allclose(value, reference, atol=1e-6), name
