"""A resumed run reaches the same parameters as an uninterrupted one."""

from __future__ import annotations

import shutil

import pytest
import torch

from distrain.launch import launch_local
from distrain.train.checkpoint import CheckpointStore
from tests.conftest import small_config


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm,servers", [
    # all-reduce's resume runs in CI with error feedback's state too (test_compressed_allreduce.py)
    pytest.param("allreduce", 0, marks=pytest.mark.slow),
    ("ps", 1),
])
def test_resume_matches_uninterrupted_run(tmp_path, algorithm, servers):
    """Sync all-reduce, and sync parameter server (whose server restores its optimizer state)."""
    full = tmp_path / "full"
    settings = {"workers": 2, "epochs": 2, "checkpoint_every": 7, "lr_decay": "cosine", "warmup_epochs": 0.5,
                "algorithm": algorithm, "servers": max(servers, 1)}
    nprocs = 2 + servers
    summary = launch_local(small_config(str(full), **settings))
    total = summary["steps"]
    assert total % 7 != 0  # the final checkpoint is an extra one, after the periodic ones
    periodic = min(CheckpointStore(full, 0, nprocs).steps())  # the oldest set pruning kept
    assert 0 < periodic < total

    # Pretend the run died right after that checkpoint: keep only it.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for step_dir in (cut / "checkpoints").iterdir():
        if step_dir.name != f"step-{periodic:08d}":
            shutil.rmtree(step_dir)
    resumed = launch_local(small_config(str(cut), resume="auto", **settings))
    assert resumed["resumed_from_step"] == periodic
    for rank in range(2):
        want = CheckpointStore(full, rank, nprocs).load(total)
        got = CheckpointStore(cut, rank, nprocs).load(total)
        for name, tensor in want["model"].items():
            torch.testing.assert_close(got["model"][name], tensor, rtol=0, atol=0)
