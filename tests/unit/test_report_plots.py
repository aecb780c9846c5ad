"""Plots stay readable with many configurations, and the loss curves draw the runs' own losses."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from distrain.report.plots import loss_curves, make_plots
from distrain.report.runs import group_runs, load_runs
from tests.unit.test_report import make_run


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_ten_configurations_keep_every_figure_within_bounds(tmp_path):
    quantiles = {"loss_quantiles": lambda s, r: [0.1, 0.2, 0.4, 0.6, 0.9, 1.2, 2.0 + r],
                 "compression_ratio": lambda s, r: 0.01 * (1 + (s + r) % 3)}
    for i in range(10):
        make_run(tmp_path / "runs" / f"c{i}", algorithm=f"algo{i:02d}", speed=1 + i / 10, extra=quantiles)
    groups = group_runs(load_runs([tmp_path / "runs"]))
    assert len(groups) == 10
    files = {p.name: p for p in make_plots(groups, tmp_path / "out")}
    assert {"loss_distribution.png", "compression_ratio_per_worker.png", "loss_vs_time.png"} <= set(files)
    # The largest figure is 16 x 12 inches at 110 dpi; a page per configuration made 4972 px of 20
    # configurations (about 2500 of these 10).
    for name, path in files.items():
        width, height = png_size(path)
        assert width <= 16 * 110 and height <= 12 * 110, (name, width, height)


def test_loss_curves_are_the_runs_losses(tmp_path):
    make_run(tmp_path / "a", workers=2, steps=12, evals=3)
    run = load_runs([tmp_path / "a"])[0]
    train, test = loss_curves(run)
    lines = {r: [json.loads(x) for x in (tmp_path / "a" / "metrics" / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(2)}
    expected_train = [(sum(lines[r][i]["time"] for r in range(2)) / 2, sum(lines[r][i]["loss"] for r in range(2)) / 2)
                      for i in range(12)]
    assert train == expected_train
    assert test == [(m["time"], m["test_loss"]) for m in lines[0] if "test_loss" in m]
    assert len(test) == 3
    files = make_plots(group_runs([run]), tmp_path / "out")
    assert tmp_path / "out" / "loss_vs_time.png" in files


def test_a_lost_and_a_joined_worker_are_marked_where_they_happened(tmp_path):
    """The changes of members in summary.json are placed at the time and epoch of the step they
    happened at (a lost worker 0's lines stop: another worker's line places it), and drawn on
    the plots against time and epochs."""
    membership = [{"event": "lost", "workers": [0], "members": [1], "lost_at_step": 4},
                  {"event": "joined", "workers": [0], "members": [0, 1], "joined_at_step": 9},
                  {"event": "lost", "workers": [1], "members": [0], "lost_at_step": 99}]  # after the last step
    for name in ("plain", "churn", "gap"):
        make_run(tmp_path / name, workers=2, steps=12, evals=3)
        if name != "plain":
            path = tmp_path / name / "summary.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "membership": membership}))
    rank0 = tmp_path / "gap" / "metrics" / "rank0.jsonl"
    rank0.write_text("\n".join(x for x in rank0.read_text().splitlines() if not 4 <= json.loads(x)["step"] <= 9) + "\n")
    plain, churn, gap = (load_runs([tmp_path / name])[0] for name in ("plain", "churn", "gap"))
    assert plain.membership_events() == []
    for run in (churn, gap):
        events = run.membership_events()
        assert [(e, line["step"], line["time"]) for e, line in events] == [("lost", 4, 0.4), ("joined", 9, 0.9)]
        assert [run.epoch_of(line) for _, line in events] == [1.0, 2.25]
    drawn = {p.name: p.read_bytes() for p in make_plots(group_runs([churn]), tmp_path / "churn-out")}
    clean = {p.name: p.read_bytes() for p in make_plots(group_runs([plain]), tmp_path / "plain-out")}
    for name in ("accuracy_vs_time.png", "accuracy_vs_epoch.png", "loss_vs_time.png"):
        assert drawn[name] != clean[name], name  # the same metrics: only the marks differ
    assert drawn["bytes_sent_per_worker.png"] == clean["bytes_sent_per_worker.png"]  # and nothing else does
