"""Adaptive compression through the worker loop over an emulated network (real gloo, ``launch_local``)."""

from __future__ import annotations

import statistics

import pytest

from distrain.launch import launch_local
from distrain.train.metrics import read_metrics
from tests.conftest import small_config

WORLD = 4
SPEC = "adaptive:base=0.25:min=0.05:max=1:group=64"


@pytest.mark.timeout(300)
def test_workers_on_slower_links_choose_smaller_ratios_and_train_like_dense(tmp_path):
    # Worker 2's link is slow, so the ring's links 1 -> 2 and 2 -> 3 are: workers 1 and 2 send
    # over a slow link, workers 3 and 0 over fast ones.
    network = {"bandwidth": "100mbit", "slow_link": "2:2mbit", "latency": "1ms"}
    settings = {"workers": WORLD, "epochs": 5, **network}
    adaptive = launch_local(small_config(str(tmp_path / "adaptive"), compress=SPEC, density_warmup_epochs=1, **settings))
    dense = launch_local(small_config(str(tmp_path / "dense"), compress="none", **settings))

    ratios, congestion = {}, {}
    for rank in range(WORLD):
        lines = read_metrics(tmp_path / "adaptive", rank)
        late = lines[len(lines) // 2 :]  # past the dense first epoch
        ratios[rank] = statistics.mean(m["compress_ratio"] for m in late)
        congestion[rank] = statistics.mean(m["congestion"] for m in late)
        assert all(0.05 <= m["compress_ratio"] <= 1 for m in lines)
        assert all(m["step_bytes_sent"] > 0 and len(m["loss_quantiles"]) == 7 for m in lines)
    slow, fast = (1, 2), (0, 3)
    assert max(ratios[r] for r in slow) < 0.5 * min(ratios[r] for r in fast), ratios
    assert min(congestion[r] for r in slow) > 5 * max(congestion[r] for r in fast), congestion
    gap = dense["final_test_accuracy"] - adaptive["final_test_accuracy"]
    assert gap <= 0.03, (adaptive["final_test_accuracy"], dense["final_test_accuracy"])
