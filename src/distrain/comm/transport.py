"""The Transport: the one object through which a worker's tensors reach other workers.

Every collective and point-to-point transfer goes through it, so it can count bytes per peer
and time every exchange. Collectives run by the backend (gloo, NCCL) are charged with the
per-link traffic of a ring, the algorithm gloo and NCCL use for large tensors: for an
all-reduce of M bytes over n workers each worker sends 2(n-1)/n * M bytes to its successor and
receives as much from its predecessor.

With a link model (``distrain.emulation``) every message and collective is handed to the
backend only at its emulated release time (latency + bytes / bandwidth of its link, queued
behind earlier messages on the worker's uplink), by one dispatcher thread per Transport that
keeps the order in which they were started. So the delay measured by ``Handle.wait`` includes
the emulated one, and anything that reads ``stats.exchanges`` sees the emulated network.

Two clocks, for two questions:

- ``stats.comm_seconds`` (*busy* time): the sum of every exchange's duration, from the call that
  started it to the end of its ``wait()``. Exchanges in flight at the same time (several servers,
  several neighbours, buckets overlapping backward, background gossip threads) each count in
  full, so it can exceed the wall time.
- :func:`blocked_seconds` (*exposed* time): how long the calling thread has spent blocked in
  ``wait()`` / ``recv_any()`` (or in a :func:`blocked` block), over every Transport. Only the
  waiting that nothing else hid: at most the thread's wall time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distrain.emulation.link import LinkModel, sleep_until
from distrain.errors import WorkerFailure
from distrain.runtime.membership import wait_work

log = logging.getLogger(__name__)

# How long past its release time a delayed message may take to be handed to the backend.
ISSUE_GRACE_S = 300.0

_waiting = threading.local()  # per thread: total seconds blocked, and how deep in blocked() it is


def blocked_seconds() -> float:
    """Seconds the calling thread has spent blocked on communication so far (every Transport).

    Example::

        before = blocked_seconds()
        transport.all_reduce(grad).wait()
        exposed = blocked_seconds() - before   # the wait no computation overlapped
    """
    return getattr(_waiting, "total", 0.0)


@contextmanager
def blocked() -> Iterator[None]:
    """Count the time spent inside as the calling thread waiting on communication.

    Nested blocks count once (a wait inside a wait is the same wait).
    """
    depth = getattr(_waiting, "depth", 0)
    _waiting.depth = depth + 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _waiting.depth = depth
        if depth == 0:
            _waiting.total = blocked_seconds() + time.perf_counter() - start


@dataclass
class Exchange:
    """One finished exchange: what it was, how many bytes it moved, how long it took.

    ``seconds`` runs from the call that started it to the end of its ``wait()``, so it includes
    any time the caller spent elsewhere before waiting (e.g. receiving first). ``link_seconds``,
    for a message the link model delayed, is the emulated link's delay: from the start to the
    release time the model gave it (uplink queue, transmission, latency), free of the thread
    wake-ups that a loaded machine adds to the measured time; None without a link model.
    """

    op: str
    bytes_sent: int
    bytes_received: int
    seconds: float
    link_seconds: float | None = None

    @property
    def delay(self) -> float:
        """The emulated link's delay where the link model timed it, else the measured time."""
        return self.link_seconds if self.link_seconds is not None else self.seconds


@dataclass
class TransportStats:
    """Counters of one worker's traffic, per peer rank (group ranks)."""

    sent: list[int]
    received: list[int]
    exchanges: deque = field(default_factory=lambda: deque(maxlen=256))
    comm_seconds: float = 0.0
    recorded: int = 0  # exchanges recorded so far (``exchanges`` keeps only the latest)

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent)

    @property
    def bytes_received(self) -> int:
        return sum(self.received)

    def since(self, recorded: int) -> list[Exchange]:
        """The exchanges recorded after the first ``recorded`` (those ``exchanges`` still keeps)."""
        new = min(self.recorded - recorded, len(self.exchanges))
        return list(self.exchanges)[len(self.exchanges) - new:] if new > 0 else []


#: Operations made of sends and receives (their waits differ from a collective's in elastic runs).
POINT_TO_POINT = frozenset({"send", "recv", "exchange"})


class Handle:
    """A pending exchange; ``wait()`` blocks until it is done and records its delay.

    ``work`` is the backend's work object (or a list of them, or None when nothing is pending).
    With a link model, part of the work may be started later by the Transport's dispatcher
    (``delayed``); ``after`` runs once the backend is done (the receiver's downlink queue).
    """

    def __init__(self, transport: Transport, op: str, work: dist.Work | list[dist.Work] | None, sent: int,
                 received: int, *, delayed: bool = False, after: Callable[[], None] | None = None) -> None:
        self._transport = transport
        self._op = op
        self._works = [] if work is None else list(work) if isinstance(work, list) else [work]
        self._sent = sent
        self._received = received
        self._start = time.perf_counter()
        self._done = False
        self._issued = threading.Event() if delayed else None
        self._release = self._start
        self._error: BaseException | None = None
        self._after = after

    def _set_issued(self, works: list[dist.Work], error: BaseException | None) -> None:
        self._works.extend(works)
        self._error = error
        assert self._issued is not None
        self._issued.set()

    def wait(self) -> None:
        if self._done:
            return
        with blocked():
            self._wait()

    def _wait(self) -> None:
        if self._issued is not None:
            limit = max(0.0, self._release - time.perf_counter()) + ISSUE_GRACE_S
            if not self._issued.wait(limit):
                raise WorkerFailure(f"{self._op}: the emulated link did not release the message within {limit:.0f} s")
            if self._error is not None:
                raise self._error
        p2p = self._op in POINT_TO_POINT
        for work in self._works:
            wait_work(work, p2p=p2p, group=self._transport.group)
        if self._after is not None:
            self._after()
        self._done = True
        link = None if self._issued is None else self._release - self._start
        self._transport._record(self._op, self._sent, self._received, time.perf_counter() - self._start, link)


def ring_share(nbytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * nbytes // world_size


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _then(first: Callable[[], None] | None, second: Callable[[], None] | None) -> Callable[[], None] | None:
    """``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second

    def both() -> None:
        first()
        second()
    return both


class _Dispatcher:
    """Hands delayed operations to the backend at their release times, in the order started."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="distrain-link-model", daemon=True)
        self._thread.start()

    def submit(self, release: float, issue: Callable[[], list[dist.Work]], handle: Handle) -> None:
        handle._release = release
        self._queue.put((release, issue, handle))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            release, issue, handle = item
            try:
                sleep_until(release)
                handle._set_issued(issue(), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                handle._set_issued([], exc)
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until everything submitted so far has been handed to the backend."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)


class Transport:
    """Counts and times every tensor a worker exchanges.

    Args:
        process_group: the group to talk in; ``None`` means the default (world) group.
        link_model: an emulated network (``distrain.emulation.LinkModel``) that delays each
            message by its link's latency and bandwidth; ``None`` for the real network.
        ids: the workers' ids, in group rank order (default: their global ranks).
        meet: in an elastic run, the members' meeting in the run's store before they make
            groups of some of them over this group (``meet(name, what)``, see
            :meth:`~distrain.runtime.membership.Membership.meet`): a member lost meanwhile
            raises a loss at once, where those groups' rendezvous would wait the whole timeout
            for it. None: no meeting (the groups are made straight away).

    Example::

        transport = Transport()
        transport.all_reduce(grad).wait()
        print(transport.stats.bytes_sent)
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, link_model: LinkModel | None = None,
                 ids: list[int] | None = None, meet: Callable[[str, str], None] | None = None) -> None:
        self._open(process_group, dist.get_rank(process_group), dist.get_world_size(process_group), link_model, ids)
        self.meet = meet

    @classmethod
    def detached(cls, rank: int, world_size: int, link_model: LinkModel | None = None) -> Transport:
        """A Transport of ``rank`` among ``world_size`` workers in no process group: it names the
        run's peers and adds up the traffic of the links a process outside the run's group talks
        through (a worker that joined an asynchronous run again), and starts no exchange itself."""
        transport = cls.__new__(cls)
        transport._open(None, rank, world_size, link_model, list(range(world_size)))
        return transport

    def _open(self, process_group: dist.ProcessGroup | None, rank: int, world_size: int,
              link_model: LinkModel | None, ids: list[int] | None) -> None:
        self.group = process_group
        self.rank = rank
        self.world_size = world_size
        self.meet: Callable[[str, str], None] | None = None
        self.stats = TransportStats(sent=[0] * self.world_size, received=[0] * self.world_size)
        delays = link_model is not None and link_model.delays_messages and self.world_size > 1
        self.link_model = link_model if delays else None
        self._dispatcher = _Dispatcher() if delays else None
        # Whose links the link model charges, per group rank: the workers' ids, which stay theirs
        # when the membership changes (default: their global ranks).
        self._ids = list(ids) if ids is not None else [self._global(r) for r in range(self.world_size)]
        self._ring = self._ids
        # gloo's sends and receives read and write the tensor's memory from the host, so a CUDA
        # tensor travels through a CPU copy unless the group has NCCL for CUDA tensors (gloo's
        # collectives copy CUDA tensors themselves). A group made outside torch.distributed's
        # registry is one of distrain's links between two workers, which are gloo.
        try:
            backend = str(dist.get_backend(process_group)) if process_group is not None or dist.is_initialized() else ""
        except ValueError:
            backend = "gloo"
        self._stages_cuda = "nccl" not in backend

    @property
    def ids(self) -> list[int]:
        """The worker id of each group rank (their global ranks unless the group was built over
        the members of an elastic run, whose ids stay theirs)."""
        return list(self._ids)

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a send hands to the backend: ``tensor``, or its CPU copy (see :meth:`_open`)."""
        return tensor.cpu() if tensor.is_cuda and self._stages_cuda else tensor

    def _incoming(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The buffer a receive hands to the backend for ``tensor``, and what copies it into
        ``tensor`` once it arrived (None: the backend writes ``tensor`` itself)."""
        if not (tensor.is_cuda and self._stages_cuda):
            return tensor, None
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return staged, lambda: tensor.copy_(staged)

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank ``group_rank``."""
        return self._global(group_rank)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _record(self, op: str, sent: int, received: int, seconds: float, link_seconds: float | None = None) -> None:
        self.stats.exchanges.append(Exchange(op, sent, received, seconds, link_seconds))
        self.stats.recorded += 1
        self.stats.comm_seconds += seconds

    def _charge(self, peer_sent: dict[int, int], peer_received: dict[int, int]) -> tuple[int, int]:
        for peer, n in peer_sent.items():
            self.stats.sent[peer] += n
        for peer, n in peer_received.items():
            self.stats.received[peer] += n
        return sum(peer_sent.values()), sum(peer_received.values())

    def _start(self, op: str, sent: int, received: int, issue: Callable[[], list[dist.Work]],
               release: Callable[[LinkModel], float], *, now: list[dist.Work] | None = None,
               after: Callable[[], None] | None = None) -> Handle:
        """Issue ``issue()`` now, or, with a link model, at its release time; ``now`` is work
        already started (a receive), ``after`` runs when the backend is done."""
        if self._dispatcher is None or self.link_model is None:
            return Handle(self, op, [*(now or []), *issue()], sent, received)
        handle = Handle(self, op, now, sent, received, delayed=True, after=after)
        self._dispatcher.submit(release(self.link_model), issue, handle)
        return handle

    def _delivery(self, src: int, nbytes: int) -> Callable[[], None] | None:
        """The receiver's side of a message from ``src``: wait for the downlink queue."""
        model = self.link_model
        if model is None or not model.shapes_bandwidth:
            return None
        return lambda: sleep_until(model.receive(self._ids[src], nbytes))

    def _ring_release(self, op: str, nbytes: int) -> Callable[[LinkModel], float]:
        return lambda model: model.collective(op, nbytes, self._ring)

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        """Start an in-place all-reduce of ``tensor``; charged as a ring."""
        share = ring_share(_nbytes(tensor), self.world_size)
        sent, received = self._charge({self.next_rank: share}, {self.prev_rank: share})
        return self._start("all_reduce", sent, received,
                           lambda: [dist.all_reduce(tensor, op=op, group=self.group, async_op=True)],
                           self._ring_release("all_reduce", _nbytes(tensor)))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        """Start a broadcast from group rank ``src``; charged as a pipeline along the ring."""
        nbytes = _nbytes(tensor)
        last = (src - 1) % self.world_size
        sent_to = {} if self.rank == last or self.world_size == 1 else {self.next_rank: nbytes}
        got_from = {} if self.rank == src else {self.prev_rank: nbytes}
        sent, received = self._charge(sent_to, got_from)
        return self._start("broadcast", sent, received,
                           lambda: [dist.broadcast(tensor, src=self._global(src), group=self.group, async_op=True)],
                           self._ring_release("broadcast", nbytes))

    def reduce(self, tensor: torch.Tensor, dst: int, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        """Start a reduce of ``tensor`` into group rank ``dst`` (others' copies are scratch);
        charged as a pipeline along the ring ending at ``dst``, the reverse of a broadcast."""
        nbytes = _nbytes(tensor)
        first = (dst + 1) % self.world_size
        sent_to = {} if self.rank == dst else {self.next_rank: nbytes}
        got_from = {} if self.rank == first or self.world_size == 1 else {self.prev_rank: nbytes}
        sent, received = self._charge(sent_to, got_from)
        return self._start("reduce", sent, received,
                           lambda: [dist.reduce(tensor, dst=self._global(dst), op=op, group=self.group, async_op=True)],
                           self._ring_release("broadcast", nbytes))  # same pipeline, reversed

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle:
        """Start an all-gather of equal-sized tensors; charged as a ring (n-1 pieces each way)."""
        if self.world_size == 1:
            outputs[0].copy_(tensor)
            return Handle(self, "all_gather", None, 0, 0)
        nbytes = _nbytes(tensor) * (self.world_size - 1)
        sent, received = self._charge({self.next_rank: nbytes}, {self.prev_rank: nbytes})
        return self._start("all_gather", sent, received,
                           lambda: [dist.all_gather(outputs, tensor, group=self.group, async_op=True)],
                           self._ring_release("all_gather", _nbytes(tensor)))

    def reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor],
                       op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        """Start a reduce-scatter: ``output`` gets the reduction of every worker's ``inputs[rank]``.

        Charged as a ring: n-1 rounds, each sending one output-sized piece to the successor.
        """
        if len(inputs) != self.world_size:
            raise ValueError(f"reduce_scatter needs one input per worker ({self.world_size}), got {len(inputs)}")
        if self.world_size == 1:
            output.copy_(inputs[0])
            return Handle(self, "reduce_scatter", None, 0, 0)
        nbytes = _nbytes(output) * (self.world_size - 1)
        sent, received = self._charge({self.next_rank: nbytes}, {self.prev_rank: nbytes})
        return self._start("reduce_scatter", sent, received,
                           lambda: [dist.reduce_scatter(output, inputs, op=op, group=self.group, async_op=True)],
                           self._ring_release("reduce_scatter", _nbytes(output)))

    # -- point to point ----------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Start sending ``tensor`` to group rank ``dst``; only a receive with the same ``tag``
        takes it."""
        nbytes = _nbytes(tensor)
        tensor = self._outgoing(tensor)
        sent, received = self._charge({dst: nbytes}, {})
        return self._start("send", sent, received,
                           lambda: [dist.isend(tensor, dst=self._global(dst), group=self.group, tag=tag)],
                           lambda model: model.send(self._ids[dst], nbytes))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Start receiving into ``tensor`` from group rank ``src`` (the send with the same ``tag``:
        a receive left posted by an abandoned exchange never takes a later exchange's message
        when each exchange has a tag of its own)."""
        nbytes = _nbytes(tensor)
        sent, received = self._charge({}, {src: nbytes})
        buffer, copy = self._incoming(tensor)
        work = dist.irecv(buffer, src=self._global(src), group=self.group, tag=tag)
        return Handle(self, "recv", work, sent, received, after=_then(copy, self._delivery(src, nbytes)))

    def recv_any(self, tensor: torch.Tensor) -> int:
        """Receive into ``tensor`` from whichever peer sends first; blocks; returns its group rank."""
        start = time.perf_counter()
        buffer, copy = self._incoming(tensor)
        work = dist.irecv(buffer, src=None, group=self.group)
        with blocked():
            wait_work(work, p2p=True, group=self.group)
            if copy is not None:
                copy()
            # The sender's rank in ``self.group`` (not a global rank); ``_source_rank`` is what
            # torch.distributed.recv uses, without the deprecation warning of ``source_rank``.
            src = work._source_rank()
            nbytes = _nbytes(tensor)
            self._charge({}, {src: nbytes})
            delivery = self._delivery(src, nbytes)
            if delivery is not None:
                delivery()
        self._record("recv_any", 0, nbytes, time.perf_counter() - start)
        return src

    def exchange(self, outgoing: torch.Tensor, incoming: torch.Tensor, peer: int) -> Handle:
        """Send ``outgoing`` to group rank ``peer`` while receiving ``incoming`` from it.

        Both sides call it with each other's rank; sizes must match across the pair
        (``outgoing`` here has the shape of ``incoming`` there). One handle waits for both.

        Example::

            mine, theirs = model_vector.clone(), torch.empty_like(model_vector)
            transport.exchange(mine, theirs, peer).wait()
            model_vector.copy_((mine + theirs) / 2)
        """
        sent, received = self._charge({peer: _nbytes(outgoing)}, {peer: _nbytes(incoming)})
        buffer, copy = self._incoming(incoming)
        recv = dist.irecv(buffer, src=self._global(peer), group=self.group)
        staged = self._outgoing(outgoing)
        return self._start("exchange", sent, received,
                           lambda: [dist.isend(staged, dst=self._global(peer), group=self.group)],
                           lambda model: model.send(self._ids[peer], _nbytes(outgoing)),
                           now=[recv], after=_then(copy, self._delivery(peer, _nbytes(incoming))))

    # -- control traffic ---------------------------------------------------------------------

    def control_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather a small bookkeeping tensor (metrics, summaries); not counted as training traffic."""
        self.flush()
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        wait_work(dist.all_gather(outputs, tensor, group=self.group, async_op=True))
        return outputs

    def control_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a bookkeeping tensor in place over all workers (e.g. the consensus model at
        evaluation points); not counted as training traffic."""
        self.flush()
        wait_work(dist.all_reduce(tensor, group=self.group, async_op=True))
        return tensor

    def control_barrier(self) -> None:
        """Wait for every worker; bookkeeping only, not counted."""
        self.flush()
        wait_work(dist.barrier(group=self.group, async_op=True))

    def flush(self) -> None:
        """Hand every delayed message to the backend now-ish (after its release time), so that
        a collective issued directly afterwards comes after them on every worker."""
        if self._dispatcher is not None:
            self._dispatcher.drain()

    def close(self) -> None:
        """Stop the link model's dispatcher thread (if any); the Transport is done."""
        if self._dispatcher is not None:
            self._dispatcher.drain()
            self._dispatcher.close()
            self._dispatcher = None
            self.link_model = None
