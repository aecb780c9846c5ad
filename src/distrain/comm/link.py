"""A link: sends and receives between a few processes over a gloo group of their own.

A worker started again after its loss cannot enter the group the others opened at the start
(gloo's groups are fixed), and in a run with parameter servers nobody reopens that group: the
servers and the worker they admit open a small group between themselves instead, each making it
over the same prefix of the launcher's store, outside torch.distributed's registry of groups
(which only the processes of one default group share). A :class:`LinkTransport` carries the
exchanges over it, counted and timed like any other, with peers named by their ranks in the run.

Example::

    # every server, and the worker (id 0) they admit; ranks 4, 5 are the servers of 4 workers
    link = open_link(dist.PrefixStore("join/0", store), ranks=[4, 5, 0], me=0, world_size=6, timeout=60)
    link.send(shard, 0).wait()          # on a server
    link.recv(shard, 4).wait()          # on the worker
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from distrain.comm.transport import Handle, Transport
from distrain.emulation.link import LinkModel
from distrain.runtime.membership import LinkMissed, WatchfulStore


class LinkTransport(Transport):
    """Point-to-point exchanges over ``group`` (made by :func:`open_link`), whose ranks are the
    run's ranks ``ranks``; this process is ``me`` of ``world_size``. Its peers, ``rank``,
    ``world_size`` and counters are the run's, so traffic over it adds up with the run's own
    Transport's. Sends and receives only."""

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], me: int, world_size: int,
                 link_model: LinkModel | None = None, store: dist.Store | None = None) -> None:
        self._open(group, me, world_size, link_model, list(range(world_size)))
        self._place = {r: i for i, r in enumerate(ranks)}  # run rank -> rank in the group
        self.ranks = list(ranks)  # the processes it links, by their ranks in the run
        #: the store the group met in, where its Python side must outlive the group (open_link)
        self.store = store

    def _global(self, group_rank: int) -> int:
        return group_rank  # peers are named by their ranks in the run

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        sent, received = self._charge({dst: nbytes}, {})
        return self._start("send", sent, received, lambda: [self.group.send([tensor], self._place[dst], tag)],
                           lambda model: model.send(self._ids[dst], nbytes))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        sent, received = self._charge({}, {src: nbytes})
        work = self.group.recv([tensor], self._place[src], tag)
        return Handle(self, "recv", work, sent, received, after=self._delivery(src, nbytes))


def open_link(store: dist.Store, ranks: list[int], me: int, world_size: int, timeout: float,
              link_model: LinkModel | None = None, host: str = "127.0.0.1",
              gone: Callable[[int], bool] | None = None) -> LinkTransport:
    """Open a link between the processes ``ranks`` (their ranks in the run, in the same order
    everywhere), meeting in ``store`` (a prefix of the launcher's store that every one of them
    names); this process is ``me`` and listens on ``host`` only (the processes of a local run
    meet on loopback). Blocks until all of them have opened it, at most ``timeout`` seconds.
    ``gone(rank)``: whether a process is lost; one lost in the link's rendezvous then raises
    :class:`~distrain.runtime.membership.LinkMissed` within a poll (the rendezvous would wait
    for it until ``timeout``)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    if gone is None:
        group = dist.ProcessGroupGloo(store, ranks.index(me), len(ranks), options)
        return LinkTransport(group, ranks, me, world_size, link_model)

    def lost() -> list[int]:
        return [r for r in ranks if r != me and gone(r)]

    watchful = WatchfulStore(store, lost, timeout)
    try:
        group = dist.ProcessGroupGloo(watchful, ranks.index(me), len(ranks), options)
    except Exception as exc:
        if missing := lost():
            raise LinkMissed(missing, f"rank {me}: rank(s) {missing} lost as the link opened") from exc
        raise
    return LinkTransport(group, ranks, me, world_size, link_model, store=watchful)
