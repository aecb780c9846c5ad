"""A user's training loop, as DDP or through distrain.wrap(): what bench_ddp.py --via wrap times.

The two modes differ only where a DDP script and its distrain version differ: the model wrapper
(``DistributedDataParallel``) or ``distrain.wrap(model, optimizer)``. Same model, data, batches
(worker r takes rows of its own shard in a seeded order), SGD with momentum, one thread per
process, 25 MB gradient buckets on both sides. Started by ``distrain launch`` (both modes: the
same launcher, the same environment), it writes rank 0's per-step times to OUT.

    distrain launch --workers 4 benchmarks/user_loop.py ddp mlp 300 out.json
    distrain launch --workers 4 benchmarks/user_loop.py wrap mlp 300 out.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distrain
from distrain.data import load_dataset
from distrain.models import build_model

WIDTHS = {"cnn1d": None, "mlp": 974}  # the MLP: 999,334 parameters (4 MB of gradients)
BATCH, LR, BUCKET_MB = 64, 0.05, 25


def main() -> None:
    mode, model_name, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    train, _ = load_dataset("mnist1d", num_samples=20000, seed=0)
    torch.manual_seed(0)
    model = build_model(model_name, train.input_shape, train.num_classes, width=WIDTHS[model_name])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if mode == "ddp":
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        step, rank, world = optimizer.step, dist.get_rank(), dist.get_world_size()
    else:
        opt = distrain.wrap(model, optimizer, algorithm="allreduce", bucket_mb=BUCKET_MB)
        step, rank, world = opt.step, opt.rank, opt.workers
    shard = torch.arange(rank, len(train), world)
    order = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        rows = shard[torch.randint(len(shard), (BATCH,), generator=order)]
        started = time.perf_counter()
        loss = F.cross_entropy(model(train.x[rows]), train.y[rows])
        loss.backward()
        step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode, "model": model_name, "step_times": times, "loss": loss.item(),
                       "median_step_s": statistics.median(times[5:])}, f)
    if mode == "ddp":
        dist.barrier()  # nobody tears the group down while a peer is still in its last all-reduce
        dist.destroy_process_group()
    else:
        opt.finish()
    # The interpreter's own teardown can hang on gloo's threads after DDP (seen here: two ranks
    # of four never exited); the measurement is written, so leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
