"""From a run's configuration to the algorithm that trains with it: the one place that reads the
flags an algorithm runs with.

Each algorithm takes a small frozen settings dataclass defined beside it, holding exactly what it
uses: its hyperparameters, the compression settings of one that compresses
(:class:`~distrain.compress.settings.CompressionSettings`) and the run's facts
(:class:`~distrain.algorithms.base.RunFacts`). This module makes them from a ``TrainConfig``
(:data:`SETTINGS`); the algorithms never see the config. :func:`check_algorithm` refuses, before
any worker starts, the flag combinations the chosen algorithm cannot honour
(``TrainConfig.validate`` calls it); :func:`survives` tells the launchers whether a run goes on
when a worker is lost; :func:`build_algorithm` makes one worker's algorithm, and :func:`serve`
runs a parameter server.

Example::

    from distrain.assemble import build_algorithm
    from distrain.config import TrainConfig

    algorithm = build_algorithm("diloco", TrainConfig(sync_every=32).validate())
    algorithm.setup(model, optimizer, transport)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from distrain.algorithms import ALGORITHMS, Algorithm, parameter_server
from distrain.algorithms.adpsgd import ADPSGD, ADPSGDSettings, bipartite_graph
from distrain.algorithms.allreduce import AllReduce, AllReduceSettings
from distrain.algorithms.base import RunFacts
from distrain.algorithms.d2 import D2
from distrain.algorithms.diloco import AUTO, DiLoCo, DiLoCoSettings
from distrain.algorithms.dpsgd import DPSGD, DPSGDSettings
from distrain.algorithms.gossip import GossipSettings
from distrain.algorithms.parameter_server import ParameterServer, PSSettings, ServerSettings
from distrain.algorithms.parameter_server.settings import NO_JOINS_IN_NODES
from distrain.algorithms.prague import Prague, PragueSettings
from distrain.compress.settings import CompressionSettings
from distrain.emulation import Emulation
from distrain.errors import ConfigError, flag
from distrain.optim.optimizers import build_optimizer
from distrain.topology import build_topology, mixing_matrix

if TYPE_CHECKING:  # the type only: the config imports this module to check an algorithm's flags
    from distrain.config import TrainConfig


def algorithm_class(name: str) -> type[Algorithm]:
    """The algorithm called ``name``; the error lists the valid names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError("--algorithm", f"unknown algorithm {name!r}; choose one of: {', '.join(sorted(ALGORITHMS))}") from None


def build_algorithm(name: str, config: TrainConfig) -> Algorithm:
    """One worker's algorithm ``name``, with the settings ``config`` gives it."""
    return algorithm_class(name)(SETTINGS[name](config))


def survives(config: TrainConfig) -> bool:
    """Whether a run with ``config`` goes on when a worker is lost (launchers then keep the
    others running)."""
    name = config.algo.algorithm
    return algorithm_class(name).survives(SETTINGS[name](config))


# -- settings ---------------------------------------------------------------------------------


def run_facts(config: TrainConfig) -> RunFacts:
    c = config.cluster
    return RunFacts(workers=c.workers, min_workers=c.min_workers, timeout=c.timeout, device=c.device,
                    seed=config.run.seed)


def compression_settings(config: TrainConfig) -> CompressionSettings:
    """``--compress`` and its companion flags, the density warm-up's defaults resolved."""
    c = config.compress
    warmup, decay = c.density_schedule()
    hold, hold_until = c.density_hold(config.run.epochs)
    return CompressionSettings(spec=c.compress, error_feedback=c.error_feedback == "on",
                               sparse_collective=c.sparse_collective, momentum_correction=c.momentum_correction == "on",
                               density_warmup_epochs=warmup, density_decay_epochs=decay,
                               density_hold=hold, density_hold_until=hold_until, momentum_masking=not hold)


def allreduce_settings(config: TrainConfig) -> AllReduceSettings:
    a = config.algo
    return AllReduceSettings(bucket_mb=a.bucket_mb, first_bucket_mb=a.first_bucket_mb, ring=a.ring,
                             workers_per_node=a.workers_per_node, on_nonfinite=config.run.on_nonfinite,
                             compression=compression_settings(config), run=run_facts(config))


def dpsgd_settings(config: TrainConfig) -> DPSGDSettings:
    a = config.algo
    return DPSGDSettings(topology=a.topology, mixing=a.mixing, gossip_order=a.gossip_order, run=run_facts(config))


def _gossip_settings(config: TrainConfig, kind: type[GossipSettings], **own: Any) -> Any:
    """The asynchronous gossip settings of ``kind``, with its ``own``."""
    g = config.gossip
    return kind(budget=g.budget, time_budget=g.time_budget, max_lag=g.max_lag, peer_timeout=g.peer_timeout,
                snapshot_every=g.snapshot_every, run=run_facts(config), **own)


def adpsgd_settings(config: TrainConfig) -> ADPSGDSettings:
    return _gossip_settings(config, ADPSGDSettings, topology=config.algo.topology)


def prague_settings(config: TrainConfig) -> PragueSettings:
    return _gossip_settings(config, PragueSettings, group_size=config.gossip.group_size)


def diloco_settings(config: TrainConfig) -> DiLoCoSettings:
    o = config.outer
    return DiLoCoSettings(sync_every=o.sync_every, comm_overhead=o.comm_overhead, sync_every_min=o.sync_every_min,
                          sync_every_max=o.sync_every_max, outer_optimizer=o.outer_optimizer, outer_lr=o.outer_lr,
                          outer_momentum=o.outer_momentum, fragments=o.fragments, overlap_steps=o.overlap_steps,
                          merge_weight=o.merge_weight, compression=compression_settings(config), run=run_facts(config))


def _ps_settings(config: TrainConfig, kind: type[PSSettings], **own: Any) -> Any:
    """The parameter-server settings of ``kind``, with its ``own``."""
    return kind(servers=config.ps.servers, ps_mode=config.ps.ps_mode, workers_per_node=config.algo.workers_per_node,
                compression=compression_settings(config), run=run_facts(config), **own)


def ps_settings(config: TrainConfig) -> PSSettings:
    return _ps_settings(config, PSSettings)


def server_settings(config: TrainConfig) -> ServerSettings:
    r = config.run
    return _ps_settings(config, ServerSettings, max_staleness=config.ps.max_staleness,
                        checkpoint_every=r.checkpoint_every, model=config.model.model, resume=r.resume, epochs=r.epochs)


#: The settings each algorithm takes, made from the config (by name).
SETTINGS: dict[str, Callable[[TrainConfig], Any]] = {
    AllReduce.name: allreduce_settings,
    DPSGD.name: dpsgd_settings,
    D2.name: dpsgd_settings,
    ADPSGD.name: adpsgd_settings,
    Prague.name: prague_settings,
    DiLoCo.name: diloco_settings,
    ParameterServer.name: ps_settings,
}


def serve(config: TrainConfig, run_dir: str | Path | None, like: torch.optim.Optimizer | None = None, *,
          gather_totals: bool = True) -> None:
    """Run one parameter server of a run with ``config`` (this process is one of the last
    ``--servers`` ranks) until every worker's training has ended (see
    :func:`~distrain.algorithms.parameter_server.serve`).

    ``like``: the workers' optimizer (default: the one ``config`` describes); ``run_dir`` None
    saves no checkpoint and resumes from none.
    """
    like, emulation = _server_parts(config, like)
    parameter_server.serve(server_settings(config), run_dir, like, emulation, gather_totals=gather_totals)


def serve_again(config: TrainConfig, run_dir: str | Path | None, rank: int, like: torch.optim.Optimizer | None = None,
                *, gather_totals: bool = True) -> None:
    """Run parameter server ``rank`` (its rank in the run) started again after its loss: it
    returns to the run and takes its range back (see
    :func:`~distrain.algorithms.parameter_server.serve_again`); as :func:`serve` otherwise."""
    like, emulation = _server_parts(config, like, rank)
    parameter_server.serve_again(server_settings(config), run_dir, like, emulation, rank, gather_totals=gather_totals)


def _server_parts(config: TrainConfig, like: torch.optim.Optimizer | None,
                  rank: int | None = None) -> tuple[torch.optim.Optimizer, Emulation]:
    """The optimizer a server copies (``like``, or the one ``config`` describes) and its emulated
    links (``rank``: its rank in the run, where it is not in the default process group)."""
    if like is None:
        o = config.optim
        like = build_optimizer(o.optimizer, [torch.zeros(1, requires_grad=True)], lr=o.lr, momentum=o.momentum,
                               weight_decay=o.weight_decay)
    world = None if rank is None else config.cluster.workers + config.ps.servers
    emulation = Emulation.from_config(config.network, rank, world, seed=config.run.seed, workers=config.cluster.workers,
                                      workers_per_node=config.algo.workers_per_node)
    return like, emulation


# -- what each algorithm refuses before any worker starts ------------------------------------


def check_algorithm(config: TrainConfig) -> None:
    """Refuse settings the chosen algorithm cannot honour (ConfigError), before any worker starts.

    First ``--compress`` for algorithms that would ignore it, then the algorithm's own checks.
    """
    klass = algorithm_class(config.algo.algorithm)
    spec = config.compress.compress.strip()
    if not klass.compresses and spec != "none":
        raise ConfigError("--compress", f"{klass.name} does not compress its traffic; use --compress none, "
                                        f"or --algorithm allreduce or ps to train with {spec}")
    CHECKS.get(klass.name, _no_check)(config, klass.name)


@dataclass(frozen=True)
class Scope:
    """Where a setting takes effect: the algorithms that use it, and what more it needs, if
    anything (a test of the config, and the words that name it)."""

    algorithms: tuple[str, ...]
    needs: Callable[[TrainConfig], bool] | None = None
    needs_text: str = ""


_GOSSIP, _DECENTRALIZED = (ADPSGD.name, Prague.name), (DPSGD.name, D2.name, ADPSGD.name)
_DILOCO, _AUTO_H = (DiLoCo.name,), Scope((DiLoCo.name,), lambda c: c.outer.sync_every == AUTO, "--sync-every auto")

#: The settings that take effect only with some algorithms, or with another setting (by field
#: name). Given with a value other than its default where it would change nothing, one is
#: refused: ``--servers 2`` with allreduce, or ``--max-staleness 4`` with synchronous servers,
#: would otherwise be ignored without a word. ``distrain compare`` gives its shared settings only
#: to the configurations that use them. Not here: ceilings on waits (``--timeout``,
#: ``--peer-timeout``) and ``--compress``'s companions (``--error-feedback``, the density
#: warm-up), which scripts give to every run of a sweep and which change nothing where unused.
SCOPES: dict[str, Scope] = {
    **dict.fromkeys(("bucket_mb", "first_bucket_mb", "ring"), Scope((AllReduce.name,))),
    **dict.fromkeys(("servers", "ps_mode"), Scope((ParameterServer.name,))),
    "max_staleness": Scope((ParameterServer.name,), lambda c: c.ps.ps_mode == "async", "--ps-mode async"),
    "topology": Scope(_DECENTRALIZED), "mixing": Scope((DPSGD.name, D2.name)), "gossip_order": Scope((DPSGD.name,)),
    **dict.fromkeys(("budget", "max_lag", "snapshot_every"), Scope(_GOSSIP)),
    "time_budget": Scope(_GOSSIP, lambda c: c.gossip.budget == "time", "--budget time"),
    "group_size": Scope((Prague.name,)),
    **dict.fromkeys(("sync_every", "outer_optimizer", "outer_lr", "outer_momentum", "fragments", "overlap_steps"),
                    Scope(_DILOCO)),
    **dict.fromkeys(("comm_overhead", "sync_every_min", "sync_every_max"), _AUTO_H),
    "merge_weight": Scope(_DILOCO, lambda c: c.outer.overlap_steps > 0, "--overlap-steps above 0"),
}


def _out_of_effect(config: TrainConfig) -> Iterator[tuple[str, str]]:
    """The settings of :data:`SCOPES` that ``config`` sets to a value other than the default where
    they take no effect, each with the reason."""
    name, defaults = config.algo.algorithm, type(config)()
    for setting, scope in SCOPES.items():
        if config.get(setting) == defaults.get(setting):
            continue
        if name not in scope.algorithms:
            users = " or ".join(scope.algorithms)
            yield setting, f"is used only by --algorithm {users} (this run's is {name}): leave it out, or choose {users}"
        elif scope.needs is not None and not scope.needs(config):
            yield setting, f"takes effect only with {scope.needs_text}: leave it out, or add that"


def check_in_effect(config: TrainConfig) -> None:
    """Refuse the first setting that ``config`` sets where it takes no effect (see
    :data:`SCOPES`), naming its flag and where it would: what ``distrain train``, ``fit()`` and
    ``wrap()`` check beside ``TrainConfig.validate()``, which leaves them to the runs that use
    its settings (a DDP or torchft baseline's config names no algorithm of distrain's and takes
    ``--sync-every``)."""
    for setting, reason in _out_of_effect(config):
        raise ConfigError(flag(setting), reason)


def drop_out_of_effect(config: TrainConfig, keep: Collection[str] = ()) -> None:
    """Set back to its default every setting of ``config`` that takes no effect there, but those in
    ``keep`` (which :func:`check_in_effect` then refuses): ``distrain compare`` gives its shared
    settings to the configurations that use them only."""
    defaults = type(config)()
    for setting, _ in list(_out_of_effect(config)):
        if setting not in keep:
            config.set(setting, defaults.get(setting))


def _no_check(config: TrainConfig, name: str) -> None:
    """Nothing more to refuse."""


def _require_peers(config: TrainConfig, name: str) -> None:
    """Decentralized algorithms have nobody to average with on one worker."""
    if config.cluster.workers < 2:
        raise ConfigError("--workers", f"{name} is decentralized and needs at least 2 workers, got "
                          f"{config.cluster.workers}; use --algorithm allreduce for one worker")


def _check_dpsgd(config: TrainConfig, name: str) -> None:
    """The topology must exist and be connected for ``--workers``, the weights fit it."""
    _require_peers(config, name)
    mixing_matrix(build_topology(config.algo.topology, config.cluster.workers), config.algo.mixing)


def _check_adpsgd(config: TrainConfig, name: str) -> None:
    _require_peers(config, name)
    bipartite_graph(config.algo.topology, config.cluster.workers)


def _check_prague(config: TrainConfig, name: str) -> None:
    _require_peers(config, name)
    g, n = config.gossip.group_size, config.cluster.workers
    if n > 1 and g > n:
        # stacklevel 3: the warning points at the TrainConfig.validate() line that checked the config
        warnings.warn(f"--group-size {g} is larger than --workers {n}: groups will have {n} workers", stacklevel=3)


def _check_diloco(config: TrainConfig, name: str) -> None:
    o = config.outer
    if o.sync_every == AUTO:
        if o.overlap_steps >= o.sync_every_min:
            raise ConfigError("--overlap-steps", f"must be less than --sync-every-min ({o.sync_every_min}) with "
                                                 f"--sync-every auto, got {o.overlap_steps}")
        return
    if o.fragments > o.sync_every:
        raise ConfigError("--fragments", f"must be at most --sync-every ({o.sync_every}): each fragment syncs at "
                                         f"its own step of the period, got {o.fragments}")
    if o.overlap_steps >= o.sync_every // o.fragments:
        raise ConfigError("--overlap-steps", f"must be less than --sync-every / --fragments "
                                             f"({o.sync_every // o.fragments}), the steps between two syncs, "
                                             f"got {o.overlap_steps}")


def _check_ps(config: TrainConfig, name: str) -> None:
    if config.cluster.max_restarts and config.algo.workers_per_node:
        raise ConfigError("--max-restarts", NO_JOINS_IN_NODES)
    if config.optim.optimizer == "lars":
        raise ConfigError("--optimizer", "lars adapts per layer; the parameter server updates flat shards: use sgd or adam")
    if config.algo.workers_per_node and config.compress.compress.strip() != "none":
        raise ConfigError("--workers-per-node", "hierarchical aggregation does not combine with --compress yet")


#: Each algorithm's checks besides ``--compress`` (by name; none for allreduce).
CHECKS: dict[str, Callable[[TrainConfig, str], None]] = {
    DPSGD.name: _check_dpsgd,
    D2.name: _check_dpsgd,
    ADPSGD.name: _check_adpsgd,
    Prague.name: _check_prague,
    DiLoCo.name: _check_diloco,
    ParameterServer.name: _check_ps,
}
