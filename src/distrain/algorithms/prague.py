"""Prague: asynchronous partial all-reduce in small groups (Luo et al. 2020).

Each worker trains its own model with no global barrier, as in AD-PSGD (see ``gossip.py``), and
after each local step its communication thread reports *ready* to a group generator. The
generator (a service thread on one worker, rank 0 at first) puts ready workers into groups of ``--group-size``,
choosing at random among the ready ones so information spreads over the whole cluster, and
each group averages its members' models with a ring all-reduce over point-to-point messages
(``comm/ring.py``), while other groups proceed independently. A worker is in at most one group
at a time (it asks again only after its group is done), so groups never conflict; a slow
worker only delays the group it is in, and joins one only when it is ready. Groups are formed
on the fly, so no process group has to exist per possible group: the ring runs over one gossip
process group of all workers, addressed by member.

The default group size is 3, but at most ``n // 2`` (so 2 for 4 or 5 workers): two groups
must fit at once, or a group with a slow member holds up all averaging (measured on 4 workers
with one 10x slower link: groups of 3 averaged a third as often as groups of 2 and did not
reach 95% accuracy in 15 epochs; groups of 2 did).

Traffic, all through the engine's two Transports (bytes, delays, emulated links), on process
groups of their own so they never interleave with the main thread's collectives:

- control group (with a worker that joined again, a link: see below): worker -> generator
  ``[READY | BYE, last ring all-reduce in microseconds, id of the last group it was told,
  *counts, *done]``; generator -> worker ``[GROUP | STOP, k, *members (padded with -1 to the
  group size), group id, *counts, *done]`` (int64);
- data group (or link): the ring all-reduce of the group's models.

A worker behind a slow link makes every group it is in slow, and the workers in such a group
are no use to others meanwhile. So the generator also weighs cost: a worker's
cost is the fastest of its last few ring all-reduces (a group is as slow as its slowest
member, so only a slow worker is slow in all of its groups), and a ready worker whose cost
exceeds the median cost by ``d`` waits ``d`` in the queue before it may join a group, while
groups of the others go ahead. It is still averaged regularly, just not in every group; when
everyone is waiting, nobody is held.

A worker that dies (killed, cut off) is dropped: its group partners find their ring failing,
name the member whose heartbeat stopped, declare it dead in the rendezvous store and count it
done; the generator learns it from their next READY (or, for a worker that died between
groups, from its silence past ``--peer-timeout`` with a stale heartbeat), never groups it again
and no longer waits for it, and the survivors finish their budget and take the consensus
without it.

The generator has no single point of failure either. Before it answers a group, it writes the
answer of each member in the run's store (the launcher's, which outlives every worker; one
request per group), and before the first STOP it marks training over there. When the worker
that runs it is lost, every survivor finds out (its request for a group fails, or a thread that
watches the store sees it declared dead) and takes the lowest live rank as the new generator;
that worker starts a generator of its own, which needs no queue from the old one: every live
worker asks it again, saying which group it was told last. One told nothing of a group the old
generator had formed for it (it died between answers) gets that group from the store, so its
partners, already waiting in the ring, are not left there. Once training was marked over, a
survivor stops instead of electing anyone. Groups of three or more that contain the lost worker
can leave a partner waiting for one who never heard of the group until ``--peer-timeout``.

A lost worker that the launcher starts again (``--max-restarts``) joins again, keeping its id
(see ``rejoin.py``): the members admit it as soon as one of them sees it ask in the store and
count it training again from then on (its next life in ``done``, named by the admission's epoch,
at the generator too), so the budget and the shutdown wait for it. It is in neither group the
others opened (gloo's groups are fixed), so every live member opens two links with it, a gloo
group of the two over the store (``prague-data``: the models; ``prague-control``: the
generator's messages), and hands it ``[HELLO, seconds since the start in microseconds, *counts,
*done]`` and its model on the first; it takes the first model, reads in the store which worker
generates the groups now (a successor records itself there: worker 0 comes back as an ordinary
worker), and asks it for groups over their link. A ring with it runs over the links
(``GroupView``'s routes), each member reaching every other member over the gossip group as
before; a member told to group with a joiner it has not admitted yet admits it first.

Shutdown: a worker whose budget is used keeps reporting ready (at about one step time) so its
group partners are not left waiting; once the generator knows every worker is done it closes the
run to joiners (admitting those already agreed on, who are not done: then it goes on grouping)
and answers STOP to each (immediately to those waiting), each worker stops and answers BYE, and
the generator's service thread ends after the last BYE. Then no model changes any more and the
loop takes the consensus.

Example::

    distrain train --algorithm prague                        # 4 workers: groups of 2
    distrain train --algorithm prague --network slow-link    # the slow link slows one group at a time
    distrain train --algorithm prague --workers 8            # groups of 3
    distrain train --algorithm prague --workers 8 --group-size 4
    distrain train --algorithm prague --max-restarts 1         # a lost worker joins the run again
"""

from __future__ import annotations

import logging
import os
import queue
import random
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distrain.algorithms.gossip import (
    GOSSIP_BACKSTOP_S,
    AsyncGossip,
    GossipEngine,
    GossipSettings,
    LeftBehind,
    PeerTimeout,
    SharedModel,
    Waiter,
    bounded_by_us,
    gossip_group,
    survivors_link,
)
from distrain.algorithms.rejoin import POLL_S, Admissions, await_entry, open_pair
from distrain.comm.ring import ring_all_reduce
from distrain.comm.transport import Handle, Transport
from distrain.errors import WorkerFailure
from distrain.runtime.faults import is_comm_error
from distrain.runtime.health import Liveness
from distrain.runtime.membership import LinkMissed, asked

log = logging.getLogger(__name__)

READY, GROUP, STOP, BYE, HELLO = 1, 2, 3, 4, 5
FIRST_GENERATOR = 0  # the rank whose service thread forms the groups until it is lost
NO_GROUP = -1  # a group id: none yet
#: How often a waiting worker (and each worker's succession thread) checks whether the
#: generator was declared dead (seconds).
WATCH_S = 0.25
DEFAULT_GROUP = 3
COST_WINDOW = 8  # ring all-reduces per worker the generator remembers


def group_size_for(requested: int, world: int) -> int:
    """Workers per group: ``requested`` (at most ``world``), or for 0 the default, 3 but at most
    ``world // 2`` (and at least 2), so that two groups can run at once."""
    size = requested if requested > 0 else min(DEFAULT_GROUP, max(2, world // 2))
    return max(1, min(size, world))


class GroupView:
    """Members of one group seen as a ring-shaped Transport (what ``comm.ring`` needs): local
    rank ``i`` is ``members[i]`` of ``transport``'s group, and the traffic is ``transport``'s;
    a member in ``routes`` is reached over its own Transport instead (a link with a worker that
    joined again, named by run ranks too)."""

    def __init__(self, transport: Transport, members: list[int], routes: dict[int, Transport] | None = None,
                 tag: int = 0) -> None:
        self.transport, self.members = transport, members
        self.routes = routes or {}
        self.rank = members.index(transport.rank)
        self.world_size = len(members)
        self.tag = tag  # every message of this group's ring carries it (see ring_tag)

    def _to(self, member: int) -> Transport:
        return self.routes.get(member, self.transport)

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def send(self, tensor: torch.Tensor, dst: int) -> Handle:
        return self._to(self.members[dst]).send(tensor, self.members[dst], tag=self.tag)

    def recv(self, tensor: torch.Tensor, src: int) -> Handle:
        return self._to(self.members[src]).recv(tensor, self.members[src], tag=self.tag)


def ring_tag(gid: int) -> int:
    """The tag of group ``gid``'s messages: a positive 31-bit number of its own (0 is for the
    untagged control messages). A ring given up on (a member hung) leaves receives posted and
    sends pending between live members; under tags of their own, none of them ever matches a
    message of a later group."""
    generator, count = gid >> 40, gid & ((1 << 40) - 1)
    return 1 + (generator * 1_000_003 + count) % (2**31 - 2)


class GroupBoard:
    """What a group generator leaves in the run's store for a successor: each worker's latest
    group answer, and whether training is over (the first STOP was decided).

    Args:
        store: a store client of the run (used by one thread at a time).
    """

    PREFIX = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/prague/"

    def __init__(self, store: Any) -> None:
        self.store = store

    def record(self, answers: list[tuple[int, torch.Tensor]]) -> None:
        """Keep each worker's answer (one request for all of them)."""
        if answers:
            self.store.multi_set([f"{self.PREFIX}answer/{w}" for w, _ in answers],
                                 [",".join(map(str, a.tolist())) for _, a in answers])

    def answer(self, worker: int) -> torch.Tensor | None:
        """The last answer recorded for ``worker`` (None: none)."""
        key = f"{self.PREFIX}answer/{worker}"
        if not self.store.check([key]):
            return None
        return torch.tensor([int(v) for v in self.store.get(key).decode().split(",")], dtype=torch.int64)

    def forget(self, worker: int) -> None:
        """A worker that joins again: the answers of its earlier life are void (a successor must
        not send it into a group whose members have long left)."""
        self.store.delete_key(f"{self.PREFIX}answer/{worker}")

    def elect(self, rank: int) -> None:
        """``rank`` generates the groups from now on (read by a worker that joins again)."""
        self.store.set(self.PREFIX + "generator", str(rank))

    def generator(self) -> int | None:
        """The last successor elected (None: the first generator still runs)."""
        key = self.PREFIX + "generator"
        return int(self.store.get(key).decode()) if self.store.check([key]) else None

    def close_training(self) -> None:
        self.store.set(self.PREFIX + "over", "1")

    def training_over(self) -> bool:
        return bool(self.store.check([self.PREFIX + "over"]))


class GroupGenerator:
    """Forms groups of ready workers; runs on one worker (its own requests arrive in process).

    Args:
        world: number of workers.
        group_size: workers per group (at most ``world``).
        control: this worker's Transport on the control group.
        seed: seeds the choice of groups.
        timeout: how long this worker's own worker thread may wait for a group (seconds); also
            how long a worker may stay silent before its heartbeat is checked.
        liveness: where lost workers are declared and looked up (``None``: a lost worker fails
            the run).
        rank: the worker it runs on.
        successor: it took over from a lost generator (workers may have missed its answers;
            see :class:`GroupBoard`).
        route: the Transport to a worker's generator messages (default ``control``; a worker
            that joined again is reached over a link, see :class:`GroupGossip`).

    Workers that join again (the launcher's ``--max-restarts``): :meth:`revive` counts one as
    training again and :meth:`listen` hears it; ``close_joins`` (set by the engine when workers
    may join) closes the run to joiners before the first STOP, admitting those already agreed
    on, so nobody is stopped while a joiner trains.
    """

    def __init__(self, world: int, group_size: int, control: Transport, seed: int = 0, timeout: float = 120.0,
                 liveness: Liveness | None = None, rank: int = FIRST_GENERATOR, successor: bool = False,
                 route: Callable[[int], Transport] | None = None) -> None:
        self.world, self.size, self.rank = world, min(group_size, world), rank
        self.control, self.timeout, self.liveness = control, timeout, liveness
        self.route = route or (lambda worker: control)
        self.successor = successor
        self.close_joins: Callable[[], None] | None = None
        self.joins_closed = False
        self.board = GroupBoard(liveness.another().store) if liveness is not None else None  # used under the lock
        self.checked: set[int] = set()  # workers whose first READY to a successor was checked
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.ready: list[int] = []  # waiting for a group, in arrival order
        self.ready_since: dict[int, float] = {}
        self.ring_seconds: list[deque[float]] = [deque(maxlen=COST_WINDOW) for _ in range(world)]
        self.stopped: set[int] = set()
        self.lost: set[int] = set()  # workers found dead: never grouped or waited for again
        self.deaf: set[int] = set()  # workers whose connection to us closed
        self.heard = dict.fromkeys(range(world), time.monotonic())  # when each last sent a message
        self.served = threading.Event()  # the service thread has ended
        self.counts, self.done = [0] * world, [0] * world
        self.local: queue.Queue[torch.Tensor] = queue.Queue()  # answers to this worker's own worker thread
        self.groups = 0
        self.gids = 0  # group ids: unique over generators (see _answer)
        # READY / BYE messages of every worker, one receiving thread each (see listen)
        self.inbox: queue.SimpleQueue[tuple[int, torch.Tensor]] = queue.SimpleQueue()
        self.listening: dict[int, Transport] = {}  # the Transport each worker is heard on

    def inherit(self, counts: list[int], done: list[int], lost: set[int]) -> None:
        """A successor starts from what its worker knows of the progress and the losses."""
        with self.lock:
            self.counts, self.done = list(counts), list(done)
            for r in sorted(lost - {self.rank}):
                self._drop(r)

    def revive(self, worker: int, epoch: int) -> None:
        """``worker`` joined again, admitted in membership ``epoch``: it trains again (see
        :meth:`~distrain.algorithms.gossip.SharedModel.revive`) and is grouped once it is ready."""
        with self.lock:
            self.done[worker] = max(self.done[worker], 2 * epoch)
            if self.done[worker] & 1:
                return  # a late call: it finished, or was lost again
            self.lost.discard(worker)
            self.deaf.discard(worker)
            self.ring_seconds[worker].clear()
            self.heard[worker] = time.monotonic()
        log.info("group generator: worker %d trains again", worker)

    def _all_done(self) -> bool:
        return all(d & 1 for d in self.done)

    def _answering(self, form: Callable[[], list[tuple[int, torch.Tensor]]]) -> list[tuple[int, torch.Tensor]]:
        """``form()`` under the lock; when every worker is done and the run is still open to
        joiners, close it first (outside the lock: an admission revives a worker here) and form
        again, so that the STOPs go out only once nobody can join."""
        with self.lock:
            answers = form()
            closing = self.close_joins is not None and not self.joins_closed and self._all_done()
        if not closing:
            return answers
        assert self.close_joins is not None
        self.close_joins()
        with self.lock:
            self.joins_closed = True
            return answers + self._form(time.monotonic())

    def _answer(self, kind: int, members: list[int]) -> torch.Tensor:
        padded = members + [-1] * (self.size - len(members))
        gid = NO_GROUP
        if kind == GROUP:
            self.gids += 1
            gid = self.rank << 40 | self.gids  # a successor's ids never repeat its predecessor's
        return torch.tensor([kind, len(members), *padded, gid, *self.counts, *self.done], dtype=torch.int64)

    def on_ready(self, worker: int, message: torch.Tensor, now: float | None = None) -> list[tuple[int, torch.Tensor]]:
        """Record ``worker`` as ready; ``message`` is ``[ring microseconds, last group id, *counts,
        *done]``. Returns the answers now due (to this worker and to others waiting)."""
        values = message.tolist()
        n = self.world
        now = time.monotonic() if now is None else now
        # A worker counts another as done only once it declared it lost (it learns the others'
        # progress from us alone): ask the store which, so it is never grouped again.
        told = [r for r in range(n) if r != worker and values[2 + n + r] & 1 and values[2 + n + r] > self.done[r]] \
            if len(values) == 2 + 2 * n else []
        dead = set(self.liveness.dead_ranks()) & set(told) if told and self.liveness is not None else set()

        def form() -> list[tuple[int, torch.Tensor]]:
            if worker in self.lost:  # back after we gave up on it (stopped, then resumed): it must leave
                return [(worker, self._answer(STOP, []))]
            if worker in self.ready or worker in self.stopped or len(values) != 2 + 2 * n:
                raise WorkerFailure(f"group generator: unexpected ready message from worker {worker}")
            if values[0] > 0:
                self.ring_seconds[worker].append(values[0] / 1e6)
            self.counts = [max(a, b) for a, b in zip(self.counts, values[2 : 2 + n], strict=True)]
            self.done = [max(a, b) for a, b in zip(self.done, values[2 + n :], strict=True)]
            for r in dead:
                self._drop(r)
            if (missed := self._missed(worker, values[1])) is not None:
                self.heard[worker] = now
                return [(worker, missed)]
            self.ready.append(worker)
            self.ready_since[worker] = now
            self.heard[worker] = now
            return self._form(now)

        return self._answering(form)

    def _missed(self, worker: int, last_gid: int) -> torch.Tensor | None:
        """A successor, at a worker's first READY: the group the lost generator formed for it and
        it never heard of, if its other members are all live (they wait for it in the ring)."""
        if not self.successor or worker in self.checked or self.board is None:
            return None
        self.checked.add(worker)
        answer = self.board.answer(worker)
        if answer is None or int(answer[0]) != GROUP or int(answer[2 + self.size]) == last_gid:
            return None
        members = answer[2 : 2 + int(answer[1])].tolist()
        if set(members) & self.lost:
            return None
        n = self.world
        lives = answer[3 + self.size + n : 3 + self.size + 2 * n].tolist()  # each worker's life, as answered
        if any(self.done[m] // 2 > lives[m] // 2 for m in members):  # one joined again since: its last
            return None  # life was in that group; its new life never hears of it
        log.warning("group generator: worker %d never heard of its group %s; it joins it now", worker, members)
        return answer

    def drop(self, worker: int, now: float | None = None) -> list[tuple[int, torch.Tensor]]:
        """``worker`` is gone: never group it or wait for it again. Returns the answers now due."""
        def form() -> list[tuple[int, torch.Tensor]]:
            self._drop(worker)
            return self._form(time.monotonic() if now is None else now)

        return self._answering(form)

    def _drop(self, worker: int) -> None:
        if worker in self.lost:
            return
        self.lost.add(worker)
        self.done[worker] |= 1
        if worker in self.ready:
            self.ready.remove(worker)
        log.warning("group generator: lost worker %d; grouping the others without it", worker)

    def _form(self, now: float) -> list[tuple[int, torch.Tensor]]:
        """Groups (or STOPs) for the ready workers, as far as they are due (lock held)."""
        if self._all_done():  # everyone is done: nobody needs a group any more
            if self.close_joins is not None and not self.joins_closed:
                return []  # first closed to joiners (see _answering)
            if self.board is not None and not self.stopped:
                self.board.close_training()  # before the first STOP: no successor is elected from now on
            stop = self._answer(STOP, [])
            answers = [(w, stop) for w in self.ready]
            self.stopped.update(self.ready)
            self.ready.clear()
            return answers
        answers = []
        while len(eligible := self._eligible(now)) >= self.size:
            members = self.rng.sample(eligible, self.size)  # random members, in random ring order
            for m in members:
                self.ready.remove(m)
            group = self._answer(GROUP, members)
            answers += [(m, group) for m in members]
            self.groups += 1
        if self.board is not None:
            self.board.record(answers)  # before any member hears of it: a successor can tell the others
        return answers

    def cost(self, worker: int) -> float:
        """The fastest of the worker's recent ring all-reduces (0 before any)."""
        return min(self.ring_seconds[worker], default=0.0)

    def _eligible(self, now: float) -> list[int]:
        """Ready workers that may join a group now: those that have waited out their extra cost
        over the median worker's, or all of them if those are too few to group and no other
        worker is left to come (nobody would ever be released otherwise)."""
        base = statistics.median(self.cost(w) for w in range(self.world))
        eligible = [w for w in self.ready if now - self.ready_since[w] >= self.cost(w) - base]
        if len(eligible) < self.size and len(set(self.ready) | self.stopped | self.lost) == self.world:
            return list(self.ready)
        return eligible

    def deliver(self, answers: list[tuple[int, torch.Tensor]]) -> None:
        """Send the answers; a worker whose connection closed is left to its group partners,
        whose ring with it fails (they find out who is gone). A connection that failed already
        (its listening thread saw the worker die first) fails the send as it is issued, not at
        its wait: that, too, is the worker's loss, not the generator's."""
        handles = []
        for worker, answer in answers:
            if worker == self.rank:
                self.local.put(answer)
                continue
            try:
                handles.append((worker, self.route(worker).send(answer, worker)))
            except Exception as exc:
                self._not_answered(worker, exc)
        for worker, handle in handles:
            try:
                handle.wait()
            except Exception as exc:
                self._not_answered(worker, exc)

    def _not_answered(self, worker: int, exc: Exception) -> None:
        if self.liveness is None or not is_comm_error(exc):
            raise exc
        log.warning("group generator: could not answer worker %d (%s)", worker, str(exc).strip()[:120])

    def ask_local(self, message: torch.Tensor) -> torch.Tensor:
        """This worker's own worker thread is ready: wait for its answer."""
        self.deliver(self.on_ready(self.rank, message))
        try:
            return self.local.get(timeout=self.timeout)
        except queue.Empty:
            raise WorkerFailure(f"worker {self.rank} waited {self.timeout:.0f} s for a group") from None

    def serve(self) -> None:
        """The service thread: answer READY messages until every other worker said BYE (or was lost)."""
        others = set(range(self.world)) - {self.rank}
        byes: set[int] = set()
        inbox = None
        if self.liveness is not None:
            inbox = self.inbox
            for w in sorted(others - self.lost):
                self.listen(w)
        message = torch.empty(3 + 2 * self.world, dtype=torch.int64)
        try:
            while not others <= byes | self.lost:
                if inbox is None:
                    src = self.control.recv_any(message)
                else:
                    try:
                        src, message = inbox.get(timeout=1.0)  # wakes up to see whether the lost ones were all left
                    except queue.Empty:
                        continue
                kind = int(message[0])
                if kind == BYE and src in self.stopped:
                    byes.add(src)
                    self.heard[src] = time.monotonic()
                elif kind == READY:
                    self.deliver(self.on_ready(src, message[1:]))
                elif src in self.lost:
                    log.warning("group generator: ignored message kind %d from lost worker %d", kind, src)
                else:
                    raise WorkerFailure(f"group generator: unexpected message kind {kind} from worker {src}")
        finally:
            self.served.set()
        log.info("group generator: %d groups of %d; fastest recent ring all-reduce per worker (ms): %s", self.groups,
                 self.size, [round(self.cost(w) * 1e3, 1) for w in range(self.world)])

    def listen(self, worker: int) -> None:
        """Hear ``worker`` on a receiving thread of its own, feeding :attr:`inbox`. (Not an
        any-source receive: when a sender dies mid-message, gloo can leave such a receive posted,
        and it swallows the next message of another worker.) A thread whose worker's connection
        closed just ends; the watch drops the worker once it is silent. Called again for a
        worker that joined again (heard on its link from then on); a second call for the same
        Transport does nothing."""
        threading.Thread(target=self._listen, args=(worker,), name=f"distrain-prague-listen-{worker}",
                         daemon=True).start()

    def _listen(self, worker: int) -> None:
        try:
            control = self.route(worker)  # a joiner's link may still be opening
        except Exception as exc:  # noqa: BLE001 - lost meanwhile: the watch drops it
            log.info("group generator: cannot hear worker %d (%s)", worker, str(exc).strip()[:120])
            return
        with self.lock:
            if self.listening.get(worker) is control:
                return
            self.listening[worker] = control
        try:
            while True:
                message = torch.empty(3 + 2 * self.world, dtype=torch.int64)
                control.recv(message, worker).wait()
                self.inbox.put((worker, message))
                if int(message[0]) == BYE:
                    return
        except Exception as exc:  # noqa: BLE001 - a lost worker: the watch drops it
            with self.lock:
                if self.listening.get(worker) is control:  # not a connection of an earlier life
                    self.deaf.add(worker)
            log.warning("group generator: no more messages from worker %d (%s)", worker, str(exc).strip()[:120])
        finally:
            with self.lock:
                if self.listening.get(worker) is control:
                    del self.listening[worker]

    def watch(self) -> None:
        """The generator's second thread: once a second, drop workers declared dead by others,
        and workers silent for longer than a heartbeat's staleness (neither waiting for a group
        nor stopped) whose heartbeat stopped too (killed or hung between groups: nobody else
        would notice), and group the ready workers that have become eligible since the last
        message."""
        assert self.liveness is not None
        live = self.liveness.another()  # its own store client
        while not self.served.wait(1.0):
            now = time.monotonic()
            with self.lock:
                quiet = [w for w in range(self.world) if w != self.rank and w not in self.lost and w not in self.ready
                         and w not in self.stopped and now - self.heard[w] > live.stale_after]
            gone = set(live.silent(quiet)) if quiet else set()
            gone |= {w for w in quiet if w in self.deaf and now - self.heard[w] > 2 * self.timeout}  # cut off
            for w in gone:
                live.declare_dead(w)  # before counting it done: see AsyncGossip._survivors
            with self.lock:  # before the store is read: a joiner revived during the read (its earlier
                known = set(self.lost)  # life's mark just deleted) is in it, and its old mark is no loss
            dead = set(live.dead_ranks())
            if self.rank in dead:  # this worker was silent and the others went on without it
                raise LeftBehind(self.rank)
            gone |= dead - known
            for w in sorted(gone):
                self.deliver(self.drop(w))
            # A ready worker whose ring costs more than the median waits that much before it is
            # eligible: a time, not an event. Without this, ready workers that were not yet
            # eligible when the last READY came would wait for an event that may never come
            # (every other worker waiting too, or lost), until their timeout.
            self.deliver(self._answering(lambda: self._form(time.monotonic())))


class GeneratorLost(PeerTimeout):
    """The worker that generates the groups was declared dead while this one waited for it."""


class GroupGossip(GossipEngine):
    """The communication thread of one Prague worker (and, on the generator's worker, the group
    generator's threads).

    Args:
        state: the shared model and progress of this worker.
        data: a Transport on a group of all workers for the ring all-reduces.
        control: a Transport on another group of all workers for READY / GROUP messages.
        group_size: workers per group.
        seed: seeds the generator's choices.
        timeout: the ceiling: a wait for the generator's worker, or for a group's ring, whose
            peers' heartbeats go on stamping is given up after twice this many seconds (a peer
            whose heartbeat is stale is given up on a few seconds after its last stamp).
        liveness: where lost workers are declared and looked up (``None``: a lost worker fails
            the run, as in a synchronous algorithm, and the generator stays on rank 0).
        admissions: where workers started again ask to join (None: the launcher starts none).
        entry: this worker joined the run again, admitted in this membership epoch (0: it
            trained from the start); ``data`` and ``control`` then name its peers only (a
            detached Transport), every peer is reached over a link (see :meth:`enter`).

    Joins (see the module docstring): a worker that joined again is in neither of the groups
    the others opened at the start, so each member opens two links with it once it admitted it
    (a gloo group of the two: the models, and the generator's messages) and hands it its model
    and what it knows of every worker's progress; a member reaches the joiner over them from
    then on, and the joiner reaches every member over them.
    """

    def __init__(self, state: SharedModel, data: Transport, control: Transport, group_size: int, seed: int = 0,
                 timeout: float = 120.0, liveness: Liveness | None = None, admissions: Admissions | None = None,
                 entry: int = 0) -> None:
        super().__init__(state)
        self.data, self.control = data, control
        self.transports = [data] if data is control else [data, control]
        self.liveness, self.timeout, self.seed = liveness, timeout, seed
        self.rank, n = control.rank, state.world
        self.group_size = group_size
        self.admissions, self.entry = admissions, entry
        #: per peer that joined again (or, on a joiner, every peer): the epoch of its admission
        #: (or of ours) and its data and control links
        self.links: dict[int, tuple[int, Transport, Transport]] = {}
        self._elect_lock = threading.RLock()  # elections and admissions: a successor sees every revive
        self.generator_rank = FIRST_GENERATOR
        self.generator = self._generator(successor=False) if self.rank == FIRST_GENERATOR and not entry else None
        self.size = min(group_size, n)
        self.answer_len = 3 + self.size + 2 * n
        self.sent = torch.empty(state.x.numel(), dtype=state.x.dtype)
        self.total = torch.empty_like(self.sent)
        self.groups = 0  # groups this worker averaged in
        self.last_ring_us = 0
        self.last_gid = NO_GROUP  # the id of the last group this worker was told
        self.board = GroupBoard(liveness.store) if liveness is not None else None  # the worker thread's
        self._graveyard: list[torch.Tensor] = []  # buffers of failed rings (see _lose)
        self.waiter = Waiter("distrain-prague-wait") if liveness is not None else None
        self._worker_ended = threading.Event()
        #: per peer, the asks to join of its lives this worker knows (welcomed, or before its own
        #: entry): a later ask means the life it exchanges with is gone (see _drop_silent)
        self._lives: dict[int, int] = Counter(asked(liveness.store)) if entry and liveness is not None else {}

    def _generator(self, successor: bool) -> GroupGenerator:
        generator = GroupGenerator(self.state.world, self.group_size, self.control, self.seed, self.timeout,
                                   self.liveness, rank=self.rank, successor=successor,
                                   route=lambda worker: self._route(worker)[1])
        if self.admissions is not None:
            generator.close_joins = self._close_joins
        return generator

    def _threads(self) -> list[tuple[str, Any]]:
        threads = [("distrain-prague-worker", self._run_worker)]
        if self.generator is not None:
            threads += self._generator_threads(self.generator)
        elif self.liveness is not None:
            threads.append(("distrain-prague-succession", self._watch_generator))
        if self.admissions is not None:
            threads.append(("distrain-prague-admit", self._admit_joiners))
        return threads

    def _generator_threads(self, generator: GroupGenerator) -> list[tuple[str, Any]]:
        threads = [("distrain-prague-generator", generator.serve)]
        if self.liveness is not None:
            threads.append(("distrain-prague-watch", generator.watch))
        return threads

    def _run_worker(self) -> None:
        try:
            told_by = self._work()
            if told_by is not None and told_by != self.rank:
                self._bye(told_by)
        finally:
            self._worker_ended.set()

    def _work(self) -> int | None:
        """Ask for groups and average in them until told to stop; returns who told (None: the
        store said training was over after the generator was lost)."""
        gossiped = 0  # the first group follows the first step
        while True:
            steps, _ = self.wait_for_round(gossiped)
            answer, told_by = self._ask()
            kind, k = int(answer[0]), int(answer[1])
            self.state.merge(answer[3 + self.size:])
            if kind == STOP:
                return told_by
            members = answer[2 : 2 + k].tolist()
            if kind != GROUP or self.rank not in members:
                raise WorkerFailure(f"worker {self.rank}: bad group answer {answer.tolist()}")
            self.last_gid = int(answer[2 + self.size])
            lives = dict(self._lives)  # the members' lives this ring is with (see _drop_silent)
            try:
                self._reduce(members, {m: self._route(m, poll=True)[0] for m in members if m != self.rank})
                gossiped = steps
            except Exception as exc:
                # No averaging came of this step: ask for another group at once (our training
                # thread may be waiting for an averaging, --max-lag, and take no step until then).
                self._lose(members, exc, lives)

    def _bye(self, generator: int) -> None:
        """Tell the generator that stopped this worker that it has stopped (so its service thread
        can end); a generator lost meanwhile needs no answer."""
        bye = self.state.progress_header(BYE, 0, NO_GROUP)
        try:
            self._wait_on(generator, [self._route(generator)[1].send(bye, generator)])
        except Exception as exc:
            if self.liveness is None or not (isinstance(exc, GeneratorLost) or is_comm_error(exc)):
                raise
            log.info("worker %d: the generator (worker %d) left before our goodbye", self.rank, generator)

    def close(self) -> None:
        if self.waiter is not None:
            self.waiter.close()
        super().close()

    def _ask(self) -> tuple[torch.Tensor, int | None]:
        """This worker is ready: the generator's answer, and who gave it (None: no generator is
        needed any more, training is over). A lost generator is replaced (see the module doc)."""
        while True:
            generator = self.generator_rank
            ready = self.state.progress_header(READY, self.last_ring_us, self.last_gid)
            if generator == self.rank:
                assert self.generator is not None
                return self.generator.ask_local(ready[1:]), generator
            answer = torch.empty(self.answer_len, dtype=torch.int64)
            lives = dict(self._lives)  # the generator's life this wait is with (see _drop_silent)
            try:
                control = self._route(generator)[1]
                self._wait_on(generator, [control.recv(answer, generator), control.send(ready, generator)])
                return answer, generator
            except GeneratorLost:  # seen declared dead: no need to wait for its heartbeat to go stale
                pass  # (it may have joined again since, and stamp again)
            except Exception as exc:
                if self.liveness is None or not is_comm_error(exc):
                    raise
                self._generator_gone(generator, exc, lives)
            if self._succeed(self.liveness, generator) is None:
                return torch.cat([torch.tensor([STOP, 0, *[-1] * self.size, NO_GROUP]), self.state.progress_header()]), None

    def _wait_on(self, generator: int, handles: list[Handle]) -> None:
        """Wait for messages to and from the generator's worker; raise GeneratorLost once it is
        declared dead (or its heartbeat is stale: killed, hung), PeerTimeout after twice the
        timeout."""
        if self.waiter is None or self.liveness is None:
            for handle in handles:
                handle.wait()
            return

        def wait_all() -> None:
            for handle in handles:
                handle.wait()

        # The control group's gloo timeout is a backstop (see Waiter): the wait is bounded here.
        live = self.liveness
        gave_up = self.waiter.bounded(wait_all, live, [generator], 2 * self.timeout, WATCH_S,
                                      gone=lambda: live.is_dead(generator))
        if gave_up is not None and gave_up.silent:
            raise GeneratorLost(f"the group generator (worker {generator}) is lost")
        if gave_up is not None:
            raise PeerTimeout(f"no answer from the group generator (worker {generator}): timed out after "
                              f"{2 * self.timeout:g} s")

    def _generator_gone(self, generator: int, exc: BaseException, lives: dict[int, int]) -> None:
        """A wait on the generator's worker failed: once it is declared dead (or its heartbeat
        stopped), declare it dead for all; raise ``exc`` if it stays alive past the timeout."""
        self._drop_silent([generator], exc, WATCH_S, lives)

    def _drop_silent(self, peers: list[int], exc: BaseException, poll: float,
                     lives: dict[int, int] | None = None) -> list[int]:
        """After ``exc``, an exchange with ``peers`` failing: wait (polling every ``poll`` s, at
        most the timeout, then raise ``exc``) until some of them are declared dead or their
        heartbeat stopped, or were started again; declare the first dead for all, count them all
        done, and return them.

        A worker killed and started again at once (``--max-restarts``) may be admitted, its dead
        mark deleted and its new heartbeat stamping, before this worker looks: its new life's
        ask to join tells that the life this exchange was with is gone. It is counted done here
        (its new life trains again once this worker welcomes it), never declared dead: the mark
        would name the new life. ``lives``: the peers' lives (:attr:`_lives`) as the exchange
        began; one welcomed since was counted done then, and trains again already."""
        assert self.liveness is not None
        if self.rank in self.liveness.dead_ranks():  # we were the silent one (e.g. SIGSTOP)
            raise LeftBehind(self.rank) from exc
        deadline = time.monotonic() + self.timeout
        while True:
            gone = self.liveness.silent(peers)  # a heartbeat goes stale seconds after death
            with self._elect_lock:  # (welcomes count lives under it: none comes between)
                asks = self._asks(set(peers) - set(gone))
                again = [q for q, n in asks.items() if n > (lives if lives is not None else self._lives).get(q, 0)]
                for peer in again:
                    if asks[peer] > self._lives.get(peer, 0):  # not welcomed yet: its last life is lost
                        self.state.mark_lost(peer)
            if gone or again:
                break
            if time.monotonic() >= deadline:
                raise exc
            time.sleep(poll)
        for peer in gone:
            self.liveness.declare_dead(peer)  # before counting it done: see AsyncGossip._survivors
            self.state.mark_lost(peer)
        return sorted({*gone, *again})

    def _asks(self, peers: set[int], live: Liveness | None = None) -> dict[int, int]:
        """How many times each of ``peers`` asked to join the run (started again), read through
        ``live`` (default: the worker thread's); {} when no worker is started again in this run."""
        live = live if live is not None else self.liveness
        if not peers or self.admissions is None or live is None:
            return {}
        asks = Counter(asked(live.store))
        return {p: asks[p] for p in peers}

    def _succeed(self, live: Liveness, lost: int) -> int | None:
        """The generator ``lost`` was declared dead: the lowest live rank other than it generates
        the groups from now on (this worker starts a generator if it is that rank). Returns it
        (the generator already elected, where another thread of this worker replaced ``lost``
        first), or None when training was marked over before the loss (every worker stops;
        nobody is elected). ``lost`` is never elected again: started again, and admitted before
        this worker looked, it is no longer dead, but its new life generates nothing (it waits
        for the one the others elect, see :meth:`enter`)."""
        with self._elect_lock:
            if GroupBoard(live.store).training_over():  # read after the loss: see the module doc
                return None
            if lost != self.generator_rank:
                return self.generator_rank
            dead = live.dead_ranks()
            if self.rank in dead:
                raise LeftBehind(self.rank)
            new = min(r for r in range(self.state.world) if r not in dead and r != lost)
            if new != self.generator_rank:
                log.warning("worker %d: the group generator (worker %d) is lost; worker %d forms the groups from now on",
                            self.rank, self.generator_rank, new)
                for r in dead:
                    self.state.mark_lost(r)
                self.generator_rank = new
                if new == self.rank and self.generator is None:
                    generator = self._generator(successor=True)
                    generator.inherit(self.state.counts, self.state.done, set(dead))
                    self.generator = generator
                    GroupBoard(live.store).elect(new)  # for workers that join again
                    for name, fn in self._generator_threads(generator):
                        self.spawn(name, fn)
            return new

    def _watch_generator(self) -> None:
        """Each worker's succession thread: a worker busy in a ring (or between steps) still takes
        over at once when the generator's worker is declared dead, or asks to join again (killed
        and started again so fast that its dead mark was gone before this thread looked); those
        waiting for it might otherwise wait for this worker's generator."""
        assert self.liveness is not None
        live = self.liveness.another()
        asks: dict[int, int] = {}  # the generator's asks to join when it became the one this thread watches
        while not self._worker_ended.wait(WATCH_S):
            if self.generator is not None:
                return  # this worker is the generator now
            generator = self.generator_rank
            now = self._asks({generator}, live).get(generator, 0)
            again = now > asks.setdefault(generator, now)
            if (again or live.is_dead(generator)) and self._succeed(live, generator) is None:
                return  # training is over: nobody needs a generator

    def _lose(self, members: list[int], exc: BaseException, lives: dict[int, int] | None = None) -> None:
        """A ring failed: drop the members whose heartbeat stopped (declared dead in the store,
        counted done; the generator reads it from our next READY), or fail if none did."""
        me = self.rank
        if self.liveness is None or not is_comm_error(exc):
            raise exc
        others = [m for m in members if m != me and m not in self.state.lost]
        for peer in self._drop_silent(others, exc, 0.5, lives):
            log.warning("worker %d: lost worker %d in a group (%s); going on without it", me, peer,
                        str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__)
        # A receive of the failed ring may still be posted in the backend and land later: give it
        # the old buffers to write into, and use new ones from now on.
        self._graveyard += [self.sent, self.total]
        self.sent, self.total = torch.empty_like(self.sent), torch.empty_like(self.total)

    def _reduce(self, members: list[int], routes: dict[int, Transport] | None = None) -> None:
        self.state.read(out=self.sent)
        self.total.copy_(self.sent)
        start = time.perf_counter()
        view = GroupView(self.data, members, routes, tag=ring_tag(self.last_gid))
        self._bounded([m for m in members if m != self.rank],
                      lambda: ring_all_reduce(view, self.total))  # type: ignore[arg-type]
        self.last_ring_us = max(1, round((time.perf_counter() - start) * 1e6))
        self.state.mix(self.sent, self.total.div_(len(members)))
        self.groups += 1

    def _bounded(self, peers: list[int], ring: Callable[[], None]) -> None:
        """Run ``ring`` (an exchange with ``peers``). With liveness: on the waiter, giving up
        (PeerTimeout) once it outlasted a heartbeat's staleness and a peer's heartbeat stopped
        (killed, hung: its connections stay open, and every member of the ring waits for it),
        or after twice the timeout whatever their heartbeats say."""
        if self.waiter is None or self.liveness is None:
            ring()
            return
        # On giving up, the ring's buffers go to the graveyard (see _lose).
        gave_up = self.waiter.bounded(ring, self.liveness, peers, 2 * self.timeout, WATCH_S)
        if gave_up is not None and gave_up.silent:
            raise PeerTimeout(f"worker {gave_up.silent[0]} did not answer in a group: silent for "
                              f"{gave_up.waited:.0f} s, no heartbeat")
        if gave_up is not None:
            raise PeerTimeout(f"a group with workers {peers} timed out after {2 * self.timeout:g} s")

    # -- joins: a lost worker started again (see distrain.algorithms.rejoin) --

    def _route(self, peer: int, poll: bool = False) -> tuple[Transport, Transport]:
        """The data and control Transports to ``peer``: the groups of the run's start, or the links
        opened when one of us joined again (waiting for them while they open, at most the
        timeout). ``poll`` (the worker thread only): a group with a joiner this worker has not
        admitted yet (the generator did, and grouped it) first admits it here."""
        deadline = time.monotonic() + self.timeout
        while True:
            with self.state.lock:
                need = max(self.state.done[peer] // 2, self.entry)  # the epoch of its life, or of ours
                if need == 0:
                    return self.data, self.control
                epoch, data, control = self.links.get(peer, (-1, self.data, self.control))
                if epoch >= need:
                    return data, control
                opening = peer in self._opening
            if poll and not opening and self.admissions is not None and self.liveness is not None:
                self.admissions.poll(self._welcome, self._live)
                with self.state.lock:
                    opening = peer in self._opening
            if not opening and peer in self.state.lost:
                raise PeerTimeout(f"worker {self.rank}: no link with worker {peer}, which is lost")
            if time.monotonic() > deadline:
                raise PeerTimeout(f"worker {self.rank}: no link with worker {peer} within {self.timeout:g} s")
            with self.state.lock:
                self.state.lock.wait(0.05)

    def _live(self) -> list[int]:
        """The workers not declared dead (for an admission's record)."""
        assert self.liveness is not None
        dead = self.liveness.another().dead_ranks()
        return [r for r in range(self.state.world) if r not in dead]

    def _admit_joiners(self) -> None:
        """A member's thread: a few times a second, admit the workers that asked to join."""
        assert self.admissions is not None
        while not self._worker_ended.wait(POLL_S):
            self.admissions.steps = self.state.own_steps
            self.admissions.poll(self._welcome, self._live)

    def _close_joins(self) -> None:
        """The generator, once every worker is done: admit those already agreed on, then close the
        run to joiners (a later one is told the run ended)."""
        assert self.admissions is not None
        self.admissions.close(self._welcome, self._live)

    def _welcome(self, joiner: int, epoch: int) -> None:
        """``joiner`` was admitted in ``epoch``: once its dead mark is gone (it took its admission,
        see Membership.enter; a mark still there would drop it again), it trains again here and at
        this worker's generator, and a thread of its own opens the links with it and hands it
        this worker's model."""
        assert self.liveness is not None and self.admissions is not None
        try:
            came = await_entry(self.admissions.membership, joiner, epoch, self.liveness.another(), self.timeout)
        except LinkMissed as exc:
            log.warning("worker %d: %s", self.rank, exc)
            return
        if not came:
            log.warning("worker %d: worker %d was admitted but did not come within %g s", self.rank, joiner,
                        self.timeout)
            return
        with self._elect_lock:
            self.state.revive(joiner, epoch)
            self._lives[joiner] = self._lives.get(joiner, 0) + 1
            if self.generator is not None:
                self.generator.revive(joiner, epoch)
        log.info("worker %d: worker %d joins again", self.rank, joiner)
        with self.state.lock:
            self._opening.add(joiner)
        self.spawn(f"distrain-prague-link-{joiner}", lambda: self._hand_over(joiner, epoch))

    def _open_links(self, peer: int, epoch: int, joiner: int | None = None) -> tuple[Transport, Transport]:
        """The data and control links with ``peer`` (both sides open them in this order; a
        member names the ``joiner``, see :func:`~distrain.algorithms.rejoin.open_pair`)."""
        assert self.admissions is not None
        pair, m, n = (self.rank, peer), self.admissions.membership, self.state.world
        data = open_pair(m, epoch, pair, self.rank, n, self.timeout, self.data.link_model, name="prague-data",
                         joiner=joiner)
        control = open_pair(m, epoch, pair, self.rank, n, self.timeout, self.data.link_model, name="prague-control",
                            joiner=joiner)
        # A generator's receive on the control link must not time out while a slow worker trains.
        return data, bounded_by_us(control, f"the control link with worker {peer}", self.timeout)

    def _hand_over(self, joiner: int, epoch: int) -> None:
        """Open the links with ``joiner``, send it this worker's model and what it knows of every
        worker's progress (HELLO), and reach it over them from now on."""
        assert self.liveness is not None
        live = self.liveness.another()
        try:
            data, control = self._open_links(joiner, epoch, joiner=joiner)
            hello = self.state.progress_header(HELLO, round((time.perf_counter() - self.t0) * 1e6))
            model = self.state.read()
            for tensor in (hello, model):
                data.send(tensor, joiner).wait()  # bounded: the link's gloo timeout
            self._linked(joiner, epoch, data, control)
        except Exception as exc:  # noqa: BLE001 - it died again, or never came
            self._lose_joiner(joiner, exc, live)
        finally:
            self._opened(joiner)

    def _linked(self, peer: int, epoch: int, data: Transport, control: Transport) -> None:
        with self.state.lock:
            self.links[peer] = (epoch, data, control)
            self.transports += [data, control]
            self.state.lock.notify_all()
        with self._elect_lock:
            if self.generator is not None:
                self.generator.listen(peer)

    def lost_at_start(self, lost: set[int]) -> None:
        """Workers lost as the run started, before the gossip groups were made (the others opened
        their links without them): never grouped or waited for; the first generator among them,
        the lowest of the others forms the groups instead (elected in the store, for workers that
        join again)."""
        assert self.liveness is not None
        for r in sorted(lost):
            self.state.mark_lost(r)
        first = min(set(range(self.state.world)) - lost)
        if FIRST_GENERATOR in lost:
            self.generator_rank = first
            if self.rank == first:
                self.generator = self._generator(successor=False)
                GroupBoard(self.liveness.store).elect(first)
        if self.generator is not None:
            self.generator.inherit(self.state.counts, self.state.done, lost)

    def enter(self, epoch: int) -> None:
        """This worker joined again, admitted in ``epoch``: open links with every live peer (each
        opens its side once it admitted it) and take the first model handed over (:attr:`has_model`
        is set then); ask the generator the survivors elected for groups."""
        assert self.liveness is not None and self.admissions is not None
        board = GroupBoard(self.liveness.store)
        board.forget(self.rank)
        deadline = time.monotonic() + self.timeout
        while (generator := board.generator()) in (None, self.rank) and self.rank == FIRST_GENERATOR:
            if time.monotonic() > deadline:  # the generator was lost with it: the survivors elect another
                raise WorkerFailure(f"worker {self.rank} joined again, but no other worker took over the groups "
                                    f"within {self.timeout:g} s")
            time.sleep(POLL_S)
        self.generator_rank = FIRST_GENERATOR if generator is None else generator
        dead = self.liveness.dead_ranks()
        for r in dead:
            if r != self.rank:
                self.state.mark_lost(r)
        peers = [r for r in range(self.state.world) if r != self.rank and r not in dead]
        with self.state.lock:
            self._opening.update(peers)
        for peer in peers:
            self.spawn(f"distrain-prague-link-{peer}", lambda peer=peer: self._take_over(peer, epoch))

    def _take_over(self, peer: int, epoch: int) -> None:
        """Open the links with ``peer`` and receive its HELLO: the first one's model becomes this
        worker's (and its clock the run's); every one's progress is merged."""
        assert self.liveness is not None
        live = self.liveness.another()
        try:
            data, control = self._open_links(peer, epoch)
            hello = torch.empty(2 + 2 * self.state.world, dtype=torch.int64)
            model = torch.empty_like(self.state.x)
            for tensor in (hello, model):
                data.recv(tensor, peer).wait()  # bounded: the link's gloo timeout
            if int(hello[0]) != HELLO:
                raise WorkerFailure(f"worker {self.rank}: expected worker {peer}'s model, got message kind {int(hello[0])}")
            self._take_handed(peer, hello, model)
            self._linked(peer, epoch, data, control)
        except Exception as exc:  # noqa: BLE001
            self._lose_joiner(peer, exc, live)
        finally:
            self._opened(peer)


@dataclass(frozen=True, kw_only=True)
class PragueSettings(GossipSettings):
    """What Prague runs with: the gossip settings and its group size."""

    #: workers per partial all-reduce group (0: see :func:`group_size_for`)
    group_size: int


class Prague(AsyncGossip):
    """Partial all-reduce in groups of ready workers (see the module docstring)."""

    name = "prague"
    settings: PragueSettings

    def build_engine(self, transport: Transport) -> GroupGossip:
        g = self.settings
        liveness = self.liveness(transport.world_size)
        admissions = self.admissions(liveness, transport)
        size = group_size_for(g.group_size, transport.world_size)
        if self.entered is not None:  # no group to enter: links with every peer (see GroupGossip.enter)
            return GroupGossip(self.state, transport, transport, size, seed=g.run.seed, timeout=g.peer_timeout,
                               liveness=liveness, admissions=admissions, entry=self.entered.epoch)
        # With liveness both groups' waits are bounded by us (see Waiter), gloo's is a backstop.
        came = self.meet_before_groups(liveness, transport)
        if liveness is not None and self.started_without:  # some were lost as the run started
            data = survivors_link(liveness, came, transport, g.run.timeout, name="prague-data")
            control = survivors_link(liveness, came, transport, g.run.timeout, name="prague-control")
            engine = GroupGossip(self.state, data, control, size, seed=g.run.seed, timeout=g.peer_timeout,
                                 liveness=liveness, admissions=admissions)
            engine.lost_at_start(self.started_without)
            return engine
        data = gossip_group(GOSSIP_BACKSTOP_S if liveness is not None else g.peer_timeout)
        control = gossip_group(GOSSIP_BACKSTOP_S if liveness is not None else g.peer_timeout)
        link = transport.link_model
        return GroupGossip(self.state, Transport(data, link_model=link), Transport(control, link_model=link),
                           size, seed=g.run.seed, timeout=g.peer_timeout, liveness=liveness, admissions=admissions)

    def info(self) -> dict[str, Any]:
        return {"group_size": group_size_for(self.settings.group_size, self.state.world),
                "budget": self.settings.budget}

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if isinstance(self.engine, GroupGossip):
            out["groups"] = self.engine.groups
        return out


__all__ = ["GroupGenerator", "GroupGossip", "GroupView", "Prague", "PragueSettings", "group_size_for"]
