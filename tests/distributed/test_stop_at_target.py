"""--stop-at-target: distrain's loop and the DDP baselines end every worker at the first evaluation
that reaches the target, report the steps they took, and give the final figures on the whole test set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import distrain
from distrain.baselines import run_baseline
from distrain.config import TrainConfig
from distrain.errors import ConfigError
from distrain.train.metrics import read_metrics
from tests.conftest import small_config

TARGET = 0.6  # test accuracy: the small job crosses it within its first epoch, far before its 3 epochs end


def check_stopped(summary: dict, run_dir: Path) -> list[dict]:
    cfg = json.loads((run_dir / "config.json").read_text())
    planned, interval = cfg["total_steps"], round(0.25 * cfg["steps_per_epoch"])
    steps = summary["steps"]
    assert summary["stopped_at_target"] is True and summary["time_to_target_s"] is not None
    assert steps < planned and steps % interval == 0, (steps, planned, interval)
    assert summary["steps_per_worker"] == [steps, steps]
    for rank in range(2):  # every worker took the same steps and stopped there
        assert [m["step"] for m in read_metrics(run_dir, rank) if "step" in m][-1] == steps
    evals = [m for m in read_metrics(run_dir, 0) if "test_accuracy" in m]
    assert evals[-1]["step"] == steps
    assert all(m["test_accuracy"] < TARGET for m in evals[:-1])  # the first evaluation that reached it
    assert evals[-1]["test_accuracy"] == summary["final_test_accuracy"]
    return evals


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


@pytest.mark.timeout(180)
def test_the_loop_and_ddp_stop_every_worker_at_the_evaluation_that_reaches_the_target(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 20, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    train, test = TensorDataset(x[:1600], y[:1600]), TensorDataset(x[1600:], y[1600:])
    result = distrain.fit(make_model, train, test, workers=2, epochs=3, batch_size=16, lr=0.05, warmup_epochs=0,
                          eval_every=0.25, eval_samples=60, target_accuracy=TARGET, stop_at_target=True,
                          progress=False, run_dir=str(tmp_path / "allreduce"), timeout=60)
    check_stopped(result.summary, tmp_path / "allreduce")
    # the final figures are the whole test set's (the evaluations during the run used 60 samples)
    model = make_model()
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    assert accuracy == pytest.approx(result["final_test_accuracy"])

    ddp = run_baseline("ddp", small_config(str(tmp_path / "ddp"), workers=2, epochs=3, eval_every=0.25,
                                           eval_samples=60, target_accuracy=TARGET, stop_at_target=True))
    check_stopped(ddp, tmp_path / "ddp")


def test_asynchronous_algorithms_and_parameter_servers_refuse_it() -> None:
    for algorithm in ("adpsgd", "prague", "ps"):
        with pytest.raises(ConfigError, match="--stop-at-target"):
            TrainConfig.from_dict({"algorithm": algorithm, "stop_at_target": True}).validate()
    TrainConfig.from_dict({"algorithm": "diloco", "stop_at_target": True}).validate()
