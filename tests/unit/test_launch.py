"""The local launcher's housekeeping (no processes started beyond what each test names)."""

from __future__ import annotations

import multiprocessing as mp

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

    from distrain.launch.common import worker_context

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
