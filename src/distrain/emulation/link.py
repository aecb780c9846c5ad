"""The in-process link model: when each message a worker sends may leave, and when one it
receives may be delivered.

The Transport asks this model for a *release time* before it hands a message (or a collective)
to the backend: ``start + transmission + latency``, where transmission integrates the link's
bandwidth over time (traces), ``start`` waits for the worker's uplink to be free (messages to
different peers share it, one after another), and a collective is charged by the per-link
traffic of its algorithm, round by round at the pace of the slowest link of the ring. On the
receiving side, messages that arrive together queue on the receiver's downlink (incast). The
real transfer then runs, so a measured delay is the emulated one plus the real one (small on
loopback or a bridge).

Links between two ranks of one node (``--workers-per-node``) are local: messages over them are
released at once and use neither the uplink nor the downlink queue; a ring that mixes local and
remote links runs at the pace of its slowest remote link.

In ``netns`` mode ``tc`` shapes bandwidth on real links, so this model adds latency and jitter
only.

Example::

    spec = NetworkSpec.uniform(world=2, bandwidth=100e6, latency=0.005)
    link = LinkModel(spec, rank=0)
    release = link.send(dst=1, nbytes=1_000_000)  # perf_counter() time: now + 80 ms + 5 ms
"""

from __future__ import annotations

import math
import random
import threading
import time

from distrain.emulation.network import NetworkSpec

#: Rounds (and the size of each round's piece, as a fraction of the tensor) of a ring collective.
RING_ROUNDS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
}


class LinkModel:
    """One worker's view of the emulated network; thread-safe.

    Args:
        spec: the resolved network (bandwidths in bits/s, latency and jitter in seconds).
        rank: this worker's global rank.
        seed: seeds the jitter (each worker draws its own sequence).
    """

    def __init__(self, spec: NetworkSpec, rank: int, seed: int = 0) -> None:
        self.spec, self.rank = spec, rank
        self.shapes_bandwidth = spec.mode == "model" and spec.shaped
        self._rng = random.Random(seed * 100_003 + rank)
        self._lock = threading.Lock()
        self.start()

    @property
    def delays_messages(self) -> bool:
        return self.spec.delays_messages

    def start(self) -> None:
        """Start the clock (t = 0 of bandwidth traces) and empty the links."""
        self._t0 = time.perf_counter()
        self._uplink_free = self._downlink_free = 0.0

    def now(self) -> float:
        """Seconds since ``start()``."""
        return time.perf_counter() - self._t0

    # -- the arithmetic, on model time -------------------------------------------------------

    def latency(self) -> float:
        """One message's latency: the link's, plus uniform jitter, never negative."""
        jitter = self.spec.jitter
        return max(0.0, self.spec.latency + (self._rng.uniform(-jitter, jitter) if jitter else 0.0))

    def rate(self, links: list[tuple[int, int]], t: float) -> float | None:
        """Bytes per second through the slowest of ``links`` at time ``t`` (None: unlimited)."""
        if not self.shapes_bandwidth:
            return None
        remote = [(i, j) for i, j in links if not self.spec.same_node(i, j)]
        rates = [b for i, j in remote for b in (self.spec.bandwidth(i, t), self.spec.bandwidth(j, t)) if b is not None]
        return min(rates) / 8 if rates else None

    def transmit(self, t: float, nbytes: float, links: list[tuple[int, int]]) -> float:
        """When ``nbytes`` started at ``t`` have gone through ``links`` (bandwidth may change on the way)."""
        ranks = sorted({r for link in links for r in link})
        while nbytes > 0:
            rate = self.rate(links, t)
            if rate is None:
                return t
            change = self.spec.next_change(t, ranks)
            if math.isinf(change) or rate * (change - t) >= nbytes:
                return t + nbytes / rate
            nbytes -= rate * (change - t)
            t = change
        return t

    def ring_seconds(self, op: str, nbytes: int, ring: list[int], t: float) -> float:
        """Duration of a ring collective over ``ring`` (global ranks) started at ``t``; a pure function."""
        n = len(ring)
        if n <= 1:
            return 0.0
        links = [(ring[i], ring[(i + 1) % n]) for i in range(n)]
        if all(self.spec.same_node(i, j) for i, j in links):
            return 0.0  # one node: local links only
        if op == "broadcast":  # pipelined along the ring: the tensor once over the slowest link
            return self.transmit(t, nbytes, links) + sum(self.latency() for _ in range(n - 1)) - t
        piece = nbytes / n if op in ("all_reduce", "reduce_scatter") else nbytes
        end = t
        for _ in range(RING_ROUNDS[op](n)):
            end = self.transmit(end, piece, links) + self.latency()
        return end - t

    # -- what the Transport asks: perf_counter() deadlines ------------------------------------

    def local(self, ranks: list[int]) -> bool:
        """Whether ``ranks`` (global) all sit on this worker's node: their links are not emulated."""
        return all(self.spec.same_node(self.rank, r) for r in ranks if r != self.rank)

    def send(self, dst: int, nbytes: int) -> float:
        """Release time of a message to ``dst``, queued behind earlier ones on this worker's uplink."""
        if self.local([dst]):
            return time.perf_counter()
        with self._lock:
            start = max(self.now(), self._uplink_free)
            self._uplink_free = self.transmit(start, nbytes, [(self.rank, dst)])
            return self._t0 + self._uplink_free + self.latency()

    def collective(self, op: str, nbytes: int, ring: list[int]) -> float:
        """Release time of a collective (``nbytes``: the tensor; for reduce-scatter, one output)."""
        if self.local(ring):
            return time.perf_counter()
        with self._lock:
            start = max(self.now(), self._uplink_free)
            if op == "reduce_scatter":
                nbytes *= len(ring)
            end = start + self.ring_seconds(op, nbytes, ring, start)
            self._uplink_free = self._downlink_free = end
            return self._t0 + end

    def receive(self, src: int, nbytes: int) -> float:
        """Delivery time of a message that has just arrived from ``src``: after the ones before it
        have gone through this worker's downlink."""
        if self.local([src]):
            return time.perf_counter()
        with self._lock:
            now = self.now()
            if not self.shapes_bandwidth:
                return self._t0 + now
            self._downlink_free = max(now, self.transmit(self._downlink_free, nbytes, [(self.rank, self.rank)]))
            return self._t0 + self._downlink_free


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline``."""
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
