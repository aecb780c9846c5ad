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


def test_twenty_configurations_keep_every_figure_within_bounds(tmp_path):
    quantiles = {"loss_quantiles": lambda s, r: [0.1, 0.2, 0.4, 0.6, 0.9, 1.2, 2.0 + r],
                 "compression_ratio": lambda s, r: 0.01 * (1 + (s + r) % 3)}
    for i in range(20):
        make_run(tmp_path / "runs" / f"c{i}", algorithm=f"algo{i:02d}", speed=1 + i / 10, extra=quantiles)
    groups = group_runs(load_runs([tmp_path / "runs"]))
    assert len(groups) == 20
    files = {p.name: p for p in make_plots(groups, tmp_path / "out")}
    assert {"loss_distribution.png", "compression_ratio_per_worker.png", "loss_vs_time.png"} <= set(files)
    # The largest figure is 16 x 12 inches at 110 dpi; a page per configuration made 4972 px.
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
