"""Compressed all-reduce through the worker loop (real gloo processes, ``launch_local``)."""

from __future__ import annotations

import shutil

import pytest
import torch

from distrain.launch import launch_local
from distrain.runtime.checkpoint import CheckpointStore
from distrain.train.metrics import read_metrics
from tests.conftest import small_config
from tests.distributed.test_allreduce import reference_parameters


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,spec,settings", [
    (3, "group_topk:1.0:group=64", {"sparse_collective": "ring"}),
    # `make test-all`: the all-gather and the own ring (the group top-k case is the CI's; each
    # compressor at ratio 1 has its unit test)
    pytest.param(2, "topk:1.0", {"sparse_collective": "allgather"}, marks=pytest.mark.slow),
    pytest.param(2, "randomk:1.0", {"ring": "own"}, marks=pytest.mark.slow),
])
def test_compressed_allreduce_at_ratio_one_equals_dense_allreduce(tmp_path, world, spec, settings):
    # The dense all-reduce equals one process on the concatenated batches (test_allreduce.py),
    # so the compressed path at ratio 1.0 is held to the same reference and tolerance.
    cfg = small_config(str(tmp_path / "run"), workers=world, compress=spec, **settings)
    summary = launch_local(cfg)
    steps = summary["steps"]
    expected = reference_parameters(cfg, world, steps)
    for rank in range(world):
        got = CheckpointStore(tmp_path / "run", rank, world).load(steps)["model"]
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    assert read_metrics(tmp_path / "run")[-1]["compress_ratio"] == 1.0


@pytest.mark.timeout(180)
def test_group_topk_run_follows_the_density_warmup_and_sends_few_bytes(tmp_path):
    world, ratio = 4, 0.05
    cfg = small_config(str(tmp_path / "run"), workers=world, epochs=3, compress=f"group_topk:{ratio}:group=64",
                       density_warmup_epochs=1.0, density_decay_epochs=1.0)
    summary = launch_local(cfg)
    records = read_metrics(tmp_path / "run", 0)
    spe = len(records) // 3  # steps per epoch
    params = sum(t.numel() for t in CheckpointStore(tmp_path / "run", 0, world).load(len(records))["model"].values())
    dense_share = 2 * (world - 1) * params * 4 // world  # a ring all-reduce of float32 gradients
    totals = [0] + [r["bytes_sent"] for r in records]
    for step, record in enumerate(records):
        sent = totals[step + 1] - totals[step]
        epoch = step / spe
        if epoch < 1:
            assert sent == dense_share and record["compress_ratio"] == 1.0, step
        elif epoch < 2 and ratio ** (epoch - 1) * world >= 1:  # the all-gather would send more than dense
            assert sent == dense_share and record["compress_ratio"] == 1.0, step
        elif epoch < 2:
            assert record["compress_ratio"] == pytest.approx(ratio ** (epoch - 1)), step
        else:
            assert record["compress_ratio"] == ratio and sent < 0.4 * dense_share, (step, sent, dense_share)
    assert records[-1]["loss"] < 0.7 * records[0]["loss"]
    finals = [CheckpointStore(tmp_path / "run", r, world).load(len(records))["model"] for r in range(world)]
    for other in finals[1:]:  # every worker applied the same averaged gradient
        for name, tensor in finals[0].items():
            assert torch.equal(other[name], tensor), name
    assert summary["bytes_sent_per_worker"][0] == records[-1]["bytes_sent"]


@pytest.mark.timeout(240)
def test_resume_with_error_feedback_matches_uninterrupted_run(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    settings = {"workers": 2, "epochs": 1, "checkpoint_every": 11, "compress": "group_topk:0.1:group=64",
                "density_warmup_epochs": 0.0, "density_decay_epochs": 0.0}
    summary = launch_local(small_config(str(full), **settings))
    total = summary["steps"]
    shutil.copytree(full, cut)
    for step_dir in (cut / "checkpoints").iterdir():
        if step_dir.name != "step-00000011":
            shutil.rmtree(step_dir)
    state = CheckpointStore(cut, 0, 2).load(11)["algorithm"]
    assert state["compressor"]["residual.0"].abs().sum() > 0  # the memory is in the checkpoint
    resumed = launch_local(small_config(str(cut), resume="auto", **settings))
    assert resumed["resumed_from_step"] == 11
    for rank in range(2):
        want = CheckpointStore(full, rank, 2).load(total)["model"]
        got = CheckpointStore(cut, rank, 2).load(total)["model"]
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
