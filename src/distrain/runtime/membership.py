"""Elastic membership: who is in a run, kept in the rendezvous store, outside every worker.

The store is hosted by the launcher (``distrain train``, ``distrain launch``) or by torchrun's
agent, never by a worker alone, so it outlives any worker, rank 0 included. Each worker keeps its
*id* (its rank when the run started) for life; its rank is its place in the current member list.

When a peer is lost, a survivor's collective fails (the peer's connection resets), or its wait
sees that another survivor has flagged the change. Every survivor then:

1. flags the change for the membership's epoch ``e`` (``.../<e>/changed``), so that survivors
   blocked in other waits leave them at once (waits poll the flag, see :func:`watch_waits`);
2. registers for epoch ``e + 1`` with the number of steps it has completed;
3. waits until every member of epoch ``e`` has registered or is gone: declared dead (the
   launcher does it the moment a process exits; a survivor whose peer reset its connection
   does too), or silent (its heartbeat older than ``stale_after`` seconds, e.g. a hung
   process); at most ``deadline`` seconds;
4. proposes the registered members by compare-and-set: the first proposal is the agreement,
   which every survivor reads back, so all of them hold the same member list;
5. marks itself ready for the new epoch's group and, once every member has, opens it over the
   store under the new epoch's prefix, with ranks in member order (the opening bounded by
   ``stale_after`` plus :data:`OPEN_GRACE_S`, not the run's timeout; a member gone in the
   rendezvous itself ends it within a poll, see :class:`WatchfulStore`). A member lost meanwhile (or
   while the state moves to who needs it) makes them agree again from step 1 over whoever is
   left; so does a loss while the members admit a joiner, which then takes a member's state in
   that agreement (:meth:`Membership.settle`).

Example::

    membership = Membership.from_env(members=list(range(4)), me=rank, min_workers=2, backend="gloo")
    try:
        transport.all_reduce(grad).wait()
    except BaseException as exc:
        if not membership.is_loss(exc):
            raise
        change = membership.recover(steps=step)   # the group is rebuilt over the survivors
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch.distributed as dist

from distrain.errors import ConfigError, WorkerFailure
from distrain.runtime.faults import inject_kill_in
from distrain.runtime.health import (
    DEAD_KEY,
    Heartbeat,
    declare_dead,
    declared_dead,
    heartbeat_stale,
    silent,
)

if TYPE_CHECKING:
    from distrain.config import TrainConfig

log = logging.getLogger(__name__)

PREFIX = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/members"
#: Set in the store by the workers of an elastic run: a launcher then keeps the survivors going.
ELASTIC_KEY = PREFIX + "/elastic"
#: A process's mark, as ``wrap()`` begins to open the default group (see :func:`mark_opening`).
OPENING_KEY = PREFIX + "/opening/{}"
#: Set by a launcher that restarts lost workers: the members then look for joiners at every step.
RESTARTS_KEY = PREFIX + "/restarts"
#: Set by the parameter servers of a run where a lost server's range is taken over and the
#: server may return: a launcher that restarts lost workers then restarts lost servers too.
SERVERS_RETURN_KEY = PREFIX + "/servers-return"
#: How many workers have asked to join (a counter), and who each was (``.../joiner/<n>``).
JOINS_KEY = PREFIX + "/joins"
JOINER_KEY = PREFIX + "/joiner/{}"
#: ``epoch:count``: joiner number ``n`` was admitted in that membership epoch, with every joiner
#: numbered below ``count``.
ADMIT_KEY = PREFIX + "/admit/{}"
#: Set by the members once they have stopped stepping: nobody can join any more.
CLOSED_KEY = PREFIX + "/closed"
#: An epoch's growth key once an asynchronous member closed the run to joiners (:meth:`Membership.close_growth`).
CLOSED = "closed"
#: The environment variable a launcher sets on a worker it starts again after its loss.
JOIN_ENV = "DISTRAIN_JOIN"
#: How often a wait polls the store for a membership change (seconds).
POLL_S = 0.05
#: Seconds, besides ``stale_after``, the members give the opening of a group once every one of
#: them is ready: connecting takes milliseconds, so a member that has not come by then died
#: after its ready mark (its heartbeat is stale by then) or is stuck.
OPEN_GRACE_S = 10.0
#: The steps a worker that joins reports while it holds no member's state yet (it registers
#: with them when a loss interrupts its admission: the others then hand it their state).
NOT_ENTERED = -1
#: gloo's messages when a timed wait ends before the work does (the work goes on): a collective's,
#: and a point-to-point send's or receive's ("Timed out waiting 50ms for recv operation ...").
_WAIT_TIMED_OUT = ("Operation timed out", "Timed out waiting")


class RunEnded(Exception):
    """A worker asked to join a run whose members have already stopped training."""


class LeftOut(WorkerFailure):
    """This worker was silent while the others agreed on the members, and they went on without
    it (launchers count it lost, like a worker that died, and may start it again)."""


class MembershipChanged(Exception):
    """Raised inside a wait when another worker has flagged that the membership changed."""


@dataclass
class Change:
    """One change of membership, as every survivor agreed on it."""

    epoch: int
    members: list[int]  # worker ids, in rank order of the new group
    lost: list[int]
    steps: dict[int, int]  # steps each member had completed when it registered
    at: float  # Unix time the change was agreed
    seconds: float  # from the failure this worker saw to the new group being open
    step: int  # steps this worker had completed when it saw the failure
    joined: list[int] = field(default_factory=list)  # workers admitted (with live state from a member)
    #: parameter servers (their ranks in the run) admitted back after their loss: not members
    returned: list[int] = field(default_factory=list)

    @property
    def leader(self) -> int:
        """The member whose state the others take: the first of those furthest ahead."""
        furthest = max(self.steps.values())
        return next(m for m in self.members if self.steps[m] == furthest)

    def record(self) -> dict[str, object]:
        """The change as a metrics / summary record."""
        if self.joined:
            return {"event": "joined", "workers": self.joined, "members": self.members, "membership_epoch": self.epoch,
                    "joined_at_step": self.step, "unix_time": self.at, "recovery_s": self.seconds}
        return {"event": "lost", "workers": self.lost, "members": self.members, "membership_epoch": self.epoch,
                "lost_at_step": self.step, "unix_time": self.at, "recovery_s": self.seconds}


@dataclass
class Growth:
    """The members' agreement to admit the workers waiting to join: after step ``at``, the
    joiners registered up to number ``count``."""

    at: int
    count: int


@dataclass
class Membership:
    """This worker's view of the run's members, and the protocol that changes it.

    Args:
        store: a client of the rendezvous store (the launcher's, or torchrun's).
        members: the worker ids in the run now, in rank order.
        me: this worker's id.
        min_workers: fewer survivors than this stop the run (``--min-workers``).
        backend: the process groups' backend (gloo).
        timeout: the groups' timeout in seconds (``--timeout``), and the longest a survivor waits
            for a live member to register.
        stale_after: seconds without a heartbeat after which a member counts as gone.
    """

    store: dist.Store
    members: list[int]
    me: int
    min_workers: int = 1
    backend: str = "gloo"
    timeout: float = 120.0
    stale_after: float = 3.0
    epoch: int = 0
    changes: list[Change] = field(default_factory=list)

    @classmethod
    def from_env(cls, members: list[int], me: int, **kwargs: object) -> Membership | None:
        """A membership over the store that MASTER_ADDR / MASTER_PORT name (None without one)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        return cls(store, list(members), me, **kwargs)  # type: ignore[arg-type]

    admitted: int = 0  # joiners admitted so far (the counter's value at the last growth)
    growth: Growth | None = None
    #: a worker that joins a group reopened with it: the heartbeat it stamps from before it asks
    heartbeat: Heartbeat | None = None
    #: (joiner, epoch) -> how many times that joiner had asked to join when that epoch admitted it
    lives: dict[tuple[int, int], int] = field(default_factory=dict)
    #: whether this worker has opened a group of the run (False: :func:`open_first_group` opens
    #: the first one, and nobody's heartbeat counts yet)
    opened: bool = True
    #: the members of this worker's open default group, in its rank order (None: none open yet)
    group_members: list[int] | None = None
    #: the store the open default group met in (kept alive with it: see :meth:`_reopen`)
    _group_store: dist.Store | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.opened and self.group_members is None and dist.is_initialized() \
                and dist.get_world_size() == len(self.members):
            self.group_members = list(self.members)  # opened before this membership, over its members
        mark_elastic(self.store)
        #: whether workers may join (a launcher restarts lost ones): then every step asks the store
        self.accepts_joins = self.store.check([RESTARTS_KEY])

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def _key(self, name: str, epoch: int | None = None) -> str:
        return f"{PREFIX}/{self.epoch if epoch is None else epoch}/{name}"

    # -- noticing a change ---------------------------------------------------------------------

    def changed(self, waited: float = 0.0) -> bool:
        """Whether a survivor has flagged a change of this epoch's membership; after a wait of
        ``waited`` seconds longer than ``stale_after``, also whether a member has gone silent (a
        hung process: its connections stay open, but its heartbeat stops), which this flags."""
        if self.store.check([self._key("changed")]):
            return True
        if waited > self.stale_after and self._gone([m for m in self.members if m != self.me]):
            self.flag()
            return True
        return False

    def flag(self) -> None:
        self.store.set(self._key("changed"), repr(time.time()))

    @staticmethod
    def is_loss(exc: BaseException) -> bool:
        """Whether ``exc`` means a peer is gone (a failed collective or a flagged change), not
        a fault of this worker."""
        from distrain.runtime.faults import is_comm_error

        if isinstance(exc, MembershipChanged):
            return True
        cause = exc.__cause__ if isinstance(exc, WorkerFailure) else None
        return is_comm_error(exc) or (cause is not None and is_comm_error(cause))

    # -- agreeing on the survivors -------------------------------------------------------------

    def _gone(self, ids: list[int]) -> list[int]:
        """Of ``ids``: declared dead, or silent (heartbeat missing or stale); until this worker's
        first group has opened (:attr:`opened`), declared dead only: as the run starts a worker
        still importing has stamped no heartbeat yet, and is not gone."""
        if not self.opened:
            return [i for i in ids if declared_dead(self.store, i)]
        return silent(self.store, ids, self.stale_after)

    def _all_gone(self, ids: list[int]) -> bool:
        """Whether every one of ``ids`` is gone: declared dead, silent, or started again and
        asking to join (it lost its place: its new life is alive, but it is not a member)."""
        gone = set(self._gone(ids))
        return gone == set(ids) or gone | (self.asking() & set(ids)) == set(ids)

    def asking(self, store: dist.Store | None = None) -> set[int]:
        """The workers that asked to join and are not admitted yet (through ``store``, another
        client of the same store, from another thread)."""
        return set(asked(self.store if store is None else store, self.admitted))

    def lost_again(self, worker: int, epoch: int, store: dist.Store | None = None) -> bool:
        """Whether ``worker``'s life admitted in ``epoch`` died since: its heartbeat (stamped from
        before it asked; its last life's dead mark may stand yet) is stale, or a later life of it
        has asked to join since (through ``store`` as :meth:`asking`)."""
        store = self.store if store is None else store
        if heartbeat_stale(store, worker, self.stale_after):
            return True
        admitted = self.lives.get((worker, epoch))
        return worker in self.asking(store) if admitted is None else asked(store).count(worker) > admitted

    def agree(self, steps: int) -> tuple[list[int], dict[int, int]]:
        """Register for the next epoch with ``steps`` completed; return the agreed members (in
        rank order) and each one's completed steps."""
        nxt = self.epoch + 1
        self.store.set(self._key(f"here/{self.me}", nxt), str(steps))
        deadline = time.monotonic() + self.timeout
        while True:
            here = {m: int(self.store.get(self._key(f"here/{m}", nxt)).decode())
                    for m in self.members if self.store.check([self._key(f"here/{m}", nxt)])}
            missing = [m for m in self.members if m not in here]
            if not missing or self._all_gone(missing) or time.monotonic() > deadline \
                    or self.store.check([self._key("members", nxt)]):
                break
            time.sleep(POLL_S / 2)
        proposal = ",".join(f"{m}:{here[m]}" for m in self.members if m in here)
        agreed = self.store.compare_set(self._key("members", nxt), "", proposal)
        text = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
        pairs = [item.split(":") for item in text.split(",") if item]
        return [int(m) for m, _ in pairs], {int(m): int(s) for m, s in pairs}

    def recover(self, steps: int, since: float) -> Change:
        """Agree on the survivors and open the new group over them (collective among them).

        Args:
            steps: the steps this worker has completed.
            since: when (perf_counter) this worker saw the failure.

        Raises WorkerFailure when this worker was left out, or fewer than ``min_workers`` remain.
        """
        from distrain.runtime.faults import announced_failure

        self.flag()
        cause = announced_failure(self.store)
        if cause is not None:  # a worker failed on its own (a non-finite loss, an error): that stops the run
            raise WorkerFailure(f"worker {self.me} stopped at step {steps} because {cause}")
        members, done = self.agree(steps)
        lost = [m for m in self.members if m not in members]
        asking = self.asking()
        for m in lost:  # every survivor sees them dead from now on (gossip, summaries), but a new
            if m not in asking:  # life of one, already asking to join, is alive (its launcher declared the last)
                declare_dead(self.store, m)
        if self.me not in members:
            raise LeftOut(f"worker {self.me} was left out of the run at step {steps}: the other workers "
                                f"agreed on {members} without it (its heartbeat was late)")
        if len(members) < self.min_workers:
            raise WorkerFailure(f"worker {self.me}: lost worker(s) {lost} at step {steps}; {len(members)} left, "
                                f"fewer than --min-workers {self.min_workers}")
        inject_kill_in("recovery", self.me)  # fault injection for tests
        self.epoch += 1
        self.members = members
        # Joiners not let in yet are admitted again at this epoch (the agreement was the last one's).
        self.growth = None
        change = Change(self.epoch, members, lost, done, time.time(), 0.0, steps)
        self.changes.append(change)  # (recorded before the group opens: a loss then recovers from this one)
        self._reopen()
        change.seconds = time.perf_counter() - since
        return change

    def settle(self, change: Callable[[], object], steps: int,
               then: Callable[[], object] | None = None) -> list[Change]:
        """Run ``change()`` (:meth:`grow`, :meth:`recover`, or the first opening of a joiner's
        group) and ``then()`` over the group it opened (what the members build on it, e.g. their
        node groups), and when a loss interrupts either, recover over whoever is left (with
        ``steps`` completed), as often as it takes, until both are done. Returns the changes
        recorded on the way (the last one's members form the open group)."""
        known = len(self.changes)
        while True:
            try:
                change()
                if then is not None:
                    then()
                return self.changes[known:]
            except Exception as exc:
                if not self.is_loss(exc):
                    raise
                since = time.perf_counter()
                log.warning("worker %d: a worker was lost while the members of epoch %d made their group; the "
                            "others agree again (%s)", self.me, self.epoch, exc)
            change = partial(self.recover, steps, since)  # (outside the except block: its traceback holds the group)

    # -- growing: workers that join ---------------------------------------------------------------

    def planned_growth(self, steps: int, align: Callable[[int], int] = int, every: int = 1) -> Growth | None:
        """At a step's end, with ``steps`` completed: when the members admit the workers waiting to
        join (None: nobody waits). One store request every ``every`` steps while workers may join.

        The first member to see a joiner proposes ``steps + max(2, every)`` (compare-and-set: one
        proposal wins), or the first step count after it that ``align`` allows (an outer round's
        end). Synchronous members are at most one step apart and each asks at every ``every``-th
        step's end (the same step counts for all), so none has passed the agreed step when it
        learns it: one a step ahead of the proposer asks next at the agreed step itself
        (synchronous parameter servers ask at every round's end too: they and the workers are at
        most one step apart as well). A store request costs about a millisecond on a busy host, a
        fifth of a small model's step: ``every`` spares it where a join may wait a few steps more."""
        if self.growth is not None:
            return self.growth
        if steps % every:
            return None
        joins = self._joins_waiting()
        return None if joins is None else self._agree_growth(f"{align(steps + max(2, every))}:{joins}")

    def growth_now(self) -> Growth | None:
        """Asynchronous algorithms, which have no common step: the agreement to admit the workers
        waiting to join now (None: nobody waits, or the run was closed to joiners at this epoch,
        :meth:`close_growth`). ``Growth.at`` names the member whose proposal won (the first one
        that saw the joiners), not a step. One store request while nobody waits."""
        if self.growth is not None:
            return self.growth
        joins = self._joins_waiting()
        return None if joins is None else self._agree_growth(f"{self.me}:{joins}")

    def _joins_waiting(self) -> int | None:
        """How many workers have asked to join so far, when some of them are not admitted yet
        (None: nobody waits, or this run admits nobody). One store request."""
        if not self.accepts_joins:
            return None
        joins = int(self.store.add(JOINS_KEY, 0))
        return joins if joins > self.admitted else None

    def close_growth(self) -> Growth | None:
        """Asynchronous algorithms, before a member stops: close the run to joiners at this epoch,
        unless the members already agreed to admit some (returned: admit them, then close again at
        the next epoch). Once closed, every member reads the same answer and the workers still
        waiting to join are told the run ended (:meth:`enter` raises RunEnded)."""
        if self.growth is not None:
            return self.growth
        growth = self._agree_growth(CLOSED)
        if growth is None:
            self.store.set(CLOSED_KEY, "1")
        return growth

    def _agree_growth(self, proposal: str) -> Growth | None:
        agreed = self.store.compare_set(self._key("grow"), "", proposal)
        text = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
        if text == CLOSED:
            return None
        at, count = (int(v) for v in text.split(":"))
        self.growth = Growth(at, count)
        return self.growth

    def grow(self, growth: Growth, steps: int, since: float) -> Change:
        """Admit the joiners of ``growth`` (collective with them): the next epoch's members are
        this one's and then the joiners, each told its epoch; the group is opened again."""
        joined = [j for j in self.joiners(growth) if j not in self.members]
        done = self._settle(growth, [*self.members, *joined], steps)
        change = self._grown(steps, since, joined, done)  # (recorded first, as in recover)
        self._reopen()
        change.seconds = time.perf_counter() - since
        return change

    def admit(self, growth: Growth, steps: int, since: float, live: list[int], servers_from: int | None = None) -> Change:
        """Admit the joiners of ``growth`` into a run whose group stays as it is (parameter
        servers: they open a link to each joiner themselves, and the workers only record it).
        The next epoch's members are ``live`` (the workers not declared dead, as this process
        sees them) and the joiners, in order of their ids; every proposal names every joiner, and
        the first one is everyone's. Joiners from rank ``servers_from`` on are parameter servers
        that return (``Change.returned``), not members."""
        asked = self.joiners(growth)
        joined = [j for j in asked if servers_from is None or j < servers_from]
        done = self._settle(growth, sorted({*live, *joined}), steps)
        change = self._grown(steps, since, joined, done)
        change.returned = [j for j in asked if j not in joined]
        return change

    def joiners(self, growth: Growth) -> list[int]:
        """The ids of the joiners ``growth`` admits, once each, in the order they asked."""
        return list(dict.fromkeys(asked(self.store, self.admitted, growth.count)))

    def _settle(self, growth: Growth, proposal: list[int], steps: int) -> dict[int, int]:
        """Propose the next epoch's members (compare-and-set: the first proposal wins), tell each
        joiner of ``growth`` its epoch, and take the agreed members; returns each one's steps."""
        nxt = self.epoch + 1
        self.store.compare_set(self._key("members", nxt), "", ",".join(f"{m}:{steps}" for m in proposal))
        for n in range(self.admitted, growth.count):
            self.store.compare_set(ADMIT_KEY.format(n), "", f"{nxt}:{growth.count}")
        asks = asked(self.store, 0, growth.count)
        for joiner in set(asks[self.admitted :]):  # which life of each joiner this epoch admits
            self.lives[(joiner, nxt)] = asks.count(joiner)
        self.members, done = self._members_of(nxt)
        self.epoch, self.admitted, self.growth = nxt, growth.count, None
        return done

    def _grown(self, steps: int, since: float, joined: list[int], done: dict[int, int]) -> Change:
        change = Change(self.epoch, list(self.members), [], done, time.time(), time.perf_counter() - since, steps,
                        joined=joined)
        self.changes.append(change)
        return change

    def store_prefix(self, name: str, epoch: int | None = None, store: dist.Store | None = None) -> dist.PrefixStore:
        """The store under this epoch's (or ``epoch``'s) key ``name``: where processes that all
        name it meet (e.g. to open a group between the parameter servers and a worker they
        admitted); through ``store`` (another client of the same store) if given."""
        return dist.PrefixStore(self._key(name, epoch), store if store is not None else self.store)

    def close(self) -> None:
        """This member has stopped stepping: workers still waiting to join are told the run ended."""
        self.store.set(CLOSED_KEY, "1")

    def _members_of(self, epoch: int) -> tuple[list[int], dict[int, int]]:
        text = self.store.get(self._key("members", epoch)).decode()
        pairs = [item.split(":") for item in text.split(",") if item]
        return [int(m) for m, _ in pairs], {int(m): int(s) for m, s in pairs}

    @classmethod
    def enter(cls, store: dist.Store, me: int, reopen: bool = True, **kwargs: object) -> Membership:
        """Join a running elastic run as worker ``me`` (a restarted or new process): ask, wait for
        the members to admit this worker at a step's end (at most ``timeout`` seconds), and open
        the group with them (``reopen``; not in a run with parameter servers, which open a link
        to it instead). The caller then takes a member's state (collective)."""
        timeout = float(kwargs.get("timeout", 120.0))  # type: ignore[arg-type]
        n = int(store.add(JOINS_KEY, 1)) - 1
        store.set(JOINER_KEY.format(n), str(me))
        if reopen:
            # Alive again from here (its heartbeat stamps already): the members then see it gone
            # only if it dies again, e.g. while they open the group with it. Until admitted it is
            # not theirs to wait for (they count a worker asking to join as gone). With parameter
            # servers or asynchronous gossip, it stays dead to its peers until they admit it.
            store.delete_key(DEAD_KEY.format(me))
        deadline = time.monotonic() + timeout
        while not store.check([ADMIT_KEY.format(n)]):
            if reopen and store.check([DEAD_KEY.format(me)]):  # survivors that agreed on its last life's
                store.delete_key(DEAD_KEY.format(me))  # loss as it asked declared that one dead: not this one
            # (admitted just before the members closed: it joins, and finds the run at its end)
            if store.check([CLOSED_KEY]) and not store.check([ADMIT_KEY.format(n)]):
                raise RunEnded(f"worker {me} was started again, but the others had finished training")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker {me} asked to join the run but was not admitted within {timeout:g} s")
            time.sleep(POLL_S)
        epoch, admitted = (int(v) for v in store.get(ADMIT_KEY.format(n)).decode().split(":"))
        inject_kill_in("entry", me)  # fault injection for tests
        if not reopen:
            store.delete_key(DEAD_KEY.format(me))  # alive again
        membership = cls(store, [me], me, epoch=epoch, admitted=admitted, **kwargs)  # type: ignore[arg-type]
        membership.members, steps = membership._members_of(epoch)
        if reopen:  # its admission, as the members record it (a loss may interrupt it: settle)
            membership.changes.append(Change(epoch, list(membership.members), [], steps, time.time(), 0.0,
                                             max(steps.values()), joined=[me]))
            membership.settle(membership._reopen, NOT_ENTERED)
        return membership

    def _close_group(self) -> None:
        """Close this worker's connections in the group it leaves, through a member still in
        the run (:func:`close_connections`). The group is kept, not freed (see
        :func:`_keep_groups_alive`), and a connection left open on which a peer had sent what
        this worker never read kept gloo's transport thread of that group polling it without
        end: about half a core for the rest of the run, which slowed DiLoCo's rounds after a
        loss by up to a third."""
        old = self.group_members or []
        peers = [rank for rank, m in enumerate(old) if m != self.me and m in self.members]
        if peers and dist.get_world_size() == len(old):
            close_connections(peer=peers[0])

    def _reopen(self) -> None:
        """Replace the default process group by one over the current members, once every one
        of them is ready to (:meth:`_meet`)."""
        self._meet()
        if self.opened:  # (a group after a change; not the first one)
            inject_kill_in("meet", self.me)  # fault injection for tests
        if dist.is_initialized():
            self._close_group()
            _abort(dist.group.WORLD)  # an operation still waiting on the lost peer ends now
            _keep_groups_alive(self.timeout)
            dist.destroy_process_group()
        # a member that dies between its ready mark and the group's rendezvous would hold the
        # others there for the run's whole timeout: the opening gets its own, shorter bound
        opening = min(self.timeout, self.stale_after + OPEN_GRACE_S)
        others = [m for m in self.members if m != self.me]
        store = WatchfulStore(dist.PrefixStore(self._key("group"), self.store), lambda: self._gone(others), opening)
        try:
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=len(self.members),
                                    timeout=datetime.timedelta(seconds=opening))
        except Exception as exc:
            if gone := self._gone(others):
                self.flag()
                raise MembershipChanged(f"worker(s) {gone} gone as the group of epoch {self.epoch} "
                                        "opened") from exc
            raise
        # The group holds the store's C++ side only; its Python side (the overrides) must live as
        # long as the group: groups made later from the default store (hierarchical all-reduce's
        # node groups) call it, and met "Not implemented" once it was freed.
        self._group_store = store
        self.group_members = list(self.members)
        if opening < self.timeout:  # the group's operations get the run's timeout
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout))
        self.opened = True


    def _meet(self) -> None:
        """Mark this member ready to open the epoch's group and wait for every other member's
        mark. The group's own rendezvous would wait the whole timeout for a member that died
        since the agreement; here a member gone meanwhile (declared dead, or silent), or a change
        flagged for this epoch, raises MembershipChanged within a poll, and the members agree
        again (:meth:`settle`)."""
        self.meet("ready", "open the group")

    def meet(self, name: str, what: str) -> None:
        """Every member marks itself ready under this epoch's key ``name`` and waits for the
        others' marks, before they ``what`` together over the epoch's group (e.g. make groups of
        some of them, whose rendezvous would wait the whole timeout for a member that died): a
        member gone meanwhile, or a change flagged for this epoch, raises MembershipChanged within
        a poll. Gone is declared dead, or silent; as the run starts (epoch 0, every heartbeat
        maybe not stamped yet), declared dead only. A member declared dead after its mark (it died
        waiting for a slower one) counts too, once more after the last mark came: the first
        members to mark themselves wait longest, and the rendezvous would wait for it."""
        self.store.set(self._key(f"{name}/{self.me}"), "1")
        deadline = time.monotonic() + self.timeout
        others = [m for m in self.members if m != self.me]
        while True:
            waiting = [m for m in others if not self.store.check([self._key(f"{name}/{m}")])]
            if self.store.check([self._key("changed")]):
                raise MembershipChanged(f"a change of epoch {self.epoch} was flagged before its members could {what}")
            died = [m for m in others if m not in waiting and declared_dead(self.store, m)]
            if gone := died + (self._gone(waiting) if self.epoch else [m for m in waiting if declared_dead(self.store, m)]):
                self.flag()
                raise MembershipChanged(f"worker(s) {sorted(gone)} gone before the members of epoch {self.epoch} "
                                        f"could {what}")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker {self.me}: workers {waiting} did not {what} in epoch {self.epoch} "
                                    f"within {self.timeout:g} s")
            time.sleep(POLL_S / 2)


class WatchfulStore(dist.Store):
    """A store whose waits for a key end as soon as ``gone()`` names someone, for a group's
    rendezvous: a member that died after its ready mark (:meth:`Membership.meet`) never writes
    its address, and the rendezvous would wait for it until ``timeout`` (the members' opening
    bound, 13 s). ``gone()`` is asked at most every ``GONE_POLL_S``; a wait polls the key with
    a back-off from 1 to 20 ms (a rendezvous waits for a few keys once)."""

    def __init__(self, inner: dist.Store, gone: Callable[[], list[int]], timeout: float) -> None:
        super().__init__()
        self._inner, self._gone_now, self._timeout = inner, gone, timeout

    def _await(self, keys: list[str], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        pause, looked = 0.001, time.monotonic()
        while not self._inner.check(keys):
            now = time.monotonic()
            if now - looked >= GONE_POLL_S:
                looked = now
                if lost := self._gone_now():
                    raise RuntimeError(f"worker(s) {lost} gone during the group's rendezvous")
            if now > deadline:
                raise RuntimeError(f"timed out after {self._timeout:g} s waiting for {keys} in the group's rendezvous")
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    def get(self, key: str) -> bytes:
        self._await([key])
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._await(list(keys), None if timeout is None else timeout.total_seconds())

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()


#: How often a rendezvous's wait asks whether a member is gone (seconds).
GONE_POLL_S = 0.1


class LinkMissed(WorkerFailure):
    """Processes that were to open a link died before they were ready to (``ranks``)."""

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(message)
        self.ranks = ranks


def await_ready(store: dist.Store, ranks: list[int], me: int, timeout: float,
                gone: Callable[[int], bool] | None, missed: str) -> None:
    """Before ``ranks`` open a link or group over a prefix of the store: mark ``me`` ready in
    ``store`` (that prefix) and wait for every other rank's mark; a rank not ready that ``gone``
    says is gone raises :class:`LinkMissed` within a poll (the link's rendezvous would wait the
    whole timeout for it); after ``timeout`` seconds, WorkerFailure (``missed``: what went wrong)."""
    store.set(f"ready/{me}", "1")
    deadline = time.monotonic() + timeout
    while waiting := [r for r in ranks if r != me and not store.check([f"ready/{r}"])]:
        if gone is not None and (lost := [r for r in waiting if gone(r)]):
            raise LinkMissed(lost, f"rank {me}: rank(s) {lost} gone before they were ready to meet")
        if time.monotonic() > deadline:
            raise WorkerFailure(f"{missed} within {timeout:g} s (ranks {waiting} never came)")
        time.sleep(POLL_S / 2)


def open_first_group(rank: int, world: int, *, min_workers: int, backend: str, timeout: float) -> Membership | None:
    """Open an elastic run's first default group over the workers that came, where the launcher
    hosting the rendezvous store (``distrain launch``'s) declares a dead process dead: the
    membership of ``world`` workers (this one ``rank``), or None without a store.

    Every worker marks itself ready and waits for the others' marks, then they open the group
    under the epoch's key (:meth:`Membership._reopen`, as after a change of members). A worker
    dead before its mark (its script died loading its data), or in the group's rendezvous, is
    declared dead by the launcher, and the others agree on who is left and open their group
    without it (:meth:`Membership.settle`; below ``min_workers`` the run stops in one line), where
    the rendezvous of a group over every process would have waited for it until ``timeout``.
    Until the group is open a worker counts as gone only when declared dead, not by its
    heartbeat: one still importing has stamped none yet. A lost worker is recorded as a change at
    step 0 (:attr:`Membership.changes`)."""
    membership = Membership.from_env(list(range(world)), rank, min_workers=min_workers, backend=backend,
                                     timeout=timeout, opened=False)
    if membership is None:
        return None
    mark_opening(membership.store, rank)  # (the run was marked elastic first, as the membership was made)
    membership.settle(membership._reopen, 0)
    return membership


def agree_before_groups(store: dist.Store | None, rank: int, world: int, timeout: float, what: str,
                        key: str, members: list[int] | None = None) -> list[int]:
    """The processes of a run that survives losses that came to make ``what`` (e.g. "its gossip
    groups"), in rank order, where making them over every process would wait for one lost as
    the run starts until their timeout.

    In rounds: in each, every process (``rank`` of ``world``) marks itself in the launcher's
    ``store`` (under ``key``) and waits until each of the round's members has marked itself or
    been declared dead; those marked are the next round's members. Every process that waits
    gets the same members (a mark stays, and a process declared dead makes none; one started
    again does not come here: it joins). It ends after a round in which nobody was missing and
    everybody was there from its start, at least the second: a process that marked itself in
    the first round and then died while waiting for a slower one would be counted otherwise,
    and the groups' rendezvous would wait for it; now only one that dies in the few
    milliseconds between a last round all were waiting for and the groups is. No store (no
    launcher declares deaths): every process. ``members``: the processes that may come (default:
    every one)."""
    if store is None:
        return list(range(world)) if members is None else list(members)
    marks = dist.PrefixStore(f"{PREFIX}/groups/{key}", store)
    deadline = time.monotonic() + timeout
    members, round_ = list(range(world)) if members is None else list(members), 0
    while True:
        marks.set(f"{round_}/{rank}", "1")
        while waiting := [r for r in members if r != rank and not marks.check([f"{round_}/{r}"])
                          and not declared_dead(store, r)]:
            if time.monotonic() > deadline:
                raise WorkerFailure(f"process {rank}: {what} were not made within {timeout:g} s (ranks {waiting} "
                                    "never came)")
            time.sleep(POLL_S / 2)
        came = [r for r in members if r == rank or marks.check([f"{round_}/{r}"])]
        if came == members and round_ > 0:
            return came
        members, round_ = came, round_ + 1


def meet_before_groups(store: dist.Store | None, rank: int, world: int, timeout: float, what: str, key: str) -> None:
    """:func:`agree_before_groups`, for ``what`` made over every process: one lost before its
    mark stops the run here in one line."""
    came = agree_before_groups(store, rank, world, timeout, what, key)
    if len(came) < world:
        lost = sorted(set(range(world)) - set(came))
        raise WorkerFailure(f"process {rank}: rank(s) {lost} lost as the run started, before {what} "
                            "were made; the run stops")


def asked(store: dist.Store, start: int = 0, stop: int | None = None) -> list[int]:
    """Who asked to join the run, in the order they asked: asks ``start`` to ``stop`` (None: every
    ask so far); a worker started again several times is named once per ask."""
    stop = int(store.add(JOINS_KEY, 0)) if stop is None else stop
    return [int(store.get(JOINER_KEY.format(n)).decode()) for n in range(start, stop)]


def restarted_workers(store: dist.Store) -> set[int]:
    """The ids of every worker started again that asked to join the run (admitted or not)."""
    return set(asked(store))


def enter_run(cfg: TrainConfig, stamp: bool = True) -> Membership:
    """Join the running elastic job a launcher restarted this process for (its ``RANK`` is the
    worker's id; the store is at ``MASTER_ADDR:MASTER_PORT``): wait to be admitted at a step's end,
    then open the group with the members (with parameter servers or asynchronous gossip, no group:
    the servers, or the gossip's peers, open links with it)."""
    from distrain.comm.group import backend_for

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ConfigError(JOIN_ENV, "is set but MASTER_ADDR / MASTER_PORT are not: only a launcher restarts workers")
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.cluster.timeout))
    c = cfg.cluster
    # The servers, or the asynchronous gossip's peers, open links of their own with it: nobody
    # reopens the run's group.
    links = cfg.algo.algorithm in LINKED_JOINS
    me = int(os.environ.get("RANK", "0"))
    # The members (or the servers, opening its link) see it alive by its heartbeat from the
    # moment it asks: one that dies on the way is then seen gone, not waited for. (``stamp``
    # False: the caller stamps one already, as distrain train's FaultWatch does.)
    heartbeat = Heartbeat(host, int(port), me, c.workers, ceiling=c.timeout).start() if stamp else None
    try:
        membership = Membership.enter(store, me, reopen=not links, min_workers=c.min_workers,
                                      backend=backend_for(cfg), timeout=c.timeout)
    except BaseException:
        if heartbeat is not None:
            heartbeat.stop()
        raise
    membership.heartbeat = heartbeat
    return membership


#: Algorithms whose workers admit a joiner without reopening the run's group: parameter servers
#: and the asynchronous gossip open links with it.
LINKED_JOINS = ("ps", "adpsgd", "prague")


def _abort(group: dist.ProcessGroup) -> None:
    """End the group's pending operations and close its connections, where the backend can."""
    import torch

    try:
        group._get_backend(torch.device("cpu")).abort()
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        log.debug("could not abort the old group: %s", exc)


#: Process groups replaced after a membership change, each with the time after which every
#: operation it may still hold has ended (see :func:`_keep_groups_alive`).
_KEPT: list[tuple[float, list[dist.ProcessGroup]]] = []


def _keep_groups_alive(timeout: float) -> None:
    """Keep every process group of this process from being freed for twice ``timeout`` seconds
    (the longest any of its operations may take; a group of an algorithm takes at most the
    run's), and free those kept that long. gloo's group, as it is freed, joins its threads, and
    one of them may still be in an operation with a peer that is alive but silent (stopped,
    deadlocked), which ``abort()`` does not end: freeing the group with the default group's
    destruction held the survivors of a user's ``wrap()`` script until that timeout (57 s of a
    60 s --timeout, where they had agreed on the loss within 3 s). Whatever is kept as the
    process exits is never freed: its threads end with the process."""
    now = time.monotonic()
    _KEPT[:] = [(until, groups) for until, groups in _KEPT if until > now]  # the others are freed here
    _keep(now + 2 * timeout, list(dist.distributed_c10d._world.pg_names))


def _keep(until: float, groups: list[dist.ProcessGroup]) -> None:
    """Keep ``groups`` from being freed until ``until`` (monotonic), and at exit for good."""
    atexit.unregister(_never_free_kept)
    atexit.register(_never_free_kept)  # (once)
    _KEPT.append((until, groups))


def _never_free_kept() -> None:
    """At exit: let the groups still kept outlive the interpreter (freed as it ends, one might
    wait for an operation with a silent peer)."""
    for _, groups in _KEPT:
        for group in groups:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    _KEPT.clear()


def mark_elastic(store: dist.Store | None) -> None:
    """Tell the launcher hosting ``store`` that the others go on when a process dies."""
    if store is not None:
        store.set(ELASTIC_KEY, "1")


def mark_opening(store: dist.Store | None, rank: int) -> None:
    """Tell the launcher hosting ``store`` that process ``rank`` begins to open the default
    group (``wrap()``): one that dies before has held nobody in a rendezvous, and may be started
    again in its place (:func:`opening`)."""
    if store is not None:
        store.set(OPENING_KEY.format(rank), "1")


def opening(store: dist.Store | None, rank: int) -> bool:
    """Whether process ``rank`` began to open the default group (best effort: True when the
    store cannot say, so that nothing is started in a place that may be taken)."""
    try:
        return store is None or store.check([OPENING_KEY.format(rank)])
    except Exception:  # noqa: BLE001
        return True


def elastic_run(store: dist.Store | None) -> bool:
    """Whether the workers meeting in ``store`` run elastically (best effort: False when the
    store cannot say)."""
    try:
        return store is not None and store.check([ELASTIC_KEY])
    except Exception:  # noqa: BLE001
        return False


# -- waits that notice a change --------------------------------------------------------------------

_watch = threading.local()


def watch_waits(check: Callable[[float], bool] | None) -> None:
    """Make every wait of this thread (``wait_work``) poll ``check(seconds waited)`` (None:
    stop); when it returns True the wait raises :class:`MembershipChanged`."""
    _watch.check = check


def watched(waited: float) -> bool:
    """Poll this thread's watch (:func:`watch_waits`) from a wait of ``waited`` seconds that is
    not a ``wait_work`` (e.g. for a condition another thread sets): True when it says the
    membership changed; False without a watch. A watch may raise instead (see
    :class:`~distrain.runtime.health.HungPeers`)."""
    check = getattr(_watch, "check", None)
    return check is not None and check(waited)


@contextmanager
def watching(check: Callable[[float], bool]) -> Iterator[None]:
    """:func:`watch_waits` with ``check`` inside the block, and this thread's watch as it was after."""
    before = getattr(_watch, "check", None)
    _watch.check = check
    try:
        yield
    finally:
        _watch.check = before


def wait_work(work: dist.Work, p2p: bool = False, group: dist.ProcessGroup | None = None) -> None:
    """``work.wait()``, leaving early with :class:`MembershipChanged` when this thread's watch
    (:func:`watch_waits`) sees the membership change. ``p2p``: ``work`` is a send or a receive on
    ``group`` (None: the default group), whose waits cannot be timed (see :func:`_wait_p2p`)."""
    check = getattr(_watch, "check", None)
    if check is None:
        work.wait()
        return
    if p2p:
        _wait_p2p(work, check, group)
        return
    poll, began = datetime.timedelta(seconds=POLL_S), time.monotonic()
    while True:
        try:
            work.wait(timeout=poll)
            return
        except RuntimeError as exc:
            if not any(text in str(exc) for text in _WAIT_TIMED_OUT):
                raise
        if check(time.monotonic() - began):
            raise MembershipChanged("the run's membership changed")


def _wait_p2p(work: dist.Work, check: Callable[[float], bool], group: dist.ProcessGroup | None) -> None:
    """A send's or receive's wait under a watch. gloo answers a timed-out point-to-point wait by
    closing every connection of the group, so the wait runs untimed in a thread of its own
    (:class:`_Waiter`) while this one polls the watch; on a change this worker closes the group's
    connections itself (a receive that cannot arrive, timed out at once), which ends that wait and
    every peer's wait on this worker at once."""
    def watch(elapsed: float) -> None:
        if check(elapsed):
            close_connections(group)
            raise MembershipChanged("the run's membership changed")

    wait_polling(work.wait, watch, POLL_S)


def wait_polling(wait: Callable[[], None], poll: Callable[[float], None], every: float) -> None:
    """Run ``wait`` (blocking calls that gloo cannot interrupt) on this process's waiter thread
    and call ``poll(seconds waited)`` here every ``every`` seconds while it lasts; an exception
    that ``wait`` or ``poll`` raises is raised here (``poll``'s at once, the wait left to its
    thread, which this process's later waits then no longer queue behind: see :func:`_abandon`)."""
    waiter = _waiter()
    done, failed = waiter.submit(wait)
    began = time.monotonic()
    try:
        while not done.wait(every):
            poll(time.monotonic() - began)
    except BaseException:
        if not done.is_set():
            _abandon(waiter)
        raise
    if failed:
        raise failed[0]


class _Waiter:
    """The thread that runs this process's point-to-point waits, one after another (a thread
    started per wait cost D-PSGD's default job about 9% of its wall time)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event, list[BaseException]] | None] = \
            queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="distrain-p2p-wait", daemon=True)
        self.thread.start()

    def submit(self, wait: Callable[[], None]) -> tuple[threading.Event, list[BaseException]]:
        done, failed = threading.Event(), []
        self._jobs.put((wait, done, failed))
        return done, failed

    def hand_over(self, to: _Waiter) -> None:
        """Give the waits queued here to ``to``, and end this thread after the one it is in."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                to._jobs.put(job)
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            wait, done, failed = job
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failed.append(exc)
            finally:
                del wait, job  # nothing may keep an old group's work alive
                done.set()


_WAITER: _Waiter | None = None
_WAITER_LOCK = threading.Lock()


def _waiter() -> _Waiter:
    global _WAITER  # noqa: PLW0603 - one per process, made on first use
    with _WAITER_LOCK:
        if _WAITER is None:
            _WAITER = _Waiter()
        return _WAITER


def _abandon(waiter: _Waiter) -> None:
    """A wait its caller left (a peer was lost) goes on in ``waiter``'s thread until the backend
    ends it, which may be never: a connection to a live member that nobody closed stays open. The
    process's later waits, and those queued behind it, go to a new waiter thread, so that a wait
    left in an old group never holds the new group's (it held a survivor's first wait after a
    loss until the old group's timeout, and the others recovered again and again meanwhile)."""
    global _WAITER  # noqa: PLW0603
    with _WAITER_LOCK:
        if _WAITER is not waiter:
            return
        _WAITER = _Waiter()
        waiter.hand_over(_WAITER)


_LET_GO = threading.Event()


def letting_go() -> bool:
    """Whether this process let go of its groups (:func:`let_go_of_groups`): the failures of
    its operations that follow are that, not news."""
    return _LET_GO.is_set()


def let_go_of_groups() -> None:
    """A process about to fail because a peer stopped answering: close its connections in every
    process group, so that its pending operations (waiting for that peer until ``--timeout``) and
    the peers' waits on it fail now, and keep the groups from being freed at exit (freeing a gloo
    group joins its threads, which may still be in an operation with the silent peer)."""
    _LET_GO.set()
    groups = list(dist.distributed_c10d._world.pg_names)
    for group in groups:
        try:
            close_connections(group)
        except Exception as exc:  # noqa: BLE001 - best effort: the process is about to fail anyway
            log.debug("could not close a group's connections: %s", exc)
    _keep(float("inf"), groups)


#: The tag of the receive that :func:`close_connections` times out (no message ever carries it).
_NEVER_SENT_TAG = 0x5EA1


def close_connections(group: dist.ProcessGroup | None = None, peer: int | None = None) -> None:
    """Close this worker's connections in ``group``: its pending sends and receives fail now,
    here and at its peers (see :func:`_wait_p2p`). A receive that times out makes gloo close
    every connection of the group; a receive from a peer whose connection has failed already
    (a lost peer) fails at once and closes nothing else, so the peers are tried in turn, from
    ``peer`` (a rank in ``group``; default: the next rank), until one times out. Where every
    connection has failed, none is left open."""
    import torch

    world = dist.get_world_size(group)
    if world < 2:
        return
    me = dist.get_rank(group)
    first = (me + 1) % world if peer is None else peer
    for rank in [first, *(r for r in range(world) if r not in (me, first))]:
        src = dist.get_global_rank(group, rank) if group is not None else rank
        try:
            dist.irecv(torch.zeros(1), src=src, group=group, tag=_NEVER_SENT_TAG).wait(
                timeout=datetime.timedelta(milliseconds=1))
        except RuntimeError as exc:
            if any(text in str(exc) for text in _WAIT_TIMED_OUT):
                return
