"""``ddp``: plain PyTorch DDP, its gradient buckets all-reduced as they become ready.

DDP's built-in all-reduce is replaced by ``allreduce_hook``, which PyTorch documents as its
equivalent, so that :mod:`distrain.baselines.wire` can count and (emulated network) delay it.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.baselines.common import Peer
from distrain.baselines.wire import MeteredState, WireMeter, dense_wire, metered_hook
from distrain.config import TrainConfig


class PlainDDP(Peer):
    """DDP with its default all-reduce of every gradient bucket."""

    name = "ddp"

    def register(self, model: DDP, optimizer: torch.optim.Optimizer, meter: WireMeter, cfg: TrainConfig,
                 steps_per_epoch: int, total_steps: int) -> None:
        super().register(model, optimizer, meter, cfg, steps_per_epoch, total_steps)
        model.register_comm_hook(MeteredState(meter, None, allreduce_hook, dense_wire), metered_hook)
