"""Learning-rate scaling and schedules, and the optimizers (SGD, Adam, LARS) they drive."""

from __future__ import annotations

import io
import math
from itertools import pairwise

import pytest
import torch

from distrain.errors import ConfigError
from distrain.optim.optimizers import LARS, OPTIMIZERS, build_optimizer
from distrain.optim.schedule import DECAYS, LRSchedule, scaled_lr

# --- scaled_lr ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "global_batch", "reference", "expected"),
    [(0.1, 256, 64, 0.4), (0.1, 32, 64, 0.05), (0.2, 256, 256, 0.2), (0.05, 1024, 256, 0.2)],
)
def test_scaled_lr_linear_rule(base, global_batch, reference, expected):
    assert scaled_lr(base, global_batch, reference) == pytest.approx(expected, rel=1e-12)


def test_scaled_lr_disabled_returns_base():
    assert scaled_lr(0.1, 1024, 64, enabled=False) == 0.1


@pytest.mark.parametrize(
    ("args", "setting"),
    [
        ((0.0, 64, 64), "--lr"),
        ((-0.1, 64, 64), "--lr"),
        ((math.nan, 64, 64), "--lr"),
        ((0.1, 0, 64), "--batch-size"),
        ((0.1, 64, 0), "--reference-batch"),
    ],
)
def test_scaled_lr_rejects_bad_values(args, setting):
    with pytest.raises(ConfigError) as info:
        scaled_lr(*args)
    assert info.value.setting == setting


# --- LRSchedule -----------------------------------------------------------------------------------


def test_warmup_endpoints_and_midpoint():
    s = LRSchedule(peak_lr=0.4, base_lr=0.1, warmup_steps=60, total_steps=900, decay="cosine")
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(30) == pytest.approx(0.25)
    assert s.lr_at(60) == pytest.approx(0.4)


def test_warmup_is_strictly_increasing():
    s = LRSchedule(peak_lr=1.0, base_lr=0.0, warmup_steps=20, total_steps=100, decay="none")
    lrs = [s.lr_at(k) for k in range(21)]
    assert all(b > a for a, b in pairwise(lrs))
    assert lrs[0] == 0.0 and lrs[-1] == 1.0


def test_no_warmup_starts_at_peak():
    s = LRSchedule(peak_lr=0.3, base_lr=0.1, warmup_steps=0, total_steps=10, decay="none")
    assert [s.lr_at(k) for k in (0, 5, 10, 50)] == [0.3, 0.3, 0.3, 0.3]


def test_cosine_decay_reaches_zero():
    s = LRSchedule(peak_lr=0.4, base_lr=0.1, warmup_steps=100, total_steps=1100, decay="cosine")
    assert s.lr_at(100) == pytest.approx(0.4)
    assert s.lr_at(600) == pytest.approx(0.2)  # halfway through the decay
    assert s.lr_at(350) == pytest.approx(0.2 * (1 + math.cos(math.pi / 4)))
    assert abs(s.lr_at(1100)) < 1e-12
    assert abs(s.lr_at(5000)) < 1e-12
    decay = [s.lr_at(k) for k in range(100, 1101)]
    assert all(b <= a for a, b in pairwise(decay))


def test_step_decay_points():
    s = LRSchedule(peak_lr=1.0, base_lr=0.1, warmup_steps=10, total_steps=100, decay="step")
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(49) == pytest.approx(1.0)
    assert s.lr_at(50) == pytest.approx(0.1)
    assert s.lr_at(74) == pytest.approx(0.1)
    assert s.lr_at(75) == pytest.approx(0.01)
    assert s.lr_at(1000) == pytest.approx(0.01)


def test_apply_sets_every_group_and_returns_lr():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1.0)
    s = LRSchedule(peak_lr=0.4, base_lr=0.0, warmup_steps=4, total_steps=8, decay="none")
    assert s.apply(optimizer, 1) == pytest.approx(0.1)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.1)] * 2


def test_decays_listed():
    assert DECAYS == ("cosine", "none", "step")


@pytest.mark.parametrize(
    ("kwargs", "setting", "fragment"),
    [
        (
            {"decay": "linear"},
            "--lr-decay",
            "unknown decay 'linear'; choose one of: cosine, none, step",
        ),
        ({"warmup_steps": -1}, "--warmup-epochs", "must be >= 0"),
        ({"warmup_steps": 1.5}, "--warmup-epochs", "whole number of steps"),
        ({"total_steps": 0}, "--epochs", "integer >= 1"),
        ({"peak_lr": 0.0}, "--lr", "> 0"),
        ({"base_lr": -1.0}, "--lr", ">= 0"),
        ({"peak_lr": math.inf}, "--lr", "finite"),
    ],
)
def test_schedule_rejects_bad_values(kwargs, setting, fragment):
    args = {"peak_lr": 0.4, "base_lr": 0.1, "warmup_steps": 5, "total_steps": 50, "decay": "none"}
    with pytest.raises(ConfigError) as info:
        LRSchedule(**{**args, **kwargs})
    assert info.value.setting == setting
    assert fragment in info.value.message


def test_warmup_longer_than_run_warns():
    with pytest.warns(UserWarning, match="never reaches its peak"):
        s = LRSchedule(peak_lr=1.0, base_lr=0.0, warmup_steps=20, total_steps=10)
    assert s.lr_at(10) == pytest.approx(0.5)


def test_negative_step_is_an_error():
    s = LRSchedule(peak_lr=1.0, base_lr=0.0, warmup_steps=0, total_steps=10)
    with pytest.raises(ValueError):
        s.lr_at(-1)


# --- build_optimizer ------------------------------------------------------------------------------


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.zeros(3))]


def test_optimizer_names():
    assert OPTIMIZERS == ("adam", "lars", "sgd")


def test_build_sgd_adam_lars():
    sgd = build_optimizer("sgd", _params(), lr=0.1, momentum=0.8, weight_decay=1e-4)
    assert isinstance(sgd, torch.optim.SGD)
    group = sgd.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]) == (
        0.1,
        0.8,
        1e-4,
        False,
    )
    adam = build_optimizer("adam", _params(), lr=1e-3, momentum=0.85)
    assert isinstance(adam, torch.optim.Adam)
    assert adam.param_groups[0]["betas"] == (0.85, 0.999)
    lars = build_optimizer("lars", _params(), lr=2.0, trust_coefficient=0.02)
    assert isinstance(lars, LARS)
    assert lars.param_groups[0]["trust_coefficient"] == 0.02


def test_unknown_optimizer_lists_choices():
    with pytest.raises(ConfigError) as info:
        build_optimizer("x", _params(), lr=0.1)
    assert str(info.value) == "--optimizer: unknown optimizer 'x'; choose one of: adam, lars, sgd"


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"lr": 0.0}, "--lr"),
        ({"momentum": 1.0}, "--momentum"),
        ({"momentum": -0.1}, "--momentum"),
        ({"weight_decay": -1e-4}, "--weight-decay"),
        ({"trust_coefficient": 0.0}, "--trust-coefficient"),
    ],
)
def test_build_optimizer_rejects_bad_values(kwargs, setting):
    with pytest.raises(ConfigError) as info:
        build_optimizer("lars", _params(), **{"lr": 0.1, **kwargs})
    assert info.value.setting == setting


# --- LARS -----------------------------------------------------------------------------------------


def _lars_reference_step(p, g, v, lr, momentum, wd, eta, eps=1e-8):
    """One LARS step written out from the formula, in float64."""
    p_norm, g_norm = p.norm().item(), g.norm().item()
    local_lr = eta * p_norm / (g_norm + wd * p_norm + eps) if p_norm > 0 and g_norm > 0 else 1.0
    v = momentum * v + lr * local_lr * (g + wd * p)
    return p - v, v


def test_lars_matches_formula_over_two_steps():
    p0 = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64)
    grads = [
        torch.tensor([[0.5, -1.0], [0.25, 2.0]], dtype=torch.float64),
        torch.tensor([[-0.3, 0.1], [0.7, -0.2]], dtype=torch.float64),
    ]
    lr, momentum, wd, eta = 0.5, 0.9, 0.1, 0.02

    param = torch.nn.Parameter(p0.clone())
    optimizer = LARS([param], lr=lr, momentum=momentum, weight_decay=wd, trust_coefficient=eta)
    p_ref, v_ref = p0.clone(), torch.zeros_like(p0)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
        p_ref, v_ref = _lars_reference_step(p_ref, g, v_ref, lr, momentum, wd, eta)
        torch.testing.assert_close(param.detach(), p_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(optimizer.state[param]["momentum_buffer"], v_ref)


def test_lars_update_scales_with_weight_norm():
    g = torch.tensor([[0.3, -0.6, 0.9]])
    deltas = []
    for scale in (1.0, 10.0):
        p0 = scale * torch.tensor([[1.0, 2.0, -2.0]])
        param = torch.nn.Parameter(p0.clone())
        optimizer = LARS([param], lr=1.0, momentum=0.0, trust_coefficient=0.01)
        param.grad = g.clone()
        optimizer.step()
        deltas.append(param.detach() - p0)
    torch.testing.assert_close(deltas[1], 10 * deltas[0])
    # the step moves the tensor by lr * eta of its norm, whatever the gradient's size
    assert deltas[0].norm().item() == pytest.approx(0.01 * 3.0, rel=1e-5)


def test_lars_excludes_1d_params_from_adaptation_and_weight_decay():
    bias = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    g = torch.tensor([0.5, 0.5, -1.0])
    optimizer = LARS([bias], lr=0.1, momentum=0.0, weight_decay=0.5, trust_coefficient=0.001)
    bias.grad = g.clone()
    optimizer.step()
    torch.testing.assert_close(bias.detach(), torch.tensor([1.0, -2.0, 3.0]) - 0.1 * g)


def test_lars_adapts_1d_params_when_not_excluded():
    p0 = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    g = torch.tensor([0.5, 0.5, -1.0], dtype=torch.float64)
    bias = torch.nn.Parameter(p0.clone())
    optimizer = LARS([bias], lr=0.1, momentum=0.0, weight_decay=0.5, exclude_1d=False)
    bias.grad = g.clone()
    optimizer.step()
    expected, _ = _lars_reference_step(p0, g, torch.zeros_like(p0), 0.1, 0.0, 0.5, 0.001)
    torch.testing.assert_close(bias.detach(), expected)


def test_lars_zero_weights_take_a_plain_step():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    g = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    optimizer = LARS([param], lr=0.1, momentum=0.9, weight_decay=0.1)
    param.grad = g.clone()
    optimizer.step()
    torch.testing.assert_close(param.detach(), -0.1 * g)


def test_lars_converges_on_least_squares():
    torch.manual_seed(0)
    a = torch.randn(64, 8)
    w_true = torch.randn(8, 1)
    b = a @ w_true
    w = torch.nn.Parameter(torch.randn(8, 1))
    steps = 400
    optimizer = LARS([w], lr=20.0, momentum=0.9, trust_coefficient=0.001)
    schedule = LRSchedule(
        peak_lr=20.0, base_lr=2.0, warmup_steps=20, total_steps=steps, decay="cosine"
    )
    initial = torch.mean((a @ w - b) ** 2).item()
    for step in range(steps):
        schedule.apply(optimizer, step)
        optimizer.zero_grad()
        torch.mean((a @ w - b) ** 2).backward()
        optimizer.step()
    final = torch.mean((a @ w - b) ** 2).item()
    assert final < 1e-4 * initial
    torch.testing.assert_close(w.detach(), w_true, rtol=0, atol=0.02)


def test_lars_state_dict_round_trip():
    torch.manual_seed(0)
    model_a = torch.nn.Linear(4, 3)
    model_b = torch.nn.Linear(4, 3)
    model_b.load_state_dict(model_a.state_dict())
    x = torch.randn(16, 4)
    opt_a = LARS(model_a.parameters(), lr=1.0, momentum=0.9, weight_decay=1e-3)
    for _ in range(3):
        opt_a.zero_grad()
        model_a(x).square().mean().backward()
        opt_a.step()
    # through bytes, as a checkpoint would: state_dict() shares the live momentum buffers
    blob = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "optimizer": opt_a.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    model_b.load_state_dict(saved["model"])
    opt_b = LARS(model_b.parameters(), lr=0.5)
    opt_b.load_state_dict(saved["optimizer"])
    assert opt_b.param_groups[0]["lr"] == 1.0
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


# --- lr_schedule: the samples of one optimizer step -----------------------------------------------

@pytest.mark.parametrize("workers", [2, 4])
def test_diloco_scales_its_inner_steps_for_one_workers_batch(workers):
    """All-reduce's step averages the workers' gradients (the global batch); DiLoCo's inner
    optimizer steps on each worker's own batch, so its rate is one worker's and stays the same
    when the members change. torchft's DiLoCo and LocalSGD baselines step the same way."""
    from distrain.baselines import build_peer
    from distrain.config import TrainConfig
    from distrain.train.loop import lr_schedule

    cfg = TrainConfig(lr=0.1, batch_size=32, reference_batch=64)
    synced, global_batch = lr_schedule(cfg, workers, 10, 100)
    assert global_batch == workers * 32 and synced.peak_lr == pytest.approx(0.1 * workers * 32 / 64)
    cfg = TrainConfig(algorithm="diloco", lr=0.1, batch_size=32, reference_batch=64)
    local, global_batch = lr_schedule(cfg, workers, 10, 100)
    assert global_batch == workers * 32 and local.peak_lr == pytest.approx(0.1 * 32 / 64)
    assert build_peer("torchft-diloco").local_steps and build_peer("torchft-localsgd").local_steps
    assert not build_peer("ddp").local_steps
