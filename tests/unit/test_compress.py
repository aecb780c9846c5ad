"""Compressors: round trips, error bounds, exact selection, unbiasedness, wire sizes, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.compress import (
    QSGD,
    CompressInfo,
    DensityWarmup,
    ErrorFeedback,
    FP16Compressor,
    GroupTopK,
    NoneCompressor,
    RandomK,
    TopK,
    build_compressor,
    payload_nbytes,
)

SPECS = ["none", "fp16", "bf16", "topk:0.1", "randomk:0.1", "group_topk:0.1:group=16", "qsgd:8bit", "qsgd:4bit",
         "sparseloco:0.1:chunk=16"]
SHAPES = [(1,), (37,), (5, 7, 3), (2, 1000)]


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("error_feedback", [False, True])
def test_round_trip_keeps_shape_and_dtype(spec, error_feedback):
    c = build_compressor(spec, error_feedback=error_feedback)
    for shape in SHAPES:
        for dtype in (torch.float32, torch.float64):
            x = randn(*shape, dtype=dtype)
            payload, ctx = c.compress(x, CompressInfo(step=1))
            assert all(isinstance(t, torch.Tensor) for t in payload)
            y = c.decompress(payload, ctx)
            assert y.shape == x.shape and y.dtype == x.dtype, (spec, shape, dtype)
            assert torch.isfinite(y).all()


@pytest.mark.parametrize("spec", SPECS)
def test_zeros_give_finite_zeros(spec):
    c = build_compressor(spec, error_feedback=False)
    x = torch.zeros(3, 50)
    payload, ctx = c.compress(x, CompressInfo())
    assert torch.equal(c.decompress(payload, ctx), x)


def test_none_is_exact_and_half_precision_is_within_rounding():
    x = randn(10_000) * 100
    payload, ctx = NoneCompressor().compress(x, CompressInfo())
    assert torch.equal(NoneCompressor().decompress(payload, ctx), x)
    for dtype, mantissa_bits in ((torch.float16, 11), (torch.bfloat16, 8)):
        c = FP16Compressor(dtype)
        payload, ctx = c.compress(x, CompressInfo())
        assert payload[0].dtype == dtype
        err = (c.decompress(payload, ctx) - x).abs()
        # round to nearest: at most half a unit in the last place, relative 2^-mantissa_bits
        assert bool((err <= x.abs() * 2.0**-mantissa_bits).all()), (dtype, float((err / x.abs()).max()))
        assert float(err.max()) > 0  # and it is lossy


def test_topk_keeps_exactly_the_k_largest():
    x = randn(1000)
    c = TopK(0.05)
    payload, ctx = c.compress(x, CompressInfo())
    expected = set(x.abs().argsort(descending=True)[:50].tolist())
    assert set(payload[0].tolist()) == expected
    y = c.decompress(payload, ctx)
    kept = torch.tensor(sorted(expected))
    assert torch.equal(y[kept], x[kept]) and int((y != 0).sum()) == 50


@pytest.mark.parametrize("numel,group,ratio", [(1000, 64, 0.1), (1024, 1024, 0.01), (1000, 1, 0.3), (77, 100, 0.5), (4100, 1024, 0.003)])
def test_group_topk_keeps_exactly_the_k_largest_of_each_group(numel, group, ratio):
    x = randn(numel, seed=numel)
    c = GroupTopK(ratio, group=group)
    payload, ctx = c.compress(x, CompressInfo())
    y = c.decompress(payload, ctx)
    assert payload[0].numel() == c.kept_count(numel)
    for start in range(0, numel, group):
        part = x[start : start + group]
        k = max(1, round(ratio * part.numel()))  # the documented rule, also for a short last group
        want = set((part.abs().argsort(descending=True)[:k] + start).tolist())
        got = set(i for i in payload[0].tolist() if start <= i < start + group)
        assert got == want, (start, k)
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[payload[0]] = True
    assert torch.equal(y[mask], x[mask]) and bool((y[~mask] == 0).all())


def test_randomk_is_unbiased_after_scaling_and_shares_indices():
    x = randn(200)
    c = RandomK(0.1, seed=3)
    trials = 4000
    total = torch.zeros_like(x, dtype=torch.float64)
    for step in range(trials):
        payload, ctx = c.compress(x, CompressInfo(step=step, worker=step % 4))
        assert payload[0].numel() == 20
        total += c.decompress(payload, ctx).double()
    mean = total / trials
    # Each element is x / p with probability p = 0.1, else 0: std of the mean is |x| sqrt((1/p - 1) / trials).
    std = x.abs().double() * math.sqrt((1 / 0.1 - 1) / trials)
    assert bool(((mean - x.double()).abs() <= 5 * std + 1e-12).all())
    assert float((mean - x.double()).abs().max()) > 0  # a real estimate, not the identity
    # the same indices on every worker at a step, different ones at the next step
    _, a = c.compress(x, CompressInfo(step=7, key=1, worker=0))
    _, b = c.compress(x, CompressInfo(step=7, key=1, worker=3))
    _, d = c.compress(x, CompressInfo(step=8, key=1, worker=0))
    assert torch.equal(a.indices, b.indices) and not torch.equal(a.indices, d.indices)


@pytest.mark.parametrize("bits", [8, 4])
def test_qsgd_is_unbiased_with_bounded_error(bits):
    x = randn(301)
    c = QSGD(bits, seed=1)
    levels = 2 ** (bits - 1) - 1
    scale = float(x.abs().max())
    trials = 2000
    total = torch.zeros(301, dtype=torch.float64)
    for step in range(trials):
        payload, ctx = c.compress(x, CompressInfo(step=step))
        y = c.decompress(payload, ctx)
        assert float((y - x).abs().max()) <= scale / levels * (1 + 1e-5)
        total += y.double()
    # Rounding up or down by one level (scale / levels): the std of one draw is at most half of that.
    bound = 5 * 0.5 * scale / levels / math.sqrt(trials)
    assert float((total / trials - x.double()).abs().max()) <= bound
    assert payload[1].dtype == torch.uint8 and payload[1].numel() == math.ceil(301 * bits / 8)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", [1, 999, 4096])
def test_wire_bytes_match_payload_bytes(spec, numel):
    c = build_compressor(spec, error_feedback=False)
    payload, _ = c.compress(randn(numel), CompressInfo())
    assert c.wire_bytes(numel) == payload_nbytes(payload)
    if c.ratio is not None:  # a per-call ratio changes both alike
        payload, _ = c.compress(randn(numel), CompressInfo(ratio=0.5))
        assert c.wire_bytes(numel, ratio=0.5) == payload_nbytes(payload)


@pytest.mark.parametrize("spec", ["topk:0.01", "group_topk:0.01:group=100", "randomk:0.01", "qsgd:4bit"])
def test_error_feedback_sends_every_coordinate_and_tracks_the_true_sum(spec):
    z = randn(1000, seed=5)
    g = torch.sign(z) * (0.5 + z.abs())  # no coordinate so small that it would wait for ages
    ef = build_compressor(spec, error_feedback=True)
    assert isinstance(ef, ErrorFeedback)
    sent_sum = torch.zeros(1000, dtype=torch.float64)
    ever_sent = torch.zeros(1000, dtype=torch.bool)
    errors = {}
    for step in range(1, 2001):
        payload, ctx = ef.compress(g, CompressInfo(step=step))
        sent = ef.decompress(payload, ctx)
        sent_sum += sent.double()
        ever_sent |= sent != 0
        if step in (200, 2000):
            errors[step] = float((sent_sum - step * g.double()).norm() / (step * g.double().norm()))
            # the identity behind it: what was sent plus what is held back is everything
            torch.testing.assert_close(sent_sum + ef.residuals[0].double(), step * g.double(), rtol=1e-4, atol=1e-2)
    assert bool(ever_sent.all()), int((~ever_sent).sum())
    # The lag (what is still held back) stays bounded, so relative to the true sum it fades
    # like 1 / steps: ten times the steps, well under three times the lag.
    assert errors[2000] < 0.1 and errors[2000] * 2000 < 3 * errors[200] * 200, errors

    plain = build_compressor(spec, error_feedback=False)
    if isinstance(plain, (TopK, GroupTopK)):  # without memory the same coordinates go every time, the rest never
        payload, ctx = plain.compress(g, CompressInfo(step=1))
        again, ctx2 = plain.compress(g, CompressInfo(step=2))
        assert torch.equal(payload[0], again[0])


def test_error_feedback_state_round_trips_with_tensors_only():
    ef = build_compressor("group_topk:0.05:group=50")
    for step in range(3):
        ef.compress(randn(500, seed=step), CompressInfo(step=step, key=0))
        ef.compress(randn(20, seed=step), CompressInfo(step=step, key=4))
    state = ef.state_dict()
    assert set(state) == {"residual.0", "residual.4"} and all(isinstance(v, torch.Tensor) for v in state.values())
    other = build_compressor("group_topk:0.05:group=50")
    other.load_state_dict(state)
    x = randn(500, seed=9)
    p1, _ = ef.compress(x, CompressInfo(step=3))
    p2, _ = other.compress(x, CompressInfo(step=3))
    assert torch.equal(p1[0], p2[0]) and torch.equal(p1[1], p2[1])


def test_randomk_under_error_feedback_sends_raw_values():
    ef = build_compressor("randomk:0.1")
    assert isinstance(ef, ErrorFeedback) and isinstance(ef.inner, RandomK) and not ef.inner.unbiased
    assert build_compressor("randomk:0.1", error_feedback=False).unbiased
    assert isinstance(build_compressor("none"), NoneCompressor)  # nothing to feed back


def test_density_warmup_schedule():
    s = DensityWarmup(target=0.01, warmup=2.0, decay=4.0)
    assert s.dense(0.0) and s.dense(1.99) and not s.dense(2.0)
    assert s.ratio(2.0) == pytest.approx(1.0)
    assert s.ratio(4.0) == pytest.approx(0.1)
    assert s.ratio(6.0) == pytest.approx(0.01) and s.ratio(100.0) == 0.01
    ratios = [s.ratio(2.0 + i / 10) for i in range(41)]
    assert all(a > b for a, b in zip(ratios, ratios[1:], strict=False))  # strictly falling over the decay span
    assert DensityWarmup(target=0.05).ratio(0.0) == 0.05 and not DensityWarmup(target=0.05).dense(0.0)
    assert DensityWarmup(target=None, warmup=1.0, decay=3.0).ratio(1.5) is None


def test_density_hold_keeps_the_ratio_up_then_falls_to_the_target():
    plain = DensityWarmup(target=0.01, warmup=1.0, decay=2.0)
    held = DensityWarmup(target=0.01, warmup=1.0, decay=2.0, hold=0.05, hold_until=6.0)
    assert held.dense(0.5) and held.ratio(1.0) == pytest.approx(1.0)  # the warm-up is the plain one
    assert held.ratio(2.0) == pytest.approx(plain.ratio(2.0))  # above the hold: the warm-up's own fall
    assert plain.ratio(3.5) == 0.01 and held.ratio(3.5) == 0.05 and held.ratio(5.99) == 0.05
    assert held.ratio(7.0) == pytest.approx(0.05 * (0.01 / 0.05) ** 0.5)  # halfway down over the decay's 2 epochs
    assert held.ratio(8.0) == pytest.approx(0.01) and held.ratio(50.0) == pytest.approx(0.01)
    ratios = [held.ratio(6.0 + i / 10) for i in range(21)]
    assert all(a > b for a, b in zip(ratios, ratios[1:], strict=False))
    assert DensityWarmup(target=0.1, warmup=1.0, decay=2.0, hold=0.05, hold_until=6.0).ratio(4.0) == 0.1  # below the target: no hold


def test_the_hold_applies_to_sparsifiers_on_the_default_warmup_only():
    from distrain.assemble import compression_settings
    from distrain.config import SPARSIFIER_HOLD, TrainConfig

    def settings(**kw):
        return compression_settings(TrainConfig.from_dict(kw).validate())

    default = settings(compress="group_topk:0.01")
    assert (default.density_hold, default.density_hold_until) == SPARSIFIER_HOLD[:2] and not default.momentum_masking
    short = settings(compress="group_topk:0.01", epochs=5)
    assert short.density_hold_until == pytest.approx(SPARSIFIER_HOLD[2] * 5)  # a short run keeps most of it at the target
    for kw in ({"compress": "group_topk:0.01", "density_warmup_epochs": 1.0},
               {"compress": "group_topk:0.01", "density_decay_epochs": 2.0}, {"compress": "fp16"}, {}):
        other = settings(**kw)
        assert other.density_hold == 0.0 and other.momentum_masking, kw  # as set: the schedule and masking as before
    assert settings(compress="group_topk:0.01").warmup(0.01).ratio(4.0) == SPARSIFIER_HOLD[0]


@pytest.mark.parametrize("spec", ["topk:0.05", "group_topk:0.05:group=64"])
def test_error_feedback_of_a_sparsifier_matches_compensate_minus_sent(spec):
    """The in-place residual of sparsifiers that send their input's values is exactly the
    reference ``(g + residual) - decompress(payload)``, step after step, and the input is untouched."""
    ef = build_compressor(spec, error_feedback=True)
    assert ef.inner.keeps_values
    reference = torch.zeros(300)
    for step in range(5):
        g = randn(300, seed=step)
        before = g.clone()
        compensated = g + reference
        payload, ctx = ef.compress(g, CompressInfo(step=step))
        reference = compensated - ef.decompress(payload, ctx)
        assert torch.equal(ef.residuals[0], reference) and torch.equal(g, before)
        assert torch.equal(payload[1], compensated[payload[0]])


@pytest.mark.parametrize("inner", [lambda: GroupTopK(0.05, group=64), lambda: build_compressor("int4", error_feedback=False)])
def test_error_feedback_decays_the_residual_before_adding(inner):
    """With ``residual_decay`` D each step compresses ``g + D e`` and keeps ``(g + D e) - sent``,
    for sparsifiers (in place) and for the others alike."""
    compressor = inner()
    compressor.residual_decay = 0.5
    ef = ErrorFeedback(compressor)
    reference = torch.zeros(300)
    for step in range(5):
        g = randn(300, seed=step)
        meant = g + 0.5 * reference
        payload, ctx = ef.compress(g, CompressInfo(step=step))
        sent = ef.decompress(payload, ctx)
        torch.testing.assert_close(sent + ef.residuals[0], meant, rtol=0, atol=1e-6)
        reference = meant - sent
    assert float(reference.abs().max()) > 0  # something was held back and decayed


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("spec", ["group_topk:0.05:group=64", "int8", "qsgd:4bit"])
def test_error_feedback_residuals_live_in_cpu_memory_when_asked(spec, device):
    ef = build_compressor(spec, residual_device="cpu")  # DiLoCo's pseudo-gradients
    reference = torch.zeros(500, dtype=torch.float64)
    for step in range(3):
        g = randn(500, seed=step).to(device)
        meant = g.double().cpu() + reference
        payload, ctx = ef.compress(g, CompressInfo(step=step))
        sent = ef.decompress(payload, ctx)
        assert sent.device.type == device and ef.residuals[0].device.type == "cpu"
        reference = meant - sent.double().cpu()
        torch.testing.assert_close(ef.residuals[0].double(), reference, rtol=0, atol=1e-6)
    other = build_compressor(spec, residual_device="cpu")
    other.load_state_dict({k: v.to(device) for k, v in ef.state_dict().items()})
    assert other.residuals[0].device.type == "cpu" and torch.equal(other.residuals[0], ef.residuals[0])
    kept = build_compressor(spec)  # by default on the tensor's device
    kept.compress(randn(500).to(device), CompressInfo())
    assert kept.residuals[0].device.type == device
