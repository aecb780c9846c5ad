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
