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
    network = {"bandwidth": "100mbit", "slow_link": "2:2mbit", "latency": "1ms", "sparse_collective": "ring"}
    settings = {"workers": WORLD, "epochs": 5, **network}
    adaptive = launch_local(small_config(str(tmp_path / "adaptive"), compress=SPEC, density_warmup_epochs=1, **settings))
    # Dense all-reduce is synchronous: its final accuracy does not depend on the network, so the
    # reference runs without the emulated links (half the time).
    dense = launch_local(small_config(str(tmp_path / "dense"), compress="none", workers=WORLD, epochs=5))

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
    # no budget (the default): a congested link sends less and nobody sends more for it, so the
    # mean falls below base; the fast workers stay near base times their batches' importance
    assert statistics.mean(ratios.values()) < 0.25 and min(ratios[r] for r in fast) > 0.5 * 0.25, ratios
    assert min(congestion[r] for r in slow) > 5 * max(congestion[r] for r in fast), congestion
    # 240 test samples: 0.05 is 12 of them. The adaptive run's ratios follow measured delays, so
    # its accuracy moves from run to run (0.858 against dense 0.892 once on a quiet machine).
    gap = dense["final_test_accuracy"] - adaptive["final_test_accuracy"]
    assert gap <= 0.05, (adaptive["final_test_accuracy"], dense["final_test_accuracy"])


@pytest.mark.slow  # `make test-all`
@pytest.mark.timeout(300)
def test_parameter_server_workers_push_smaller_ratios_while_their_link_is_slow(tmp_path):
    # Worker 1's link alternates each second between 100 and 2 Mbit/s; the others stay at
    # 100 Mbit/s. Without a shared baseline (workers never talk to one another) each worker
    # compares its delay with its own best: only worker 1 sees congestion, half of the time.
    trace = tmp_path / "trace.csv"
    trace.write_text("0,*,100mbit\n1,1,2mbit\n2,*,repeat\n")
    settings = {"algorithm": "ps", "servers": 2, "workers": 3, "epochs": 5, "latency": "1ms",
                "bandwidth_trace": str(trace)}
    adaptive = launch_local(small_config(str(tmp_path / "adaptive"), compress=SPEC, density_warmup_epochs=1, **settings))
    # Dense all-reduce is synchronous: its final accuracy does not depend on the network, so the
    # reference runs without the emulated links (half the time).
    dense = launch_local(small_config(str(tmp_path / "dense"), compress="none", workers=WORLD, epochs=5))

    lines = {rank: read_metrics(tmp_path / "adaptive", rank) for rank in range(3)}
    compressed = {rank: [m for m in lines[rank] if m["epoch"] > 1] for rank in range(3)}  # past the warm-up
    for rank in range(3):
        assert all(0.05 <= m["compress_ratio"] <= 1 for m in lines[rank])
        assert all(m["step_bytes_sent"] > 0 for m in compressed[rank])
    # 2 Mbit/s against its own 100 Mbit/s: C ~ 50 while slow, and the ratio at min then. The
    # others see little, but one step can stand out (the first compressed step lumps the
    # warm-up's messages together; a server busy with worker 1's slow push delays a reply), so
    # count congested steps rather than compare single peaks. Slow steps are few (they take
    # long), so compare those steps, not means over steps.
    hot = {rank: sum(m["congestion"] > 10 for m in compressed[rank]) for rank in range(3)}
    assert max(m["congestion"] for m in compressed[1]) > 20, hot
    assert hot[1] >= 3 and max(hot[0], hot[2]) < hot[1] / 3, hot
    congested = [m["compress_ratio"] for m in compressed[1] if m["congestion"] > 10]
    assert congested and statistics.median(congested) == pytest.approx(0.05), congested
    # Compressed pushes on this 240-sample test set are noisy: fixed group_topk at 0.25 and 0.1
    # ended at 0.75 and 0.90 against dense 0.90 here; the tolerance allows that spread.
    gap = dense["final_test_accuracy"] - adaptive["final_test_accuracy"]
    assert gap <= 0.15, (adaptive["final_test_accuracy"], dense["final_test_accuracy"])
