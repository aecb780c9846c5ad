"""Momentum correction and the per-step gradient averaging, on one process (a one-worker transport)."""

from __future__ import annotations

import pytest
import torch

from distrain.assemble import compression_settings
from distrain.comm.transport import TransportStats
from distrain.compress import CompressInfo, GroupTopK, MomentumCorrection, build_compressor
from distrain.compress.gradients import GradientCompression, take_momentum
from distrain.compress.warmup import DensityWarmup
from tests.conftest import small_config


class _Done:
    def wait(self) -> None:
        pass


class OneWorker:
    """The part of a Transport that a world of one uses: collectives are the identity."""

    rank, world_size = 0, 1
    stats = TransportStats(sent=[0], received=[0])

    def all_reduce(self, tensor: torch.Tensor) -> _Done:
        return _Done()

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> _Done:
        outputs[0].copy_(tensor)
        return _Done()


def from_config(cfg, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> GradientCompression | None:
    """What all-reduce builds from a run's config."""
    return GradientCompression.from_settings(compression_settings(cfg), params, opt, seed=cfg.run.seed)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))


def train(compression_spec: str | None, steps: int = 6, weight_decay: float = 0.0, **settings) -> torch.nn.Module:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)
    compression = None
    if compression_spec is not None:
        cfg = small_config("unused", compress=compression_spec, **settings)
        compression = from_config(cfg, list(m.parameters()), opt)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 30, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        if compression is not None:
            compression.average(OneWorker(), step=step, epochs_done=step / 3)
        opt.step()
    return m


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_momentum_correction_at_ratio_one_is_momentum_sgd(weight_decay):
    want = train(None, weight_decay=weight_decay)
    got = train("group_topk:1.0:group=64", weight_decay=weight_decay)
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_momentum_correction_changes_training_below_ratio_one_and_can_be_turned_off():
    want = train(None)
    sparse = train("group_topk:0.1:group=64")
    assert any(not torch.allclose(a, b) for a, b in zip(sparse.parameters(), want.parameters(), strict=True))
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    cfg = small_config("unused", compress="group_topk:0.1", momentum_correction="off")
    compression = from_config(cfg, list(m.parameters()), opt)
    assert not isinstance(compression.compressor, MomentumCorrection) and opt.param_groups[0]["momentum"] == 0.9
    cfg = small_config("unused", compress="qsgd:8bit")  # not a sparsifier: no momentum correction
    assert not isinstance(from_config(cfg, list(m.parameters()), opt).compressor, MomentumCorrection)


def test_one_dimensional_tensors_travel_dense_and_the_rest_sparse():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0)
    compression = GradientCompression(build_compressor("group_topk:0.05:group=100"), list(m.parameters()),
                                      DensityWarmup(0.05))
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    before = {n: p.grad.clone() for n, p in m.named_parameters()}
    compression.average(OneWorker(), step=0, epochs_done=0.0)
    for name, p in m.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p.grad, before[name]), name
        else:
            kept = int((p.grad != 0).sum())
            assert 0 < kept < 0.1 * p.numel(), (name, kept)
    assert opt.param_groups[0]["momentum"] == 0.0


def test_masking_zeroes_the_velocity_of_sent_coordinates_only_when_something_was_held_back():
    mc = MomentumCorrection(GroupTopK(0.1, group=10), momentum=0.9)
    g = torch.arange(1.0, 21.0)
    payload, ctx = mc.compress(g, CompressInfo(step=0))
    sent = payload[0]
    assert sent.tolist() == [9, 19]  # the largest of each group of 10
    assert bool((mc.velocities[0][sent] == 0).all()) and bool((mc.velocities[0][:9] == g[:9]).all())
    payload, _ = mc.compress(g, CompressInfo(step=1))
    assert payload[0].tolist() == [8, 18]  # index 8 had waited a step: 9 + 9 beats 10
    assert torch.equal(mc.velocities[0][:8], 0.9 * g[:8] + g[:8])  # momentum kept where nothing was sent
    dense = MomentumCorrection(GroupTopK(1.0, group=10), momentum=0.9)
    dense.compress(g, CompressInfo(step=0))
    assert torch.equal(dense.velocities[0], g)  # ratio 1 held nothing back: nothing masked
    state = mc.state_dict()
    assert {"residual.0", "velocity.0"} <= set(state)
    other = MomentumCorrection(GroupTopK(0.1, group=10), momentum=0.9)
    other.load_state_dict(state)
    assert torch.equal(other.velocities[0], mc.velocities[0]) and torch.equal(other.residuals[0], mc.residuals[0])


def test_without_masking_the_velocity_of_sent_coordinates_is_kept():
    g = torch.arange(1.0, 21.0)
    mc = MomentumCorrection(GroupTopK(0.1, group=10), momentum=0.9, masking=False)
    payload, _ = mc.compress(g, CompressInfo(step=0))
    assert payload[0].tolist() == [9, 19]
    assert torch.equal(mc.velocities[0], g)  # nothing zeroed: the sent coordinates keep their momentum
    mc.compress(g, CompressInfo(step=1))
    assert torch.equal(mc.velocities[0], 0.9 * g + g)


def test_take_momentum_only_from_plain_sgd():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert take_momentum(torch.optim.Adam(p)) == (0.0, 0.0)
    assert take_momentum(torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)) == (0.0, 0.0)
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4)
    assert take_momentum(sgd) == (0.9, 1e-4) and sgd.param_groups[0]["momentum"] == 0.0


def test_momentum_taken_once_is_taken_again_by_a_compression_built_again():
    """The survivors of a lost worker build their compression again over the same optimizer, and
    a resumed run loads the optimizer whose momentum was taken: momentum correction stays."""
    p = [torch.nn.Parameter(torch.zeros(4, 3))]
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4)
    settings = compression_settings(small_config("unused", compress="group_topk:0.25"))
    first = GradientCompression.from_settings(settings, p, sgd, seed=0)
    again = GradientCompression.from_settings(settings, p, sgd, seed=0)
    assert isinstance(first.compressor, MomentumCorrection) and isinstance(again.compressor, MomentumCorrection)
    assert again.compressor.momentum == 0.9 and again.weight_decay == 1e-4
    resumed = torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4)
    resumed.load_state_dict(sgd.state_dict())
    assert resumed.param_groups[0]["momentum"] == 0.0 and take_momentum(resumed) == (0.9, 1e-4)
    assert take_momentum(sgd) == (0.9, 1e-4) and sgd.param_groups[0]["weight_decay"] == 0.0


class FourSameWorkers:
    """Four workers holding the same tensors: a sum is four times the tensor; records the ops."""

    rank, world_size = 0, 4

    def __init__(self) -> None:
        self.stats = TransportStats(sent=[0] * 4, received=[0] * 4)
        self.ops: list[tuple[str, int]] = []

    def all_reduce(self, tensor: torch.Tensor) -> _Done:
        self.ops.append(("all_reduce", tensor.numel()))
        tensor.mul_(4)
        return _Done()

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> _Done:
        self.ops.append(("all_gather", tensor.numel()))
        for out in outputs:
            out.copy_(tensor)
        return _Done()


def test_all_gather_falls_back_to_dense_at_a_ratio_of_one_over_n_and_flushes_the_residual():
    m = model()
    numel = sum(p.numel() for p in m.parameters())
    compression = GradientCompression(build_compressor("group_topk:0.01:group=100"), list(m.parameters()),
                                      DensityWarmup(0.01, warmup=0, decay=2), sparse_collective="allgather")
    g = torch.Generator().manual_seed(3)
    first = [torch.randn(p.shape, generator=g) for p in m.parameters()]
    for p, grad in zip(m.parameters(), first, strict=True):
        p.grad = grad.clone()
    transport = FourSameWorkers()
    compression.average(transport, step=0, epochs_done=1.5)  # ratio 0.01 ** 0.75 = 0.03: sparse
    assert {op for op, _ in transport.ops} == {"all_gather"} and compression.ratio < 0.25
    sent_first = [p.grad.clone() for p in m.parameters()]
    second = [torch.randn(p.shape, generator=g) for p in m.parameters()]
    for p, grad in zip(m.parameters(), second, strict=True):
        p.grad = grad.clone()
    transport.ops.clear()
    compression.average(transport, step=1, epochs_done=0.5)  # ratio 0.01 ** 0.25 = 0.32 >= 1 / 4: dense
    assert transport.ops == [("all_reduce", numel)] and compression.ratio == 1.0
    for p, a, b, s in zip(m.parameters(), first, second, sent_first, strict=True):
        want = b + (a - s) if p.dim() > 1 else b  # the held-back part of the first step arrives now
        torch.testing.assert_close(p.grad, want)
    assert all(not r.any() for r in compression.compressor.residuals.values())
