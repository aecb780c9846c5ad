"""allreduce's gradient buckets are the ones PyTorch DDP builds for the same settings.

The DDP baselines and ``bench_ddp.py`` compare the two on the same job; a different bucket
layout would make one side run more collectives per step than the other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.algorithms import StepContext
from distrain.assemble import build_algorithm
from distrain.baselines.common import ddp_buckets
from distrain.comm.transport import Transport
from distrain.config import TrainConfig
from distrain.models import build_model
from tests.harness import run_group

#: (model, width, --bucket-mb, --first-bucket-mb)
CASES = [
    ("mlp", 974, 25.0, 0.0),  # the 1M-parameter MLP of bench_ddp: one bucket
    ("mlp", 974, 25.0, 1.0),  # DDP's default first bucket: the last layers and the big hidden layer, then the first layer
    ("mlp", 974, 0.5, 0.0),
    ("mlp", 256, 0.05, 0.01),
    ("cnn1d", None, 0.01, 0.0),
    ("cnn1d", None, 0.01, 0.002),
]


def bucket_sizes(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Bucket sizes in bytes, in all-reduce order, of DDP and of allreduce after two steps."""
    out = {}
    x, y = torch.randn(8, 40), torch.randint(0, 10, (8,))
    for i, (model_name, width, bucket_mb, first_mb) in enumerate(CASES):
        cfg = TrainConfig.from_dict({"model": model_name, "bucket_mb": bucket_mb, "first_bucket_mb": first_mb}).validate()
        ddp = DDP(build_model(model_name, (40,), 10, width=width), **ddp_buckets(cfg))
        seen: dict[int, int] = {}

        def record(state, bucket, seen=seen):  # noqa: ANN001, ANN202 - DDP's comm-hook signature
            seen[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, record)
        model = build_model(model_name, (40,), 10, width=width)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ours = build_algorithm("allreduce", cfg)
        ours.setup(model, optimizer, Transport())
        out[f"static{i}"] = torch.tensor([sum(b.sizes) * 4 for b in ours.buckets])  # reversed parameter order
        for step in range(3):  # both rebuild their buckets in gradient order after the first backward
            seen.clear()
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            ours.after_backward(StepContext(step=step, epoch=0.0, batch_size=len(y)))
        out[f"ddp{i}"] = torch.tensor([seen[k] for k in sorted(seen)])
        out[f"ours{i}"] = torch.tensor([sum(b.sizes) * 4 for b in ours.buckets])
        # backward still accumulates straight into the (rebuilt) buckets: no copy in or out
        out[f"views{i}"] = torch.tensor(all(p.grad is v for b in ours.buckets for p, v in zip(b.params, b.views, strict=True)))
        ours.close()
    return out


@pytest.mark.timeout(120)
def test_allreduce_buckets_are_ddps_buckets():
    result = run_group(bucket_sizes, world=2)[0]
    for i, case in enumerate(CASES):
        assert result[f"ours{i}"].tolist() == result[f"ddp{i}"].tolist(), case
        assert bool(result[f"views{i}"]), case
    assert len(result["ours0"]) == 1 and len(result["ours1"]) == 2  # the first bucket is what splits the MLP
    assert len(result["ours4"]) > 2
    # the conv layers' gradients come weight before bias: the rebuilt buckets differ from the static ones
    assert result["ours4"].tolist() != result["static4"].tolist()

