"""``ddp-powersgd[:RANK]``: DDP with PyTorch's PowerSGD hook (low-rank gradients, error feedback).

Each matrix-shaped gradient M (n x m) is sent as P (n x r) and Q (m x r), two all-reduces one
after the other; tensors too small to gain (``(n + m) r * min_compression_rate >= n m``) and
vectors are all-reduced uncompressed first. The run is dense (plain all-reduce) for
``--density-warmup-epochs`` (at least the 2 iterations PyTorch needs with error feedback), like
distrain's own compressors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.baselines.common import Peer
from distrain.baselines.wire import MeteredState, WireMeter, metered_hook
from distrain.config import TrainConfig
from distrain.errors import ConfigError

DEFAULT_RANK = 2


def powersgd_wire(meter: WireMeter, state: PowerSGDState, bucket: dist.GradBucket) -> list[int]:
    """Bytes of the all-reduces ``powerSGD_hook`` makes for ``bucket``: dense before
    ``start_powerSGD_iter``, then [uncompressed tensors, Ps, Qs] (PyTorch's own selection rule)."""
    buffer = bucket.buffer()
    size = buffer.element_size()
    meter.dense_elements += buffer.numel()
    if state.iter < state.start_powerSGD_iter:
        meter.wire_elements += buffer.numel()
        return [buffer.numel() * size]
    uncompressed = ps = qs = 0
    for grad in bucket.gradients():
        n = grad.shape[0] if grad.dim() else 1
        m = grad.numel() // max(n, 1)
        r = min(n, m, state.matrix_approximation_rank)
        if (n + m) * r * state.min_compression_rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            uncompressed += grad.numel()
    meter.wire_elements += uncompressed + ps + qs
    return [uncompressed * size, ps * size, qs * size]


class DDPPowerSGD(Peer):
    """DDP + ``powerSGD_hook`` with matrix approximation rank ``RANK`` (default 2)."""

    name = "ddp-powersgd"
    option_help = "matrix approximation rank, an integer >= 1"

    def __init__(self, option: str | None = None) -> None:
        super().__init__(option)
        if option is not None and not (option.isdigit() and int(option) >= 1):
            raise ConfigError("--baselines", f"ddp-powersgd:RANK needs a rank that is an integer >= 1, got {option!r}")
        self.rank = int(option) if option is not None else DEFAULT_RANK
        self.state: PowerSGDState | None = None

    def register(self, model: DDP, optimizer: torch.optim.Optimizer, meter: WireMeter, cfg: TrainConfig,
                 steps_per_epoch: int, total_steps: int) -> None:
        super().register(model, optimizer, meter, cfg, steps_per_epoch, total_steps)
        warmup = math.ceil(cfg.compress.density_schedule()[0] * steps_per_epoch)
        # PyTorch needs >= 2 dense iterations with error feedback: DDP rebuilds buckets after the first.
        self.state = PowerSGDState(process_group=None, matrix_approximation_rank=self.rank,
                                   start_powerSGD_iter=max(2, warmup), use_error_feedback=True, warm_start=True)
        model.register_comm_hook(MeteredState(meter, self.state, powerSGD_hook,
                                              lambda state, bucket: powersgd_wire(meter, state, bucket)), metered_hook)

    def metrics(self) -> dict[str, float]:
        meter = self.meter
        if meter is None or not meter.dense_elements:
            return {}
        ratio = meter.wire_elements / meter.dense_elements
        meter.dense_elements = meter.wire_elements = 0
        return {"compress_ratio": ratio}

    def info(self) -> dict[str, Any]:
        start = self.state.start_powerSGD_iter if self.state is not None else None
        return {**super().info(), "matrix_approximation_rank": self.rank, "start_powerSGD_iter": start}
