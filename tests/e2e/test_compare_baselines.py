"""The PyTorch baselines in distrain's harness: each runs on 2 workers, writes the same summary
keys as a distrain run, learns, and puts the expected bytes on the (emulated) wire."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from distrain.baselines import run_baseline
from distrain.launch import launch_local
from distrain.train.metrics import read_metrics
from tests.conftest import small_config

LATENCY = 0.005  # every message: 5 ms on the in-process link model
#: Largest final test accuracy below or above the dense all-reduce's (240 test samples: 1 = 0.0042).
ACCURACY_GAP = {"ddp-fp16": 0.01, "localsgd:2": 0.02, "ddp-powersgd:1": 0.15}


@pytest.mark.timeout(240)
@pytest.mark.slow  # `make test-all`: test_ddp_hook.py runs the DDP hooks and test_compare_torchft.py compare's peers in CI
def test_baselines_run_learn_and_count_their_bytes(tmp_path: Path) -> None:
    def cfg(name: str):
        return small_config(str(tmp_path / name), workers=2, epochs=2, eval_every=1.0, latency="5ms")

    reference = launch_local(cfg("allreduce"))
    steps = reference["steps"]
    dense = reference["bytes_sent_per_worker"][0]
    summaries = {spec: run_baseline(spec, cfg(spec.replace(":", "_"))) for spec in ("ddp-fp16", "ddp-powersgd:1", "localsgd:2")}

    for spec, summary in summaries.items():
        assert set(summary) == set(reference), spec
        assert summary["algorithm"] == spec and summary["workers"] == 2 and summary["steps"] == steps
        # Same data, seed and schedule as the dense all-reduce: fp16 and averaging every other
        # step end where it does; rank-1 PowerSGD loses some accuracy but stays far above chance.
        gap = abs(summary["final_test_accuracy"] - reference["final_test_accuracy"])
        assert gap <= ACCURACY_GAP[spec], (spec, summary["final_test_accuracy"], reference["final_test_accuracy"])
        losses = [m["loss"] for m in read_metrics(summary["run_dir"], 0)]
        assert len(losses) == steps
        assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10, (spec, losses[:10], losses[-10:])
        # Both workers send the same and every message pays the emulated latency: at least one
        # 2-round ring (2 latencies) per step that communicates.
        assert summary["bytes_sent_per_worker"][0] == summary["bytes_sent_per_worker"][1]

    assert summaries["ddp-fp16"]["final_test_loss"] == pytest.approx(reference["final_test_loss"], rel=1e-3)
    assert summaries["ddp-fp16"]["bytes_sent_per_worker"][0] == dense // 2
    assert summaries["ddp-fp16"]["wall_time_s"] >= steps * 2 * LATENCY
    powersgd = summaries["ddp-powersgd:1"]["bytes_sent_per_worker"][0]
    assert powersgd < 0.5 * dense  # the MLP's weight matrices go as rank-1 factors after 2 dense steps
    assert summaries["ddp-powersgd:1"]["wall_time_s"] >= steps * 2 * LATENCY
    ratios = [m["compress_ratio"] for m in read_metrics(summaries["ddp-powersgd:1"]["run_dir"], 0)]
    assert ratios[:2] == [1.0, 1.0] and max(ratios[2:]) < 0.5
    # Post-local SGD without warm-up: the parameters are averaged after steps 1, 3, 5, ...
    assert summaries["localsgd:2"]["bytes_sent_per_worker"][0] == dense // steps * math.ceil(steps / 2)
