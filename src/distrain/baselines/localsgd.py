"""``localsgd[:PERIOD]``: post-local SGD, PyTorch's ``PostLocalSGDState`` + ``post_localSGD_hook``
and ``PeriodicModelAverager``.

For ``--density-warmup-epochs`` the gradients are all-reduced every step (plain DDP); after that
each worker steps on its own gradients and the models are averaged (an all-reduce of all
parameters) every PERIOD steps (default 4). Every worker is its own machine in distrain's
emulated networks, so there is no intra-node subgroup to all-reduce gradients in after the
switch (``post_local_gradient_allreduce=False``). The model evaluated is the average of the
workers' models (computed with uncounted bookkeeping traffic, as for distrain's decentralized
algorithms).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.baselines.common import Peer
from distrain.baselines.wire import MeteredState, WireMeter, dense_wire, metered_hook
from distrain.config import TrainConfig
from distrain.errors import ConfigError

DEFAULT_PERIOD = 4


def localsgd_wire(state: PostLocalSGDState, bucket: dist.GradBucket) -> list[int]:
    """A dense all-reduce before ``start_localSGD_iter``, nothing after."""
    return dense_wire(state, bucket) if state.iter < state.start_localSGD_iter else []


class PostLocalSGD(Peer):
    """Post-local SGD averaging the models every ``PERIOD`` steps."""

    name = "localsgd"
    option_help = "averaging period in steps, an integer >= 1"

    def __init__(self, option: str | None = None) -> None:
        super().__init__(option)
        if option is not None and not (option.isdigit() and int(option) >= 1):
            raise ConfigError("--baselines", f"localsgd:PERIOD needs a period that is an integer >= 1, got {option!r}")
        self.period = int(option) if option is not None else DEFAULT_PERIOD
        if self.period == 1:
            warnings.warn("localsgd:1 averages the models every step: it is synchronous SGD with more traffic", stacklevel=2)
        self.averager: PeriodicModelAverager | None = None
        self.warmup = 0

    def register(self, model: DDP, optimizer: torch.optim.Optimizer, meter: WireMeter, cfg: TrainConfig,
                 steps_per_epoch: int, total_steps: int) -> None:
        super().register(model, optimizer, meter, cfg, steps_per_epoch, total_steps)
        self.warmup = math.ceil(cfg.compress.density_schedule()[0] * steps_per_epoch)
        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=self.warmup,
                                  post_local_gradient_allreduce=False)
        model.register_comm_hook(MeteredState(meter, state, post_localSGD_hook, localsgd_wire), metered_hook)
        self.averager = PeriodicModelAverager(period=self.period, warmup_steps=self.warmup)

    def after_step(self, model: DDP) -> None:
        averager, meter = self.averager, self.meter
        assert averager is not None and meter is not None
        will_average = averager.step >= averager.warmup_steps and (averager.step - averager.warmup_steps) % averager.period == 0
        start = time.perf_counter()
        averager.average_parameters(model.parameters())
        if will_average:
            params = [p for p in model.parameters() if p.grad is not None]
            meter.synchronous([sum(p.numel() * p.element_size() for p in params)], start)

    def eval_model(self, model: DDP) -> torch.nn.Module:
        average = copy.deepcopy(model.module)
        tensors = [p.data for p in average.parameters()] + [b for b in average.buffers() if b.is_floating_point()]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)  # bookkeeping for evaluation, not training traffic
        flat /= dist.get_world_size()
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return average

    def info(self) -> dict[str, Any]:
        return {**super().info(), "period": self.period, "start_localSGD_iter": self.warmup}
