"""The Python API and per-worker shard files, through real worker processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import distrain
import distrain.train.metrics
from distrain.data import load_dataset, write_shard_dir
from distrain.launch import launch_local
from distrain.launch.common import free_port
from tests.conftest import small_config


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _toy_data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 20, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x[:1600], y[:1600]), TensorDataset(x[1600:], y[1600:])


@pytest.mark.timeout(180)
def test_fit_trains_a_user_model_on_user_datasets(tmp_path):
    train, test = _toy_data()
    # Majority class share: the bar a model that learned nothing would reach.
    majority = torch.bincount(test.tensors[1]).max().item() / len(test)
    summary = distrain.fit(make_model, train, test, workers=2, epochs=5, batch_size=32, progress=False,
                           run_dir=str(tmp_path / "fit"), timeout=60)
    assert summary["workers"] == 2
    assert summary["final_test_accuracy"] > max(0.9, majority + 0.3)
    config = json.loads((tmp_path / "fit" / "config.json").read_text())
    assert config["model"]["model"] == f"user:{__name__}.make_model"  # not the default model's name
    assert config["data"]["dataset"] == "user" and config["data"]["num_samples"] == len(train) + len(test)
    assert summary["model"] == config["model"]["model"] and summary["dataset"] == "user"


@pytest.mark.timeout(180)
def test_fit_in_process_with_one_worker(tmp_path):
    train, test = _toy_data()
    summary = distrain.fit(lambda: make_model(), train, test, workers=1, epochs=3, batch_size=32,
                           progress=False, run_dir=str(tmp_path / "one"))
    assert summary["workers"] == 1 and summary["bytes_sent_per_worker"] == [0]
    assert summary["final_test_accuracy"] > 0.85


def make_regressor() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def huber(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.huber_loss(output.squeeze(-1), target, reduction="none", delta=0.5)


def _regression_data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 0.1 * torch.randn(1200, generator=g)
    return TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])


@pytest.mark.timeout(180)
def test_fit_regression_reaches_a_loss_target_and_returns_the_trained_model(tmp_path):
    train, test = _regression_data()
    spread = test.tensors[1].var().item()  # the mean squared error of always predicting the mean
    config = distrain.TrainConfig()
    before = config.to_dict()
    result = distrain.fit(make_regressor, train, test, config, task="regression", target_loss=0.1 * spread,
                          workers=2, epochs=4, batch_size=20, lr=0.05, warmup_epochs=0, progress=False,
                          run_dir=str(tmp_path / "reg"), timeout=60)
    assert config.to_dict() == before  # the caller's config is copied, never changed
    assert result["task"] == "regression" and result["final_test_accuracy"] is None
    assert result["final_test_loss"] < 0.1 * spread and result["time_to_target_s"] is not None
    model = make_regressor()
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        mse = ((model(test.tensors[0]).squeeze(-1) - test.tensors[1]) ** 2).mean().item()
    assert mse == pytest.approx(result["final_test_loss"], rel=1e-5)
    evals = [m for m in distrain.train.metrics.read_metrics(tmp_path / "reg") if "test_loss" in m]
    assert evals and all("test_accuracy" not in m for m in evals)


@pytest.mark.timeout(180)
def test_fit_with_the_users_own_loss(tmp_path):
    train, test = _regression_data()
    result = distrain.fit(make_regressor, train, test, task="regression", loss_fn=huber, workers=2, epochs=2,
                          batch_size=20, lr=0.05, warmup_epochs=0, progress=False, run_dir=str(tmp_path / "huber"),
                          timeout=60)
    model = make_regressor()
    untrained = huber(model(test.tensors[0]), test.tensors[1]).mean().item()
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        trained = huber(model(test.tensors[0]), test.tensors[1]).mean().item()
    assert result["final_test_loss"] == pytest.approx(trained, rel=1e-5)  # the test loss is the user's loss
    assert trained < 0.3 * untrained


@pytest.mark.timeout(180)
def test_shard_directory_each_worker_reads_its_own_files(tmp_path):
    train, test = load_dataset("synthetic", num_samples=1200, seed=0)
    files = write_shard_dir(tmp_path / "shards", train, test, num_shards=4)
    cfg = small_config(str(tmp_path / "run"), workers=2, dataset="shards", data_path=str(tmp_path / "shards"))
    launch_local(cfg)
    shards = json.loads((tmp_path / "run" / "config.json").read_text())["shards"]
    sizes = [len(np.load(f)["y"]) for f in files]
    # shard i belongs to rank i % 2
    assert [s["size"] for s in shards] == [sizes[0] + sizes[2], sizes[1] + sizes[3]]


#: The README's example of ``distrain.fit``, run as its users run it.
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.timeout(180)
def test_readme_fit_example_under_torchrun_on_every_rank(tmp_path):
    section = README.read_text().split("### From Python", 1)[1]
    script = tmp_path / "fit_example.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    # Each rank's stdout in its own file: ranks printing at once would interleave their words.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--log-dir", str(tmp_path / "logs"), "--redirects", "1", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = {int(f.parent.name): f.read_text() for f in (tmp_path / "logs").glob("**/attempt_0/*/stdout.log")}
    assert sorted(printed) == [0, 1], printed
    lines = printed[0].splitlines()  # the example prints the summary's accuracy and run directory
    assert len(lines) == 1 and printed[1] == printed[0], printed  # every rank has the same summary
    run_dir = tmp_path / lines[0].split()[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert lines[0] == f"{summary['final_test_accuracy']} {summary['run_dir']}"
    assert re.fullmatch(r"allreduce-user-.+", run_dir.name), run_dir.name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["model"] == "user:fit_example.make_model"
    assert config["data"]["dataset"] == "user" and config["data"]["num_samples"] == 2000  # x[:1600] + x[1600:]
    assert sum(shard["size"] for shard in config["shards"]) == 1600
