"""Your own training loop with distrain: your model, AdamW, your loss, a cosine schedule.

    distrain launch --workers 4 examples/custom_loop.py
    distrain launch --workers 4 --network edge examples/custom_loop.py --compress group_topk:0.01
    distrain launch --workers 4 --slow-worker 3:4x examples/custom_loop.py --algorithm adpsgd
    torchrun --nproc-per-node 4 examples/custom_loop.py --algorithm dpsgd
    distrain launch --workers 4 --servers 2 examples/custom_loop.py --algorithm ps

Two machines (4 processes each; run on both with --node-rank 0 and 1):

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        examples/custom_loop.py
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import distrain


class ResidualMLP(torch.nn.Module):
    def __init__(self, features: int, width: int, classes: int, blocks: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(features, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(blocks))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    """Per-sample label-smoothed cross-entropy (distrain's adaptive compression can use them)."""
    logp = logits.log_softmax(-1)
    return -(1 - smoothing) * logp.gather(1, target[:, None]).squeeze(1) - smoothing * logp.mean(-1)


def make_data(samples: int = 16384, features: int = 64, classes: int = 10) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, features, generator=g)
    y = torch.randint(classes, (samples,), generator=g)
    x = centres[y] + 1.5 * torch.randn(samples, features, generator=g)
    split = samples * 7 // 8
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def endless(loader: DataLoader):  # noqa: ANN201
    while True:
        yield from loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="allreduce")
    parser.add_argument("--compress", default="none")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--servers", type=int, default=None, help="parameter servers (algorithm ps) under torchrun")
    args = parser.parse_args()

    torch.manual_seed(0)
    train_set, test_set = make_data()
    model = ResidualMLP(features=64, width=256, classes=10)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    servers = {"servers": args.servers} if args.servers else {}  # distrain launch --servers sets it itself
    opt = distrain.wrap(model, inner, algorithm=args.algorithm, compress=args.compress, epochs=args.epochs,
                        batch_size=args.batch_size, **servers)
    loader = DataLoader(opt.shard(train_set), batch_size=args.batch_size, shuffle=True, drop_last=True)
    total = opt.total_steps  # this worker's share of --epochs (opt.shard worked it out)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / total, 1))))

    batches = endless(loader)
    started = time.perf_counter()
    while opt.keep_going():  # asynchronous algorithms: faster workers take more steps
        x, y = next(batches)
        losses = smoothed_cross_entropy(model(x), y)
        losses.mean().backward()
        opt.step(losses=losses)
        scheduler.step()
        opt.zero_grad()
        if opt.rank == 0 and opt.steps % 50 == 0:
            print(f"step {opt.steps}/{total}  loss {losses.mean().item():.3f}  lr {scheduler.get_last_lr()[0]:.2e}")
    wall = time.perf_counter() - started
    used = opt.traffic()
    final = opt.finish()

    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = (final(x).argmax(1) == y).float().mean().item()
    steps = max(1, used["steps"])
    print(f"worker {opt.rank}: {used['steps']} steps, {1000 * wall / steps:.1f} ms/step "
          f"(compute {1000 * used['compute_s'] / steps:.1f}, network wait {1000 * used['exposed_comm_s'] / steps:.1f}), "
          f"sent {used['bytes_sent'] / steps / 1e3:.1f} kB/step, test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
