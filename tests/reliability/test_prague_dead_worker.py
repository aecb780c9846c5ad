"""Prague goes on without a worker killed (SIGKILL) at a fixed step: its group partners (or the
group generator) find it gone, it is never grouped again, the survivors finish their budget, and
their consensus leaves it out."""

from __future__ import annotations

import json

import pytest

from tests.reliability.common import QUICK, injected_at, run_cli
from tests.reliability.test_adpsgd_dead_worker import finite_final_models

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]  # `make test-all`

# A larger test set than QUICK's, so that two runs' accuracies differ by less than the 2 points allowed.
PRAGUE = ["--algorithm", "prague", "--epochs", "2", "--num-samples", "9600"]


def test_kill_one_of_four_the_three_survivors_finish_without_it(tmp_path):
    whole = run_cli([*QUICK, *PRAGUE, "--workers", "4", "--run-dir", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr
    three = run_cli([*QUICK, *PRAGUE, "--workers", "3", "--group-size", "2", "--run-dir", str(tmp_path / "three")])
    assert three.returncode == 0, three.stderr
    mark = tmp_path / "killed-at"
    run_dir = tmp_path / "broken"
    broken = run_cli([*QUICK, *PRAGUE, "--workers", "4", "--run-dir", str(run_dir)],
                     DISTRAIN_INJECT_KILL="1:30", DISTRAIN_INJECT_MARK=str(mark))
    assert broken.returncode == 0, broken.stderr
    assert broken.orphans == []
    assert "worker 1 was killed by SIGKILL; the other workers finished without it" in broken.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["lost_workers"]) == ["1"]
    detection = summary["lost_workers"]["1"] - injected_at(mark)
    assert detection <= 15, detection
    steps = summary["steps_per_worker"]
    assert steps[1] == 0 and min(steps[0], steps[2], steps[3]) > 0
    assert sum(steps) + 30 >= summary["steps"] * 4  # the survivors used the whole (global) budget
    assert broken.wall <= 1.5 * whole.wall + 15, (broken.wall, whole.wall)
    reference = json.loads((tmp_path / "three" / "summary.json").read_text())["final_test_accuracy"]
    assert abs(summary["final_test_accuracy"] - reference) <= 0.02, (summary["final_test_accuracy"], reference)
    finite_final_models(run_dir, [0, 2, 3])
