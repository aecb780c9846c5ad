"""The emulated network: presets, the flags that override them, and the resolved per-worker spec.

Model of the network: every worker has one link to a switch (a bridge, in ``netns`` mode), with
a bandwidth (both directions) that may follow a trace, and a one-way latency. A message from
worker i to worker j moves at ``min(bandwidth_i, bandwidth_j)`` and arrives ``latency`` (plus
jitter, uniform in ``[-jitter, +jitter]``, never below zero) after it was sent; latency is per
message, not per link, so it is not added twice (it is the max of the two ends, which are equal
unless a preset says otherwise). Compute slowdown is a factor per worker.

With ``--workers-per-node K`` the workers form nodes of K consecutive ranks (parameter servers
are nodes of their own): links between two ranks of one node are local (shared memory, NVLink)
and not emulated, only links between nodes carry the bandwidth cap and the latency.

Presets (``--network``), for n workers; explicit flags override the preset field by field:

========== ============================================================================
lan        10 Gbit/s, 0.1 ms
wan        100 Mbit/s, 20 ms
edge       20 Mbit/s, 10 ms
straggler  lan links; the last rank computes 4x slower
slow-link  100 Mbit/s, 1 ms; the last rank's link is 10 Mbit/s
fluctuating 5 ms; each worker alternates 2 s at 50 Mbit/s and 2 s at 5 Mbit/s, worker r
           shifted by r/n of the 4 s period
========== ============================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from distrain.emulation.trace import BandwidthTrace, Schedule
from distrain.emulation.units import format_bandwidth, parse_bandwidth, parse_duration, parse_factor
from distrain.errors import ConfigError

MODES = ("model", "netns")

PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    "lan": {"bandwidth": "10gbit", "latency": "0.1ms"},
    "wan": {"bandwidth": "100mbit", "latency": "20ms"},
    "edge": {"bandwidth": "20mbit", "latency": "10ms"},
    "straggler": {"bandwidth": "10gbit", "latency": "0.1ms", "slow_worker": "last:4x"},
    "slow-link": {"bandwidth": "100mbit", "latency": "1ms", "slow_link": "last:10mbit"},
    "fluctuating": {"latency": "5ms", "fluctuate": "50mbit:5mbit:4s"},
}

RankSpec = int | str  # a rank, or "last"


def fluctuating_schedules(world: int, high: float, low: float, period: float) -> list[Schedule | None]:
    """Worker r: ``high`` for half a period, then ``low``, shifted by r/n of the period."""
    out: list[Schedule | None] = []
    for r in range(world):
        shift = period * r / world
        up, down = shift % period, (shift + period / 2) % period
        points = sorted({(0.0, high if (-shift) % period < period / 2 else low), (up, high), (down, low)})
        out.append(Schedule([t for t, _ in points], [v for _, v in points], period))
    return out


def _parse_pairs(text: str, setting: str, parse_value: Any, example: str) -> list[tuple[RankSpec, float]]:
    pairs: list[tuple[RankSpec, float]] = []
    for part in text.split(","):
        rank, sep, value = part.strip().partition(":")
        if not sep or not (rank.isdigit() or rank == "last"):
            raise ConfigError(setting, f"must look like {example} (rank:value, comma-separated), got {text!r}")
        pairs.append((int(rank) if rank.isdigit() else "last", parse_value(value.strip(), setting)))
    return pairs


@dataclass
class NetworkSettings:
    """The network settings of a run, parsed, before the world size is known."""

    preset: str = "none"
    bandwidth: float | None = None  # bits/s, every worker's link
    latency: float = 0.0  # s, one way, per message
    jitter: float = 0.0  # s
    slow_workers: list[tuple[RankSpec, float]] = field(default_factory=list)
    slow_links: list[tuple[RankSpec, float]] = field(default_factory=list)
    trace: BandwidthTrace | None = None
    fluctuate: tuple[float, float, float] | None = None  # high, low, period (the fluctuating preset)
    mode: str = "model"

    def bits_per_s(self) -> dict[str, Any]:
        """The bandwidths as parsed, in bits per second, for a run's config.json."""
        return {"bandwidth": self.bandwidth,
                "slow_link": {str(rank): bits for rank, bits in self.slow_links},
                "fluctuate": None if self.fluctuate is None else {"high": self.fluctuate[0], "low": self.fluctuate[1]}}

    @property
    def active(self) -> bool:
        """Whether anything is emulated (or the run goes to namespaces)."""
        return (self.mode == "netns" or self.bandwidth is not None or self.latency > 0 or self.jitter > 0
                or bool(self.slow_workers or self.slow_links) or self.trace is not None or self.fluctuate is not None)

    @classmethod
    def from_config(cls, cfg: Any) -> NetworkSettings:
        """Parse a :class:`~distrain.config.NetworkConfig`: the preset, then explicit flags over it."""
        if cfg.network not in PRESETS:
            raise ConfigError("--network", f"unknown preset {cfg.network!r}; choose one of: {', '.join(PRESETS)}")
        if cfg.emulation not in MODES:
            raise ConfigError("--emulation", f"unknown value {cfg.emulation!r}; choose one of: {', '.join(MODES)}")
        values: dict[str, Any] = dict(PRESETS[cfg.network])
        explicit = {name: getattr(cfg, name) for name in ("bandwidth", "latency", "jitter", "slow_worker", "slow_link", "bandwidth_trace")}
        if explicit["bandwidth"] is not None or explicit["bandwidth_trace"] is not None:
            values.pop("fluctuate", None)  # the preset's bandwidth is its trace: an explicit one replaces it
        values.update({k: v for k, v in explicit.items() if v is not None})
        out = cls(preset=cfg.network, mode=cfg.emulation)
        if "bandwidth" in values:
            out.bandwidth = parse_bandwidth(values["bandwidth"], "--bandwidth")
        if "latency" in values:
            out.latency = parse_duration(values["latency"], "--latency")
        if "jitter" in values:
            out.jitter = parse_duration(values["jitter"], "--jitter")
        if "slow_worker" in values:
            out.slow_workers = _parse_pairs(values["slow_worker"], "--slow-worker", parse_factor, "2:4x")
        if "slow_link" in values:
            out.slow_links = _parse_pairs(values["slow_link"], "--slow-link", parse_bandwidth, "3:10mbit")
        if "bandwidth_trace" in values:
            out.trace = BandwidthTrace.load(os.path.expanduser(values["bandwidth_trace"]))
        if "fluctuate" in values:
            high, low, period = values["fluctuate"].split(":")
            out.fluctuate = (parse_bandwidth(high), parse_bandwidth(low), parse_duration(period))
        return out

    def resolve(self, world: int, workers: int | None = None, workers_per_node: int = 0) -> NetworkSpec:
        """The per-process network for a world of ``world`` processes; ConfigError if a rank does
        not exist. ``workers``: how many of them train (the rest are parameter servers, last);
        ``last`` names the last training worker. ``workers_per_node``: workers per node (0: one
        each); links inside a node are not emulated."""
        workers = world if workers is None else min(workers, world)
        last = workers - 1

        named: dict[tuple[str, int], RankSpec] = {}  # (setting, rank): how the setting named it first

        def rank_of(spec: RankSpec, setting: str) -> int:
            rank = last if spec == "last" else int(spec)
            if rank >= world:
                raise ConfigError(setting, f"names worker {rank}, but there are only {world} workers (ranks 0..{world - 1})")
            if (setting, rank) in named:
                how = f" (as {named[setting, rank]} and {spec})" if named[setting, rank] != spec else ""
                raise ConfigError(setting, f"names worker {rank} twice{how}; give each worker one value")
            named[setting, rank] = spec
            return rank

        bandwidth: list[float | None] = [self.bandwidth] * world
        for spec, bits in self.slow_links:
            bandwidth[rank_of(spec, "--slow-link")] = bits
        factors = [1.0] * world
        for spec, factor in self.slow_workers:
            factors[rank_of(spec, "--slow-worker")] = factor
        schedules: list[Schedule | None] = [None] * world
        if self.fluctuate is not None:
            schedules = fluctuating_schedules(world, *self.fluctuate)
        if self.trace is not None:
            schedules = self.trace.resolve(world, last)
        return NetworkSpec(world=world, base_bandwidth=bandwidth, schedules=schedules, latency=self.latency,
                           jitter=self.jitter, compute_factors=factors, mode=self.mode, preset=self.preset,
                           nodes=node_ids(world, workers, workers_per_node))


def node_ids(world: int, workers: int, workers_per_node: int) -> list[int]:
    """The node of every process: workers in nodes of ``workers_per_node`` consecutive ranks
    (0: one per node), then each parameter server on a node of its own."""
    if workers_per_node <= 0:
        return list(range(world))
    ids = [r // workers_per_node for r in range(workers)]
    first = ids[-1] + 1 if ids else 0
    return ids + list(range(first, first + world - workers))


@dataclass
class NetworkSpec:
    """The emulated network of a run with a known world size. Bandwidths in bits per second."""

    world: int
    base_bandwidth: list[float | None]
    schedules: list[Schedule | None]
    latency: float = 0.0
    jitter: float = 0.0
    compute_factors: list[float] = field(default_factory=list)
    mode: str = "model"
    preset: str = "none"
    nodes: list[int] = field(default_factory=list)  # node of every rank; empty: one rank per node

    @classmethod
    def uniform(cls, world: int, bandwidth: float | None = None, latency: float = 0.0, jitter: float = 0.0,
                mode: str = "model") -> NetworkSpec:
        """Every link the same: ``bandwidth`` bits/s (None: unlimited), ``latency`` seconds."""
        return cls(world=world, base_bandwidth=[bandwidth] * world, schedules=[None] * world, latency=latency,
                   jitter=jitter, compute_factors=[1.0] * world, mode=mode)

    def same_node(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` are distinct ranks of one node (a local, unemulated link)."""
        return bool(self.nodes) and a != b and self.nodes[a] == self.nodes[b]

    def bandwidth(self, rank: int, t: float) -> float | None:
        """Worker ``rank``'s link bandwidth at time ``t`` (bits/s; None: unlimited)."""
        schedule = self.schedules[rank]
        value = schedule.at(max(t, 0.0)) if schedule is not None else None
        return value if value is not None else self.base_bandwidth[rank]

    def next_change(self, t: float, ranks: list[int] | None = None) -> float:
        """The first time after ``t`` at which any of ``ranks``' bandwidth may change."""
        ranks = list(range(self.world)) if ranks is None else ranks
        times = [s.next_change(max(t, 0.0)) for r in ranks if (s := self.schedules[r]) is not None]
        return min(times, default=float("inf"))

    @property
    def shaped(self) -> bool:
        """Whether any link has a bandwidth limit (at any time)."""
        return any(b is not None for b in self.base_bandwidth) or any(s is not None for s in self.schedules)

    @property
    def delays_messages(self) -> bool:
        """Whether the in-process model has anything to add to each message in this mode."""
        return self.latency > 0 or self.jitter > 0 or (self.mode == "model" and self.shaped)

    def describe(self) -> str:
        """One line for logs: ``edge: 20mbit, 10ms; worker 3 computes 4x slower``."""
        parts = []
        bws = sorted({format_bandwidth(b) for b in self.base_bandwidth})
        parts.append("/".join(bws) + (" (traced)" if any(self.schedules) else ""))
        parts.append(f"{self.latency * 1e3:g}ms" + (f" +-{self.jitter * 1e3:g}ms" if self.jitter else ""))
        slow = [f"worker {r} computes {f:g}x slower" for r, f in enumerate(self.compute_factors) if f != 1]
        if self.nodes and len(set(self.nodes)) < self.world:
            slow.append(f"{len(set(self.nodes))} nodes, links inside a node not emulated")
        return f"{self.preset} ({self.mode}): " + ", ".join(parts) + ("; " + "; ".join(slow) if slow else "")
