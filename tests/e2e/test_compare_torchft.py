"""``distrain compare --algorithms diloco --baselines torchft-diloco,torchft-localsgd``: both peers
finish on an emulated link beside distrain's diloco, count their bytes, and all three agree
where they must."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from distrain.compare import Grid, run_comparison
from tests.conftest import small_config

pytest.importorskip("torchft", reason="the torchft peers need torchft: pip install 'distrain[peers]'")

H, LATENCY = 5, 0.005  # the job below takes 30 steps: 6 syncs, the last one at the last step


@pytest.mark.slow  # `make test-all` (about 15 s): test_torchft_peers.py runs torchft's DiLoCo against distrain's in CI
@pytest.mark.timeout(240)
def test_compare_runs_both_torchft_peers_beside_diloco(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    # With outer SGD at lr 1 and no momentum, DiLoCo's outer step sets the shared parameters to
    # the replicas' average: exactly what LocalSGD does, and what distrain's diloco does with the
    # same settings. H comes from --sync-every for one peer and from the option for the other.
    cfg = small_config(str(tmp_path / "unused"), workers=2, sync_every=H, outer_optimizer="sgd", outer_lr=1.0,
                       outer_momentum=0.0, latency="5ms")
    peers = ["torchft-diloco", f"torchft-localsgd:{H}"]
    comparison = run_comparison(Grid(algorithms=["diloco"], baselines=peers, out=out), cfg, echo=lambda line: None)
    with open(out / "comparison.csv") as f:
        rows = {r["label"]: r for r in csv.DictReader(f)}
    labels = ["diloco", *peers]
    assert list(rows) == labels

    summaries, losses = {}, {}
    for config in comparison["configs"]:
        assert config["status"] == "ok", config.get("reason")
        run_dir = out / config["runs"][0]["run_dir"]
        summary = summaries[config["label"]] = json.loads((run_dir / "summary.json").read_text())
        losses[config["label"]] = [json.loads(line)["loss"] for line in
                                   (run_dir / "metrics" / "rank1.jsonl").read_text().splitlines()]
        assert summary["steps"] % H == 0
        if config["label"] != "diloco":
            info = json.loads((run_dir / "config.json").read_text())["algorithm_info"]
            assert info["sync_every"] == H and info["unsynced_last_steps"] == 0
            assert summary["algorithm"] == config["label"] and "torchft's process group" in summary["bytes_counted"]
            assert (run_dir / "logs" / "lighthouse.log").exists()
        # One all-reduce of the whole model every H steps (2 workers: each sends all its bytes).
        sent = summary["steps"] // H * summary["model_parameters"] * 4
        assert summary["bytes_sent_per_worker"] == [sent, sent]
        assert float(rows[config["label"]]["bytes_sent_per_worker_mean"]) == sent > 0
        # Every all-reduce waited out a 2-round ring on the emulated 5 ms links: torchft makes one
        # per parameter tensor (at least a weight and a bias), distrain's diloco at least one.
        all_reduces = 1 if config["label"] == "diloco" else 2
        assert summary["wall_time_s"] >= summary["steps"] // H * all_reduces * 2 * LATENCY
    for label in peers:  # same data, seed, schedule and steps: the same losses and final model
        assert losses[label] == pytest.approx(losses["diloco"], rel=1e-4, abs=1e-6), label
        assert summaries[label]["final_test_accuracy"] == summaries["diloco"]["final_test_accuracy"], label
