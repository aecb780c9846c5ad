"""Adaptive compression: spec parsing, the policy's ratio, its link calibration and its importance."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from distrain.comm.transport import Exchange
from distrain.compress import build_compressor
from distrain.compress.adaptive import (
    AdaptiveGroupTopK,
    AdaptivePolicy,
    AdaptiveSettings,
    detrended_rank,
    parse_adaptive,
    policy_ratio,
)
from distrain.compress.error_feedback import ErrorFeedback
from distrain.errors import ConfigError

SETTINGS = AdaptiveSettings(base=0.01, min=0.001, max=0.1, beta=1)  # bytes in proportion to the link's speed
LATENCY = 0.005
COMPUTE = 0.05  # seconds of compute per step


def step_messages(bits_per_s: float, body: int, latency: float = LATENCY) -> list[Exchange]:
    """One step of a sparse ring on one worker as the link model times it: per round a 24-byte
    header and a body, sent back to back on the uplink (the body queues behind the header), and
    the matching receives."""
    rate = bits_per_s / 8
    out = []
    for _ in range(6):
        out.append(Exchange("send", 24, 0, 0.05, latency + 24 / rate))
        out.append(Exchange("send", body, 0, 0.05, latency + (24 + body) / rate))
        out.append(Exchange("recv", 0, body, 0.05))
    out.append(Exchange("all_reduce", 4000, 4000, 0.02, 0.02))
    return out


class Worker:
    """A policy fed as the training loop feeds it, over a link the test sets per step: the body
    it sends is proportional to the ratio it chose (``bytes_per_ratio``)."""

    def __init__(self, settings: AdaptiveSettings = SETTINGS, bytes_per_ratio: float = 3e6) -> None:
        self.policy, self.bytes_per_ratio = AdaptivePolicy(settings), bytes_per_ratio
        self.ratio = settings.base

    def step(self, bits_per_s: float, losses: torch.Tensor | None = None, compute: float = COMPUTE) -> float:
        self.policy.observe_exchanges(step_messages(bits_per_s, int(self.ratio * self.bytes_per_ratio)))
        self.policy._compute.append(compute)
        self.policy.observe_losses(losses)
        self.ratio = self.policy.ratio()
        self.policy._ratio = self.ratio
        return self.ratio


def test_spec_builds_group_topk_with_error_feedback_and_round_trips():
    compressor = build_compressor("adaptive:base=0.02:min=0.002:max=0.2:alpha=2:group=512")
    assert isinstance(compressor, ErrorFeedback) and isinstance(compressor.inner, AdaptiveGroupTopK)
    settings = compressor.inner.settings
    assert (settings.base, settings.min, settings.max, settings.alpha, settings.beta, settings.group) == (
        0.02, 0.002, 0.2, 2.0, 0.5, 512)
    assert compressor.ratio == 0.02 and compressor.inner.group == 512
    assert parse_adaptive([], dict(p.split("=") for p in settings.spec().split(":")[1:])) == settings
    assert parse_adaptive(["0.05"]).base == 0.05


@pytest.mark.parametrize("spec,needle", [
    ("adaptive:base=0.01:min=0.02:max=0.1", "min <= base"),
    ("adaptive:base=0.01:min=0.001:max=2", "max <= 1"),
    ("adaptive:base=x", "base must be a number"),
    ("adaptive:alpha=-1", "alpha must be >= 0"),
    ("adaptive:spare=-0.1", "spare must be >= 0"),
    ("adaptive:window=2.5", "window must be an integer"),
    ("adaptive:group=0", "group must be an integer >= 1"),
    ("adaptive:history=4", "history must be an integer >= 8"),
    ("adaptive:budget=1", "unknown option 'budget'"),
    ("adaptive:speed=3", "unknown option 'speed'"),
    ("adaptive:0.01:base=0.01", "once"),
])
def test_bad_specs_are_one_line_config_errors(spec, needle):
    with pytest.raises(ConfigError) as info:
        build_compressor(spec)
    message = str(info.value)
    assert "--compress" in message and needle in message and "\n" not in message


def test_default_policy_follows_the_link_and_leaves_importance_off():
    default = parse_adaptive([], {"base": "0.01", "min": "0.001", "max": "0.1"})
    assert (default.alpha, default.beta, default.dead, default.spare) == (0.0, 0.5, 0.25, 0.1)
    assert policy_ratio(default, 1.0, 1.0) == pytest.approx(0.01)
    assert policy_ratio(default, 1.5, 1.0) == pytest.approx(0.01)  # importance off
    assert policy_ratio(default, 1.0, 4.0) == pytest.approx(0.005)  # 1 / sqrt(C)
    assert policy_ratio(SETTINGS, 1.0, 4.0) == pytest.approx(0.0025)  # beta=1: bytes follow the link's speed
    assert policy_ratio(default, 1.0, 1e6) == pytest.approx(0.001)  # never below min
    assert policy_ratio(default, 1.0, 1.0, spare_ratio=0.05) == pytest.approx(0.05)
    assert policy_ratio(default, 1.0, 1.0, spare_ratio=0.5) == pytest.approx(0.1)  # never above max
    assert policy_ratio(default, 1.0, 1.0, scale=8) == pytest.approx(0.08)  # a round of 8 steps
    assert policy_ratio(default, 1.0, 1.0, scale=1000) == 1.0


def test_ratio_is_monotone_in_both_signals_and_within_min_and_max():
    settings = AdaptiveSettings(base=0.01, min=0.001, max=0.1, alpha=1)
    importances, congestions = [0.5, 0.8, 1.0, 1.3, 1.5], [1.0, 1.5, 3.0, 10.0]
    for c in congestions:
        ratios = [policy_ratio(settings, i, c) for i in importances]
        assert all(a <= b for a, b in itertools.pairwise(ratios)) and ratios[0] < ratios[-1], (c, ratios)
    for i in importances:
        ratios = [policy_ratio(settings, i, c) for c in congestions]
        assert all(a >= b for a, b in itertools.pairwise(ratios)) and ratios[0] > ratios[-1], (i, ratios)
    for i, c, spare in itertools.product([0.0, 0.3, 1.0, 1.5, 1e9], [1.0, 2.0, 1e3, 1e12], [0.0, 0.02, 5.0]):
        assert settings.min <= policy_ratio(settings, i, c, spare_ratio=spare) <= settings.max


@pytest.mark.parametrize("bits_per_s", [5e6, 50e6, 500e6])
def test_a_constant_link_keeps_the_base_ratio_for_the_whole_run(bits_per_s):
    # spare=0: whatever the link's speed, it is never congested, so every step sends base
    worker = Worker(AdaptiveSettings(base=0.01, min=0.001, max=0.1, spare=0))
    ratios = [worker.step(bits_per_s) for _ in range(300)]
    assert all(r == pytest.approx(0.01) for r in ratios), (min(ratios), max(ratios))
    assert worker.policy.idle_rate == pytest.approx(bits_per_s / 8, rel=0.01)
    assert worker.policy.latency == pytest.approx(LATENCY, rel=1e-3)  # the delay less what the bytes take


def test_a_slow_constant_link_sends_base_and_a_fast_one_spends_its_spare_time():
    # 6 bodies of 0.5 MB per unit of ratio a step; 50 ms of compute, 10% of it spare: at 5 Mbit/s
    # base takes 48 ms a step, more than the spare 5 ms, so base; at 500 Mbit/s base takes 0.5 ms
    # and the spare time holds a ratio of 5 ms x 62.5 MB/s / 3 MB = 0.104 (max 0.1)
    slow, fast = Worker(bytes_per_ratio=0.5e6), Worker(bytes_per_ratio=0.5e6)
    slow_ratios = [slow.step(5e6) for _ in range(50)]
    fast_ratios = [fast.step(500e6) for _ in range(50)]
    assert all(r == pytest.approx(0.01) for r in slow_ratios)
    assert fast_ratios[-1] == pytest.approx(0.1) and min(fast_ratios) >= 0.01
    middle = Worker(bytes_per_ratio=0.5e6)
    for _ in range(50):
        middle.step(100e6)  # 12.5 MB/s: 5 ms hold 0.0208
    assert middle.ratio == pytest.approx(0.1 * 0.05 * 12.5e6 / 3e6, rel=0.03)


def test_a_tenfold_drop_cuts_the_ratio_within_three_steps_and_it_recovers_as_fast():
    worker = Worker()
    before = [worker.step(10e6) for _ in range(40)]
    assert all(r == pytest.approx(0.01) for r in before)
    during = [worker.step(1e6) for _ in range(20)]
    # the median of the last 5 steps turns on the third slow step
    assert all(r == pytest.approx(0.01) for r in during[:2]), during[:4]
    assert all(r < 0.0015 for r in during[2:]), during
    assert worker.policy.congestion == pytest.approx(10.0, rel=0.1)
    after = [worker.step(10e6) for _ in range(20)]
    assert all(r == pytest.approx(0.01) for r in after[3:]), after[:5]


def test_timing_noise_and_small_delays_read_as_no_congestion():
    torch.manual_seed(0)
    worker = Worker()
    for step in range(200):
        # a loopback: a very fast link whose messages now and then wait for a busy peer
        messages = step_messages(10e9, 3000)
        noisy = [Exchange(e.op, e.bytes_sent, e.bytes_received, e.seconds,
                          e.link_seconds * (1 + 5 * float(torch.rand(()))) if e.link_seconds else None)
                 for e in messages]
        worker.policy.observe_exchanges(noisy)
        worker.policy._compute.append(COMPUTE)
        assert worker.policy.congestion == 1.0, (step, worker.policy.slowdown)
        # the slowdown reads 2-6, but it costs ~0.1 ms a step, under 10% of 50 ms
        assert worker.policy.ratio() >= 0.01


def test_importance_stays_centred_while_the_loss_falls():
    torch.manual_seed(0)
    policy = AdaptivePolicy(AdaptiveSettings(alpha=1))
    per_epoch, epochs = 100, 10
    means = []
    for epoch in range(epochs):
        values = []
        for step in range(per_epoch):
            level = 2.3 * math.exp(-3 * (epoch * per_epoch + step) / (epochs * per_epoch))  # 2.3 -> 0.11
            values.append(policy.observe_losses(level * (1 + 0.3 * torch.rand(64))))
        means.append(statistics.mean(values))
    assert all(abs(m - 1) <= 0.1 for m in means), means
    assert min(means[1:]) > 0.95  # the first epoch holds the 7 batches of I = 1 before history


def test_importance_ranks_a_hard_batch_high_and_an_easy_one_low():
    policy = AdaptivePolicy(AdaptiveSettings(alpha=1))
    for step in range(30):
        policy.observe_losses(torch.full((8,), 2.0 - 0.01 * step + 0.001 * (step % 3)))
    assert policy.observe_losses(torch.full((8,), 5.0)) == 1.5
    assert policy.observe_losses(torch.full((8,), 0.1)) == 0.5
    assert detrended_rank([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.5)  # on the trend: the middle
    assert policy.observe_losses(torch.tensor([float("nan")])) == 1.0


def test_metrics_and_state():
    policy = AdaptivePolicy(SETTINGS)
    policy.choose(torch.tensor([2.0]), None, compute_seconds=COMPUTE)
    policy.observe_exchanges(step_messages(50e6, 30_000))
    metrics = policy.metrics()
    assert set(metrics) == {"importance", "congestion", "slowdown", "idle_mbit_s", "latency_ms"}
    assert metrics["latency_ms"] == pytest.approx(LATENCY * 1e3, rel=1e-3)
    assert 45 < metrics["idle_mbit_s"] <= 50
    for step in range(20):
        policy.observe_losses(torch.tensor([2.0 - 0.01 * step]))
    other = AdaptivePolicy(SETTINGS)
    other.load_state_dict(policy.state_dict())
    assert list(other._losses) == list(policy._losses) and len(other._losses) == 21


def test_a_step_without_sends_is_timed_by_its_collectives():
    policy = AdaptivePolicy(SETTINGS)

    def gather_step(bits_per_s: float) -> list[Exchange]:
        size = [Exchange("all_gather", 24, 24, 0.05, LATENCY + 24 * 8 / bits_per_s)]
        body = [Exchange("all_gather", 90_000, 90_000, 0.5, LATENCY + 90_000 * 8 / bits_per_s)]
        return size + body + [Exchange("recv", 0, 100, 0.01)]

    for _ in range(10):
        policy.observe_exchanges(gather_step(50e6))
    assert policy.congestion == pytest.approx(1.0)
    for _ in range(10):
        policy.observe_exchanges(gather_step(5e6))
    assert policy.congestion == pytest.approx(10.0, rel=0.05)
