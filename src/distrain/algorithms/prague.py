"""Prague: asynchronous partial all-reduce in small groups (Luo et al. 2020).

Each worker trains its own model with no global barrier, as in AD-PSGD (see ``gossip.py``), and
after each local step its communication thread reports *ready* to a group generator. The
generator (a service thread on rank 0) puts ready workers into groups of ``--group-size``,
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

- control group: worker -> generator ``[READY | BYE, last ring all-reduce in microseconds,
  *counts, *done]``; generator -> worker ``[GROUP | STOP, k, *members (padded with -1 to the
  group size), *counts, *done]`` (int64);
- data group: the ring all-reduce of the group's models.

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
without it. The generator itself (rank 0) cannot be replaced: its loss stops the run with the
lost-peer line.

Shutdown: a worker whose budget is used keeps reporting ready (at about one step time) so its
group partners are not left waiting; once the generator knows every worker is done it answers
STOP to each (immediately to those waiting), each worker stops and answers BYE, and the
generator's service thread ends after the last BYE. Then no model changes any more and the loop
takes the consensus.

Example::

    distrain train --algorithm prague                        # 4 workers: groups of 2
    distrain train --algorithm prague --network slow-link    # the slow link slows one group at a time
    distrain train --algorithm prague --workers 8            # groups of 3
    distrain train --algorithm prague --workers 8 --group-size 4
"""

from __future__ import annotations

import logging
import queue
import random
import statistics
import threading
import time
import warnings
from collections import deque
from typing import Any

import torch

from distrain.algorithms.gossip import (
    GOSSIP_BACKSTOP_S,
    AsyncGossip,
    GossipEngine,
    LeftBehind,
    PeerTimeout,
    SharedModel,
    Waiter,
    gossip_group,
)
from distrain.comm.ring import ring_all_reduce
from distrain.comm.transport import Handle, Transport
from distrain.errors import WorkerFailure
from distrain.runtime.faults import is_comm_error
from distrain.runtime.health import Liveness

log = logging.getLogger(__name__)

READY, GROUP, STOP, BYE = 1, 2, 3, 4
GENERATOR = 0  # the rank whose service thread forms the groups
DEFAULT_GROUP = 3
COST_WINDOW = 8  # ring all-reduces per worker the generator remembers


def group_size_for(requested: int, world: int) -> int:
    """Workers per group: ``requested`` (at most ``world``), or for 0 the default, 3 but at most
    ``world // 2`` (and at least 2), so that two groups can run at once."""
    size = requested if requested > 0 else min(DEFAULT_GROUP, max(2, world // 2))
    return max(1, min(size, world))


class GroupView:
    """Members of one group seen as a ring-shaped Transport (what ``comm.ring`` needs): local
    rank ``i`` is ``members[i]`` of ``transport``'s group, and the traffic is ``transport``'s."""

    def __init__(self, transport: Transport, members: list[int]) -> None:
        self.transport, self.members = transport, members
        self.rank = members.index(transport.rank)
        self.world_size = len(members)

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def send(self, tensor: torch.Tensor, dst: int) -> Handle:
        return self.transport.send(tensor, self.members[dst])

    def recv(self, tensor: torch.Tensor, src: int) -> Handle:
        return self.transport.recv(tensor, self.members[src])


class GroupGenerator:
    """Forms groups of ready workers; runs on rank 0 (its own requests arrive in process).

    Args:
        world: number of workers.
        group_size: workers per group (at most ``world``).
        control: rank 0's Transport on the control group.
        seed: seeds the choice of groups.
        timeout: how long rank 0's own worker may wait for a group (seconds); also how long a
            worker may stay silent before its heartbeat is checked.
        liveness: where lost workers are declared and looked up (``None``: a lost worker fails
            the run).
    """

    def __init__(self, world: int, group_size: int, control: Transport, seed: int = 0, timeout: float = 120.0,
                 liveness: Liveness | None = None) -> None:
        self.world, self.size = world, min(group_size, world)
        self.control, self.timeout, self.liveness = control, timeout, liveness
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
        self.local: queue.Queue[torch.Tensor] = queue.Queue()  # answers to rank 0's own worker
        self.groups = 0

    def _answer(self, kind: int, members: list[int]) -> torch.Tensor:
        padded = members + [-1] * (self.size - len(members))
        return torch.tensor([kind, len(members), *padded, *self.counts, *self.done], dtype=torch.int64)

    def on_ready(self, worker: int, message: torch.Tensor, now: float | None = None) -> list[tuple[int, torch.Tensor]]:
        """Record ``worker`` as ready; ``message`` is ``[ring microseconds, *counts, *done]``.
        Returns the answers now due (to this worker and to others waiting)."""
        values = message.tolist()
        n = self.world
        now = time.monotonic() if now is None else now
        # A worker counts another as done only once it declared it lost (it learns the others'
        # progress from us alone): ask the store which, so it is never grouped again.
        told = [r for r in range(n) if r != worker and values[1 + n + r] and not self.done[r]] if len(values) == 1 + 2 * n else []
        dead = set(self.liveness.dead_ranks()) & set(told) if told and self.liveness is not None else set()
        with self.lock:
            if worker in self.lost:  # back after we gave up on it (stopped, then resumed): it must leave
                return [(worker, self._answer(STOP, []))]
            if worker in self.ready or worker in self.stopped or len(values) != 1 + 2 * n:
                raise WorkerFailure(f"group generator: unexpected ready message from worker {worker}")
            if values[0] > 0:
                self.ring_seconds[worker].append(values[0] / 1e6)
            self.counts = [max(a, b) for a, b in zip(self.counts, values[1 : 1 + n], strict=True)]
            self.done = [max(a, min(1, b)) for a, b in zip(self.done, values[1 + n :], strict=True)]
            self.ready.append(worker)
            self.ready_since[worker] = now
            self.heard[worker] = now
            for r in dead:
                self._drop(r)
            return self._form(now)

    def drop(self, worker: int, now: float | None = None) -> list[tuple[int, torch.Tensor]]:
        """``worker`` is gone: never group it or wait for it again. Returns the answers now due."""
        with self.lock:
            self._drop(worker)
            return self._form(time.monotonic() if now is None else now)

    def _drop(self, worker: int) -> None:
        if worker in self.lost:
            return
        self.lost.add(worker)
        self.done[worker] = 1
        if worker in self.ready:
            self.ready.remove(worker)
        log.warning("group generator: lost worker %d; grouping the others without it", worker)

    def _form(self, now: float) -> list[tuple[int, torch.Tensor]]:
        """Groups (or STOPs) for the ready workers, as far as they are due (lock held)."""
        if all(self.done):  # everyone is done: nobody needs a group any more
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
        whose ring with it fails (they find out who is gone)."""
        handles = []
        for worker, answer in answers:
            if worker == GENERATOR:
                self.local.put(answer)
            else:
                handles.append((worker, self.control.send(answer, worker)))
        for worker, handle in handles:
            try:
                handle.wait()
            except Exception as exc:
                if self.liveness is None or not is_comm_error(exc):
                    raise
                log.warning("group generator: could not answer worker %d (%s)", worker, str(exc).strip()[:120])

    def ask_local(self, message: torch.Tensor) -> torch.Tensor:
        """Rank 0's own worker is ready: wait for its answer."""
        self.deliver(self.on_ready(GENERATOR, message))
        try:
            return self.local.get(timeout=self.timeout)
        except queue.Empty:
            raise WorkerFailure(f"worker 0 waited {self.timeout:.0f} s for a group") from None

    def serve(self) -> None:
        """The service thread: answer READY messages until every other worker said BYE (or was lost)."""
        others = set(range(self.world)) - {GENERATOR}
        byes: set[int] = set()
        inbox = self._listen(others) if self.liveness is not None else None
        message = torch.empty(2 + 2 * self.world, dtype=torch.int64)
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

    def _listen(self, workers: set[int]) -> queue.SimpleQueue[tuple[int, torch.Tensor]]:
        """One receiving thread per worker, feeding one inbox. (Not an any-source receive: when a
        sender dies mid-message, gloo can leave such a receive posted, and it swallows the next
        message of another worker.) A thread whose worker's connection closed just ends; the
        watch drops the worker once it is silent."""
        inbox: queue.SimpleQueue[tuple[int, torch.Tensor]] = queue.SimpleQueue()

        def listen(worker: int) -> None:
            try:
                while True:
                    message = torch.empty(2 + 2 * self.world, dtype=torch.int64)
                    self.control.recv(message, worker).wait()
                    inbox.put((worker, message))
                    if int(message[0]) == BYE:
                        return
            except Exception as exc:  # noqa: BLE001 - a lost worker: the watch drops it
                self.deaf.add(worker)
                log.warning("group generator: no more messages from worker %d (%s)", worker, str(exc).strip()[:120])

        for w in sorted(workers):
            threading.Thread(target=listen, args=(w,), name=f"distrain-prague-listen-{w}", daemon=True).start()
        return inbox

    def watch(self) -> None:
        """The generator's second thread: once a second, drop workers declared dead by others,
        and workers silent past the timeout (neither waiting for a group nor stopped) whose
        heartbeat stopped too (killed between groups: nobody else would notice), and group the
        ready workers that have become eligible since the last message."""
        assert self.liveness is not None
        live = Liveness(self.liveness.host, self.liveness.port, self.liveness.world_size)  # its own store client
        while not self.served.wait(1.0):
            now = time.monotonic()
            with self.lock:
                quiet = [w for w in range(self.world) if w != GENERATOR and w not in self.lost and w not in self.ready
                         and w not in self.stopped and now - self.heard[w] > self.timeout]
            gone = set(live.silent(quiet)) if quiet else set()
            gone |= {w for w in quiet if w in self.deaf and now - self.heard[w] > 2 * self.timeout}  # cut off
            for w in gone:
                live.declare_dead(w)  # before counting it done: see AsyncGossip._survivors
            gone |= set(live.dead_ranks()) - self.lost - {GENERATOR}
            for w in sorted(gone):
                self.deliver(self.drop(w))
            # A ready worker whose ring costs more than the median waits that much before it is
            # eligible: a time, not an event. Without this, ready workers that were not yet
            # eligible when the last READY came would wait for an event that may never come
            # (every other worker waiting too, or lost), until their timeout.
            with self.lock:
                answers = self._form(time.monotonic())
            self.deliver(answers)


class GroupGossip(GossipEngine):
    """The communication thread of one Prague worker (and, on rank 0, the group generator).

    Args:
        state: the shared model and progress of this worker.
        data: a Transport on a group of all workers for the ring all-reduces.
        control: a Transport on another group of all workers for READY / GROUP messages.
        group_size: workers per group.
        seed: seeds the generator's choices.
        timeout: how long rank 0's worker may wait for a group (the others wait in gloo,
            bounded by their group's timeout), and a silent worker may stay silent before its
            heartbeat is checked.
        liveness: where lost workers are declared and looked up (``None``: a lost worker fails
            the run, as in a synchronous algorithm).
    """

    def __init__(self, state: SharedModel, data: Transport, control: Transport, group_size: int, seed: int = 0,
                 timeout: float = 120.0, liveness: Liveness | None = None) -> None:
        super().__init__(state)
        self.data, self.control = data, control
        self.transports = [data, control]
        self.liveness, self.timeout = liveness, timeout
        n = state.world
        self.generator = GroupGenerator(n, group_size, control, seed, timeout, liveness) \
            if control.rank == GENERATOR else None
        self.size = min(group_size, n)
        self.answer_len = 2 + self.size + 2 * n
        self.sent = torch.empty(state.x.numel(), dtype=state.x.dtype)
        self.total = torch.empty_like(self.sent)
        self.groups = 0  # groups this worker averaged in
        self.last_ring_us = 0
        self._graveyard: list[torch.Tensor] = []  # buffers of failed rings (see _lose)
        self.waiter = Waiter("distrain-prague-wait") if liveness is not None and self.generator is None else None

    def _threads(self) -> list[tuple[str, Any]]:
        threads = [("distrain-prague-worker", self._run_worker)]
        if self.generator is not None:
            threads.append(("distrain-prague-generator", self.generator.serve))
            if self.liveness is not None:
                threads.append(("distrain-prague-watch", self.generator.watch))
        return threads

    def _run_worker(self) -> None:
        gossiped = 0  # the first group follows the first step
        while True:
            gossiped, _ = self.wait_for_round(gossiped)
            answer = self._ask()
            kind, k = int(answer[0]), int(answer[1])
            self.state.merge(answer[2 + self.size:])
            if kind == STOP:
                break
            members = answer[2 : 2 + k].tolist()
            if kind != GROUP or self.control.rank not in members:
                raise WorkerFailure(f"worker {self.control.rank}: bad group answer {answer.tolist()}")
            try:
                self._reduce(members)
            except Exception as exc:
                self._lose(members, exc)
        if self.generator is None:
            self.control.send(self.state.progress_header(BYE, 0), GENERATOR).wait()

    def close(self) -> None:
        if self.waiter is not None:
            self.waiter.close()
        super().close()

    def _ask(self) -> torch.Tensor:
        ready = self.state.progress_header(READY, self.last_ring_us)
        if self.generator is not None:
            return self.generator.ask_local(ready[1:])
        answer = torch.empty(self.answer_len, dtype=torch.int64)
        handles = [self.control.recv(answer, GENERATOR), self.control.send(ready, GENERATOR)]
        if self.waiter is None or self.liveness is None:
            for handle in handles:
                handle.wait()
            return answer

        def wait_all() -> None:
            for handle in handles:
                handle.wait()

        # The control group's gloo timeout is a backstop (see Waiter): the wait is bounded here.
        job = self.waiter.start(wait_all)
        if job.wait(self.timeout) or (not self.liveness.silent([GENERATOR]) and job.wait(self.timeout)):
            return answer
        self.waiter.abandon()
        raise PeerTimeout(f"no answer from the group generator (worker {GENERATOR}): timed out after "
                          f"{2 * self.timeout:g} s")

    def _lose(self, members: list[int], exc: BaseException) -> None:
        """A ring failed: drop the members whose heartbeat stopped (declared dead in the store,
        counted done; the generator reads it from our next READY), or fail if none did."""
        me = self.control.rank
        if self.liveness is None or not is_comm_error(exc):
            raise exc
        if me in self.liveness.dead_ranks():  # we were the silent one (e.g. SIGSTOP)
            raise LeftBehind(me) from exc
        others = [m for m in members if m != me and m not in self.state.lost]
        deadline = time.monotonic() + self.timeout
        while not (gone := self.liveness.silent(others)):  # a heartbeat goes stale seconds after death
            if time.monotonic() >= deadline:
                raise exc
            time.sleep(0.5)
        for peer in gone:
            self.liveness.declare_dead(peer)  # before counting it done: see AsyncGossip._survivors
            self.state.mark_lost(peer)
            log.warning("worker %d: lost worker %d in a group (%s); going on without it", me, peer,
                        str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__)
        # A receive of the failed ring may still be posted in the backend and land later: give it
        # the old buffers to write into, and use new ones from now on.
        self._graveyard += [self.sent, self.total]
        self.sent, self.total = torch.empty_like(self.sent), torch.empty_like(self.total)

    def _reduce(self, members: list[int]) -> None:
        self.state.read(out=self.sent)
        self.total.copy_(self.sent)
        start = time.perf_counter()
        ring_all_reduce(GroupView(self.data, members), self.total)  # type: ignore[arg-type]
        self.last_ring_us = max(1, round((time.perf_counter() - start) * 1e6))
        self.state.mix(self.sent, self.total.div_(len(members)))
        self.groups += 1


class Prague(AsyncGossip):
    """Partial all-reduce in groups of ready workers (see the module docstring)."""

    name = "prague"
    survives_lost_workers = True  # survivors drop a lost worker and finish (see GroupGossip)

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        g, n = config.gossip.group_size, config.cluster.workers
        if n > 1 and g > n:
            warnings.warn(f"--group-size {g} is larger than --workers {n}: groups will have {n} workers", stacklevel=2)

    def build_engine(self, transport: Transport) -> GroupGossip:
        g = self.config.gossip
        liveness = Liveness.from_env(transport.world_size)
        # With liveness the control group's waits are bounded by us (see Waiter), gloo's is a backstop.
        data = gossip_group(g.peer_timeout)
        control = gossip_group(GOSSIP_BACKSTOP_S if liveness is not None else g.peer_timeout)
        link = transport.link_model
        size = group_size_for(g.group_size, transport.world_size)
        return GroupGossip(self.state, Transport(data, link_model=link), Transport(control, link_model=link),
                           size, seed=self.config.run.seed, timeout=g.peer_timeout, liveness=liveness)

    def info(self) -> dict[str, Any]:
        return {"group_size": group_size_for(self.config.gossip.group_size, self.state.world),
                "budget": self.config.gossip.budget}

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if isinstance(self.engine, GroupGossip):
            out["groups"] = self.engine.groups
        return out


__all__ = ["GroupGenerator", "GroupGossip", "GroupView", "Prague", "group_size_for"]
