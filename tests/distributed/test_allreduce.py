"""All-reduce data parallel over real gloo processes equals one process on the concatenated batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distrain.data import load_dataset, partition_indices
from distrain.data.batches import batches_of
from distrain.data.sampler import ShardSampler
from distrain.launch import launch_local
from distrain.models import build_model
from distrain.optim.schedule import scaled_lr
from distrain.runtime.checkpoint import CheckpointStore
from tests.conftest import small_config


def reference_parameters(cfg, world: int, steps: int) -> dict[str, torch.Tensor]:
    """Train one process on the concatenation of every worker's batch, step by step."""
    train_set, _ = load_dataset(cfg.data.dataset, num_samples=cfg.data.num_samples, seed=cfg.run.seed)
    parts = partition_indices(train_set.y.numpy(), world, "iid", seed=cfg.run.seed)
    samplers = [ShardSampler(parts[r], cfg.data.batch_size, cfg.run.seed, r) for r in range(world)]
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model.model, train_set.input_shape, train_set.num_classes, width=cfg.model.model_width, depth=cfg.model.model_depth)
    lr = scaled_lr(cfg.optim.lr, world * cfg.data.batch_size, cfg.optim.reference_batch)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    for step in range(steps):
        x, y = batches_of(train_set, torch.cat([s.batch(step) for s in samplers]))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,ring", [  # 2 workers: `make test-all`; each ring on 4 in CI
    pytest.param(2, "gloo", marks=pytest.mark.slow), (4, "gloo"), pytest.param(2, "own", marks=pytest.mark.slow), (4, "own")])
def test_allreduce_equals_single_process_on_concatenated_batches(tmp_path, world, ring):
    cfg = small_config(str(tmp_path / "run"), workers=world, ring=ring, bucket_mb=0.001)
    summary = launch_local(cfg)
    steps = summary["steps"]
    assert steps >= 10
    expected = reference_parameters(cfg, world, steps)
    for rank in range(world):
        got = CheckpointStore(tmp_path / "run", rank, world).load(steps)["model"]
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
