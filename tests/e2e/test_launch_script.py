"""distrain launch as a user types it: one line and exit 2 on bad input, the failing rank named,
nothing left running; and wrap() in a plain single process."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

import distrain
from distrain.errors import ConfigError
from tests.reliability.common import cli_env, kill_tagged, tagged


def launch(args: list[str], cwd: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[int]]:
    tag = uuid.uuid4().hex
    try:
        done = subprocess.run([sys.executable, "-m", "distrain", "launch", *args], env=cli_env(tag), cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        return done, tagged(tag)
    finally:
        kill_tagged(tag)


@pytest.mark.parametrize("args, flag", [
    (["--bandwidth", "10parsecs", "x.py"], "--bandwidth"),
    (["--workers", "0", "x.py"], "--workers"),
    (["--emulation", "moon", "x.py"], "--emulation"),
    (["--servers", "-1", "x.py"], "--servers"),
    (["missing.py"], "SCRIPT"),
    ([], "SCRIPT"),
    (["-m", "no_such_module_of_distrain_tests"], "-m"),  # was found missing only by every rank
    (["--workers", "2", "--slow-worker", "5:4x", "x.py"], "--slow-worker"),  # names no worker: was each rank's traceback
    (["--workers", "2", "--slow-link", "7:10mbit", "x.py"], "--slow-link"),
    (["--nnodes", "2", "x.py"], "--master-port"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "29999", "x.py"], "--node-rank"),
    (["--nnodes", "0", "x.py"], "--nnodes"),
    (["--join", "x.py"], "--join"),
    (["--nnodes", "2", "--join", "--master-port", "29999", "x.py"], "--join"),
    (["--nnodes", "2", "--servers", "1", "--master-port", "29999", "x.py"], "--servers"),
    (["--nnodes", "2", "--master-addr", "192.0.2.1", "--master-port", "29999", "x.py"], "--master-addr"),
])
def test_bad_input_is_one_line_before_anything_starts(tmp_path: Path, capsys, monkeypatch, args: list[str],
                                                      flag: str):
    """In this process (the checks come before any process starts); the test below types one."""
    from distrain.cli import main

    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["launch", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and flag in lines[0], (code, out.err)
    assert "must not run" not in out.out + out.err


def test_bad_input_typed_is_one_line_and_starts_nothing(tmp_path: Path):
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    done, orphans = launch(["--bandwidth", "10parsecs", "x.py"], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--bandwidth" in lines[0], done.stderr
    assert "must not run" not in done.stdout + done.stderr
    assert orphans == []


def test_a_failing_rank_stops_all_and_is_named(tmp_path: Path):
    # rank 2 fails; the others would wait forever in a collective without it
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        print("started", flush=True)
        if dist.get_rank() == 2:
            raise RuntimeError("boom on purpose")
        dist.barrier()
    """))
    done, orphans = launch(["--workers", "3", "--timeout", "60", "job.py"], tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == \
        "distrain: rank 2 failed: RuntimeError: boom on purpose (exit status 1)"
    assert sorted(line for line in done.stdout.splitlines() if "started" in line) == \
        [f"[rank {r}] started" for r in range(3)]
    assert orphans == []


def test_a_setting_refused_by_wrap_in_a_script_is_bad_input(tmp_path: Path):
    # the script's own traceback stays (it is the user's script); the job's status is distrain's for bad input
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import torch, distrain
        model = torch.nn.Linear(2, 2)
        distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm="allreduce", sync_every=16)
    """))
    done, orphans = launch(["--workers", "2", "--timeout", "60", "job.py"], tmp_path)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("distrain: rank ") and "ConfigError: --sync-every: is used only by --algorithm diloco" in last
    assert orphans == []


def test_the_failure_that_caused_the_others_is_named_though_it_ended_last(tmp_path: Path):
    # rank 2 drops its connections, so ranks 0 and 1 fail first ("Connection closed by peer"),
    # and only then fails itself: its error, not theirs, is the job's cause
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import time, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 2:
            dist.destroy_process_group()
            time.sleep(1.0)  # the others have failed by now
            raise RuntimeError("boom on purpose")
        dist.barrier()
    """))
    done, orphans = launch(["--workers", "3", "--timeout", "60", "job.py"], tmp_path)
    assert done.returncode == 1
    assert re.search("Connection (closed|reset) by peer", done.stderr)  # the others did fail first, for want of rank 2
    assert done.stderr.strip().splitlines()[-1] == \
        "distrain: rank 2 failed: RuntimeError: boom on purpose (exit status 1)"
    assert orphans == []


def test_a_warning_is_not_named_as_the_cause_of_a_failure(tmp_path: Path):
    # rank 1 prints a Python warning (two lines: where, then the source line), then is killed
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, signal, warnings
        if os.environ["RANK"] == "1":
            warnings.warn("a harmless warning")
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    done, orphans = launch(["--workers", "2", "--timeout", "30", "job.py"], tmp_path)
    assert done.returncode == 1
    assert "UserWarning: a harmless warning" in done.stderr  # still shown as the rank wrote it
    assert done.stderr.strip().splitlines()[-1] == "distrain: rank 1 failed: killed by SIGKILL"
    assert orphans == []


def test_a_rank_that_never_finishes_after_its_peers_is_stopped_and_named(tmp_path: Path):
    # rank 1 blocks for ever once rank 0 has finished: the job must not stay up
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, threading
        print("done", flush=True)
        if os.environ["RANK"] == "1":
            threading.Event().wait()
    """))
    done, orphans = launch(["--workers", "2", "--timeout", "3", "job.py"], tmp_path, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "distrain: rank 1 did not finish within 3 s of rank 0 (ranks still running: [1]); stopped them")
    assert orphans == []


def test_environment_is_torchruns_and_the_settings_reach_wrap(tmp_path: Path):
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, sys, torch, distrain
        model = torch.nn.Linear(4, 2)
        opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        print(os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], opt.rank, opt.workers,
              opt.config.network.network, opt.emulation.link_model is not None, sys.argv[1:])
        opt.finish()
    """))
    done, orphans = launch(["--workers", "2", "--network", "lan", "job.py", "--my-flag", "7"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.strip().splitlines())
    assert lines == [f"[rank {r}] {r} {r} 2 {r} 2 lan True ['--my-flag', '7']" for r in range(2)]
    assert orphans == []


def test_wrap_in_one_process_is_the_plain_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    plain.load_state_dict(model.state_dict())
    opt = distrain.wrap(model, torch.optim.AdamW(model.parameters(), lr=0.01), progress=False)
    reference = torch.optim.AdamW(plain.parameters(), lr=0.01)
    x, y = torch.randn(40, 6), torch.randint(2, (40,))
    try:
        assert (opt.rank, opt.workers, opt.is_worker) == (0, 1, True)
        for step in range(5):
            rows = slice(8 * step, 8 * step + 8)
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(plain(x[rows]), y[rows]).backward()
            reference.step()
            reference.zero_grad()
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert opt.steps == 5 and opt.state_dict()["steps"] == 5
    finally:
        opt.finish()
    assert not torch.distributed.is_initialized()  # wrap() opened the group, finish() closed it


@pytest.mark.parametrize("settings, name", [
    ({"algorithm": "nope"}, "algorithm"), ({"compress": "topk:7"}, "compress"), ({"lr_typo": 1}, "lr_typo"),
    ({"algorithm": "dpsgd"}, "workers"), ({"algorithm": "ps"}, "servers"), ({"servers": 2}, "servers"),
])
def test_bad_settings_raise_one_line_naming_them(settings: dict, name: str):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings)
    assert name in str(info.value) and "\n" not in str(info.value)
    assert not torch.distributed.is_initialized()  # refused before any process group exists


def test_ctrl_c_stops_every_rank(tmp_path: Path):
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import threading
        print("started", flush=True)
        threading.Event().wait()   # a script that would never end by itself
    """))
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "distrain", "launch", "--workers", "3", "job.py"], cwd=tmp_path,
                            env=cli_env(tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = 0
        while started < 3:  # every rank is running
            line = proc.stdout.readline()
            assert line, "the launcher ended early"
            started += "started" in line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert err.strip().splitlines() == ["distrain: interrupted (SIGINT); stopped 3 processes"]
        assert tagged(tag) == []
    finally:
        proc.kill()
        kill_tagged(tag)


def test_a_worker_left_out_ends_its_script_with_status_3_and_other_errors_are_untouched(tmp_path: Path):
    """After wrap(), a LeftOut that ends the user's script (the others went on without this
    worker) prints its one line and exits with status 3, which distrain launch counts as a
    loss; another WorkerFailure (e.g. a peer lost in a run that cannot go on without it) prints
    its one line and exits with status 1; any other error keeps Python's traceback and status 1
    (the hook before it runs)."""
    script = textwrap.dedent("""
        import sys, torch, distrain
        from distrain.errors import WorkerFailure
        from distrain.runtime.membership import LeftOut
        model = torch.nn.Linear(2, 1)
        opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        failures = {"left": LeftOut("worker 0 was left out of the run at step 7"),
                    "lost": WorkerFailure("worker 0 lost contact with rank 1 at step 7 (Connection reset by peer)")}
        raise failures.get(sys.argv[1], ValueError("mine"))
    """)
    (tmp_path / "job.py").write_text(script)

    def job(kind: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "job.py", kind], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env=cli_env(uuid.uuid4().hex))

    left = job("left")
    assert left.returncode == 3, left.stderr
    assert left.stderr.strip().splitlines()[-1] == "worker 0 was left out of the run at step 7"
    lost = job("lost")
    assert lost.returncode == 1 and "Traceback" not in lost.stderr, lost.stderr
    assert lost.stderr.strip().splitlines()[-1] == "worker 0 lost contact with rank 1 at step 7 (Connection reset by peer)"
    other = job("other")
    assert other.returncode == 1 and "Traceback" in other.stderr
    assert other.stderr.strip().splitlines()[-1].endswith("ValueError: mine")  # (torch prefixes the rank)


def test_a_lost_single_parameter_server_stops_the_job_in_one_line_naming_it(tmp_path: Path):
    """--servers 1, the server (rank 2) killed at its step 5: nobody holds its parameters, so the
    job stops at once, its last line naming the server (the launcher said "the others go on
    without it", and each worker's script then printed gloo's traceback through distrain's
    internals). A worker that saw the loss first says so in one line."""
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import torch, distrain
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), algorithm="ps")
        for step in range(40):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
            opt.step()
        opt.finish()
    """))
    tag = uuid.uuid4().hex
    try:
        done = subprocess.run([sys.executable, "-m", "distrain", "launch", "--workers", "2", "--servers", "1",
                               "--timeout", "60", "job.py"], env={**cli_env(tag), "DISTRAIN_INJECT_KILL": "2:5"},
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        orphans = tagged(tag)
    finally:
        kill_tagged(tag)
    assert done.returncode == 1, done.stderr
    assert orphans == []
    assert "Traceback" not in done.stderr and "go on without it" not in done.stderr, done.stderr
    for line in done.stderr.splitlines():
        if line.startswith(("[rank 0]", "[rank 1]")):
            assert re.fullmatch(r"\[rank (\d)\] worker \1 lost contact with rank 2 at step \d+ \(.+\)", line), done.stderr
    assert done.stderr.strip().splitlines()[-1] == "distrain: rank 2 failed: killed by SIGKILL", done.stderr


def test_a_lost_peer_in_a_step_is_one_failure_naming_the_worker_and_step():
    """A backend error for a lost peer that reaches wrap()'s optimizer (a run that cannot go on
    without it) becomes one WorkerFailure line with the step and the backend's reason."""
    from distrain.errors import WorkerFailure

    model = torch.nn.Linear(2, 1)
    opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt.steps = 7
    with pytest.raises(WorkerFailure, match=r"^worker 0 lost contact with an unknown rank at step 7 "
                                            r"\(Connection reset by peer\)$") as failure:
        with opt._naming_lost_peers():
            raise RuntimeError("[gloo/pair.cc:534] Connection reset by peer")
    assert isinstance(failure.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="mine"), opt._naming_lost_peers():  # not a lost peer: untouched
        raise ValueError("mine")
    opt.finish()


@pytest.mark.parametrize("algorithm", ["allreduce", pytest.param("adpsgd", marks=pytest.mark.slow)])
def test_a_stopped_rank_stops_a_job_that_survives_no_loss_within_seconds(tmp_path: Path, algorithm: str):
    """--min-workers 4 of 4 (no loss survived): rank 2 stops itself (SIGSTOP) at its step 10,
    alive, its connections open. The others' waits end a few seconds after its heartbeat's last
    stamp, in one line naming it, and the launcher stops it (before: the others waited out the
    60 s --timeout; under adpsgd, whose passive threads receive from any caller, for ever)."""
    stopped = tmp_path / "stopped-at"
    (tmp_path / "job.py").write_text(textwrap.dedent(f"""
        import os, signal, time, torch, distrain
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), algorithm="{algorithm}")
        for step in range(400):
            if opt.rank == 2 and step == 10:
                open({str(stopped)!r}, "w").write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
            opt.step()
        opt.finish()
    """))
    done, orphans = launch(["--workers", "4", "--min-workers", "4", "--timeout", "60", "job.py"], tmp_path)
    ended = time.time()
    assert done.returncode == 1, done.stderr
    assert orphans == []
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"distrain: rank [013] failed: worker [013] lost contact with rank 2 at step \d+ "
                        r"\(rank 2 has stamped no heartbeat for .+\)", last), done.stderr
    assert ended - float(stopped.read_text()) < 20  # the heartbeat's staleness (3 s), polls, the stop
