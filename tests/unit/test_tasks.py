"""Tasks: the per-sample losses and evaluation metrics every loop takes from one place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distrain.config import TrainConfig
from distrain.errors import ConfigError
from distrain.tasks import TASKS, Classification, Regression, build_task, check_task_data


def test_classification_is_per_sample_cross_entropy_and_accuracy():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(50, 5, generator=g), torch.randint(0, 3, (50,), generator=g)
    task = build_task("classification")
    torch.testing.assert_close(task.losses(model(x), y), F.cross_entropy(model(x), y, reduction="none"))
    model.train()
    got = task.evaluate(model, TensorDataset(x, y), torch.device("cpu"), batch_size=7)  # 8 uneven batches
    with torch.no_grad():
        want_acc = (model(x).argmax(1) == y).float().mean().item()
        want_loss = F.cross_entropy(model(x), y).item()
    assert got["test_accuracy"] == pytest.approx(want_acc, abs=1e-6)  # want_acc went through float32
    assert got["test_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert model.training  # its mode is restored


@pytest.mark.parametrize("out_shape, target_shape", [((6, 1), (6,)), ((6, 3), (6, 3)), ((6,), (6,))])
def test_regression_is_the_mean_squared_error_of_each_sample(out_shape, target_shape):
    g = torch.Generator().manual_seed(1)
    out, target = torch.randn(*out_shape, generator=g), torch.randn(*target_shape, generator=g)
    losses = Regression().losses(out, target)
    assert losses.shape == (6,)
    want = ((out.reshape(6, -1) - target.reshape(6, -1)) ** 2).mean(1)
    torch.testing.assert_close(losses, want)


def test_regression_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"output \(4, 2\) does not match the targets \(4, 3\)"):
        Regression().losses(torch.zeros(4, 2), torch.zeros(4, 3))


def test_regression_evaluates_the_test_loss_only():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 4, generator=g)
    y = x.sum(1)
    model = torch.nn.Linear(4, 1)
    got = Regression().evaluate(model, TensorDataset(x, y), torch.device("cpu"), batch_size=8)
    with torch.no_grad():
        want = ((model(x).squeeze(1) - y) ** 2).mean().item()
    assert set(got) == {"test_loss"} and got["test_loss"] == pytest.approx(want, rel=1e-6)


def test_a_user_loss_gives_per_sample_losses_from_a_mean_or_per_sample():
    out, y = torch.randn(5, 3), torch.randint(0, 3, (5,))
    per_sample = build_task("classification", lambda o, t: F.cross_entropy(o, t, reduction="none", label_smoothing=0.1))
    torch.testing.assert_close(per_sample.losses(out, y), F.cross_entropy(out, y, reduction="none", label_smoothing=0.1))
    mean = build_task("regression", lambda o, t: F.l1_loss(o.squeeze(-1), t.float()))
    assert mean.losses(out[:, :1], y).shape == (5,)
    torch.testing.assert_close(mean.losses(out[:, :1], y), F.l1_loss(out[:, 0], y.float()).expand(5))
    assert per_sample.classes and not mean.classes  # accuracy still reported for classification


def test_the_target_is_the_loss_when_one_is_set_else_the_accuracy():
    c, r = Classification(), Regression()
    assert c.reached({"test_accuracy": 0.96, "test_loss": 0.3}, 0.95, None)
    assert not c.reached({"test_accuracy": 0.94, "test_loss": 0.01}, 0.95, None)
    assert not c.reached({"test_accuracy": 0.99, "test_loss": 0.3}, 0.95, 0.2)  # the loss decides
    assert r.reached({"test_loss": 0.2}, 0.95, 0.2) and not r.reached({"test_loss": 0.21}, 0.95, 0.2)
    assert not r.reached({"test_loss": 0.0}, 0.95, None)  # regression without a loss target: none


def test_settings_for_tasks_are_checked():
    assert set(TASKS) == {"classification", "regression", "lm"}
    with pytest.raises(ConfigError, match="--task: unknown value 'ranking'"):
        TrainConfig.from_dict({"task": "ranking"}).validate()
    with pytest.raises(ConfigError, match="--partition: dirichlet splits by class"):
        TrainConfig.from_dict({"task": "regression", "partition": "dirichlet"}).validate()
    with pytest.raises(ConfigError, match="--target-loss"):
        TrainConfig.from_dict({"target_loss": -1.0}).validate()
    with pytest.raises(ConfigError, match="--task: regression trains on your own data set"):
        check_task_data("regression", None)
    check_task_data("regression", TensorDataset(torch.zeros(2, 1), torch.zeros(2)))
    check_task_data("classification", None)
