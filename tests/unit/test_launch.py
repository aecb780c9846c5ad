"""The local launcher's housekeeping (no processes started beyond what each test names)."""

from __future__ import annotations

import multiprocessing as mp

from distrain.launch.local import _stop


def test_stopping_workers_skips_those_never_started() -> None:
    # When one worker's start fails, the others were never started: stopping them must not
    # raise over that error ("can only join a started process").
    _stop([mp.get_context("spawn").Process(target=print)])
