"""The local launcher's housekeeping (no processes started beyond what each test names)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from distrain.launch.local import _stop


def test_stopping_workers_skips_those_never_started() -> None:
    # When one worker's start fails, the others were never started: stopping them must not
    # raise over that error ("can only join a started process").
    _stop([mp.get_context("spawn").Process(target=print)])


def test_a_lost_parameter_server_is_not_started_again() -> None:
    from distrain.launch.common import Restarts

    started: list[int] = []
    restarts = Restarts(2, lambda rank: started.append(rank) or rank, workers=4)
    assert restarts(4) is None and restarts(5) is None  # ranks 4, 5: the servers
    assert restarts(1) == 1 and restarts(3) == 3 and restarts(0) is None  # two restarts in all
    assert started == [1, 3] and restarts.left == 0


def _report_environment(launcher: int, environ: dict[str, str], out: str) -> None:
    from pathlib import Path

    from distrain.launch.common import enter_worker

    enter_worker(launcher, environ)
    import os

    Path(out).write_text(f"{os.environ.get('DISTRAIN_TEST_LATE', '')} {os.getppid() != launcher}")


def test_a_worker_of_the_fork_server_gets_the_launchers_environment_of_its_start(tmp_path, monkeypatch) -> None:
    """The fork server keeps the environment it started with; a worker it forks takes the
    launcher's as the launcher starts it (a setting made after the fork server started too)."""
    import os

    from distrain.runtime.forkserver import worker_context

    context = worker_context()  # the fork server runs from here on
    monkeypatch.setenv("DISTRAIN_TEST_LATE", "seen")
    out = tmp_path / "env"
    p = context.Process(target=_report_environment, args=(os.getpid(), dict(os.environ), str(out)))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    late, forked = out.read_text().split()
    assert late == "seen"
    assert forked == str(context.get_start_method() == "forkserver")  # not the launcher's child there


class _Worker:
    """Stands in for a worker process: records its start; the first start can bring a stop request."""

    def __init__(self, rank: int, log: list, on_start=None) -> None:  # noqa: ANN001
        self.rank, self.log, self.on_start, self.pid, self.alive = rank, log, on_start, None, False

    def start(self) -> None:
        if self.on_start is not None:
            self.on_start()  # e.g. the request arrives while the fork server imports torch
        self.pid, self.alive = 1_000_000 + self.rank, True
        self.log.append(("start", self.rank))

    def is_alive(self) -> bool:
        return self.alive


def test_no_worker_starts_after_a_stop_request_and_those_started_are_told(monkeypatch) -> None:
    """A Ctrl-C or SIGTERM that came while the first worker started found no worker to tell:
    the run then trained to its end and was reported stopped. Now no more start, and the started
    ones get the request (SIGTERM)."""
    import os
    import signal

    from distrain.launch.local import _Signals, _start_all

    log: list = []
    signals = _Signals([])
    monkeypatch.setattr(os, "kill", lambda pid, sig: log.append(("kill", pid - 1_000_000, sig)))
    workers = [_Worker(0, log, on_start=lambda: setattr(signals, "at", 1.0)), _Worker(1, log), _Worker(2, log)]
    assert _start_all(workers, signals) == workers[:1]
    assert log == [("start", 0), ("kill", 0, signal.SIGTERM)]

    log.clear()
    quiet = _Signals([])
    workers = [_Worker(r, log) for r in range(3)]
    assert _start_all(workers, quiet) == workers  # no request: every worker, none told anything
    assert log == [("start", 0), ("start", 1), ("start", 2)]

    def fork_server_ended_by_ctrl_c(signals: _Signals):  # noqa: ANN202
        def start() -> None:
            if signals is not None:
                signals.at = 1.0
            raise EOFError  # the fork server died importing torch: the start reads nothing
        return start

    log.clear()
    stopped = _Signals([])
    workers = [_Worker(0, log, on_start=fork_server_ended_by_ctrl_c(stopped)), _Worker(1, log)]
    assert _start_all(workers, stopped) == []  # the stop request is the news: no EOFError traceback
    unasked = [_Worker(0, log, on_start=fork_server_ended_by_ctrl_c(None))]
    with pytest.raises(EOFError):  # no stop request: the failed start is the error
        _start_all(unasked, _Signals([]))


def test_ctrl_c_before_the_command_runs_is_one_line(monkeypatch, capsys) -> None:
    """A Ctrl-C while the command line is set up (before its command's own handling) was
    Python's KeyboardInterrupt traceback; now one line and status 130."""
    import distrain.cli as cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["distrain: interrupted"]


@pytest.mark.parametrize("argv,wanted", [
    (["train"], True), (["train", "--workers", "4"], True), (["compare", "--workers=2"], True),
    (["train", "--workers", "1"], False), (["train", "--workers=1"], False),
    (["train", "--emulation", "netns"], False), (["train", "--help"], False), (["report", "runs/x"], False),
    ([], False)])
def test_the_fork_server_starts_early_only_for_commands_that_fork_workers(argv, wanted, monkeypatch) -> None:
    from distrain.runtime.forkserver import wants_workers

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert wants_workers(argv) is wanted
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    assert wants_workers(argv) is False  # a torchrun worker forks none


EARLY_START = """
import sys
from distrain.runtime.forkserver import start_early, worker_context

def report():
    print("imported", "torch" in sys.modules, "distrain.train.loop" in sys.modules)

if __name__ == "__main__":
    assert start_early(["train", "--workers", "2"])
    assert "torch" not in sys.modules  # the caller imports nothing heavy to start it
    p = worker_context().Process(target=report)
    p.start()
    p.join(120)
    sys.exit(p.exitcode)
"""


def test_a_worker_of_the_early_fork_server_has_torch_and_the_loop_imported(tmp_path) -> None:
    """The fork server started from the command line's first look at its arguments imports
    torch and distrain's loop before it forks a worker, so no worker imports them again; the
    caller itself has imported neither."""
    import subprocess
    import sys

    script = tmp_path / "early.py"
    script.write_text(EARLY_START)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["imported", "True", "True"]


CTRL_C_AS_THE_SERVER_STARTS = """
import multiprocessing.forkserver
import os
import signal
import sys
from distrain.runtime.forkserver import start_early, worker_context

def report(launcher):
    from distrain.launch.common import enter_worker

    enter_worker(launcher, dict(os.environ))
    print("worker", signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
          signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)

if __name__ == "__main__":
    started = multiprocessing.forkserver.ensure_running

    def ctrl_c_as_it_starts():
        started()  # the server's process is there, its start not yet over for the launcher
        os.killpg(0, signal.SIGINT)

    multiprocessing.forkserver.ensure_running = ctrl_c_as_it_starts
    try:
        start_early(["train", "--workers", "2"])
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    print("interrupted", interrupted, flush=True)
    multiprocessing.forkserver.ensure_running = started
    p = worker_context().Process(target=report, args=(os.getpid(),))
    p.start()
    p.join(120)
    sys.exit(p.exitcode)
"""


def test_a_ctrl_c_as_the_fork_server_starts_reaches_the_launcher_and_no_worker_starts_with_it(tmp_path) -> None:
    """Ctrl-C (the whole process group) in the moment the fork server has started but the
    launcher's start of it is not over: the launcher gets it (it was ignored there, so a run
    trained to its end with exit status 0), the server prints nothing, and a worker it forks
    later ignores SIGINT (unblocked) until its stop request takes it over."""
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_AS_THE_SERVER_STARTS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          start_new_session=True)  # (its own process group, which the Ctrl-C reaches)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["interrupted", "True", "worker", "True", "False"], done.stdout
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr


REFUSED_EARLY = """
import multiprocessing.forkserver
import sys
from distrain.runtime.forkserver import start_early

if __name__ == "__main__":
    assert start_early(["train", "--workers", "2"])
    print(multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
    sys.exit(2)  # refused before any worker started, while the fork server still imports
"""


def test_the_early_fork_server_ends_with_a_launcher_that_started_no_worker(tmp_path) -> None:
    """A command refused before any worker started takes its fork server with it as it exits, in
    the middle of its imports (which would otherwise hold the command's output open for
    seconds after its one line)."""
    import subprocess
    import sys

    script, out = tmp_path / "refused.py", tmp_path / "out.txt"
    script.write_text(REFUSED_EARLY)
    with out.open("w") as stdout:  # (not pipes: the call returns as the launcher exits)
        done = subprocess.run([sys.executable, str(script)], stdout=stdout, stderr=subprocess.STDOUT, timeout=120,
                              cwd=tmp_path)
    assert done.returncode == 2, out.read_text()
    pid = int(out.read_text())
    proc = Path(f"/proc/{pid}")
    assert not proc.exists() or b"forkserver" not in (proc / "cmdline").read_bytes()
