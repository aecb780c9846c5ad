"""Emulated networks and machines: link bandwidth, latency, jitter, traces, compute slowdown.

One worker builds one :class:`Emulation` from its run's network settings; the Transport takes
its link model, the loop calls ``start()`` once the workers start together and
``after_compute()`` after each backward pass.

Example::

    emulation = Emulation.from_config(cfg.network, rank, world)
    transport = Transport(link_model=emulation.link_model)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from distrain.emulation.compute import ComputeSlowdown
from distrain.emulation.link import LinkModel, sleep_until
from distrain.emulation.network import PRESETS, NetworkSettings, NetworkSpec
from distrain.emulation.trace import BandwidthTrace, Schedule
from distrain.emulation.units import (
    format_bandwidth,
    parse_bandwidth,
    parse_duration,
    parse_factor,
    parse_size,
)
from distrain.errors import ConfigError

log = logging.getLogger(__name__)

#: Set by the netns launcher in each worker's environment: bandwidth is shaped by tc outside.
NETNS_WORKER_ENV = "DISTRAIN_NETNS_WORKER"
#: A file the netns launcher waits for before it starts playing bandwidth traces (rank 0 makes it).
CLOCK_FILE_ENV = "DISTRAIN_CLOCK_FILE"


class Emulation:
    """Everything one worker emulates: its link model (or None) and its compute slowdown."""

    def __init__(self, spec: NetworkSpec | None, rank: int, seed: int = 0) -> None:
        self.spec, self.rank = spec, rank
        self.link_model = LinkModel(spec, rank, seed) if spec is not None and spec.delays_messages else None
        self.compute = ComputeSlowdown(spec.compute_factors[rank] if spec is not None else 1.0)

    @classmethod
    def from_config(cls, network: Any, rank: int | None = None, world: int | None = None, seed: int = 0,
                    workers: int | None = None, workers_per_node: int = 0) -> Emulation:
        """From a :class:`~distrain.config.NetworkConfig`; a no-op when nothing is emulated.

        ``rank`` and ``world`` default to this process's place in the default process group;
        ``workers`` is how many of the world train (default: all; parameter servers come last);
        ``workers_per_node`` groups them into nodes whose inner links are not emulated.
        """
        if rank is None or world is None:
            import torch.distributed as dist

            rank, world = dist.get_rank(), dist.get_world_size()
        settings = NetworkSettings.from_config(network)
        if not settings.active:
            return cls(None, rank, seed)
        if settings.mode == "netns" and not os.environ.get(NETNS_WORKER_ENV):
            raise ConfigError("--emulation", "netns workers are started by 'distrain train' itself, which creates "
                              "the namespaces; under torchrun use --emulation model")
        spec = settings.resolve(world, workers, workers_per_node)
        if rank == 0:
            log.info("emulated network %s", spec.describe())
        return cls(spec, rank, seed)

    def start(self) -> None:
        """All workers start now: t = 0 of bandwidth traces."""
        if self.link_model is not None:
            self.link_model.start()
        clock_file = os.environ.get(CLOCK_FILE_ENV)
        if clock_file and self.rank == 0:
            Path(clock_file).touch()

    def after_compute(self, seconds: float) -> float:
        """Stretch a step's measured compute time by this worker's slowdown factor."""
        return self.compute.after_compute(seconds)


__all__ = [
    "PRESETS", "BandwidthTrace", "ComputeSlowdown", "Emulation", "LinkModel", "NetworkSettings", "NetworkSpec",
    "Schedule", "format_bandwidth", "parse_bandwidth", "parse_duration", "parse_factor", "parse_size", "sleep_until",
]
