"""wrap() and fit() refuse arguments of the wrong kind in one line naming the argument, before
any process group or worker exists (they used to fail later, deep inside a step or a worker)."""

from __future__ import annotations

import pytest
import torch

import distrain
from distrain.errors import ConfigError


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


@pytest.mark.parametrize("make,named", [
    (lambda m, o: ("not a model", o, {}), "^model: must be a torch.nn.Module, got str"),
    (lambda m, o: (m, "not an optimizer", {}), "^optimizer: must be a torch.optim.Optimizer"),
    (lambda m, o: (m, torch.optim.SGD(_model().parameters(), lr=0.1), {}), "^optimizer: steps none of the model's"),
    (lambda m, o: (m, o, {"config": {"algorithm": "dpsgd"}}), "^config: must be a distrain.TrainConfig, got dict"),
])
def test_wrap_refuses_arguments_of_the_wrong_kind(make, named):
    model = _model()
    model_arg, optimizer_arg, extra = make(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=named):
        distrain.wrap(model_arg, optimizer_arg, **extra)
    assert not torch.distributed.is_initialized()


def test_fit_refuses_what_cannot_reach_its_workers(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="^model_fn: must be picklable to reach 2 worker processes"):
        distrain.fit(lambda: _model(), workers=2, run_dir=str(run))
    with pytest.raises(ConfigError, match="^loss_fn: must be picklable"):
        distrain.fit(_model, workers=2, loss_fn=lambda out, y: out.sum(), run_dir=str(run))
    with pytest.raises(ConfigError, match="^model_fn: must be a callable, got str"):
        distrain.fit("not a function", workers=2, run_dir=str(run))
    with pytest.raises(ConfigError, match="^config: must be a distrain.TrainConfig, got dict"):
        distrain.fit(_model, config={"workers": 2}, run_dir=str(run))
    assert not run.exists()  # refused before anything was written
