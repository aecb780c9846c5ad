"""The Python API and per-worker shard files, through real worker processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import distrain
from distrain.data import load_dataset, write_shard_dir
from distrain.launch import launch_local
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


@pytest.mark.timeout(180)
def test_fit_in_process_with_one_worker(tmp_path):
    train, test = _toy_data()
    summary = distrain.fit(lambda: make_model(), train, test, workers=1, epochs=3, batch_size=32,
                           progress=False, run_dir=str(tmp_path / "one"))
    assert summary["workers"] == 1 and summary["bytes_sent_per_worker"] == [0]
    assert summary["final_test_accuracy"] > 0.85


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
