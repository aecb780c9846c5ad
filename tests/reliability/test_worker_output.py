"""What a successful run prints on stderr: its progress bar and the warnings it means, each
once, whatever the number of workers; nothing from interpreter or library teardown."""

from __future__ import annotations

import json
import re

import pytest

from tests.reliability.common import QUICK
from tests.reliability.test_user_factory import distrain_command

pytestmark = pytest.mark.timeout(180)

#: One frame of the progress bar (tqdm redraws it after a carriage return; leave=False blanks it).
PROGRESS = re.compile(r"allreduce: +\d+%\|.*")


def test_two_workers_print_the_progress_bar_and_one_warning_only(tmp_path):
    settings = [a for a in QUICK if a != "--no-progress"]  # the bar's multiprocessing lock leaked at exit
    # A warm-up longer than the run: legal, but pointless; every worker sees it.
    run = distrain_command(tmp_path, *settings, "--workers", "2", "--epochs", "1", "--warmup-epochs", "2",
                           "--run-dir", "run")
    assert run.returncode == 0, run.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    warmup, total = round(2 * config["steps_per_epoch"]), config["total_steps"]
    lines = [line for line in re.split(r"[\r\n]", run.stderr) if line.strip() and not PROGRESS.fullmatch(line)]
    assert not [line for line in lines if "leaked" in line or "resource_tracker" in line], run.stderr
    warning = (f"UserWarning: warm-up ({warmup} steps) is longer than the run ({total} steps); the learning rate "
               "never reaches its peak")
    assert [line for line in lines if line.endswith(warning)] == lines[:1], run.stderr  # once, not once per worker
    assert len(lines) == 1, run.stderr  # and nothing else
    assert any(PROGRESS.fullmatch(line) for line in re.split(r"[\r\n]", run.stderr))  # the bar was drawn
