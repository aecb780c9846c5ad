"""Parameter servers that go on without a lost worker and admit it again: the closing over the survivors, admissions, the link to a joiner, the link to a returning server.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from distrain.algorithms.parameter_server.settings import PSSettings, elastic_servers
from distrain.comm.link import LinkTransport, open_link
from distrain.comm.store_group import StoreGroup
from distrain.errors import WorkerFailure
from distrain.runtime.health import dead_since, declared_dead, finishers
from distrain.runtime.membership import (
    JOINS_KEY,
    POLL_S,
    RESTARTS_KEY,
    Membership,
    agree_before_groups,
    await_ready,
)

if TYPE_CHECKING:
    from distrain.emulation.link import LinkModel


def survivors_transport(store: dist.Store | None, rank: int, world: int,
                        timeout: float) -> tuple[StoreGroup | None, dict[int, float]]:
    """After serving or training (every process of an elastic parameter-server run calls it):
    the processes that finished, as a group over ``store`` (the rendezvous store) for the closing
    bookkeeping (None when all did and the run's group is whole: nobody joined, a worker started
    again being outside it), and the workers lost on the way (global rank -> when declared dead)."""
    if store is None:
        return None, {}
    finished = finishers(store, rank, world, timeout)
    lost = {r: t for r in range(world) if r not in finished and (t := dead_since(store, r)) is not None}
    if not lost and int(store.add(JOINS_KEY, 0)) == 0:
        return None, {}
    return StoreGroup(store, finished, rank, timeout), lost


def came_to_start(store: dist.Store | None, rank: int, settings: PSSettings) -> list[int]:
    """The processes (global ranks, workers then servers) that came to start a flat elastic run,
    agreed by every one of them in the launcher's ``store``
    (:func:`~distrain.runtime.membership.agree_before_groups`): a worker lost as the run starts
    would otherwise stop it, the servers waiting for its start message (worker 0) or the
    workers' barrier failing on it. The first worker that came sends the servers their start;
    the servers serve the others, the missing taken for lost before the first step. Every
    process where none is (no store, hierarchical, or not elastic)."""
    world = settings.run.workers + settings.servers
    if store is None or settings.workers_per_node or not elastic_servers(settings):
        return list(range(world))
    return agree_before_groups(store, rank, world, settings.run.timeout, "the start of training", "ps-start")


def admissions(store: dist.Store | None, workers: list[int], me: int, settings: PSSettings) -> Membership | None:
    """Where workers that a launcher starts again ask to join an elastic run (None: it starts
    none, or the run is not elastic): the workers and the servers each look there at every step's
    end, and admit them together at the step agreed in the store (see
    :meth:`~distrain.runtime.membership.Membership.admit`)."""
    if store is None or not elastic_servers(settings) or settings.workers_per_node or not store.check([RESTARTS_KEY]):
        return None
    return Membership(store, list(workers), me, timeout=settings.run.timeout)


def servers_link(membership: Membership, worker: int, me: int, settings: PSSettings,
                 link_model: LinkModel | None = None, servers: list[int] | None = None) -> LinkTransport:
    """The link between the live servers and ``worker``, admitted in ``membership``'s current
    epoch (each of them opens it; ``me``: this process's rank in the run). Its ranks are the
    run's: the live servers' (``servers``, their indices, given by the servers; the worker, which
    passes None, reads them in the store), then the worker's. Workers join only in local runs,
    whose processes listen on the store's address (``MASTER_ADDR``, loopback by default).

    A server declared dead before it was ready to meet, or (to the servers) the joiner lost again,
    raises :class:`~distrain.runtime.membership.LinkMissed` naming it, within a poll."""
    ranks = None if servers is None else [*(settings.run.workers + s for s in servers), worker]
    epoch = membership.epoch

    def gone(r: int) -> bool:  # a server lost meanwhile, or (to the servers) the joiner lost again
        if r == worker:
            return servers is not None and membership.lost_again(worker, epoch)
        return declared_dead(membership.store, r)

    link, _ = _meet(membership, f"servers/{worker}", ranks, me, settings, link_model,
                    f"worker {worker} was admitted again but the servers never met it", gone)
    return link


def return_link(membership: Membership, server: int, ranks: list[int] | None, me: int, settings: PSSettings,
                link_model: LinkModel | None = None) -> tuple[LinkTransport, list[int]]:
    """The link between a parameter server that returns after its loss (rank ``server`` in the
    run), the workers and the live servers, admitted in ``membership``'s current epoch; every one
    of them opens it, and its ranks are the run's: ``ranks`` (the member workers, the live
    servers, then ``server``), which the others publish in the store under the epoch and the
    returning server reads (``ranks`` None). Returns the link and its ranks."""
    epoch = membership.epoch

    def gone(r: int) -> bool:  # the server lost again (its last life's dead mark stands: its heartbeat says), or another
        return membership.lost_again(server, epoch) if r == server else declared_dead(membership.store, r)

    return _meet(membership, f"return/{server}", ranks, me, settings, link_model,
                 f"server {server - settings.run.workers} was admitted back but nobody met it", gone)


def _meet(membership: Membership, name: str, ranks: list[int] | None, me: int, settings: PSSettings,
          link_model: LinkModel | None, missed: str,
          gone: Callable[[int], bool] | None = None) -> tuple[LinkTransport, list[int]]:
    """Open a link named ``name`` in ``membership``'s epoch over ``ranks``, which the processes
    that know them publish in the store (the first proposal is everyone's; they must agree) and
    the one that does not (``ranks`` None) waits for: at most ``--timeout`` seconds (``missed``
    then says what went wrong). It was admitted, so some member reached the step of its
    admission, and the others do (they are synchronous): they publish the ranks there.

    Before the link's rendezvous every process marks itself ready and waits for the others'
    marks: a process that ``gone`` says is gone before its mark raises :class:`LinkMissed`
    within a poll (the rendezvous would wait the whole timeout for it)."""
    plan = membership.store_prefix(f"{name}/plan")
    if ranks is not None:
        text = ",".join(map(str, ranks))
        agreed = plan.compare_set("ranks", "", text)
        if (agreed.decode() if isinstance(agreed, bytes) else str(agreed)) != text:
            raise WorkerFailure(f"rank {me}: the processes disagree on who meets in {name} ({agreed!r}, here {text})")
    else:
        deadline = time.monotonic() + settings.run.timeout
        while not plan.check(["ranks"]):
            if time.monotonic() > deadline:
                raise WorkerFailure(f"{missed} within {settings.run.timeout:g} s")
            time.sleep(POLL_S)
        ranks = [int(r) for r in plan.get("ranks").decode().split(",")]
    await_ready(membership.store_prefix(f"{name}/ready"), ranks, me, settings.run.timeout, gone, missed)
    link = open_link(membership.store_prefix(name), ranks, me, settings.run.workers + settings.servers,
                     settings.run.timeout, link_model, host=os.environ.get("MASTER_ADDR", "127.0.0.1"), gone=gone)
    return link, ranks


def server_life(store: dist.Store, index: int, rank: int) -> str:
    """Which death of server ``index`` (global rank ``rank``; one that returned may be lost
    again): its dead mark, the same for every worker and server. The store keys of a takeover
    are named by it."""
    return f"{index}@{dead_since(store, rank)}"


def servers_taken_over(settings: PSSettings) -> bool:
    """Whether a lost server's ranges are taken over by the others (elastic, two servers or
    more), synchronous or asynchronous, with dense or compressed pushes; with
    ``--workers-per-node`` (synchronous servers only), by the nodes' pushers."""
    return elastic_servers(settings) and settings.servers > 1


def servers_return(settings: PSSettings) -> bool:
    """Whether a lost server, taken over by the others, may return (synchronous servers): a
    launcher then starts lost servers again too (not ``--workers-per-node``, whose workers do
    not join again)."""
    return servers_taken_over(settings) and settings.ps_mode == "sync" and not settings.workers_per_node
