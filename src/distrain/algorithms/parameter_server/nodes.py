"""A node's workers under synchronous parameter servers that go on without a lost worker.

With ``--workers-per-node K`` the workers of a node sum their gradients into the node's leader
(its lowest id), which pushes the sum to the servers, pulls the parameters and hands them on
inside the node (:mod:`~distrain.algorithms.hierarchical`). When a worker of the node dies, its
mates find the node's reduce or broadcast failing (its connections reset, or its dead mark in the
store, which every wait of theirs watches), and the survivors of the node meet again over a gloo
group of their own (:class:`NodeLink`), named in the store by their ids, so that survivors who
saw the loss at different moments still meet. They then take the newest parameters one of them
holds (:meth:`ElasticNode.recover`: a broadcast may have reached one survivor and failed for
another, which went on to the next step): where those are the step's answer, the step is done;
where not, every survivor sums its own gradient of the step again, without the lost one's, and
the leader (the node's new one, if the old one was lost) pushes it. The servers take a node's
new leader for its lost one (:meth:`ShardServer._succeed
<distrain.algorithms.parameter_server.server.ShardServer._succeed>`) and answer a push of a round
they already served, which the old leader had pushed before it died, with that round's
parameters without applying it again: no step is lost or applied twice. After its last step each
worker waits in the store for its node's others (:meth:`ElasticNode.end`), so that none leaves
while a mate still needs it.

Example::

    node = ElasticNode(nodes, store, timeout=60)       # every worker, after NodeGroups
    node.reduce(grad)                                  # NodeLoss: a mate died; then
    node.regroup()                                     # the survivors meet again
    step = node.recover(held, flat)                    # and take the newest parameters
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from distrain.algorithms.hierarchical import NodeGroups, global_rank
from distrain.comm.link import LinkTransport
from distrain.comm.transport import Handle, Transport
from distrain.errors import WorkerFailure
from distrain.runtime.faults import is_comm_error
from distrain.runtime.health import declared_dead
from distrain.runtime.membership import LinkMissed, MembershipChanged, await_ready, watching

log = logging.getLogger(__name__)

#: Where the survivors of a node meet (under the launcher's store; per torchrun attempt).
PREFIX = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/ps/node"


#: More than the workers of any node: the member slot packed with a step (:meth:`ElasticNode.newest`).
_SLOTS = 1 << 16


class NodeLoss(Exception):
    """A worker of this node died during the node's reduce or broadcast."""


class NodeLink(LinkTransport):
    """A link between the survivors of a node with the two collectives the node needs (a reduce
    into its leader, a broadcast from it), over a gloo group of their own; peers are named by
    their ranks in the run. Charged as a star around the root (each other member sends it, or
    receives from it, the whole tensor)."""

    def reduce(self, tensor: torch.Tensor, dst: int, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        options = dist.ReduceOptions()
        options.rootRank, options.reduceOp = self._place[dst], op
        return self._collective("reduce", tensor, dst, self.group.reduce([tensor], options), into_root=True)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = self._place[src], 0
        return self._collective("broadcast", tensor, src, self.group.broadcast([tensor], options), into_root=False)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        nbytes = tensor.numel() * tensor.element_size()
        others = {r: nbytes for r in self.ranks if r != self.rank}  # charged as an all-gather
        sent, received = self._charge(others, others)
        return Handle(self, "all_reduce", self.group.allreduce([tensor], options), sent, received)

    def _collective(self, op: str, tensor: torch.Tensor, root: int, work: dist.Work, into_root: bool) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        others = [r for r in self.ranks if r != root]
        me_root = self.rank == root
        to_root = {root: nbytes} if not me_root else {}
        from_others = {r: nbytes for r in others} if me_root else {}
        sent, received = self._charge(to_root, from_others) if into_root else self._charge(from_others, to_root)
        return Handle(self, op, work, sent, received)


class ElasticNode:
    """This worker's node in an elastic hierarchical parameter-server run: its members' ranks
    (the run's; its leader first), the reduce and broadcast among them, and their meeting again
    when one of them dies.

    Args:
        nodes: the node groups every worker made at the start.
        store: the launcher's store, where dead processes are marked and the survivors meet.
        timeout: seconds any wait may take (``--timeout``).
    """

    def __init__(self, nodes: NodeGroups, store: Any, timeout: float) -> None:
        self.nodes, self.store, self.timeout = nodes, store, timeout
        parent = nodes.parent
        self.me = global_rank(parent, parent.rank)
        self.node = nodes.node
        self.members = [global_rank(parent, r) for r in nodes.map.members(nodes.node)]
        self.link: NodeLink | None = None  # after a loss: the survivors' own group

    @property
    def leader(self) -> int:
        """The rank of the node's leader: its lowest live member."""
        return self.members[0]

    @property
    def is_leader(self) -> bool:
        return self.me == self.leader

    def _transport(self) -> Transport | None:
        """The node's group (None: this worker is its only member)."""
        if self.link is not None:
            return self.link
        return self.nodes.intra if len(self.members) > 1 else None

    def _root(self, rank: int | None = None) -> int:
        """How the node's group names member ``rank`` (None: the leader): the first group by
        its rank in it, a survivors' link by its rank in the run."""
        rank = self.leader if rank is None else rank
        return rank if self.link is not None else self.members.index(rank)

    def reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` into the leader's copy (the others' become scratch)."""
        if (t := self._transport()) is not None:
            self._wait(lambda: t.reduce(tensor, self._root()).wait())

    def broadcast(self, tensor: torch.Tensor, src: int | None = None) -> None:
        """Member ``src``'s ``tensor`` (None: the leader's) into every member's."""
        if (t := self._transport()) is not None:
            self._wait(lambda: t.broadcast(tensor, self._root(src)).wait())

    def newest(self, held: int) -> tuple[int, int]:
        """The newest step whose parameters a member holds (``held``: this one's) and the first
        member holding them; every member calls it."""
        t = self._transport()
        if t is None:
            return held, self.me
        place = self.members.index(self.me)
        value = torch.tensor([held * _SLOTS + _SLOTS - 1 - place], dtype=torch.int64)
        self._wait(lambda: t.all_reduce(value, dist.ReduceOp.MAX).wait())
        newest, slot = divmod(int(value.item()), _SLOTS)
        return newest, self.members[_SLOTS - 1 - slot]

    def recover(self, held: int, flat: torch.Tensor) -> int:
        """After :meth:`regroup`: bring every member to the newest parameters one of them holds
        (a member may have received a broadcast that failed for another, and gone on to the next
        step); returns their step. A member a step further than that redoes its step; the
        others' step is done."""
        newest, source = self.newest(held)
        self.broadcast(flat, source)
        return newest

    def _wait(self, wait: Any) -> None:
        """``wait()``, leaving early once a mate is declared dead; NodeLoss when a mate died."""
        def mate_dead(_elapsed: float) -> bool:
            return any(declared_dead(self.store, m) for m in self.members if m != self.me)

        try:
            with watching(mate_dead):
                wait()
        except MembershipChanged as exc:
            raise NodeLoss(f"worker {self.me}: a worker of node {self.node} died") from exc
        except Exception as exc:
            if not is_comm_error(exc):
                raise
            self._await_dead(exc)
            raise NodeLoss(f"worker {self.me}: a worker of node {self.node} died") from exc

    def _await_dead(self, exc: BaseException) -> None:
        """Wait until a mate is declared dead (the launcher does it as a process exits), at most
        ``--timeout`` seconds: ``exc`` is raised then (a failure that is not a mate's death)."""
        deadline = time.monotonic() + self.timeout
        while not any(declared_dead(self.store, m) for m in self.members if m != self.me):
            if time.monotonic() > deadline:
                raise exc
            time.sleep(0.02)

    def regroup(self) -> None:
        """Meet the node's survivors again (after :class:`NodeLoss`): each proposes the members
        not declared dead and waits in the store, under the name of that set, for every other
        one's ready mark; one declared dead meanwhile sends them to the next, smaller set. Then
        they open their own group (none when this worker is alone)."""
        old = self.link
        while True:
            survivors = [m for m in self.members if not declared_dead(self.store, m)]
            if self.me not in survivors:
                raise WorkerFailure(f"worker {self.me}: declared dead while its node met again")
            name = self._name(survivors)
            try:
                await_ready(dist.PrefixStore(f"{name}/ready", self.store), survivors, self.me, self.timeout,
                            lambda r: declared_dead(self.store, r),
                            f"worker {self.me}: node {self.node}'s survivors {survivors} did not meet")
            except LinkMissed:
                continue
            break
        lost = [m for m in self.members if m not in survivors]
        self.members = survivors
        self.link = self._open(name, survivors) if len(survivors) > 1 else None
        if old is not None:
            self._fold(old)
        log.warning("worker %d: node %d lost worker(s) %s; %d left, led by worker %d", self.me, self.node, lost,
                    len(survivors), self.leader)

    def _name(self, survivors: list[int]) -> str:
        return f"{PREFIX}/{self.node}/{'-'.join(map(str, survivors))}"

    def end(self, held: int, flat: torch.Tensor, stop: Any) -> None:
        """After this worker's last step (``held``: its step; ``flat``: its parameters of it):
        mark it ended in the store and wait until every mate has too or is declared dead. A
        mate may not have got that step's parameters (the broadcast that ended it here failed
        there): it meets the survivors again, and this worker joins it (:meth:`regroup`,
        :meth:`recover`). A leader lost before it marked itself ended may not have told every
        server that its node's training is over: its successor does (``stop()``)."""
        self.store.set(f"{PREFIX}/{self.node}/ended/{self.me}", str(held))
        stopped = self.is_leader  # the leader told the servers before it came here
        deadline = time.monotonic() + self.timeout
        while True:
            ended = {m for m in self.members if self.store.check([f"{PREFIX}/{self.node}/ended/{m}"])}
            survivors = [m for m in self.members if not declared_dead(self.store, m)]
            if survivors and survivors[0] == self.me and not stopped and self.leader not in ended:
                stopped = True  # the lost leader may have ended without telling some servers
                stop()
            if not [m for m in survivors if m not in ended]:
                return
            name = self._name(survivors)
            if survivors != self.members and any(self.store.check([f"{name}/ready/ready/{m}"])
                                                 for m in survivors if m != self.me):
                self.regroup()
                self.recover(held, flat)
                continue
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker {self.me}: node {self.node}'s workers "
                                    f"{[m for m in survivors if m not in ended]} did not end within {self.timeout:g} s")
            time.sleep(0.02)

    def _open(self, name: str, ranks: list[int]) -> NodeLink:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=self.timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=os.environ.get("MASTER_ADDR", "127.0.0.1"))]
        group = dist.ProcessGroupGloo(dist.PrefixStore(name, self.store), ranks.index(self.me), len(ranks), options)
        return NodeLink(group, ranks, self.me, self.nodes.parent.world_size)  # links inside a node: not emulated

    def _fold(self, link: NodeLink) -> None:
        """Move ``link``'s counters into the worker's main Transport (peers by their rank in the run)."""
        parent, index = self.nodes.parent.stats, self.nodes._parent_index
        for g, (a, b) in enumerate(zip(link.stats.sent, link.stats.received, strict=True)):
            if a or b:
                parent.sent[index[g]] += a
                parent.received[index[g]] += b
        link.stats.sent = [0] * len(link.stats.sent)
        link.stats.received = [0] * len(link.stats.received)
        parent.comm_seconds += link.stats.comm_seconds
        link.stats.comm_seconds = 0.0
        parent.exchanges.extend(link.stats.exchanges)
        link.stats.exchanges.clear()

    def fold_stats(self) -> None:
        """Move every node group's counters into the worker's main Transport."""
        self.nodes.fold_stats()
        if self.link is not None:
            self._fold(self.link)
