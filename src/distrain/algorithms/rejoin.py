"""A lost worker joins a running asynchronous gossip job again (AD-PSGD).

The launcher starts the lost worker again (``--max-restarts``) and it asks to join in the
launcher's store (:meth:`~distrain.runtime.membership.Membership.enter`). Asynchronous workers
have no common step, so the members admit it as soon as one of them sees it: every member looks
in the store a few times a second (:meth:`Admissions.poll`), the first one's proposal is
everyone's, and the membership's epoch grows by one. Nobody can admit a joiner once a member has
stopped: before its gossip ends, each worker closes the run to joiners at its epoch
(:meth:`Admissions.close`, a compare-and-set in the store), after admitting those already
agreed on; a joiner that asks later is told the run ended and leaves.

The joiner cannot enter the process groups the others opened at the start (gloo's groups are
fixed), so each neighbour it gossips with opens a link with it (:func:`open_pair`, a gloo group
of the two over a prefix of the store named by the epoch and the pair) and hands it its model on
it; the joiner takes the first model it gets, with the progress of every worker.

When the joiner becomes a member: for every member, once it has admitted it (the store's
agreement): from then on it counts the joiner as training again (its next life, see
:meth:`~distrain.algorithms.gossip.SharedModel.revive`), so nobody finishes before it does. A
neighbour waits on it only over their link, after it has handed it its model on that link: an
active neighbour calls it from then on, a passive one then waits for its calls (and its DONE).

Example::

    admissions = Admissions.for_run(liveness, world=4, me=0, timeout=60)
    admissions.poll(welcome)         # a few times a second: welcome(joiner, epoch) per joiner
    admissions.close(welcome)        # before this worker's gossip ends
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from distrain.comm.link import LinkTransport, open_link
from distrain.emulation.link import LinkModel
from distrain.runtime.health import Liveness, declared_dead
from distrain.runtime.membership import (
    RESTARTS_KEY,
    Change,
    Growth,
    LinkMissed,
    Membership,
    await_ready,
)

log = logging.getLogger(__name__)

#: How often a member looks in the store for workers asking to join (seconds).
POLL_S = 0.2


class Admissions:
    """This worker's part in admitting joiners to an asynchronous run (thread-safe).

    Args:
        membership: the run's membership as this worker sees it (its own store client).

    Each admission this worker takes part in is a :class:`~distrain.runtime.membership.Change`
    in :attr:`changes`, for the records.
    """

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.lock = threading.Lock()
        self.changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
        self.closed = False
        self.steps = 0  # this worker's steps, for the records (set by the engine)

    @classmethod
    def for_run(cls, liveness: Liveness | None, world: int, me: int, timeout: float) -> Admissions | None:
        """The admissions of a run whose launcher starts lost workers again (None otherwise)."""
        if liveness is None:
            return None
        store = liveness.another().store
        if not store.check([RESTARTS_KEY]):
            return None
        return cls(Membership(store, list(range(world)), me, timeout=timeout))

    @property
    def joined(self) -> bool:
        """Whether any worker joined this run (every member agrees once all have closed)."""
        return self.membership.epoch > 0

    def poll(self, welcome: Callable[[int, int], None], live: Callable[[], list[int]]) -> None:
        """Admit the workers waiting to join, if any (``welcome(joiner, epoch)`` for each;
        ``live()``: the workers not declared dead, for the record)."""
        with self.lock:
            if not self.closed and (growth := self.membership.growth_now()) is not None:
                self._admit(growth, welcome, live)

    def close(self, welcome: Callable[[int, int], None], live: Callable[[], list[int]]) -> None:
        """No worker joins from now on: admit those already agreed on (``welcome`` each), then
        close the run to joiners at the epoch reached. Idempotent."""
        with self.lock:
            while not self.closed:
                growth = self.membership.close_growth()
                if growth is None:
                    self.closed = True
                else:
                    self._admit(growth, welcome, live)

    def _admit(self, growth: Growth, welcome: Callable[[int, int], None], live: Callable[[], list[int]]) -> None:
        m, since = self.membership, time.perf_counter()
        change = m.admit(growth, self.steps, since, live())
        for joiner in change.joined:
            if joiner != m.me:
                welcome(joiner, change.epoch)
        self.changes.put(change)

    def newly_joined(self) -> list[Change]:
        """The admissions since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self.changes.get_nowait())
            except queue.Empty:
                return out


def await_entry(membership: Membership, joiner: int, epoch: int, live: Liveness, timeout: float) -> bool:
    """Wait until ``joiner``, admitted in ``epoch``, took its admission: its dead mark, which it
    deletes then (:meth:`~distrain.runtime.membership.Membership.enter`), is gone (a member that
    went on while the mark stood would drop it again). True then; False after ``timeout``
    seconds; :class:`~distrain.runtime.membership.LinkMissed` as soon as it died again (its
    heartbeat stopped, or a later life of it asks to join)."""
    deadline = time.monotonic() + timeout
    while live.is_dead(joiner):
        if membership.lost_again(joiner, epoch, live.store):
            raise LinkMissed([joiner], f"worker {joiner} was admitted but died again before it came")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def open_pair(membership: Membership, epoch: int, peers: tuple[int, int], me: int, world: int, timeout: float,
              link_model: LinkModel | None = None, name: str = "gossip", joiner: int | None = None) -> LinkTransport:
    """The link ``name`` between the two workers ``peers`` (a member and a worker it admitted in
    ``epoch``), each opening it over the same prefix of the store; blocks until both have, at
    most ``timeout`` seconds. Local runs listen on the store's address (loopback by default).
    Two workers may open several links, each of its own name (Prague: one for the models, one
    for the group generator's messages, which must never interleave).

    Each first marks itself ready and waits for the other's mark: a peer gone meanwhile raises
    :class:`~distrain.runtime.membership.LinkMissed` within a poll, not after the timeout. The
    member names the ``joiner``, gone once its heartbeat is stale or a new life of it asks to
    join; the joiner (``joiner`` None) sees a member gone by its dead mark."""
    a, b = sorted(peers)
    other = b if me == a else a
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    client = Liveness(host, int(os.environ.get("MASTER_PORT", "0")), world).store  # one per thread that opens a link
    prefix = membership.store_prefix(f"{name}/{a}-{b}", epoch, client)
    if joiner is not None:
        def gone(r: int) -> bool:
            return membership.lost_again(r, epoch, client)
    else:
        def gone(r: int) -> bool:
            return declared_dead(client, r)
    await_ready(prefix, [a, b], me, timeout, lambda r: r == other and gone(r),
                f"worker {me}: worker {other} never came to open the link {name}")
    return open_link(prefix, [a, b], me, world, timeout, link_model, host=host, gone=lambda r: r == other and gone(r))


__all__ = ["POLL_S", "Admissions", "await_entry", "open_pair"]
