"""The Transport: the one object through which a worker's tensors reach other workers.

Every collective and point-to-point transfer goes through it, so it can count bytes per peer
and time every exchange. Collectives run by the backend (gloo, NCCL) are charged with the
per-link traffic of a ring, the algorithm gloo and NCCL use for large tensors: for an
all-reduce of M bytes over n workers each worker sends 2(n-1)/n * M bytes to its successor and
receives as much from its predecessor.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class Exchange:
    """One finished exchange: what it was, how many bytes it moved, how long it took."""

    op: str
    bytes_sent: int
    bytes_received: int
    seconds: float


@dataclass
class TransportStats:
    """Counters of one worker's traffic, per peer rank (group ranks)."""

    sent: list[int]
    received: list[int]
    exchanges: deque = field(default_factory=lambda: deque(maxlen=256))
    comm_seconds: float = 0.0

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent)

    @property
    def bytes_received(self) -> int:
        return sum(self.received)


class Handle:
    """A pending exchange; ``wait()`` blocks until it is done and records its delay."""

    def __init__(self, transport: Transport, op: str, work: dist.Work | None, sent: int, received: int) -> None:
        self._transport = transport
        self._op = op
        self._work = work
        self._sent = sent
        self._received = received
        self._start = time.perf_counter()
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        self._done = True
        self._transport._record(self._op, self._sent, self._received, time.perf_counter() - self._start)


def ring_share(nbytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * nbytes // world_size


class Transport:
    """Counts and times every tensor a worker exchanges.

    Args:
        process_group: the group to talk in; ``None`` means the default (world) group.

    Example::

        transport = Transport()
        transport.all_reduce(grad).wait()
        print(transport.stats.bytes_sent)
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.stats = TransportStats(sent=[0] * self.world_size, received=[0] * self.world_size)

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _record(self, op: str, sent: int, received: int, seconds: float) -> None:
        self.stats.exchanges.append(Exchange(op, sent, received, seconds))
        self.stats.comm_seconds += seconds

    def _charge(self, peer_sent: dict[int, int], peer_received: dict[int, int]) -> tuple[int, int]:
        for peer, n in peer_sent.items():
            self.stats.sent[peer] += n
        for peer, n in peer_received.items():
            self.stats.received[peer] += n
        return sum(peer_sent.values()), sum(peer_received.values())

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        """Start an in-place all-reduce of ``tensor``; charged as a ring."""
        share = ring_share(tensor.numel() * tensor.element_size(), self.world_size)
        sent, received = self._charge({self.next_rank: share}, {self.prev_rank: share})
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return Handle(self, "all_reduce", work, sent, received)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        """Start a broadcast from group rank ``src``; charged as a pipeline along the ring."""
        nbytes = tensor.numel() * tensor.element_size()
        last = (src - 1) % self.world_size
        sent_to = {} if self.rank == last or self.world_size == 1 else {self.next_rank: nbytes}
        got_from = {} if self.rank == src else {self.prev_rank: nbytes}
        sent, received = self._charge(sent_to, got_from)
        work = dist.broadcast(tensor, src=self._global(src), group=self.group, async_op=True)
        return Handle(self, "broadcast", work, sent, received)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle:
        """Start an all-gather of equal-sized tensors; charged as a ring (n-1 pieces each way)."""
        nbytes = tensor.numel() * tensor.element_size() * (self.world_size - 1)
        sent, received = self._charge({self.next_rank: nbytes}, {self.prev_rank: nbytes})
        if self.world_size == 1:
            outputs[0].copy_(tensor)
            return Handle(self, "all_gather", None, 0, 0)
        work = dist.all_gather(outputs, tensor, group=self.group, async_op=True)
        return Handle(self, "all_gather", work, sent, received)

    # -- point to point ----------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> Handle:
        """Start sending ``tensor`` to group rank ``dst``."""
        nbytes = tensor.numel() * tensor.element_size()
        sent, received = self._charge({dst: nbytes}, {})
        work = dist.isend(tensor, dst=self._global(dst), group=self.group)
        return Handle(self, "send", work, sent, received)

    def recv(self, tensor: torch.Tensor, src: int) -> Handle:
        """Start receiving into ``tensor`` from group rank ``src``."""
        nbytes = tensor.numel() * tensor.element_size()
        sent, received = self._charge({}, {src: nbytes})
        work = dist.irecv(tensor, src=self._global(src), group=self.group)
        return Handle(self, "recv", work, sent, received)

    # -- control traffic ---------------------------------------------------------------------

    def control_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather a small bookkeeping tensor (metrics, summaries); not counted as training traffic."""
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(outputs, tensor, group=self.group)
        return outputs

    def control_barrier(self) -> None:
        """Wait for every worker; bookkeeping only, not counted."""
        dist.barrier(group=self.group)
