"""``distrain compare --baselines torchft-diloco,torchft-localsgd``: both peers finish on an
emulated link beside each other, count their bytes, and agree where they must."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from distrain.compare import Grid, run_comparison
from tests.conftest import small_config

pytest.importorskip("torchft", reason="the torchft peers need torchft: pip install 'distrain[peers]'")

H, LATENCY = 4, 0.005


@pytest.mark.timeout(240)
def test_compare_runs_both_torchft_peers(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    # With outer SGD at lr 1 and no momentum, DiLoCo's outer step sets the shared parameters to
    # the replicas' average: exactly what LocalSGD does. H comes from --sync-every for one peer
    # and from the option for the other.
    cfg = small_config(str(tmp_path / "unused"), workers=2, sync_every=H, outer_optimizer="sgd", outer_lr=1.0,
                       outer_momentum=0.0, latency="5ms")
    labels = ["torchft-diloco", f"torchft-localsgd:{H}"]
    comparison = run_comparison(Grid(algorithms=[], baselines=labels, out=out), cfg, echo=lambda line: None)
    with open(out / "comparison.csv") as f:
        rows = {r["label"]: r for r in csv.DictReader(f)}
    assert list(rows) == labels

    summaries, losses = {}, {}
    for config in comparison["configs"]:
        assert config["status"] == "ok", config.get("reason")
        run_dir = out / config["runs"][0]["run_dir"]
        summary = summaries[config["label"]] = json.loads((run_dir / "summary.json").read_text())
        info = json.loads((run_dir / "config.json").read_text())["algorithm_info"]
        assert info["sync_every"] == H and info["unsynced_last_steps"] == summary["steps"] % H
        assert summary["algorithm"] == config["label"] and "torchft's process group" in summary["bytes_counted"]
        losses[config["label"]] = [json.loads(line)["loss"] for line in
                                   (run_dir / "metrics" / "rank1.jsonl").read_text().splitlines()]
        # One all-reduce of the whole model every H steps (2 workers: each sends all its bytes).
        sent = summary["steps"] // H * summary["model_parameters"] * 4
        assert summary["bytes_sent_per_worker"] == [sent, sent]
        assert float(rows[config["label"]]["bytes_sent_per_worker_mean"]) == sent > 0
        # Every all-reduce (one per parameter tensor, at least a weight and a bias) waited out a
        # 2-round ring on the emulated 5 ms links.
        assert summary["wall_time_s"] >= summary["steps"] // H * 2 * 2 * LATENCY
        assert (run_dir / "logs" / "lighthouse.log").exists()
    assert losses[labels[0]] == pytest.approx(losses[labels[1]], rel=1e-4, abs=1e-6)
    assert summaries[labels[0]]["final_test_accuracy"] == summaries[labels[1]]["final_test_accuracy"]
