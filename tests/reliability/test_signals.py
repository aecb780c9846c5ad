"""SIGTERM to the launcher, or Ctrl-C (SIGINT to the whole process group): every worker stops
within 10 s at a step they agree on, leaves a valid checkpoint, and no process is left behind."""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest

from distrain.runtime.checkpoint import CheckpointStore
from tests.reliability.common import QUICK, kill_tagged, start_cli, tagged, wait_for

pytestmark = pytest.mark.timeout(240)

STOP_WITHIN_S = 10.0


def _started(run_dir):  # noqa: ANN001, ANN202
    return lambda: any((run_dir / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("algorithm,workers,sig,group", [
    # SIGTERM reaches all-reduce's agreed stop as SIGINT does (below) and the launcher as ps's: `make test-all`
    pytest.param("allreduce", 3, signal.SIGTERM, False, marks=pytest.mark.slow),
    ("allreduce", 2, signal.SIGINT, True),  # Ctrl-C in a terminal reaches every process of the group
    ("ps", 2, signal.SIGTERM, False),
    ("adpsgd", 2, signal.SIGTERM, False),
])
def test_stop_request_ends_every_worker_with_a_checkpoint(tmp_path, algorithm, workers, sig, group):
    import os

    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = start_cli([*QUICK, "--workers", str(workers), "--epochs", "200", "--algorithm", algorithm,
                      "--checkpoint-every", "5", "--run-dir", str(run_dir)], tag)
    try:
        wait_for(_started(run_dir), 120, "the first checkpoint")
        sent_at = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent_at
        orphans = tagged(tag)
    finally:
        proc.kill()
        kill_tagged(tag)
    assert proc.returncode == 130, err
    assert took <= STOP_WITHIN_S, f"took {took:.1f} s to stop"
    assert orphans == []
    assert "Traceback" not in err
    assert "--resume auto" in err.strip().splitlines()[-1], err
    nprocs = workers + (1 if algorithm == "ps" else 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["steps"] == max(summary["steps_per_worker"][:workers])  # the steps taken, not those planned
    if algorithm == "adpsgd":  # asynchronous: each worker stops at its own step; they save one set,
        # named by the furthest one's step, that --resume auto takes (the budget not used up)
        last = CheckpointStore(run_dir, 0, nprocs).latest_complete()
        assert last == max(summary["steps_per_worker"]) > 0, (last, summary["steps_per_worker"])
        for rank in range(nprocs):  # each worker's file holds the step it stopped at
            state = CheckpointStore(run_dir, rank, nprocs).load(last)
            assert state["step"] == summary["steps_per_worker"][rank] and state["budget_done"] is False
        return
    store = CheckpointStore(run_dir, 0, nprocs)
    last = store.latest_complete()
    assert last is not None and last == max(store.steps())  # the stop step's set is complete
    assert all(steps == last for steps in summary["steps_per_worker"])  # every worker stopped there
    for rank in range(nprocs):
        assert CheckpointStore(run_dir, rank, nprocs).load(last)["step"] == last



def _fork_server_of(pid: int) -> bool:
    """Whether the launcher ``pid`` has started its fork server (which then imports torch)."""
    from pathlib import Path

    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid) \
                    and b"forkserver" in (entry / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_a_ctrl_c_while_the_workers_start_stops_the_run_in_one_line(tmp_path):
    # Ctrl-C reaches the fork server too, while it still imports torch for the workers: before,
    # it printed its own KeyboardInterrupt traceback, and a Ctrl-C that early could be lost (the
    # run trained on to the end, exit status 0)
    import os

    tag = uuid.uuid4().hex
    proc = start_cli([*QUICK, "--workers", "2", "--epochs", "200", "--run-dir", str(tmp_path / "run")], tag)
    try:
        wait_for(lambda: _fork_server_of(proc.pid), 60, "the fork server")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        orphans = tagged(tag)
    finally:
        proc.kill()
        kill_tagged(tag)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert orphans == []


def test_a_stop_request_arriving_inside_another_is_taken():
    """Ctrl-C and the launcher's forwarded SIGTERM reach a worker together: the second handler
    can run between any two lines of the first (also inside what it calls). Each such moment
    is tried: the nested request must return, and the request stand (a handler that takes a
    lock held by its own thread waits for ever; the run then stopped only when the launcher
    killed its workers)."""
    import sys
    import threading

    from distrain.runtime.faults import StopRequest

    moment = 0
    while True:
        stop = StopRequest()  # not installed: called as the signal module would call it
        lines = [0]

        def nested(frame, event, arg, stop=stop, lines=lines, moment=moment):  # noqa: ANN001, ANN202
            if event == "line":
                lines[0] += 1
                if lines[0] == moment + 1:
                    sys.settrace(None)
                    stop._handle(signal.SIGTERM, None)  # the second signal, at this moment of the first
            return nested

        def first(stop=stop, nested=nested):  # noqa: ANN202
            sys.settrace(nested)
            try:
                stop._handle(signal.SIGINT, None)
            finally:
                sys.settrace(None)

        handler = threading.Thread(target=first, daemon=True)
        handler.start()
        handler.join(timeout=5)
        assert not handler.is_alive(), f"a second request {moment + 1} lines into the first never returned"
        assert stop.requested.is_set()
        if lines[0] <= moment:  # the first handler ran out of lines before this moment: all tried
            break
        moment += 1
    assert moment >= 2  # the handler's own lines were tried


@pytest.mark.slow  # a real run: 10-30 s on 2 busy cores
def test_workers_die_with_a_launcher_killed_outright(tmp_path):
    """SIGKILL gives the launcher no chance to stop anyone: its workers and server must notice."""
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = start_cli([*QUICK, "--workers", "2", "--epochs", "200", "--algorithm", "ps", "--checkpoint-every", "5",
                      "--run-dir", str(run_dir)], tag)
    try:
        wait_for(_started(run_dir), 120, "the first checkpoint")
        assert len(tagged(tag)) >= 4  # the launcher, two workers and a server
        proc.kill()
        proc.communicate(timeout=10)
        wait_for(lambda: tagged(tag) == [], 10, "every worker and the server to exit")
    finally:
        proc.kill()
        kill_tagged(tag)


# the fallbacks where the kernel has no prctl / pidfd: `make test-all`
@pytest.mark.parametrize("use_prctl", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_worker_ends_when_its_launcher_is_killed(use_prctl):
    """The kernel's signal (Linux), and the fallback where there is none: a thread polls for a
    new parent and exits with a message."""
    import subprocess
    import sys

    from tests.reliability.common import cli_env

    tag = uuid.uuid4().hex
    worker = ("import os, time; from distrain.launch.common import die_with_parent; "
              f"how = die_with_parent(os.getppid(), use_prctl={use_prctl}); print(how, flush=True); time.sleep(60)")
    launcher = (f"import subprocess, sys; w = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
                "w.wait()")
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=cli_env(tag), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == ("prctl" if use_prctl else "poll")
        assert len(tagged(tag)) == 2
        proc.kill()
        _, err = proc.communicate(timeout=10)
        wait_for(lambda: tagged(tag) == [], 5, "the worker to notice")
        if not use_prctl:
            assert "the launcher (process" in err and "is gone; exiting" in err
    finally:
        proc.kill()
        kill_tagged(tag)


@pytest.mark.parametrize("use_pidfd", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_worker_forked_by_a_fork_server_ends_when_its_launcher_is_killed(use_pidfd):
    """A local worker is the child of its launcher's fork server, which outlives the launcher
    while the worker lives: the worker watches the launcher itself (its pidfd, or polling)."""
    import subprocess
    import sys

    from tests.reliability.common import cli_env

    tag = uuid.uuid4().hex
    worker = ("import sys, time; from distrain.launch.common import die_with; "
              f"how = die_with(int(sys.argv[1]), use_pidfd={use_pidfd}); print(how, flush=True); time.sleep(60)")
    server = (f"import os, subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', {worker!r}, str(os.getppid())]); "
              "time.sleep(60)")
    launcher = (f"import subprocess, sys, time; s = subprocess.Popen([sys.executable, '-c', {server!r}], start_new_session=True); "
                "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=cli_env(tag), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == ("pidfd" if use_pidfd else "poll")
        assert len(tagged(tag)) == 3
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: len(tagged(tag)) == 1, 5, "the worker to notice")  # the fork server stays: it was not asked
    finally:
        proc.kill()
        kill_tagged(tag)
