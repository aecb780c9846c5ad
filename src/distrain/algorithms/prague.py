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

from distrain.algorithms.gossip import AsyncGossip, GossipEngine, SharedModel, gossip_group
from distrain.comm.ring import ring_all_reduce
from distrain.comm.transport import Handle, Transport
from distrain.errors import WorkerFailure

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
        timeout: how long rank 0's own worker may wait for a group (seconds).
    """

    def __init__(self, world: int, group_size: int, control: Transport, seed: int = 0, timeout: float = 120.0) -> None:
        self.world, self.size = world, min(group_size, world)
        self.control, self.timeout = control, timeout
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.ready: list[int] = []  # waiting for a group, in arrival order
        self.ready_since: dict[int, float] = {}
        self.ring_seconds: list[deque[float]] = [deque(maxlen=COST_WINDOW) for _ in range(world)]
        self.stopped: set[int] = set()
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
        with self.lock:
            if worker in self.ready or worker in self.stopped or len(values) != 1 + 2 * n:
                raise WorkerFailure(f"group generator: unexpected ready message from worker {worker}")
            if values[0] > 0:
                self.ring_seconds[worker].append(values[0] / 1e6)
            self.counts = [max(a, b) for a, b in zip(self.counts, values[1 : 1 + n], strict=True)]
            self.done = [max(a, min(1, b)) for a, b in zip(self.done, values[1 + n :], strict=True)]
            self.ready.append(worker)
            self.ready_since[worker] = now
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
        if len(eligible) < self.size and len(self.ready) + len(self.stopped) == self.world:
            return list(self.ready)
        return eligible

    def deliver(self, answers: list[tuple[int, torch.Tensor]]) -> None:
        handles = []
        for worker, answer in answers:
            if worker == GENERATOR:
                self.local.put(answer)
            else:
                handles.append(self.control.send(answer, worker))
        for handle in handles:
            handle.wait()

    def ask_local(self, message: torch.Tensor) -> torch.Tensor:
        """Rank 0's own worker is ready: wait for its answer."""
        self.deliver(self.on_ready(GENERATOR, message))
        try:
            return self.local.get(timeout=self.timeout)
        except queue.Empty:
            raise WorkerFailure(f"worker 0 waited {self.timeout:.0f} s for a group") from None

    def serve(self) -> None:
        """The service thread: answer READY messages until every other worker said BYE."""
        message = torch.empty(2 + 2 * self.world, dtype=torch.int64)
        byes = 0
        while byes < self.world - 1:
            src = self.control.recv_any(message)
            kind = int(message[0])
            if kind == BYE and src in self.stopped:
                byes += 1
            elif kind == READY:
                self.deliver(self.on_ready(src, message[1:]))
            else:
                raise WorkerFailure(f"group generator: unexpected message kind {kind} from worker {src}")
        log.info("group generator: %d groups of %d; fastest recent ring all-reduce per worker (ms): %s", self.groups,
                 self.size, [round(self.cost(w) * 1e3, 1) for w in range(self.world)])


class GroupGossip(GossipEngine):
    """The communication thread of one Prague worker (and, on rank 0, the group generator).

    Args:
        state: the shared model and progress of this worker.
        data: a Transport on a group of all workers for the ring all-reduces.
        control: a Transport on another group of all workers for READY / GROUP messages.
        group_size: workers per group.
        seed: seeds the generator's choices.
        timeout: how long rank 0's worker may wait for a group (the others wait in gloo,
            bounded by their group's timeout).
    """

    def __init__(self, state: SharedModel, data: Transport, control: Transport, group_size: int, seed: int = 0,
                 timeout: float = 120.0) -> None:
        super().__init__(state)
        self.data, self.control = data, control
        self.transports = [data, control]
        n = state.world
        self.generator = GroupGenerator(n, group_size, control, seed, timeout) if control.rank == GENERATOR else None
        self.size = min(group_size, n)
        self.answer_len = 2 + self.size + 2 * n
        self.sent = torch.empty(state.x.numel(), dtype=state.x.dtype)
        self.total = torch.empty_like(self.sent)
        self.groups = 0  # groups this worker averaged in
        self.last_ring_us = 0

    def _threads(self) -> list[tuple[str, Any]]:
        threads = [("distrain-prague-worker", self._run_worker)]
        if self.generator is not None:
            threads.append(("distrain-prague-generator", self.generator.serve))
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
            self._reduce(members)
        if self.generator is None:
            self.control.send(self.state.progress_header(BYE, 0), GENERATOR).wait()

    def _ask(self) -> torch.Tensor:
        ready = self.state.progress_header(READY, self.last_ring_us)
        if self.generator is not None:
            return self.generator.ask_local(ready[1:])
        answer = torch.empty(self.answer_len, dtype=torch.int64)
        handles = [self.control.recv(answer, GENERATOR), self.control.send(ready, GENERATOR)]
        for handle in handles:
            handle.wait()
        return answer

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

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        g, n = config.gossip.group_size, config.cluster.workers
        if n > 1 and g > n:
            warnings.warn(f"--group-size {g} is larger than --workers {n}: groups will have {n} workers", stacklevel=2)

    def build_engine(self, transport: Transport) -> GroupGossip:
        g = self.config.gossip
        data, control = gossip_group(g.peer_timeout), gossip_group(g.peer_timeout)
        link = transport.link_model
        size = group_size_for(g.group_size, transport.world_size)
        return GroupGossip(self.state, Transport(data, link_model=link), Transport(control, link_model=link),
                           size, seed=self.config.run.seed, timeout=g.peer_timeout)

    def info(self) -> dict[str, Any]:
        return {"group_size": group_size_for(self.config.gossip.group_size, self.state.world),
                "budget": self.config.gossip.budget}

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if isinstance(self.engine, GroupGossip):
            out["groups"] = self.engine.groups
        return out


__all__ = ["GroupGenerator", "GroupGossip", "GroupView", "Prague", "group_size_for"]
