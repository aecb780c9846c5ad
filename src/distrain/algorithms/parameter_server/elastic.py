"""Parameter servers that go on without a lost worker and admit it again: the closing over the survivors, admissions, the link to a joiner.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from distrain.algorithms.parameter_server.settings import PSSettings, elastic_servers
from distrain.comm.link import LinkTransport, open_link
from distrain.comm.store_group import StoreGroup
from distrain.runtime.health import dead_since, finishers
from distrain.runtime.membership import JOINS_KEY, RESTARTS_KEY, Membership

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


def admissions(store: dist.Store | None, workers: list[int], me: int, settings: PSSettings) -> Membership | None:
    """Where workers that a launcher starts again ask to join an elastic run (None: it starts
    none, or the run is not elastic): the workers and the servers each look there at every step's
    end, and admit them together at the step agreed in the store (see
    :meth:`~distrain.runtime.membership.Membership.admit`)."""
    if store is None or not elastic_servers(settings) or not store.check([RESTARTS_KEY]):
        return None
    return Membership(store, list(workers), me, timeout=settings.run.timeout)


def servers_link(membership: Membership, worker: int, me: int, settings: PSSettings,
                 link_model: LinkModel | None = None) -> LinkTransport:
    """The link between every server and ``worker``, admitted in ``membership``'s current epoch
    (each of them opens it; ``me``: this process's rank in the run). Its ranks are the run's: the
    servers after the ``--workers`` workers. Workers join only in local runs, whose processes
    listen on the store's address (``MASTER_ADDR``, loopback by default)."""
    workers = settings.run.workers
    servers = [workers + s for s in range(settings.servers)]
    return open_link(membership.store_prefix(f"servers/{worker}"), [*servers, worker], me, workers + settings.servers,
                     settings.run.timeout, link_model, host=os.environ.get("MASTER_ADDR", "127.0.0.1"))

