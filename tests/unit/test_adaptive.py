"""Adaptive compression: spec parsing, the policy's f and g, and its two signals."""

from __future__ import annotations

import itertools

import pytest
import torch

from distrain.comm.transport import Exchange
from distrain.compress import build_compressor
from distrain.compress.adaptive import (
    AdaptiveGroupTopK,
    AdaptivePolicy,
    AdaptiveSettings,
    parse_adaptive,
    policy_ratio,
)
from distrain.compress.error_feedback import ErrorFeedback
from distrain.errors import ConfigError

SETTINGS = AdaptiveSettings(base=0.01, min=0.001, max=0.1, beta=1.0, budget=1)  # the budget
ABSOLUTE = AdaptiveSettings(base=0.01, min=0.001, max=0.1, beta=1.0, budget=0)  # congestion only takes bytes away
LATENCY = 0.005


def step_messages(bits_per_s: float, body: int, latency: float = LATENCY) -> list[Exchange]:
    """One step of a sparse ring on one worker: per round a 24-byte header and a body, sent back
    to back on the uplink (the body queues behind the header), and the matching receives."""
    rate = bits_per_s / 8
    out = []
    for _ in range(6):
        out.append(Exchange("send", 24, 0, 0.05, latency + 24 / rate))
        out.append(Exchange("send", body, 0, 0.05, latency + (24 + body) / rate))
        out.append(Exchange("recv", 0, body, 0.05))
    out.append(Exchange("all_reduce", 4000, 4000, 0.02, 0.02))
    return out


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
    ("adaptive:alpha=-1", "alpha and beta"),
    ("adaptive:ema=1", "ema and fast"),
    ("adaptive:window=2.5", "window must be an integer"),
    ("adaptive:group=0", "window and group"),
    ("adaptive:budget=2", "budget must be 0 or 1"),
    ("adaptive:speed=3", "unknown option 'speed'"),
    ("adaptive:0.01:base=0.01", "once"),
])
def test_bad_specs_are_one_line_config_errors(spec, needle):
    with pytest.raises(ConfigError) as info:
        build_compressor(spec)
    message = str(info.value)
    assert "--compress" in message and needle in message and "\n" not in message


def test_constant_signals_give_base():
    assert policy_ratio(SETTINGS, 1.0, 1.0) == pytest.approx(0.01)
    policy = AdaptivePolicy(SETTINGS)
    losses = torch.full((32,), 1.7)
    for _ in range(50):
        policy.observe_losses(losses)
        policy.observe_exchanges(step_messages(50e6, 30_000))
    assert policy.importance == pytest.approx(1.0)
    assert policy.congestion == pytest.approx(1.0, rel=1e-6)
    assert policy.ratio() == pytest.approx(0.01, rel=1e-6)


def test_higher_importance_gives_a_larger_ratio_and_higher_congestion_a_smaller_one():
    importances = [0.5, 0.8, 1.0, 1.3, 2.0, 4.0]
    congestions = [1.0, 1.5, 3.0, 10.0]
    for c in congestions:
        ratios = [policy_ratio(SETTINGS, i, c) for i in importances]
        assert all(a <= b for a, b in itertools.pairwise(ratios)) and ratios[0] < ratios[-1], (c, ratios)
    for i in importances:
        ratios = [policy_ratio(SETTINGS, i, c) for c in congestions]
        assert all(a >= b for a, b in itertools.pairwise(ratios)) and ratios[0] > ratios[-1], (i, ratios)


def test_ratio_always_within_min_and_max():
    for i, c in itertools.product([0.0, 1e-6, 0.3, 1.0, 7.0, 1e9], [1.0, 2.0, 1e3, 1e12]):
        for settings in (SETTINGS, AdaptiveSettings(base=0.01, min=0.001, max=0.1, alpha=3, beta=0.5)):
            assert settings.min <= policy_ratio(settings, i, c) <= settings.max


def test_alpha_zero_and_beta_zero_switch_a_signal_off():
    network_only = AdaptiveSettings(base=0.01, min=0.001, max=0.1, alpha=0)
    importance_only = AdaptiveSettings(base=0.01, min=0.001, max=0.1, beta=0)
    assert policy_ratio(network_only, 3.0, 1.0) == pytest.approx(0.01)
    assert policy_ratio(importance_only, 1.0, 5.0) == pytest.approx(0.01)
    assert policy_ratio(importance_only, 2.0, 5.0) == pytest.approx(0.02)


def test_default_policy_sends_less_on_a_congested_link_and_more_for_a_hard_batch():
    default = parse_adaptive([], {"base": "0.01", "min": "0.001", "max": "0.1"})
    assert (default.alpha, default.beta, default.budget) == (1.0, 0.5, 0)
    assert policy_ratio(default, 1.0, 1.0) == pytest.approx(0.01)
    assert policy_ratio(default, 1.0, 10.0) == pytest.approx(0.01 / 10**0.5)
    assert policy_ratio(default, 2.0, 1.0) == pytest.approx(0.02)
    assert policy_ratio(default, 1.0, 1e6) == pytest.approx(0.001)  # never below min


def test_importance_is_batch_loss_over_its_moving_average():
    policy = AdaptivePolicy(SETTINGS)
    assert policy.observe_losses(torch.tensor([1.0, 3.0])) == 1.0  # the first batch: no history
    hard = policy.observe_losses(torch.tensor([4.0, 4.0]))
    assert hard == pytest.approx(2.0)  # 4 / 2
    ratio_hard = policy.ratio()
    easy = policy.observe_losses(torch.tensor([0.5, 0.5]))
    expected_ema = 0.9 * 2.0 + 0.1 * 4.0
    assert easy == pytest.approx(0.5 / expected_ema)
    assert policy.ratio() < SETTINGS.base < ratio_hard


def test_a_slower_link_raises_congestion_and_sending_less_does_not():
    policy = AdaptivePolicy(ABSOLUTE)
    for body in [30_000, 3_000, 60_000, 10_000] * 5:  # one bandwidth, varying payloads
        policy.observe_exchanges(step_messages(50e6, body))
    assert policy.congestion == pytest.approx(1.0, abs=0.05)
    ratios = []
    for _ in range(8):  # the link drops to a tenth: C climbs towards 10
        policy.observe_exchanges(step_messages(5e6, 30_000))
        ratios.append(policy.ratio())
    assert all(a >= b for a, b in itertools.pairwise(ratios))
    assert policy.congestion == pytest.approx(10.0, rel=0.05)
    assert ratios[-1] == pytest.approx(0.001, rel=0.1)
    for _ in range(12):  # back to 50 Mbit/s
        policy.observe_exchanges(step_messages(50e6, 30_000))
    assert policy.congestion == pytest.approx(1.0, abs=0.01)


def test_shared_baseline_makes_a_constantly_slow_worker_congested():
    fast, slow = AdaptivePolicy(SETTINGS), AdaptivePolicy(SETTINGS)
    for _ in range(10):
        fast.observe_exchanges(step_messages(50e6, 30_000))
        slow.observe_exchanges(step_messages(10e6, 30_000))
        assert slow.congestion == pytest.approx(1.0)  # alone it only knows its own history
    shared = [fast.shared_value(), 0.0, slow.shared_value()]  # 0: a worker that knows nothing yet
    for policy in (fast, slow):
        policy.observe_cluster(shared)
    assert fast.congestion == pytest.approx(1.0)
    assert slow.congestion == pytest.approx(5.0, rel=0.05)
    # the budget: bytes in proportion to the link's speed, the two together sending 2 * base
    assert fast.ratio() / slow.ratio() == pytest.approx(5.0, rel=0.05)
    assert fast.ratio() + slow.ratio() == pytest.approx(2 * SETTINGS.base, rel=1e-6)
    absolute = [AdaptivePolicy(ABSOLUTE) for _ in range(2)]
    for policy, bits in zip(absolute, (50e6, 10e6), strict=True):
        for _ in range(10):
            policy.observe_exchanges(step_messages(bits, 30_000))
    for policy in absolute:
        policy.observe_cluster([p.shared_value() for p in absolute])
    assert absolute[1].ratio() < absolute[0].ratio() == pytest.approx(0.01)


def test_budget_spends_the_base_ratio_on_average_and_moves_it_to_fast_links():
    # One worker's link alternates 10 steps at 50 Mbit/s and 30 at 5 Mbit/s; no sharing, so
    # its own recent steps make the budget. Over the run it sends about what fixed ``base``
    # sends, most of it while the link is fast; without the budget, mostly the minimum.
    means = {}
    for settings in (SETTINGS, ABSOLUTE):
        policy = AdaptivePolicy(settings)
        fast_ratios, slow_ratios = [], []
        for step in range(400):
            bits = 50e6 if step % 40 < 10 else 5e6
            policy.observe_exchanges(step_messages(bits, 30_000))
            if step >= 200:  # a full window of history
                (fast_ratios if bits == 50e6 else slow_ratios).append(policy.ratio())
                assert settings.min <= policy.ratio() <= settings.max
        means[settings.budget] = sum(fast_ratios + slow_ratios) / len(fast_ratios + slow_ratios)
        assert sum(fast_ratios) / len(fast_ratios) > sum(slow_ratios) / len(slow_ratios)
    assert means[1] == pytest.approx(SETTINGS.base, rel=0.15)
    assert means[0] < 0.5 * SETTINGS.base


def test_budget_gives_hard_batches_more_and_keeps_the_mean_at_base():
    torch.manual_seed(0)
    policy = AdaptivePolicy(SETTINGS)
    ratios, by_loss = [], []
    for step in range(600):
        level = 2.0 * 0.997 ** step  # a falling loss, so I < 1 on most batches
        losses = level * (1 + 0.3 * torch.randn(64).abs())
        policy.observe_losses(losses)
        ratios.append(policy.ratio())
        by_loss.append((policy.importance, ratios[-1]))
    assert sum(ratios[100:]) / len(ratios[100:]) == pytest.approx(SETTINGS.base, rel=0.02)
    ordered = [r for _, r in sorted(by_loss[100:])]  # by importance
    easy, hard = ordered[: len(ordered) // 4], ordered[-len(ordered) // 4 :]
    assert max(easy) < SETTINGS.base < min(hard)
    absolute = AdaptivePolicy(ABSOLUTE)
    for step in range(600):
        absolute.observe_losses(torch.full((64,), 2.0 * 0.997 ** step))
    assert absolute.ratio() < 0.999 * SETTINGS.base  # without the budget, a falling loss sends less


def test_metrics_and_state():
    policy = AdaptivePolicy(SETTINGS)
    policy.choose(torch.tensor([2.0]), None)
    policy.observe_exchanges(step_messages(50e6, 30_000))
    metrics = policy.metrics()
    assert set(metrics) == {"importance", "congestion", "delay_s_per_mb", "baseline_s_per_mb"}
    assert metrics["delay_s_per_mb"] == pytest.approx(8 / 50, rel=1e-3)  # s per MB at 50 Mbit/s
    other = AdaptivePolicy(SETTINGS)
    other.load_state_dict(policy.state_dict())
    assert other.loss_ema == policy.loss_ema == 2.0


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

