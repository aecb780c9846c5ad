"""What DDP's own collectives cost on the emulated network, and the comm hook that charges it.

DDP runs its gradient all-reduces inside ``loss.backward()`` through gloo (or NCCL) directly, so
they cannot go through distrain's Transport. To run DDP under the same emulated network as
distrain's algorithms, :func:`metered_hook` wraps the real communication hook of a baseline
(``allreduce_hook``, ``fp16_compress_hook``, ``powerSGD_hook``, ``post_localSGD_hook``):

- it charges each bucket's collectives as ring all-reduces, exactly as the Transport charges its
  own: each worker sends ``2(n-1)/n * B`` bytes to its successor and receives as much from its
  predecessor, where ``B`` is what the hook really puts on the wire (fp16: 2 bytes per element;
  PowerSGD: the uncompressed tensors, then P, then Q, three all-reduces one after another);
- with the in-process link model it holds the bucket's future back until the ring would have
  finished on the emulated links: ``LinkModel.collective`` — the same arithmetic the Transport
  uses for ``all_reduce`` — gives ``2(n-1)`` rounds of ``B/n`` bytes over the slowest link plus a
  latency each, queued behind the worker's earlier collectives. The emulated transfer starts
  when the real all-reduce completes (that is when every worker has contributed its bucket), so
  a straggler delays everyone's transfer, as on a real network.

The real all-reduce on loopback is much faster than the emulated one, so what DDP sees is the
emulated cost; the real one is hidden inside it. Bandwidth traces apply (the link model
integrates bandwidth over time). In ``netns`` mode gloo would run over shaped TCP instead; the
baselines do not support that mode yet.

Example::

    meter = WireMeter(world=dist.get_world_size(), rank=dist.get_rank(), link_model=None)
    ddp_model.register_comm_hook(MeteredState(meter, None, allreduce_hook, dense_wire),
                                 metered_hook)
"""

# No ``from __future__ import annotations``: DDP checks a hook's annotations against the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not strings.
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distrain.comm.transport import ring_share
from distrain.emulation.link import LinkModel, sleep_until

log = logging.getLogger(__name__)

#: Byte sizes of the all-reduces one hook call makes for a bucket, in the order it makes them.
WireFn = Callable[[Any, dist.GradBucket], list[int]]


class _DelayLine:
    """Completes futures at their release times, in order, from one daemon thread."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="distrain-ddp-link-model", daemon=True)
        self._thread.start()

    def put(self, release: float, future: torch.futures.Future, done: Callable[[], Any]) -> None:
        self._queue.put((release, future, done))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            release, future, done = item
            sleep_until(release)
            try:
                future.set_result(done())
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits on the future
                future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class WireMeter:
    """One worker's counters of DDP traffic (per peer, like the Transport's) and its link model.

    Args:
        world: number of workers; rank: this worker's rank.
        link_model: the emulated network, or None for the real one (then only bytes are counted).
    """

    def __init__(self, world: int, rank: int, link_model: LinkModel | None = None) -> None:
        self.world, self.rank = world, rank
        self.sent = [0] * world
        self.received = [0] * world
        self.comm_seconds = 0.0
        self.dense_elements = self.wire_elements = 0  # what compressing hooks saved (PowerSGD)
        self.backward_done = 0.0  # perf_counter() when the last bucket of a step was ready
        self.link_model = link_model if link_model is not None and link_model.delays_messages and world > 1 else None
        self._delay = _DelayLine() if self.link_model is not None else None
        self._ring = list(range(world))
        self._lock = threading.Lock()

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent)

    @property
    def bytes_received(self) -> int:
        return sum(self.received)

    def charge_all_reduce(self, nbytes: int) -> None:
        """Count a ring all-reduce of ``nbytes`` (per worker: to the successor, from the predecessor)."""
        if self.world <= 1:
            return
        share = ring_share(nbytes, self.world)
        with self._lock:
            self.sent[(self.rank + 1) % self.world] += share
            self.received[(self.rank - 1) % self.world] += share

    def release_time(self, sizes: list[int]) -> float | None:
        """perf_counter() time at which all-reduces of ``sizes`` bytes, started now one after
        another, finish on the emulated links (None without a link model)."""
        if self.link_model is None:
            return None
        release = time.perf_counter()
        for nbytes in sizes:
            release = self.link_model.collective("all_reduce", nbytes, self._ring)
        return release

    def hold(self, future: torch.futures.Future, sizes: list[int], start: float) -> torch.futures.Future:
        """A future with ``future``'s value, completed once the emulated transfer of ``sizes`` is
        over; it starts when ``future`` completes (every worker has contributed)."""
        if self._delay is None:
            return future.then(lambda f: self._done(f.value(), start))
        held: torch.futures.Future = torch.futures.Future()

        def schedule(f: torch.futures.Future) -> None:
            release = self.release_time(sizes)
            assert release is not None
            self._delay.put(release, held, lambda: self._done(f.value(), start))  # type: ignore[union-attr]

        future.add_done_callback(schedule)
        return held

    def _done(self, value: Any, start: float) -> Any:
        with self._lock:
            self.comm_seconds += time.perf_counter() - start
        return value

    def synchronous(self, sizes: list[int], start: float) -> None:
        """After a blocking all-reduce of ``sizes`` started at ``start`` has returned: count it and
        wait out the emulated transfer."""
        for nbytes in sizes:
            self.charge_all_reduce(nbytes)
        release = self.release_time(sizes)
        if release is not None:
            sleep_until(release)
        self._done(None, start)

    def close(self) -> None:
        if self._delay is not None:
            self._delay.close()
            self._delay = None


class MeteredState:
    """State of :func:`metered_hook`: the meter, and the wrapped hook with its own state.

    Args:
        meter: this worker's :class:`WireMeter`.
        inner_state: the wrapped hook's state (a process group, ``PowerSGDState``, ...).
        inner_hook: the real communication hook.
        wire: byte sizes of the all-reduces ``inner_hook`` makes for a bucket, computed before
            it is called (it may change its state).
    """

    __slots__ = ["meter", "inner_state", "inner_hook", "wire"]

    def __init__(self, meter: WireMeter, inner_state: Any, inner_hook: Callable, wire: WireFn) -> None:
        self.meter, self.inner_state, self.inner_hook, self.wire = meter, inner_state, inner_hook, wire


def metered_hook(state: MeteredState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run ``state.inner_hook`` on the bucket, count its traffic, and (emulated network) complete
    it only when its transfer would have finished on the emulated links.

    Example::

        state = MeteredState(meter, None, allreduce_hook, dense_wire)
        ddp_model.register_comm_hook(state, metered_hook)
    """
    start = time.perf_counter()
    if bucket.is_last():
        state.meter.backward_done = start
    sizes = state.wire(state.inner_state, bucket)  # an empty all-reduce still pays its latency
    for nbytes in sizes:
        state.meter.charge_all_reduce(nbytes)
    return state.meter.hold(state.inner_hook(state.inner_state, bucket), sizes, start)


def dense_wire(_: Any, bucket: dist.GradBucket) -> list[int]:
    """One all-reduce of the whole bucket, in its own dtype (``allreduce_hook``)."""
    buffer = bucket.buffer()
    return [buffer.numel() * buffer.element_size()]


def fp16_wire(_: Any, bucket: dist.GradBucket) -> list[int]:
    """One all-reduce of the bucket cast to 16-bit floats (``fp16_compress_hook``)."""
    return [bucket.buffer().numel() * 2]
