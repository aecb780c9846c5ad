"""What a run's segments add up to, and summary.json never replaced by a worse one."""

from __future__ import annotations

import json

import pytest

from distrain.runtime.checkpoint import load_checkpoint, save_checkpoint
from distrain.runtime.totals import RunTotals
from distrain.train.metrics import write_summary


def _row(steps: int, wall: float, sent: list[int], received: list[int], cpu: float = 0.5) -> list[float]:
    return [steps, steps * 16, wall, 0.1 * steps, 0.2 * steps, *sent, *received, cpu]


def test_totals_add_up_over_segments_and_survive_a_checkpoint(tmp_path) -> None:
    first = RunTotals().plus(_row(10, 2.0, [0, 100], [0, 90]), eval_s=0.5, time_to_target_s=None)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"totals": first.state_dict()})
    earlier = RunTotals.from_state(load_checkpoint(path)["totals"])
    assert earlier == first
    assert earlier.offsets(2) == (2.0, 100, 90)
    second = earlier.plus(_row(5, 1.5, [0, 50], [0, 45]), eval_s=0.25, time_to_target_s=3.0)
    assert second.row == [15, 240, 3.5, 1.5, 3.0, 0, 150, 0, 135, 1.0]
    assert second.segment_wall_s == [2.0, 1.5] and second.wall_s == 3.5
    assert (second.eval_s, second.time_to_target_s) == (0.75, 3.0)
    # The target reached in an earlier segment stays the first time it was reached.
    third = RunTotals(time_to_target_s=1.0).plus(_row(1, 1.0, [0, 1], [0, 1]), 0.0, 5.0)
    assert third.time_to_target_s == 1.0
    assert RunTotals.from_state(None) == RunTotals() and RunTotals().offsets(3) == (0.0, 0, 0)


def test_membership_changes_carry_over_and_another_workers_totals_keep_only_the_runs(tmp_path) -> None:
    lost = {"event": "lost", "workers": [2], "members": [0, 1, 3], "unix_time": 100.5}
    first = RunTotals().plus(_row(10, 2.0, [0, 100], [0, 90]), eval_s=0.5, time_to_target_s=1.5, changes=[lost],
                             lost_workers={2: 100.5})
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"totals": first.state_dict()})
    earlier = RunTotals.from_state(load_checkpoint(path)["totals"])
    assert earlier.changes == [lost] and earlier.lost_workers == {2: 100.5}
    standin = earlier.for_another_worker()  # worker 2 resuming from worker 0's file
    assert standin.row == [0, 0, 2.0, 0, 0, 0, 0, 0, 0, 0] and standin.offsets(2) == (2.0, 0, 0)
    assert (standin.eval_s, standin.time_to_target_s, standin.segment_wall_s) == (0.5, 1.5, [2.0])
    back = {"event": "joined", "workers": [2], "unix_time": 200.0}
    both = standin.plus(_row(5, 1.0, [0, 50], [0, 45]), 0.0, None, changes=[back], lost_workers={3: 300.0})
    assert both.changes == [lost, back] and both.row[:3] == [5, 80, 3.0] and both.lost_workers == {2: 100.5, 3: 300.0}


def test_summary_of_a_resumed_run_never_replaces_a_fuller_one(tmp_path) -> None:
    path = tmp_path / "summary.json"
    recorded = {"steps_per_worker": [60, 60], "final_test_accuracy": 0.91, "segments": 1}
    write_summary(path, recorded)
    before = path.read_bytes()
    shorter = {"steps_per_worker": [40, 40], "final_test_accuracy": 0.88, "segments": 2}
    assert write_summary(path, shorter) is False
    no_result = {"steps_per_worker": [60, 60], "final_test_accuracy": float("nan"), "segments": 2}
    assert write_summary(path, no_result) is False
    assert path.read_bytes() == before
    longer = {"steps_per_worker": [80, 80], "final_test_accuracy": 0.93, "segments": 2}
    assert write_summary(path, longer) is True
    assert json.loads(path.read_text()) == longer
    afresh = {"steps_per_worker": [10, 10], "final_test_accuracy": 0.5, "segments": 1}  # --resume none
    assert write_summary(path, afresh) is True
    assert json.loads(path.read_text()) == afresh
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


def test_totals_row_lengths_must_match() -> None:
    earlier = RunTotals().plus(_row(1, 1.0, [0, 1], [0, 1]), 0.0, None)
    with pytest.raises(ValueError, match="5 values"):
        earlier.total_row([0.0] * 5)


def test_a_summary_of_fewer_workers_that_got_further_replaces_a_run_of_more(tmp_path) -> None:
    """Resumed with another number of workers, the furthest step decides, not every worker's sum."""
    path = tmp_path / "summary.json"
    write_summary(path, {"steps_per_worker": [40, 40, 40, 40], "final_test_accuracy": 0.9, "segments": 1})
    assert write_summary(path, {"steps_per_worker": [30, 30], "final_test_accuracy": 0.8, "segments": 2}) is False
    assert write_summary(path, {"steps_per_worker": [50, 50], "final_test_accuracy": 0.9, "segments": 2}) is True


def test_totals_resized_keep_each_peers_bytes_and_fold_those_of_peers_gone() -> None:
    """Worker 1 of 4 goes on in a run of 2: its bytes to workers 2 and 3 move to its own column."""
    earlier = RunTotals().plus(_row(10, 2.0, [0, 5, 7, 11], [1, 0, 3, 4]), 0.5, None)
    resized = earlier.resized(2, me=1)
    assert resized.row == [10, 160, 2.0, *resized.row[3:5], 0, 5 + 7 + 11, 1, 0 + 3 + 4, resized.row[-1]]
    assert sum(resized.row[5:7]) == sum(earlier.row[5:9]) and len(resized.row) == 6 + 2 * 2
    grown = earlier.resized(6, me=5)
    assert grown.row[5:11] == earlier.row[5:9] + [0, 0] and len(grown.row) == 6 + 2 * 6
    assert earlier.resized(4, me=0) is earlier
