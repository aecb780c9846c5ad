"""distrain in the user's own training loop: ``wrap(model, optimizer)`` returns a
:class:`DistributedOptimizer` whose ``step()`` does what the chosen algorithm does around the
optimizer step.

The loop stays the user's::

    import torch, distrain

    model = MyModel()
    opt = distrain.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                        algorithm="allreduce", compress="group_topk:0.01")
    loader = torch.utils.data.DataLoader(opt.shard(train_set), batch_size=64, shuffle=True)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()            # aggregate / gossip / compress with error feedback
        opt.zero_grad()
    final = opt.finish()      # the consensus model, on every worker

Run it on one machine with ``distrain launch --workers 4 train.py`` (add ``--network edge`` or
``--slow-worker 3:4x`` to try it on an emulated network), or with ``torchrun --nproc-per-node 4
train.py``; on two machines with ``torchrun --nnodes 2 --nproc-per-node 4 --node-rank R
--master-addr HOST --master-port 29500 train.py``. Without either, the script trains as one
process.

Every algorithm runs this way: allreduce, dpsgd, d2, adpsgd, prague, diloco, and ps, whose
servers are the last ``servers`` ranks (``distrain launch --workers 4 --servers 2 train.py``, or
``torchrun --nproc-per-node 6 train.py`` with ``servers=2``): on those ranks ``wrap()`` serves
until every worker has called ``finish()`` and then exits the process with status 0.

A group of the world (``process_group=``, made with ``torch.distributed.new_group``) trains on
its own, e.g. one data-parallel replica group beside others: allreduce, dpsgd, d2 and diloco, with
ranks, shards, emulated links and ``slow_worker`` counted inside the group.

Elastic runs (``allreduce``, ``diloco``, ``dpsgd``, ``d2``, ``ps`` in sync mode, ``adpsgd``;
``distrain launch --max-restarts R``): a worker started again after its loss joins the others
inside ``wrap()``, which returns once it holds their state (with ``ps``, the servers' parameters;
with ``adpsgd``, a neighbour's model), with
``opt.steps`` where they are; loop with ``while opt.steps < total:``. If the others have finished
by then, ``wrap()`` exits the process with status 0.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from distrain.algorithms import StepContext
from distrain.algorithms.parameter_server import (
    ParameterServer,
    admissions,
    server_optimizer,
)
from distrain.assemble import (
    algorithm_class,
    build_algorithm,
    check_in_effect,
    serve,
    serve_again,
    survives,
)
from distrain.comm.transport import Transport, blocked_seconds
from distrain.config import TrainConfig, copy_of
from distrain.data.partition import labels_of, partition_indices
from distrain.emulation import Emulation
from distrain.errors import ConfigError, WorkerFailure
from distrain.runtime.checkpoint import epoch_steps
from distrain.runtime.faults import (
    grads_finite,
    inject_kill_in,
    is_comm_error,
    lost_peer,
    nonfinite_error,
    start_heartbeat,
    store_client,
)
from distrain.runtime.health import HungPeers
from distrain.runtime.membership import (
    JOIN_ENV,
    NOT_ENTERED,
    Change,
    LeftOut,
    Membership,
    RunEnded,
    enter_run,
    let_go_of_groups,
    mark_elastic,
    mark_opening,
    open_first_group,
    wait_work,
    watch_waits,
)
from distrain.runtime.process import EXIT_LEFT_OUT, freeze_at_exit

log = logging.getLogger(__name__)

#: The environment variable through which ``distrain launch`` hands its settings (the emulated
#: network, the number of servers) to ``wrap()`` in every process: a JSON object of setting names.
SETTINGS_ENV = "DISTRAIN_SETTINGS"

#: A run length for asynchronous budgets when the user gives none: their loop and ``finish()``
#: decide when a worker stops.
UNBOUNDED_STEPS = 2**62

#: How often a worker of asynchronous parameter servers looks for the admissions of workers started
#: again (seconds; a store request each): the servers admit them, the workers record them.
ASYNC_JOINS_LOOK_S = 0.5


def settings_from_env() -> dict[str, Any]:
    """The settings ``distrain launch`` put in :data:`SETTINGS_ENV` (empty when not launched by it)."""
    text = os.environ.get(SETTINGS_ENV, "")
    if not text:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(SETTINGS_ENV, f"is not a JSON object ({exc.msg})") from None
    if not isinstance(values, dict):
        raise ConfigError(SETTINGS_ENV, f"must be a JSON object of settings, got {type(values).__name__}")
    return values


def _world_from_env() -> tuple[int, int]:
    """(rank, world size) of this process as the launcher set them; (0, 1) without a launcher."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError("RANK/WORLD_SIZE", f"must be integers, got RANK={os.environ.get('RANK')!r} "
                          f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}") from None


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, config: TrainConfig | None = None,
         process_group: Any = None, total_steps: int | None = None, steps_per_epoch: int | None = None,
         **settings: Any) -> DistributedOptimizer:
    """Make ``optimizer`` a distributed one: the chosen algorithm runs around its ``step()``.

    Joins the process group that ``distrain launch`` or ``torchrun`` describes in the environment
    (one process of world size 1 when there is none), or uses the default group the caller has
    already initialised. Rank 0's parameters and buffers are copied to every worker, as DDP does.

    Args:
        model: the user's model, on its device; its parameters are the ones ``optimizer`` steps.
        optimizer: the user's optimizer; schedulers attached to it keep working.
        config: a :class:`~distrain.config.TrainConfig` to start from (not modified).
        process_group: the group to train in: None or the world for every process of the run,
            or a group of some of its processes (``torch.distributed.new_group``, with the default
            group initialised by the caller), which trains apart from the others (allreduce,
            dpsgd, d2 and diloco; ranks, shards, emulated links and ``slow_worker`` then count
            within the group, and its losses are not survived).
        total_steps: the run's length in steps per worker, for ``keep_going()`` and asynchronous
            budgets; :meth:`DistributedOptimizer.shard` derives it from ``epochs`` otherwise.
        steps_per_epoch: steps per worker in one pass over the data (density warm-up epochs,
            asynchronous budgets); also set by :meth:`DistributedOptimizer.shard`.
        **settings: distrain's settings by field name, as on the command line with underscores
            (``algorithm="dpsgd"``, ``compress="group_topk:0.01"``, ``network="edge"``,
            ``slow_worker="3:4x"``); they override those ``distrain launch`` sets. A bad value
            raises :class:`~distrain.errors.ConfigError` naming the setting.

    The process's exit then skips the interpreter's last garbage collection (``gc.freeze`` at
    exit, :mod:`distrain.runtime.process`): about 0.8 s per process with torch loaded. Objects
    still in reference cycles at exit are not finalized then, which Python does not promise
    anyway: close files and writers before the script ends.

    Example::

        opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            algorithm="dpsgd", topology="ring")
    """
    cfg = _configure(config, settings, model, process_group, optimizer)
    freeze_at_exit()  # this process's exit skips the last garbage collection (about 0.8 s with torch)
    _one_line_on_uncaught()
    if _subgroup(process_group):  # the caller's group of some of the processes: nothing else to set up
        return DistributedOptimizer(model, optimizer, cfg, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                                    workers_group=process_group, process_group=process_group)
    if os.environ.get(JOIN_ENV) and not dist.is_initialized():  # a worker started again after its loss
        if int(os.environ.get("RANK", "0")) >= cfg.cluster.workers:  # a parameter server: it takes its range back
            _serve_again(cfg, optimizer)
        try:
            joined = enter_run(cfg)
        except RunEnded as exc:  # the others finished before it could join: nothing left to do
            log.warning("%s; it leaves", exc)
            raise SystemExit(0) from None
        # (a LeftOut here, e.g. a server lost as it came, ends the script with EXIT_LEFT_OUT: the hook above)
        return DistributedOptimizer(model, optimizer, cfg, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                                    owns_group=dist.is_initialized(), joined=joined)  # (ps: a link, no group)
    first = _open_elastic(cfg)  # an elastic run: its first group, over the workers that came
    created = first is not None or _join(cfg)
    try:
        workers = cfg.cluster.workers
        servers = 0 if first is not None else dist.get_world_size() - workers  # (first: over the workers that came)
        group = dist.new_group(list(range(workers))) if servers else None  # collective: servers too
        if survives(cfg):  # ps, asynchronous gossip: distrain launch keeps the others going
            mark_elastic(store_client(cfg.cluster.timeout))
        if dist.get_rank() >= workers:
            _serve(cfg, optimizer)  # a parameter server: serve until the workers are done, then exit
        return DistributedOptimizer(model, optimizer, cfg, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                                    owns_group=created, workers_group=group, first=first)
    except BaseException:  # SystemExit from a server too: the group it opened is closed first
        if created:
            dist.destroy_process_group()
        raise


def _one_line_on_uncaught() -> None:
    """A :class:`~distrain.errors.WorkerFailure` that ends the user's script (a peer lost where
    the run cannot go on without it, the run stopped for another worker's reason) prints its one
    line instead of a traceback through distrain's internals (``distrain launch`` quotes the line
    as the rank's cause); the script still exits with status 1. A
    :class:`~distrain.runtime.membership.LeftOut` (the others went on without this worker, e.g. it
    was stopped while they agreed on the members) exits with ``EXIT_LEFT_OUT`` after its line:
    ``distrain launch`` then counts the worker lost, as if it had died, and the others go on.
    Installed once per process, in front of the hook already there."""
    previous = sys.excepthook
    if getattr(previous, "distrain_one_line", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not isinstance(exc, WorkerFailure):
            previous(kind, exc, tb)
            return
        # (torch's hook, installed later in front, swaps sys.stderr for a buffer)
        print(exc, file=sys.__stderr__ or sys.stderr, flush=True)
        sys.stdout.flush()
        if isinstance(exc, LeftOut):
            os._exit(EXIT_LEFT_OUT)  # (the interpreter would exit with status 1 after any hook)

    hook.distrain_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _check_arguments(model: Any, optimizer: Any) -> None:
    """wrap()'s model and optimizer, in one line each: a module, and an optimizer over its
    parameters (its ``config`` is checked by :func:`~distrain.config.copy_of`)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", f"must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("optimizer", f"must be a torch.optim.Optimizer over the model's parameters, got "
                          f"{type(optimizer).__name__}")
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained = [p for p in model.parameters() if p.requires_grad]
    if trained and not stepped & {id(p) for p in trained}:
        raise ConfigError("optimizer", "steps none of the model's parameters: make it over model.parameters()")


def _configure(config: TrainConfig | None, settings: dict[str, Any], model: torch.nn.Module,
               process_group: Any, optimizer: torch.optim.Optimizer) -> TrainConfig:
    """The run's settings: ``config`` (copied), then ``distrain launch``'s, then the caller's;
    checked for this world before any process group exists."""
    _check_arguments(model, optimizer)
    cfg = copy_of(config, "wrap(model, optimizer, algorithm='dpsgd')")
    given = {**settings_from_env(), **settings}
    if config is None and "momentum_correction" not in given:
        # Momentum correction moves an SGD optimizer's momentum into the compressor, i.e. edits
        # the user's optimizer: only when asked for.
        given["momentum_correction"] = "off"
    for name, value in given.items():
        cfg.set(name, value)
    if (cfg.compress.momentum_correction == "off" and "momentum_correction" not in settings
            and cfg.compress.compress.split(":")[0] in ("topk", "group_topk", "randomk")
            and isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum") for g in optimizer.param_groups)):
        warnings.warn(f"compress={cfg.compress.compress!r} with SGD momentum: momentum_correction='on' applies the "
                      "momentum before sparsifying (Deep Gradient Compression; it sets your optimizer's momentum to "
                      "0 and keeps it in distrain's state), which usually keeps accuracy", stacklevel=3)
    if process_group is not None and not dist.is_initialized():
        raise ConfigError("process_group", "needs the default group first: initialise it with "
                          "torch.distributed.init_process_group, then make the group with torch.distributed.new_group")
    subgroup = _subgroup(process_group)
    if subgroup and dist.get_rank(process_group) < 0:
        raise ConfigError("process_group", f"this process (rank {dist.get_rank()}) is not a member of the group "
                          "it was given; give each process the group it belongs to")
    if dist.is_initialized() and "nccl" in (backend := str(dist.get_backend())) and "gloo" not in backend:
        raise ConfigError("process_group", f"the default group's backend is {backend!r}, which moves CUDA tensors "
                          "only, and distrain's control messages are CPU tensors: initialise it with "
                          "backend='cpu:gloo,cuda:nccl'")
    world = dist.get_world_size(process_group if subgroup else None) if dist.is_initialized() else _world_from_env()[1]
    if subgroup:
        _check_subgroup(cfg)
    servers = cfg.ps.servers if cfg.algo.algorithm == "ps" else 0
    if "servers" in given and not servers:
        raise ConfigError("servers", f"starts parameter servers, which only algorithm 'ps' uses; this script's "
                          f"algorithm is {cfg.algo.algorithm!r}")
    if world - servers < 1:
        raise ConfigError("servers", f"{servers} server(s) leave no training worker in a world of {world} processes")
    param = next(iter(model.parameters()), None)
    device = "cuda" if param is not None and param.device.type == "cuda" else "cpu"
    cfg = replace(cfg, cluster=replace(cfg.cluster, workers=world - servers, device=device))
    cfg.validate()
    check_in_effect(cfg)
    if servers:  # the servers step this optimizer's kind on their shards: refuse what they cannot, now
        server_optimizer(optimizer, torch.nn.Parameter(torch.zeros(1)), asynchronous=cfg.ps.ps_mode == "async",
                         pushers=cfg.cluster.workers, max_staleness=cfg.ps.max_staleness, corrected=False)
    return cfg


#: The algorithms that train in a group of some of the run's processes: those whose traffic all
#: goes through the Transport over the given group (the others make groups over the world).
SUBGROUP_ALGORITHMS = ("allreduce", "dpsgd", "d2", "diloco")


def _subgroup(process_group: Any) -> bool:
    """Whether ``process_group`` is a group of only some of the world's processes."""
    return (process_group is not None and process_group is not dist.group.WORLD and dist.is_initialized()
            and dist.get_world_size(process_group) != dist.get_world_size())


def _check_subgroup(cfg: TrainConfig) -> None:
    """Refuse what cannot train inside a group of some of the processes."""
    if cfg.algo.algorithm not in SUBGROUP_ALGORITHMS:
        raise ConfigError("process_group", f"a group of some of the processes trains with {', '.join(SUBGROUP_ALGORITHMS)}; "
                          f"{cfg.algo.algorithm!r} makes process groups over the whole world: use the default group")
    if cfg.algo.workers_per_node:
        raise ConfigError("workers_per_node", "hierarchical aggregation makes process groups over the whole world; "
                          "use 0 with a process_group of some of the processes")


def _serve(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> None:
    """This process is a parameter server (the last ``servers`` ranks): serve the workers with
    ``optimizer``'s kind and hyperparameters until every worker's training has ended, then leave
    the process (SystemExit(0)): the rest of the user's script is a worker's."""
    log.info("rank %d: parameter server %d of %d", dist.get_rank(), dist.get_rank() - cfg.cluster.workers,
             cfg.ps.servers)
    serve(cfg, None, optimizer, gather_totals=False)
    raise SystemExit(0)


def _serve_again(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> None:
    """This process is a parameter server started again after its loss: return to the run, serve
    until the workers are done, then leave the process (SystemExit(0)), as :func:`_serve`."""

    rank = int(os.environ["RANK"])
    log.info("rank %d: parameter server %d started again; it returns to the run", rank, rank - cfg.cluster.workers)
    serve_again(cfg, None, rank, optimizer, gather_totals=False)
    raise SystemExit(0)


def _loses_workers(cfg: TrainConfig, workers: int) -> bool:
    """Whether a run of ``workers`` workers with ``cfg`` goes on over the survivors of a lost
    worker, through a :class:`~distrain.runtime.membership.Membership` (an elastic algorithm,
    several workers, ``min_workers`` below them, gloo on CPU, not under torchrun, whose agent
    restarts every worker instead)."""
    c = cfg.cluster
    return (algorithm_class(cfg.algo.algorithm).elastic and workers > 1 and c.min_workers < workers
            and c.device == "cpu" and "TORCHELASTIC_RUN_ID" not in os.environ)


def _open_elastic(cfg: TrainConfig) -> Membership | None:
    """An elastic run's membership, whose first default group this call opens over the workers
    that came (:func:`~distrain.runtime.membership.open_first_group`): a worker lost before or as
    the group opens is left out, where a group over every process would wait for it. None: the
    group opens as usual (:func:`_join`): one is open already, the run is not elastic, or no
    launcher's store declares deaths."""
    if dist.is_initialized() or not _loses_workers(cfg, cfg.cluster.workers) or "MASTER_ADDR" not in os.environ \
            or "MASTER_PORT" not in os.environ:
        return None
    from distrain.comm.group import backend_for, check_device

    rank, world = _world_from_env()
    if world != cfg.cluster.workers:  # (parameter servers' processes: they are not elastic this way)
        return None
    check_device(cfg, processes=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return open_first_group(rank, world, min_workers=cfg.cluster.min_workers, backend=backend_for(cfg),
                            timeout=cfg.cluster.timeout)


def _join(cfg: TrainConfig) -> bool:
    """Open the default process group unless one exists; True when this call opened it."""
    if dist.is_initialized():
        return False
    from distrain.comm.group import check_device, init_group

    rank, world = _world_from_env()
    check_device(cfg, processes=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # distrain launch: it may start a rank lost before again
            mark_opening(store_client(cfg.cluster.timeout), rank)
        init_group(cfg, rank, world, "env://")
    elif world == 1:
        init_group(cfg, 0, 1)
    else:
        raise ConfigError("WORLD_SIZE", f"is {world} but MASTER_ADDR / MASTER_PORT are not set; start the script "
                          "with 'distrain launch' or torchrun")
    return True


class DistributedOptimizer:
    """The user's optimizer with a distributed training algorithm around its step.

    Made by :func:`wrap`. Per step the user calls ``loss.backward()``, :meth:`step` and
    :meth:`zero_grad`; at the end :meth:`finish`. Gradient all-reduce overlaps backward (its hooks
    are registered when wrapping); ``step()`` waits for it.

    Attributes:
        rank: this worker's rank (in ``process_group`` when :func:`wrap` was given one).
        workers: the number of training workers (of that group).
        is_worker: True: a parameter server's process (``algorithm="ps"``, the last ``servers``
            ranks) never returns from :func:`wrap`; it serves until every worker has called
            :meth:`finish`, then exits with status 0.
        optimizer: the user's optimizer.
        steps: steps taken by this worker.
        config: the settings in force.
    """

    is_worker = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, *,
                 total_steps: int | None = None, steps_per_epoch: int | None = None, owns_group: bool = False,
                 workers_group: Any = None, broadcast: bool = True, heartbeat: bool = True,
                 joined: Membership | None = None, process_group: Any = None,
                 first: Membership | None = None) -> None:
        self.model, self.optimizer, self.config = model, optimizer, config
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self._owns_group = owns_group
        #: the training workers' group when the world also holds parameter servers, else None
        self.workers_group = workers_group
        #: the group of some of the processes that this optimizer trains in (``wrap(process_group=)``),
        #: else None (the default group)
        self.process_group = process_group
        self.algorithm = build_algorithm(config.algo.algorithm, config)
        # A worker keeps its emulated device and links by its id, whatever its rank; in a group of
        # some of the processes, by its rank in that group.
        # (``first``: the membership whose first group wrap() opened over the workers that came)
        known = joined if joined is not None else first
        me, world = (known.me, self.algorithm.processes(config.cluster.workers)) if known is not None else (None, None)
        if process_group is not None:
            me, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.emulation = Emulation.from_config(config.network, me, world, seed=config.run.seed,
                                               workers=config.cluster.workers, workers_per_node=config.algo.workers_per_node)
        # A worker that joins again either enters the members' new group (synchronous elastic
        # algorithms) or trains over links its peers open with it (the parameter servers,
        # asynchronous gossip): the algorithm says which.
        link = self.algorithm.joiner_transport(joined, self.emulation.link_model) if joined is not None else None
        if link is not None:
            assert joined is not None
            self.transport: Transport = link[0]
            self.rank, self.workers = link[1], len(joined.members)
        else:
            self.transport = Transport(process_group, link_model=self.emulation.link_model,
                                       ids=known.members if known else None)
            self.rank, self.workers = self.transport.rank, dist.get_world_size(workers_group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        #: the workers' ids (their ranks when the run started) in rank order; an elastic run
        #: drops the lost ones and adds those that join
        self.ids = list(known.members) if known is not None else list(range(self.workers))
        self.id = known.me if known is not None else self.rank
        self.membership = None if link is not None else known or self._elastic_membership()
        if self.membership is not None:
            watch_waits(self.membership.changed)  # this thread's waits leave as soon as a survivor flags a loss
            self.transport.meet = self.membership.meet
        #: a run that stops on a lost peer: this thread's waits end a few seconds after a peer
        #: stopped answering (its heartbeat stopped), not at --timeout
        self._hung_watch = self._watch_for_hung_peers(link is None and known is None)
        #: membership changes so far (elastic runs), as records for metrics and the summary
        self.changes: list[Change] = []
        self._retired: tuple[list[int], list[int], float] | None = None  # traffic of groups left behind
        # Asynchronous gossip tells a lost peer from a slow one by its heartbeat in the store, and
        # so do elastic survivors and servers (distrain's own loop stamps one for every algorithm). Stamped
        # before the first collective: a survivor of a loss as the run starts finds every other
        # worker's heartbeat, so none is taken for silent.
        wants_heartbeat = self.algorithm.stamps_heartbeat or self.membership is not None or self._hung_watch is not None
        world = dist.get_world_size() if known is None else self.config.cluster.workers
        # (a worker that joins stamps from before it asked to join)
        self._heartbeat = joined.heartbeat if joined is not None and joined.heartbeat is not None \
            else start_heartbeat(self.id, world, ceiling=config.cluster.timeout) if heartbeat and wants_heartbeat else None
        #: whether the workers start from rank 0's parameters and buffers (an elastic run: rank 0
        #: of the group the algorithm is set up over, :meth:`_set_up_first`)
        self._from_rank0 = broadcast and joined is None
        if self._from_rank0 and self.membership is None:
            _broadcast_from_rank0(model, workers_group)
        self._set_up_first(joined is not None)
        #: parameter servers that admit workers started again (the servers hand them the
        #: parameters; the workers only record the change): where this worker learns of joins
        self.joins = self._server_admissions(joined)
        self._joins_looked = time.monotonic()  # asynchronous parameter servers: the last look for joiners
        if self.membership is not None:
            self._make_elastic()
        self.steps = 0
        self.compute_seconds = self.exposed_seconds = 0.0  # summed over this worker's steps
        #: compute seconds of the last step (forward and backward, without network waits, with
        #: an emulated slowdown's stretch)
        self.last_compute_seconds = 0.0
        self._started = self._finished = False
        #: True when the last step's gradient was dropped (non-finite, ``on_nonfinite="skip"``)
        self.skipped = False
        self._forward_at: float | None = None
        self._blocked_at_forward = 0.0
        self._last_step_end = time.perf_counter()
        self._forward_hook = model.register_forward_pre_hook(self._forward_started, prepend=True)
        self._final: torch.nn.Module | None = None
        #: a worker that joins, until it holds a member's state
        self._fresh = joined is not None and link is None
        if joined is not None:  # the members wait in their step's end for this worker to take their state
            if link is not None:  # the servers hand it their parameters, or a neighbour its model
                self.steps = self.algorithm.join()
                self.changes.append(self._joined_change(joined))
            else:  # its admission, and the losses that interrupted it (the last one's members hand it their state)
                self.changes = list(joined.changes)
                self._hand_over(joined.changes[-1], NOT_ENTERED)
            self._started = True
            self._begin()
            log.warning("worker %d joined the run at step %d with %d workers", self.id, self.steps, self.workers)

    def _set_up_first(self, joins: bool) -> None:
        """Set the algorithm up over the first group (a worker that ``joins``: the group the
        members opened with it), the workers first taking rank 0's parameters. In an elastic
        run, a worker lost meanwhile (as the first group opened, in that broadcast, as the node
        groups are made) makes the others agree on the survivors and do both over their group,
        from its rank 0."""
        if self.membership is None:
            self.algorithm.setup(self.model, self.optimizer, self.transport)
            return
        def first_try() -> None:
            self._start_from_rank0()
            self.algorithm.setup(self.model, self.optimizer, self.transport)

        def set_up() -> None:
            if self.algorithm is not None:  # the first try, over the first group
                self._guarded(first_try)
            else:  # a loss undid it (_guarded let it go): over the survivors' group
                self._set_up_again(start=False)

        self.membership.settle(lambda: None, NOT_ENTERED if joins else 0, then=set_up)
        # the losses as the run started, its first group's opening included (a joiner takes its
        # admission's changes with the others' state)
        changes = [] if joins else list(self.membership.changes)
        if changes:
            width = self.config.cluster.workers  # the run's workers, each counted by its id from now on
            self.changes += changes
            self._retired = ([0] * width, [0] * width, 0.0)
            log.warning("worker %d: lost worker(s) %s as the run started; %d workers go on (recovered in %.2f s)",
                        self.id, sorted({w for c in changes for w in c.lost}), self.workers, changes[-1].seconds)

    def _guarded(self, set_up: Callable[[], None]) -> None:
        """``set_up()``; when it fails, the algorithm and transport it left half made are closed
        (best effort) and let go before the error goes on."""
        try:
            set_up()
        except BaseException:
            for part in (self.algorithm, self.transport):
                with contextlib.suppress(Exception):
                    part.close()
            self.algorithm = self.transport = None  # type: ignore[assignment]
            gc.collect()
            raise

    def _set_up_again(self, start: bool = True) -> None:
        """After a change of members: transport and algorithm over the new default group (see
        :meth:`_build`), or nothing of them left if it fails (a member lost meanwhile)."""
        assert self.membership is not None
        self._guarded(lambda: self._build(self.membership.members, start))

    def _joined_change(self, joined: Membership) -> Change:
        members, steps = joined._members_of(joined.epoch)
        return Change(joined.epoch, members, [], steps, time.time(), 0.0, self.steps, joined=[joined.me])

    def _server_admissions(self, joined: Membership | None) -> Membership | None:
        """Where workers started again ask to join, in an elastic parameter-server run whose
        launcher starts lost workers again (None otherwise); a worker that joined goes on with
        the admissions that let it in (``joined``)."""
        algorithm = self.algorithm
        if not isinstance(algorithm, ParameterServer) or not algorithm.survives(algorithm.settings):
            return None
        if joined is not None:
            return joined
        return admissions(store_client(self.config.cluster.timeout), self.ids, self.id, algorithm.settings)

    def _watch_for_hung_peers(self, default_group: bool) -> HungPeers | None:
        """Where a lost peer stops the run (no membership) and the default group holds every
        process: make this thread's waits end with a one-line failure a few seconds after a peer
        stopped answering (:class:`~distrain.runtime.health.HungPeers`), where gloo would wait out
        ``--timeout``. On the CPU (gloo's waits can be polled), not in a group of some of the
        processes (``wrap(process_group=)``), nor for a worker that trains over links of its own.
        Asynchronous gossip's training thread polls it where it waits for its gossip threads."""
        if self.membership is not None or not default_group or self.process_group is not None \
                or self.config.cluster.device != "cpu" or not dist.is_initialized():
            return None
        algorithm = type(self.algorithm)
        if not algorithm.elastic and algorithm.survives(self.algorithm.settings):
            return None  # (parameter servers and asynchronous gossip go on without a silent peer themselves)
        watch = HungPeers.from_env(dist.get_rank(), list(range(dist.get_world_size())), on_hung=let_go_of_groups)
        if watch is not None:
            watch_waits(watch)
        return watch

    def _make_elastic(self) -> None:
        """The algorithm of an elastic run keeps its own gradients of the step in flight (a redo
        starts from them)."""
        self.algorithm.keep_local = True

    def _elastic_membership(self) -> Membership | None:
        """The run's membership when the survivors of a lost worker go on: an elastic algorithm,
        several workers and no servers, gloo, a store outside the workers (``distrain train``'s
        or ``distrain launch``'s; under torchrun its agent restarts every worker instead), and
        ``min_workers`` below the number of workers."""
        c = self.config.cluster
        if self.workers_group is not None or not _loses_workers(self.config, self.workers):
            return None
        from distrain.comm.group import backend_for

        return Membership.from_env(self.ids, self.id, min_workers=c.min_workers, backend=backend_for(self.config),
                                   timeout=c.timeout)

    # -- the user's optimizer, seen through -------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- the step ---------------------------------------------------------------------------------

    def _forward_started(self, module: torch.nn.Module, _args: Any) -> None:
        # The step's first training forward (gradient accumulation: several); an evaluation
        # between steps (eval mode) is not the next step's compute.
        if self._forward_at is None and module.training:
            self._forward_at, self._blocked_at_forward = time.perf_counter(), blocked_seconds()

    def start(self) -> None:
        """Start training together (collective, but for an elastic run's workers, whose first
        collective meets them): the emulated network's clock and the algorithm's (asynchronous
        budgets, gossip threads). :meth:`step` calls it the first time; call it earlier to leave
        set-up time out of the first step."""
        if self._started:
            return
        self._started = True
        # An elastic run's workers do not meet here: their first collective meets them. A barrier
        # here comes after the first backward began the step's all-reduces; a loss in it made the
        # survivors that saw it here and those still setting up (the loss was in the start's
        # broadcast) run their collectives over the new group out of step, and wait for ever.
        if self.membership is None and not self.algorithm.meet_to_start():
            dist.barrier(group=self.workers_group)
        self._begin()

    def _begin(self) -> None:
        """The emulated network's clock and the algorithm's start now."""
        self.emulation.start()
        self.algorithm.start(self.total_steps or UNBOUNDED_STEPS, self.steps_per_epoch or 1)
        self._last_step_end = time.perf_counter()

    def step(self, losses: torch.Tensor | None = None) -> None:
        """What the algorithm does around the optimizer step, then the step itself (or the
        servers' / the gossip's equivalent).

        Args:
            losses: this batch's per-sample losses (any shape; detached here), for adaptive
                compression (``compress="adaptive:..."``); optional otherwise.
        """
        if self._finished:
            raise RuntimeError("step() after finish(): this optimizer has ended training")
        with self._naming_lost_peers():
            self._step(losses)

    def _step(self, losses: torch.Tensor | None) -> None:
        self.start()
        began = self._forward_at if self._forward_at is not None else self._last_step_end
        blocked_before = self._blocked_at_forward if self._forward_at is not None else blocked_seconds()
        self.skipped = not self.algorithm.checks_gradients and not grads_finite(self.params)
        if self.skipped:
            self._drop_nonfinite()
        self.emulation.after_compute(time.perf_counter() - began - (blocked_seconds() - blocked_before))
        compute = time.perf_counter() - began - (blocked_seconds() - blocked_before)
        per_epoch = self.steps_per_epoch or 1
        detached = losses.detach().reshape(-1) if losses is not None else None
        if detached is not None and self.skipped:
            detached = torch.zeros_like(detached)  # a dropped gradient says nothing about its samples
        ctx = StepContext(step=self.steps, epoch=(self.steps + 1) / per_epoch,
                          batch_size=len(detached) if detached is not None else self.config.data.batch_size,
                          per_sample_losses=detached, compute_seconds=compute)
        if self.membership is None:
            self._update(ctx)
        else:
            self._elastic_update(ctx)
        self.steps += 1
        if self.membership is not None and self.membership.accepts_joins:
            self._admit_joiners()
        if self.joins is not None:
            self._note_joined()
        if not self.algorithm.synchronous:
            self._note_gossip_joins()
        if self.membership is None and (lost := self.algorithm.newly_lost()):
            self._note_lost(lost)
        self.last_compute_seconds = compute
        self.compute_seconds += compute
        self.exposed_seconds += blocked_seconds() - blocked_before  # every network wait of the step
        self._forward_at, self._last_step_end = None, time.perf_counter()
        if self._heartbeat is not None:
            self._heartbeat.progress()

    @contextlib.contextmanager
    def _naming_lost_peers(self) -> Iterator[None]:
        """A peer lost where the run cannot go on without it (a run that is not elastic, the
        only parameter server) ends in a :class:`~distrain.errors.WorkerFailure` naming this
        worker, the step and the backend's reason in one line, as ``distrain train`` says it,
        instead of the backend's error from deep inside the algorithm (an elastic run's losses
        are handled before they reach here)."""
        try:
            yield
        except WorkerFailure:
            raise
        except Exception as exc:
            if not is_comm_error(exc):
                raise
            raise lost_peer(exc, self.id, self.steps, self._heartbeat) from exc

    def _update(self, ctx: StepContext) -> None:
        self.algorithm.after_backward(ctx)
        self.algorithm.apply_update(ctx)
        self.algorithm.after_update(ctx)

    def _elastic_update(self, ctx: StepContext) -> None:
        """The step; when a peer is lost on the way, the survivors agree, rebuild the group and
        redo it with their own gradients (or, behind a survivor that finished it, take its state)."""
        needs = self.algorithm.redo_needs_gradients
        own = None if not needs or self.algorithm.keeps_local_gradients() \
            else [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        redo = False
        while True:
            try:
                if redo:
                    self.algorithm.redo(ctx)
                else:
                    self._update(ctx)
                return
            except Exception as exc:
                if not Membership.is_loss(exc):
                    raise
                seen = time.perf_counter()
                log.debug("worker %d: a peer is lost at step %d: %r", self.id, self.steps, exc)
                own = (self.algorithm.local_gradients() or own) if needs else None
                before = self.algorithm.state_before_step()
            if needs and own is None:
                raise WorkerFailure(f"worker {self.id}: lost a peer at step {self.steps} with no copy of its own "
                                    "gradients to redo the step") from None
            # A worker behind one that finished the step keeps its state after it (what it sent is in
            # that worker's result); one that redoes the step starts from its state before it.
            if self._recover(seen, own, in_step=True):  # behind a survivor that finished this step, or realigned
                self.steps -= 1  # step() counts it
                if not self.algorithm.redo_when_behind:
                    return
            elif before is not None:
                self.algorithm.load_state_dict(before)
            redo = True

    def control_barrier(self) -> None:
        """Wait for every worker (bookkeeping; in an elastic run, over the survivors of any loss)."""
        self._collective(lambda: self.transport.control_barrier())

    def control_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``tensor``, in rank order (:attr:`ids` names them); bookkeeping, and in an
        elastic run over the survivors of any loss."""
        return self._collective(lambda: self.transport.control_all_gather(tensor))

    def _collective(self, fn: Any) -> Any:
        """``fn()``, a collective outside a step (a barrier, a gather), redone over the survivors
        when a peer is lost on the way."""
        while True:
            try:
                return fn()
            except Exception as exc:
                if self.membership is None or not Membership.is_loss(exc):
                    raise
            # (outside the except block: its traceback holds the failed work, and destroying the old
            # group waited for that work's timeout)
            self._recover(time.perf_counter(), None)

    def _recover(self, seen: float, own: list[torch.Tensor | None] | None, in_step: bool = False) -> bool:
        """Rebuild over the survivors (see :mod:`distrain.runtime.membership`); True when the step
        in flight (``in_step``) is done: this worker was behind the furthest survivor and took its
        parameters and optimizer state, or (decentralized algorithms) the survivors averaged their
        models and this worker now stands at the furthest one's step count; False when it is to be
        redone (``.grad`` holds this worker's own gradients again)."""
        if own is not None:  # the new buckets take them in (the old ones may be half averaged)
            for p, g in zip(self.params, own, strict=True):
                p.grad = g
        done = self.steps + 1 if in_step and self.algorithm.realigns else self.steps  # gossip: the local update is in
        return self._hand_over(None, done, seen)

    def _hand_over(self, change: Change | None, done: int, seen: float = 0.0) -> bool:
        """After a change of members, over the new group (collective): the state moves where the
        change needs it (:meth:`_take_part`); ``change`` None: the survivors of a loss this worker
        saw at ``seen`` (perf_counter) agree on the members first. A loss on the way makes them
        agree again, and the state moves as the new change needs, as often as it takes. Returns
        what :meth:`_recover` does (False after an admission)."""
        while True:
            if change is None:  # agree over whoever is left, with this worker's ``done`` steps
                assert self.membership is not None
                change = self._rebuild(partial(self.membership.recover, done, seen), done)
            try:
                return self._take_part(change, done)
            except Exception as exc:
                if self.membership is None or not Membership.is_loss(exc):
                    raise
                log.debug("worker %d: a peer is lost while the state moves after epoch %d: %r", self.id,
                          self.membership.epoch, exc)
            # (outside the except block: its traceback holds the failed work, and with it the old group)
            seen, change = time.perf_counter(), None
            done = NOT_ENTERED if self._fresh else done

    def _take_part(self, change: Change, done: int) -> bool:
        """An admission: the joiners take rank 0's state (the members keep their own: DiLoCo's
        inner state differs). A loss: who is behind the furthest survivor takes its state, or
        (decentralized algorithms) the survivors average their models; either way a worker whose
        admission the loss interrupted (it registered as :data:`NOT_ENTERED`) takes a member's
        state first."""
        if change.joined:
            self._take_state(0, receive=self.id in change.joined)
            return False
        leader, furthest = change.members.index(change.leader), max(change.steps.values())
        if self.algorithm.realigns:
            if NOT_ENTERED in change.steps.values():
                self._take_state(leader, receive=self._fresh)
            self.steps = furthest
            self.algorithm.realign()
            log.warning("worker %d: lost worker(s) %s at step %d; %d workers average their models and go on "
                        "(recovered in %.2f s)", self.id, change.lost, done, self.workers, change.seconds)
            return True
        behind = change.steps[self.id] < furthest
        if len(set(change.steps.values())) > 1:  # who is behind takes the leader's state
            self._take_state(leader, receive=behind)
        log.warning("worker %d: lost worker(s) %s at step %d; %d workers go on (recovered in %.2f s)", self.id,
                    change.lost, self.steps, self.workers, change.seconds)
        return behind

    def _note_lost(self, lost: dict[int, float]) -> None:
        """Workers lost in a run whose group stays as it is (the parameter servers serve the
        others; asynchronous gossip goes on without them): the members and the record of the
        change follow, so a loop splits the data again over the survivors (``distrain train``
        does). Workers no longer members (a joiner learns of losses before its admission) are
        left out."""
        lost = {i: t for i, t in lost.items() if i in self.ids}
        if not lost:
            return
        members = [i for i in self.ids if i not in lost]
        at = min(lost.values())
        self.ids, self.workers = members, len(members)
        self.changes.append(Change(epoch=len(self.changes) + 1, members=members, lost=sorted(lost), steps={}, at=at,
                                   seconds=max(0.0, time.time() - at), step=self.steps))
        if self.algorithm.synchronous:  # (asynchronous gossip's engine has said so already)
            log.warning("worker %d: the servers lost worker(s) %s at step %d; %d workers go on", self.id,
                        sorted(lost), self.steps, self.workers)
        else:
            log.info("worker %d: lost worker(s) %s at step %d; the data is dealt out over %d workers", self.id,
                     sorted(lost), self.steps, self.workers)

    def _note_joined(self, force: bool = False) -> None:
        """At a step's end, in a parameter-server run: when the workers and servers agreed to admit
        workers started again after this step, the members and the record of the change follow
        (the servers hand them the parameters), so a loop splits the data again over them. A loss
        not read from the store yet (a joiner's own earlier one among them) is recorded first. A
        parameter server started again after its loss takes its range back here too
        (:meth:`~distrain.algorithms.parameter_server.ParameterServer.server_back`)."""
        assert self.joins is not None and isinstance(self.algorithm, ParameterServer)
        if self.algorithm.asynchronous:  # no common step: the servers admit them at once, this worker follows
            if not force and time.monotonic() - self._joins_looked < ASYNC_JOINS_LOOK_S:
                return
            self._joins_looked = time.monotonic()
            growth = self.joins.growth_now()
            if growth is None:
                return
        else:
            growth = self.joins.planned_growth(self.steps)
            if growth is None or growth.at != self.steps:
                return
        since = time.perf_counter()
        change = self.joins.admit(growth, self.steps, since, self.algorithm.live_workers(),
                                  servers_from=self.config.cluster.workers)
        for server in change.returned:  # a lost server started again takes its range back (before any joiner)
            self.algorithm.server_back(server, self.joins, [m for m in change.members if m not in change.joined])
        if not change.joined:
            return
        missed = {i: time.time() for i in self.ids if i not in change.members or i in change.joined}
        missed.update({i: t for i, t in self.algorithm.newly_lost(force=True).items() if i in self.ids})
        if missed:
            self._note_lost(missed)
        self.algorithm.rejoin(change.joined)
        self.ids = [i for i in change.members if i in self.ids or i in change.joined]
        self.workers = len(self.ids)
        self.changes.append(change)
        log.info("worker %d: worker(s) %s joined after step %d; %d workers go on", self.id, change.joined,
                 self.steps, self.workers)

    def _note_gossip_joins(self) -> None:
        """Asynchronous gossip: the admissions of workers started again that this worker took part
        in (its gossip threads admit them, see :mod:`distrain.algorithms.rejoin`) become records;
        the loss of each joiner is recorded first. The members then are the workers not declared
        dead and the joiners, in order of their ids."""
        for change in self.algorithm.newly_joined():
            missed = [i for i in self.ids if i not in change.members or i in change.joined]
            if missed:
                members = [i for i in self.ids if i not in missed]
                self.changes.append(Change(epoch=change.epoch, members=members, lost=missed, steps={}, at=change.at,
                                           seconds=0.0, step=change.step))
            self.ids, self.workers = list(change.members), len(change.members)
            self.changes.append(change)
            log.info("worker %d: worker(s) %s joined again at step %d; %d workers", self.id, change.joined,
                     self.steps, self.workers)

    def _admit_joiners(self) -> None:
        """At a step's end: when the members agreed to admit waiting workers after this step,
        open the group with them and hand them this run's state (collective)."""
        assert self.membership is not None
        growth = self.membership.planned_growth(self.steps, self.algorithm.admission_step,
                                                self.algorithm.admission_every)
        if growth is None or growth.at != self.steps:
            return
        since, membership = time.perf_counter(), self.membership
        try:
            inject_kill_in("admission", self.id)  # fault injection for tests
            self.algorithm.before_admission()
        except Exception as exc:  # (the joiners are admitted at a later step, in the next epoch)
            if not Membership.is_loss(exc):
                raise
            lost = True
        else:
            lost = False
        if lost:  # (outside the except block, as in _hand_over)
            self._recover(time.perf_counter(), None)
            return
        change = self._rebuild(lambda: membership.grow(growth, self.steps, since), self.steps)
        inject_kill_in("handover", self.id)  # fault injection for tests
        self._hand_over(change, self.steps)
        if self.changes[-1].joined:  # (else a loss interrupted it, and _take_part said so)
            log.warning("worker %d: worker(s) %s joined after step %d; %d workers go on (in %.2f s)", self.id,
                        change.joined, self.steps, self.workers, time.perf_counter() - since)

    def _rebuild(self, change_members: Any, steps: int) -> Change:
        """Close the algorithm and transport, change the members (``change_members()``: the new
        default group is open after it; a loss on the way makes the others agree again, with this
        worker's ``steps``) and build them again over the new group."""
        state = self.algorithm.state_dict()
        self.algorithm.close()
        self._retired = self.peer_traffic()  # the closed group's bytes stay this worker's
        self.transport.close()
        # Nothing may keep the old group's work alive: its connections stay open while it lives,
        # and a member still waiting in it would wait for the whole timeout.
        self.algorithm = self.transport = None  # type: ignore[assignment]
        gc.collect()
        assert self.membership is not None
        changes = self.membership.settle(change_members, steps, then=self._set_up_again)
        self.algorithm.load_state_dict(state)
        self.algorithm.membership_changed()
        self.changes += changes
        return changes[-1]

    def _build(self, members: list[int], start: bool = True) -> None:
        """Transport and algorithm over the default group, whose ranks are the workers ``members``
        (``start``: the algorithm started, as after a change in a run under way)."""
        assert self.membership is not None
        inject_kill_in("build", self.id)  # fault injection for tests
        self.ids, self.rank, self.workers = list(members), self.membership.rank, len(members)
        self.transport = Transport(link_model=self.emulation.link_model, ids=self.ids, meet=self.membership.meet)
        # a loss before anyone's first step (as a member set up, or already waiting to start): every
        # member, whichever it was doing, takes the parameters of the new group's rank 0 again
        changes = self.membership.changes
        if changes and max(changes[-1].steps.values(), default=0) <= 0:
            self._start_from_rank0()
        self.algorithm = build_algorithm(self.config.algo.algorithm, self.config)
        self.algorithm.setup(self.model, self.optimizer, self.transport)
        self._make_elastic()
        if start:
            self.algorithm.start(self.total_steps or UNBOUNDED_STEPS, self.steps_per_epoch or 1)

    @torch.no_grad()
    def _start_from_rank0(self) -> None:
        """An elastic run's start: every member takes the parameters and buffers of the group's
        rank 0 (as :func:`_broadcast_from_rank0`), each wait ending as soon as a survivor flags
        a loss (a worker that received part of a lost rank 0's tensors takes the new rank 0's
        again, so the members start alike)."""
        if self._from_rank0:
            inject_kill_in("start-broadcast", self.id)  # fault injection for tests
            _broadcast_from_rank0(self.model, None)

    @torch.no_grad()
    def _take_state(self, src: int, receive: bool = True) -> None:
        """Rank ``src`` hands its parameters, buffers, optimizer state, the algorithm's replicated
        state and its step count to the workers that ``receive`` them (collective over the group;
        the others take part with scratch copies; set-up traffic, not counted as training). A
        worker that has not stepped yet (one that joins) first makes its optimizer's state
        tensors, with a step on zero gradients that leaves its parameters."""
        receive = receive and self.rank != src

        def broadcast(t: torch.Tensor) -> None:
            wait_work(dist.broadcast(t if receive or self.rank == src else t.clone(), src=src, async_op=True))

        def shape(tensors: list[torch.Tensor]) -> tuple[int, int]:
            return len(tensors), sum(t.numel() for t in tensors)

        mine = self._state_tensors()
        leader = torch.tensor([*shape(mine), self.steps], dtype=torch.int64)
        broadcast(leader)
        if int(leader[0]) != len(mine) and not self.optimizer.state:
            self._prime_optimizer()
            mine = self._state_tensors()
        if (int(leader[0]), int(leader[1])) != shape(mine):
            raise WorkerFailure(f"worker {self.id}: its optimizer state does not match the other workers' (a peer "
                                "was lost in the first steps); it cannot take their state")
        for t in mine:
            broadcast(t.data)
        replica = self.algorithm.replica_state()
        for t in replica:
            broadcast(t)
        if receive:
            self.algorithm.load_replica_state(replica)
            self.steps = int(leader[2])
            if self._fresh:  # a worker that joined holds a member's state now
                self._fresh = False
                self.algorithm.entered()

    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for p in (q for group in self.optimizer.param_groups for q in group["params"]):
            tensors += [v for _, v in sorted(self.optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
        return tensors

    @torch.no_grad()
    def _prime_optimizer(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved, grads = [p.detach().clone() for p in params], [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for p, value, grad in zip(params, saved, grads, strict=True):
            p.copy_(value)
            p.grad = grad

    def _drop_nonfinite(self) -> None:
        """A NaN or infinite gradient never leaves this worker: stop, or (``on_nonfinite="skip"``)
        send zeros for this step."""
        if self.config.run.on_nonfinite != "skip":
            raise nonfinite_error(self.rank, self.steps, "gradient")
        log.warning("worker %d: non-finite gradient at step %d; its gradient is dropped", self.rank, self.steps)
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def keep_going(self) -> bool:
        """Whether this worker takes another step: its share of the run's budget (``epochs``, or
        an asynchronous algorithm's ``budget``) is not used yet. Asynchronous workers that are
        done first wait here until every worker is (then their models are final)."""
        if self.total_steps is None:
            raise RuntimeError("keep_going() needs the run's length: call shard(dataset) first, or pass "
                               "total_steps= to wrap()")
        self.start()
        return self.algorithm.keep_going(self.steps, self.total_steps)

    def peer_traffic(self) -> tuple[list[int], list[int], float]:
        """Bytes sent to and received from each peer (by worker id; with servers, by global
        rank) and seconds in exchanges, over every group this worker has been in."""
        if self._retired is None:  # the group it started in: peers by their rank in it
            width = len(self.transport.stats.sent)
            sent, received, busy, ids = [0] * width, [0] * width, 0.0, range(width)
        else:  # what the groups left behind carried, and the current one's peers by worker id
            sent, received, busy, ids = [*self._retired[0]], [*self._retired[1]], self._retired[2], self.ids
        for t in [self.transport, *self.algorithm.transports()]:
            for r, (a, b) in enumerate(zip(t.stats.sent, t.stats.received, strict=True)):
                sent[ids[r]] += a
                received[ids[r]] += b
            busy += t.stats.comm_seconds
        return sent, received, busy

    def traffic(self) -> dict[str, float]:
        """This worker's use of the network so far: bytes sent and received (every message, as
        the emulated links carried them), seconds spent in exchanges, and over its steps the
        compute time and the exposed communication (time the training thread waited on the
        network)."""
        sent, received, busy = self.peer_traffic()
        return {"steps": self.steps, "bytes_sent": sum(sent), "bytes_received": sum(received), "comm_busy_s": busy,
                "compute_s": self.compute_seconds, "exposed_comm_s": self.exposed_seconds}

    # -- the end ------------------------------------------------------------------------------------

    def eval_model(self) -> torch.nn.Module:
        """The model to evaluate: the consensus (average over workers) for decentralized
        algorithms, else the model itself. Collective: every worker calls it. Asynchronous
        algorithms have a consensus only after :meth:`finish`."""
        if self._final is not None:
            return self._final
        with self._naming_lost_peers():
            if self.membership is not None and not self.algorithm.replicated:  # over the survivors of any loss
                return self._collective(lambda: self.algorithm.eval_model())
            return self.algorithm.eval_model()

    def finish(self) -> torch.nn.Module:
        """End training on this worker and return the final model (the consensus for
        decentralized algorithms), the same on every worker. Collective.

        Asynchronous workers (adpsgd, prague) keep averaging until every worker has left its
        own loop, so workers may have taken different numbers of steps.
        """
        if self._final is not None:
            return self._final
        with self._naming_lost_peers():
            return self._finish()

    def _finish(self) -> torch.nn.Module:
        self.start()
        if not self.algorithm.synchronous:
            self.algorithm.request_stop()
            while self.algorithm.keep_going(self.steps, self.total_steps or UNBOUNDED_STEPS):
                pass
        self.end()
        if self.membership is not None:  # a survivor still in its last step may take our state
            self.membership.close()
            self.control_barrier()
        inject_kill_in("final-model", self.id)  # fault injection for tests
        self._final = self.eval_model()  # in an elastic run over the survivors of a loss on the way
        if self.membership is not None or self._hung_watch is not None:
            watch_waits(None)
        control = self.algorithm.control_transport() or self.transport
        self.close()
        control.control_barrier()  # nobody tears the group down while another still averages
        if self._owns_group:
            dist.destroy_process_group()
        return self._final

    def end(self) -> None:
        """This worker's training is over (:meth:`finish` begins with it): parameter servers stop
        serving once every worker has ended, and workers they lost on the way are recorded. In an
        elastic run, a peer lost on the way leaves it to the survivors (DiLoCo's last syncs)."""
        if self.joins is not None and not self.algorithm.common_steps:  # asynchronous parameter servers
            self._note_joined(force=True)  # an admission since this worker last looked: in its record too
        self._collective(lambda: self.algorithm.end())
        if not self.algorithm.synchronous:  # admissions while this worker drained
            self._note_gossip_joins()
        # A worker started again from now on finds the run over (asynchronous servers close it
        # once every worker has ended: the others may still train).
        if self.joins is not None and self.algorithm.common_steps:
            self.joins.close()
        if self.membership is None and (lost := self.algorithm.newly_lost(force=True)):
            self._note_lost(lost)

    def close(self) -> None:
        """Release what the algorithm holds (hooks, threads, its process groups); no more steps."""
        if not self._finished:
            self._finished = True
            self._forward_hook.remove()
            self.algorithm.close()
            if self._heartbeat is not None:
                self._heartbeat.stop()

    # -- state and data -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The user optimizer's state and every algorithm state (error-feedback residuals, gossip
        state, bucket order), with the step count: what resuming needs besides the model.

        Under ``algorithm="ps"`` it also holds every server's optimizer state, asked from the
        servers now (call it between steps, before :meth:`finish`; with ``ps_mode="async"`` on
        every worker at the same step, since it waits for them all); the shards are the model's
        parameters, which worker 0 sends the servers when a resumed run starts."""
        state = {"steps": self.steps, "optimizer": self.optimizer.state_dict(), "algorithm": self.algorithm.state_dict()}
        servers = getattr(self.algorithm, "server_state", None)
        if servers is not None:
            if self.config.ps.ps_mode == "async":  # one snapshot: every worker's pushes so far applied
                dist.barrier(group=self.workers_group)
            state["servers"] = servers()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (before the first step; the model's own state is yours
        to load). A state the servers refuse (after the first step, or of another number of
        servers) raises before anything is loaded."""
        if state.get("servers") is not None:
            self.algorithm.load_server_state(state["servers"])  # type: ignore[attr-defined]
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.resume_at(int(state["steps"]))

    def resume_at(self, steps: int) -> None:
        """Go on as after ``steps`` steps (a resumed run, before its first step). Workers lost as
        it started (before any step) were lost at that step: their changes say so."""
        if not self._started:
            for change in self.changes:
                if not change.joined:
                    change.step, change.steps = steps, dict.fromkeys(change.steps, steps)
        self.steps = steps
        self.algorithm.resume_at(steps)

    def shard(self, dataset: Dataset, labels: Any = None) -> Subset:
        """This worker's shard of ``dataset``: the split ``distrain train`` makes (``partition``
        iid or dirichlet, seeded with ``seed``), and the run's length from ``epochs`` and
        ``batch_size`` unless given to :func:`wrap`.

        Args:
            dataset: the whole training set (every worker passes the same one).
            labels: the class of each sample, for ``partition="dirichlet"`` (default: read from
                the data set's ``(input, label)`` pairs).
        """
        d = self.config.data
        n = len(dataset)  # type: ignore[arg-type]
        if n < self.workers:
            raise ConfigError("workers", f"must be at most the number of training samples ({n}), got {self.workers}")
        if d.partition == "iid":
            classes = np.zeros(n, dtype=np.int64)
        else:
            classes = np.asarray(labels) if labels is not None else labels_of(dataset)
        parts = partition_indices(classes, self.workers, d.partition, alpha=d.dirichlet_alpha, seed=self.config.run.seed)
        if self.steps_per_epoch is None:
            self.steps_per_epoch = epoch_steps(sum(len(p) for p in parts), self.workers, d.batch_size)
        if self.total_steps is None:
            self.total_steps = max(1, round(self.config.run.epochs * self.steps_per_epoch))
        return Subset(dataset, parts[self.rank].tolist())


@torch.no_grad()
def _broadcast_from_rank0(model: torch.nn.Module, group: Any) -> None:
    """Every worker starts from rank 0's parameters and buffers (set-up, not training traffic);
    each wait ends early when this thread's watch sees the membership change (:func:`wait_work`)."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        wait_work(dist.broadcast(tensor.data, src=src, group=group, async_op=True))


__all__ = ["SETTINGS_ENV", "DistributedOptimizer", "settings_from_env", "wrap"]
