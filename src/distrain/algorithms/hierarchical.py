"""Hierarchical aggregation: sum inside each node first, so only one worker per node crosses the slow links.

With ``--workers-per-node K`` ranks ``0..K-1`` form node 0, ``K..2K-1`` node 1, and so on (the
first rank of a node is its leader). A sum over all workers then takes three steps:

1. reduce inside each node to its leader (fast intra-node links),
2. all-reduce among the leaders (the slow inter-node links carry one copy per node, not K),
   or, with parameter servers (:mod:`~distrain.algorithms.parameter_server`), the leaders push
   their node's sum to the servers and pull the new parameters,
3. broadcast from the leader inside each node.

Under emulation the links inside a node are not emulated (``distrain.emulation.network``).

Each step goes through its own :class:`~distrain.comm.transport.Transport` (one per process
group); their byte counters and delays are folded into the worker's main Transport once a sum
is finished, so run summaries count every byte once, per global peer rank.

Example::

    nodes = NodeGroups(transport, workers_per_node=2)   # every rank calls it, same order
    HierarchicalAllReduce(nodes).all_reduce(grad).wait()
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from distrain.comm.transport import Handle, Transport
from distrain.errors import ConfigError
from distrain.runtime.faults import inject_kill_in
from distrain.topology import NodeMap

log = logging.getLogger(__name__)


def global_rank(transport: Transport, group_rank: int) -> int:
    return group_rank if transport.group is None else dist.get_global_rank(transport.group, group_rank)


def node_process_groups(workers: int, workers_per_node: int, timeout: float | None = None,
                        ranks: list[int] | None = None,
                        ids: list[int] | None = None) -> tuple[list[dist.ProcessGroup], dist.ProcessGroup]:
    """Create the process group of every node, then the group of node leaders.

    ``dist.new_group`` is collective over the whole world: every process (parameter servers
    too) calls this, with the same arguments, at the same point of its sequence of groups, and
    gets every group (the ones it is not in are placeholders).

    Args:
        workers: training workers; nodes are made of them, not of any servers after them.
        workers_per_node: ranks per node; the last node may be smaller.
        timeout: seconds any collective in these groups may take (None: the backend's default).
        ranks: the global rank of every worker (default: ``0..workers-1``).
        ids: the worker id of every worker, which places it on its node (default: its rank).
    """
    wait = None if timeout is None else datetime.timedelta(seconds=timeout)
    ranks = list(range(workers)) if ranks is None else ranks
    nodes = NodeMap(workers, workers_per_node, None if ids is None else tuple(ids))
    groups = [dist.new_group([ranks[r] for r in nodes.members(node)], timeout=wait) for node in range(nodes.num_nodes)]
    return groups, dist.new_group([ranks[r] for r in nodes.leaders], timeout=wait)


class NodeGroups:
    """The process groups of one worker: its node, and (on leaders) the group of node leaders.

    Args:
        transport: the worker's main Transport (its group is the parent group).
        workers_per_node: ranks per node; the last node may be smaller.
        timeout: seconds any collective in these groups may take (None: the backend's default).
        workers: how many of the parent group's ranks are workers (default: all; the others,
            parameter servers, come last and must call :func:`node_process_groups` meanwhile).
        ids: the worker id of each of them, which places it on its node (default: its rank; the
            members of an elastic run after a loss keep their ids, and so their nodes).
    """

    def __init__(self, transport: Transport, workers_per_node: int, timeout: float | None = None,
                 workers: int | None = None, ids: list[int] | None = None) -> None:
        self.parent = transport
        workers = transport.world_size if workers is None else workers
        self.map = NodeMap(workers, workers_per_node, None if ids is None else tuple(ids))
        rank = transport.rank
        self.node = self.map.node_of(rank)
        self.is_leader = self.map.leaders[self.node] == rank
        link = transport.link_model
        node_groups, leaders = node_process_groups(workers, workers_per_node, timeout,
                                                   [global_rank(transport, r) for r in range(workers)], ids)
        self.intra: Transport = Transport(node_groups[self.node], link_model=link)
        self.inter = Transport(leaders, link_model=link) if self.is_leader else None
        # group rank -> global rank, for folding the counters into the parent's
        self._globals = {id(t): [global_rank(t, r) for r in range(t.world_size)] for t in self.transports}
        self._parent_index = {global_rank(transport, r): r for r in range(transport.world_size)}

    @property
    def transports(self) -> list[Transport]:
        return [t for t in (self.intra, self.inter) if t is not None]

    def fold_stats(self) -> None:
        """Move the sub-groups' byte counters, delays and exchanges into the parent Transport."""
        stats = self.parent.stats
        for t in self.transports:
            for peer, g in enumerate(self._globals[id(t)]):
                stats.sent[self._parent_index[g]] += t.stats.sent[peer]
                stats.received[self._parent_index[g]] += t.stats.received[peer]
                t.stats.sent[peer] = t.stats.received[peer] = 0
            stats.comm_seconds += t.stats.comm_seconds
            t.stats.comm_seconds = 0.0
            stats.exchanges.extend(t.stats.exchanges)
            t.stats.exchanges.clear()

    def close(self) -> None:
        for t in self.transports:
            t.close()
        self.fold_stats()


class HierarchicalHandle:
    """A pending hierarchical sum: the intra-node reduce is running; ``wait()`` does the rest."""

    def __init__(self, nodes: NodeGroups, tensor: torch.Tensor, first: Handle | None) -> None:
        self.nodes, self.tensor, self.first = nodes, tensor, first
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        nodes = self.nodes
        if self.first is not None:
            self.first.wait()
        if nodes.inter is not None and nodes.inter.world_size > 1:
            nodes.inter.all_reduce(self.tensor).wait()
        if nodes.intra.world_size > 1:
            nodes.intra.broadcast(self.tensor, src=0).wait()
        nodes.fold_stats()
        self._done = True


class HierarchicalAllReduce:
    """Sums a tensor over all workers in place, node by node; the same ``all_reduce(t).wait()``
    interface as a Transport, so the all-reduce algorithm can use either."""

    def __init__(self, nodes: NodeGroups) -> None:
        self.nodes = nodes

    def all_reduce(self, tensor: torch.Tensor) -> HierarchicalHandle:
        intra = self.nodes.intra
        first = intra.reduce(tensor, dst=0) if intra.world_size > 1 else None
        return HierarchicalHandle(self.nodes, tensor, first)

    def close(self) -> None:
        self.nodes.close()


def build_hierarchy(transport: Transport, workers_per_node: int, *, own_ring: bool, compressed: bool,
                    timeout: float) -> HierarchicalAllReduce | None:
    """The hierarchical sum for ``--workers-per-node K`` (K >= 1), or None for a flat all-reduce
    (K = 0); ConfigError with our own ring (``own_ring``) or compressed gradients (``compressed``)."""
    k = workers_per_node
    if not k:
        return None
    if own_ring:
        raise ConfigError("--workers-per-node", "hierarchical aggregation uses the backend's collectives; "
                                                "drop --ring own")
    if compressed:
        raise ConfigError("--workers-per-node", "hierarchical aggregation does not combine with --compress yet")
    if k >= transport.world_size:
        log.info("--workers-per-node %d >= %d workers: one node, no inter-node traffic", k, transport.world_size)
    if transport.meet is not None:  # elastic: a worker lost now stops no one (see Transport)
        inject_kill_in("node-groups", transport.ids[transport.rank])  # fault injection for tests
        transport.meet("node-groups", "make their node groups")
    return HierarchicalAllReduce(NodeGroups(transport, k, timeout=timeout, ids=transport.ids))
