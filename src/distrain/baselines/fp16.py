"""``ddp-fp16``: DDP whose gradient buckets are all-reduced as 16-bit floats (``fp16_compress_hook``)."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.baselines.common import Peer
from distrain.baselines.wire import MeteredState, WireMeter, fp16_wire, metered_hook
from distrain.config import TrainConfig


class DDPFp16(Peer):
    """DDP + ``fp16_compress_hook``: half the bytes of ``ddp``, gradients rounded to fp16."""

    name = "ddp-fp16"

    def register(self, model: DDP, optimizer: torch.optim.Optimizer, meter: WireMeter, cfg: TrainConfig,
                 steps_per_epoch: int, total_steps: int) -> None:
        super().register(model, optimizer, meter, cfg, steps_per_epoch, total_steps)
        model.register_comm_hook(MeteredState(meter, None, fp16_compress_hook, fp16_wire), metered_hook)
