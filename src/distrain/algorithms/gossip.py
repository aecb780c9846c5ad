"""Shared machinery of the asynchronous gossip algorithms, AD-PSGD and Prague.

Each worker keeps its model as one flat CPU vector, :class:`SharedModel`, guarded by a lock. The
main thread computes a gradient on a copy read at the start of its step (outside the lock) and
adds its optimizer's update to the shared vector (inside it); a communication thread averages
the shared vector with other workers' in the background. An averaging is applied as
``x <- x + (mean - sent)``, where ``sent`` is the copy this worker put on the wire: an update
that landed while the exchange was in flight is kept in full, and each averaging leaves the sum
of the models of the workers taking part unchanged (so the global mean of the models moves
only by gradient steps).

Besides the model, a worker knows how many steps each worker has taken and which ones have
finished training (``counts``, ``done``), as far as the gossip has told it: these travel in the
fixed-format int64 headers of every exchange and are merged by maximum (``done`` counts a
worker's lives: even while it trains, odd once it finished or was lost, and ``2 * epoch`` when it
joins again, admitted in that membership epoch, see :meth:`SharedModel.revive`). They drive the budget
(``--budget global`` stops once all workers together have made ``--epochs`` passes over the
training set) and the shutdown: a worker that has finished keeps averaging until it knows that
every worker has finished, so the models stop changing everywhere before the final consensus.

Checkpoints: a worker saves at its own step counts (a set of step ``s`` holds every worker as it
stood at its ``s``-th step, each at its own time), counting ``s`` steps for every worker, with its
clock (:meth:`AsyncGossip.state_dict`); at the end every worker saves once more, after the
gossip has drained, with every worker's exact step count and the run's clock
(:meth:`AsyncGossip.final_state`). A resumed run starts each worker from its own file, its
budget and clock going on from there (:meth:`AsyncGossip.load_state_dict`).

Evaluation without a global barrier: every worker copies its model at the same wall-clock
points, ``k * --snapshot-every`` seconds after the common start (at the first step boundary
past each point). After training, the workers average their copies point by point (the
consensus model as it was at that time) and rank 0 evaluates them, which gives accuracy over
time without pausing anyone during the run (:meth:`AsyncGossip.consensus_history`).

:class:`AsyncGossip` is the Algorithm the loop sees; AD-PSGD (``adpsgd.py``) and Prague
(``prague.py``) supply its communication engine. It runs with :class:`GossipSettings`, to which
each adds its own (``ADPSGDSettings``, ``PragueSettings``); :mod:`distrain.assemble` makes them
from the flags.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distrain.algorithms.base import Algorithm, FlatParams, RunFacts, StepContext, copy_module
from distrain.algorithms.rejoin import Admissions
from distrain.comm.link import LinkTransport, open_link
from distrain.comm.store_group import StoreGroup
from distrain.comm.surviving import SurvivingGroup
from distrain.comm.transport import Transport, blocked
from distrain.errors import WorkerFailure
from distrain.runtime.faults import PeerTimeout, inject_kill_in
from distrain.runtime.health import LOST_CHECK_S, Liveness, declared_dead
from distrain.runtime.membership import (
    PREFIX,
    Change,
    LeftOut,
    LinkMissed,
    Membership,
    MembershipChanged,
    agree_before_groups,
    await_ready,
    letting_go,
    restarted_workers,
    watched,
)

log = logging.getLogger(__name__)

BUDGETS = ("global", "local", "time")
#: Keys of an asynchronous worker's algorithm state in a checkpoint: every worker's step count as
#: this worker knows it, and the run's clock in seconds (see :meth:`AsyncGossip.state_dict`).
GOSSIP_COUNTS, GOSSIP_CLOCK = "gossip_counts", "gossip_clock"
#: Snapshots kept in memory at most (fewer for large models: about 1 GiB in all).
MAX_SNAPSHOTS = 512
SNAPSHOT_BYTES = 2**30


class LeftBehind(LeftOut):
    """This worker was silent, its heartbeat stale (hung, stopped), and its peers declared it
    dead and went on without it: it leaves, with this one line (and counts as lost, not failed)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"worker {rank} was silent (no heartbeat) and its peers went on without it; leaving")


@dataclass(frozen=True, kw_only=True)
class GossipSettings:
    """What an asynchronous gossip algorithm runs with."""

    #: when a worker stops: ``global``, ``local`` or ``time`` (see :class:`Budget`)
    budget: str
    #: seconds each worker trains with the ``time`` budget
    time_budget: float
    #: steps a worker may take since its last averaging before it waits for the next (0: no bound)
    max_lag: int
    #: seconds a gossip exchange or a wait for a group may take
    peer_timeout: float
    #: seconds between copies of every worker's model (the consensus over time)
    snapshot_every: float
    run: RunFacts


# -- the shared model ------------------------------------------------------------------------


class SharedModel:
    """A worker's model as one flat CPU vector, with what it knows of every worker's progress.

    ``lock`` (a Condition) guards ``x``, ``counts`` and ``done``; the communication thread
    waits on it for new steps.

    Example::

        state = SharedModel(torch.zeros(10), rank=0, world=2)
        sent = state.read()                      # what goes on the wire
        theirs = torch.ones(10)                  # what came back
        state.mix(sent, (sent + theirs) / 2)     # both sides end with the average
    """

    def __init__(self, x: torch.Tensor, rank: int, world: int) -> None:
        self.x = x
        self.rank, self.world = rank, world
        self.lock = threading.Condition()
        self.counts = [0] * world
        #: per worker: even while it trains, odd once it finished or was lost; a worker that joins
        #: again after its loss starts its next life (``2 * epoch``), so the maximum is always the news
        self.done = [0] * world
        self.rounds = 0  # averagings this worker took part in
        self.lost: set[int] = set()  # peers this worker found gone (asynchronous runs go on without them)
        self.revived_at: dict[int, float] = {}  # Unix time this worker learned a peer joined again
        self._lost_life: dict[int, int] = {}  # per lost peer: its ``done`` value when this worker lost it
        self._revived_epoch: dict[int, int] = {}  # per peer: the last admission this worker read
        self.steps_at_round = 0  # this worker's steps when its last averaging ended
        self.lag_seconds = 0.0  # time the main thread waited for an averaging (--max-lag)
        self.step_seconds = 0.01  # moving average of this worker's step time (paces idle gossip)

    # -- the model --

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """A consistent copy of the model."""
        with self.lock:
            return self.x.clone() if out is None else out.copy_(self.x)

    def apply_step(self, delta: torch.Tensor, read_out: torch.Tensor) -> None:
        """Add one step's update, count the step, and copy the result into ``read_out``."""
        with self.lock:
            self.x.add_(delta)
            self.counts[self.rank] += 1
            read_out.copy_(self.x)
            self.lock.notify_all()

    def mix(self, sent: torch.Tensor, mean: torch.Tensor) -> None:
        """Averaging: ``x += mean - sent`` (``sent``: the copy this worker sent)."""
        with self.lock:
            self.x.add_(mean).sub_(sent)
            self.rounds += 1
            self.steps_at_round = self.counts[self.rank]
            self.lock.notify_all()

    def wait_for_averaging(self, max_lag: int, timeout: float, failed: Callable[[], bool]) -> bool:
        """Block while this worker has taken ``max_lag`` or more steps since its last averaging.

        Bounds how far a worker's model drifts from its neighbours' when computing is much
        faster than exchanging (slow links): without it a worker could run through its whole
        budget on its own. Returns False if no averaging came within ``timeout`` seconds (the
        caller goes on: a lag bound must never hang a run), True otherwise; stops waiting at
        once when ``failed()`` says the communication thread has failed.
        """
        if max_lag <= 0:
            return True
        start = time.perf_counter()
        deadline = start + timeout
        with blocked(), self.lock:  # the worker waits on the network: exposed communication
            while self.counts[self.rank] - self.steps_at_round >= max_lag and not failed():
                left = deadline - time.perf_counter()
                if left <= 0:
                    self.lag_seconds += time.perf_counter() - start
                    return False
                self.lock.wait(timeout=min(left, 0.5))
        self.lag_seconds += time.perf_counter() - start
        return True

    # -- progress --

    def mark_lost(self, rank: int) -> None:
        """A peer is gone: it counts as done, so the others can finish without it."""
        with self.lock:
            self.lost.add(rank)
            self.done[rank] |= 1
            self._lost_life[rank] = self.done[rank]
            self.lock.notify_all()

    def revive(self, rank: int, epoch: int) -> None:
        """A lost peer joined again, admitted in membership ``epoch``: it trains again (its next
        life, ``2 * epoch``), and nobody is done before it is (or is lost again).

        The life is named by the admission's epoch, which every member agrees on, not counted up
        here: a member may merge the news from a peer's header before it reads the admission
        itself, and a second count would start a life the joiner never hears of (it would never be
        done). Each admission has a larger epoch than the last, so ``2 * epoch`` is above any
        value of the peer's earlier lives; a second call for the same admission changes nothing.

        The peer is no longer lost here unless this worker lost it in that next life already,
        even when the news that it has finished that life (``2 * epoch + 1``, merged from a
        header) came first: a finished joiner still calls and is called until everyone is done,
        and a passive neighbour that kept it among its lost would leave its calls unanswered."""
        with self.lock:
            if self._revived_epoch.get(rank, 0) >= epoch:
                return
            self._revived_epoch[rank] = epoch
            self.done[rank] = max(self.done[rank], 2 * epoch)
            if self._lost_life.get(rank, -1) < 2 * epoch:  # lost (if at all) in an earlier life
                self.lost.discard(rank)
                self.revived_at[rank] = time.time()
            self.lock.notify_all()

    def current_deaths(self, dead: dict[int, float]) -> dict[int, float]:
        """Of the store's ``dead`` marks (rank -> when declared), those of a peer's current life.
        A joiner deletes its earlier life's mark only once it enters, after the members admitted
        it: a mark declared before this worker learned of the admission is that earlier life's,
        and taken for a new loss it would drop a live joiner (whose calls then go unanswered)."""
        with self.lock:
            return {r: t for r, t in dead.items() if t > self.revived_at.get(r, float("-inf"))}

    def finish(self) -> None:
        """This worker's training budget is used up: mark it done and wake the gossip."""
        with self.lock:
            self.done[self.rank] |= 1
            self.lock.notify_all()

    @property
    def own_steps(self) -> int:
        return self.counts[self.rank]

    @property
    def finished(self) -> bool:
        return bool(self.done[self.rank] & 1)

    @property
    def all_done(self) -> bool:
        return all(d & 1 for d in self.done)

    def global_steps(self) -> int:
        """Steps taken by all workers together, as far as this worker knows (a lower bound)."""
        return sum(self.counts)

    def progress_header(self, *prefix: int) -> torch.Tensor:
        """``[*prefix, *counts, *done]`` as int64, for a message header."""
        with self.lock:
            return torch.tensor([*prefix, *self.counts, *self.done], dtype=torch.int64)

    def merge(self, tail: torch.Tensor) -> None:
        """Merge a header's ``[*counts, *done]`` (what another worker knows) into ours."""
        values = tail.tolist()
        n = self.world
        if len(values) != 2 * n:
            raise WorkerFailure(f"gossip header of {len(values)} progress values, expected {2 * n}")
        with self.lock:
            self.counts = [max(a, b) for a, b in zip(self.counts, values[:n], strict=True)]
            self.done = [max(a, b) for a, b in zip(self.done, values[n:], strict=True)]

    def wait_for_round(self, gossiped: int) -> tuple[int, bool]:
        """Block until this worker has a step newer than ``gossiped`` or has finished;
        returns (steps now, finished)."""
        with self.lock:
            while not self.done[self.rank] & 1 and self.counts[self.rank] <= gossiped:
                self.lock.wait(timeout=1.0)
            return self.counts[self.rank], bool(self.done[self.rank] & 1)

    def idle_seconds(self) -> float:
        """Pause between averagings of a worker that has finished training (one step's time)."""
        return min(0.05, max(0.002, self.step_seconds))


# -- the communication engine ----------------------------------------------------------------


class GossipEngine:
    """Background threads that average a :class:`SharedModel` with other workers.

    Subclasses implement ``_threads()`` (name, function) pairs; an exception in any thread is
    kept in ``error`` for the main thread, and ``transports`` lists every Transport the engine
    talks through (their traffic is the worker's too).
    """

    def __init__(self, state: SharedModel) -> None:
        self.state = state
        self.transports: list[Transport] = []
        self.error: BaseException | None = None
        self._threads_running: list[threading.Thread] = []
        #: where workers started again ask to join (None: the launcher starts none; see rejoin.py)
        self.admissions: Admissions | None = None
        self.t0 = time.perf_counter()  # the run's common start, for a worker that joins (set by the algorithm)
        self.has_model = threading.Event()  # joining: a peer handed this worker its model
        self.handed_at = 0.0  # joining: the seconds since the start of the peer that handed it
        self._opening: set[int] = set()  # peers whose links are being opened (with a joiner, or by one)

    def _take_handed(self, peer: int, header: torch.Tensor, model: torch.Tensor) -> None:
        """Joining: ``peer`` handed this worker ``model`` after ``header`` ``[HELLO, its seconds
        since the start in microseconds, *counts, *done]``; merge the progress, and take the first
        model handed over (with its clock)."""
        self.state.merge(header[2:])
        with self.state.lock:
            if not self.has_model.is_set():
                self.state.x.copy_(model)
                self.handed_at = int(header[1]) / 1e6
                self.has_model.set()
                log.info("worker %d: took worker %d's model", self.state.rank, peer)

    def _lose_joiner(self, peer: int, exc: BaseException, live: Liveness) -> None:
        """No link with ``peer``: drop it if it is gone (declared dead, or its heartbeat stopped,
        or it died before it was ready to open the link: :class:`LinkMissed`), else raise ``exc``."""
        if not isinstance(exc, LinkMissed) and not live.silent([peer]):
            raise exc
        live.declare_dead(peer)
        self.state.mark_lost(peer)
        log.warning("worker %d: lost worker %d while opening links with it (%s); going on without it",
                    self.state.rank, peer, str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__)

    def _opened(self, peer: int) -> None:
        """The links with ``peer`` are open, or failed: nobody waits for them any more."""
        with self.state.lock:
            self._opening.discard(peer)
            self.state.lock.notify_all()

    def enter(self, epoch: int) -> None:
        """This worker joined the run again, admitted in ``epoch``: start taking a peer's model
        (:attr:`has_model` is set once it has one)."""
        raise WorkerFailure(f"{type(self).__name__}: a worker cannot join this algorithm's run again")

    def _threads(self) -> list[tuple[str, Callable[[], None]]]:
        raise NotImplementedError

    def start(self) -> GossipEngine:
        for name, fn in self._threads():
            self.spawn(name, fn)
        return self

    def spawn(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a thread of the engine (also once running: ``alive`` and ``join`` see it)."""
        thread = threading.Thread(target=self._guard, args=(fn,), name=name, daemon=True)
        thread.start()
        self._threads_running.append(thread)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            (log.debug if letting_go() else log.error)("worker %d: gossip thread failed: %s", self.state.rank, exc)
            if self.error is None:
                self.error = exc
            with self.state.lock:
                self.state.lock.notify_all()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads_running)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every thread; True once all have ended."""
        deadline = time.monotonic() + timeout
        for t in self._threads_running:
            t.join(max(0.0, deadline - time.monotonic()))
        return not self.alive()

    def check(self) -> None:
        """Raise WorkerFailure if a gossip thread failed (LeftBehind as it is)."""
        if isinstance(self.error, LeftBehind):
            raise LeftBehind(self.state.rank) from None
        if self.error is not None:
            raise WorkerFailure(f"worker {self.state.rank}: gossip failed: {self.error}") from self.error

    def wait_for_round(self, gossiped: int) -> tuple[int, bool]:
        """Until there is something new to gossip; a finished worker gossips at a slow pace."""
        steps, finished = self.state.wait_for_round(gossiped)
        if finished:
            time.sleep(self.state.idle_seconds())
        return steps, finished

    def close(self) -> None:
        for transport in self.transports:
            transport.close()


class Job:
    """One blocking call handed to a :class:`Waiter`; ``wait`` may give up on it."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.done, self.error = fn, threading.Event(), None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - raised by wait()
            self.error = exc
        finally:
            self.done.set()

    def wait(self, timeout: float) -> bool:
        """True once the call returned (its exception raised here); False after ``timeout`` s."""
        if not self.done.wait(timeout):
            return False
        if self.error is not None:
            raise self.error
        return True


class Waiter:
    """Runs blocking waits on a thread of its own, so that a gossip thread can give up on a peer.

    Gloo cannot cancel a wait, and a wait that times out in gloo closes every connection of the
    process group (all peers then see theirs closed). So gossip groups get a long backstop
    (``GOSSIP_BACKSTOP_S``) and the peer timeout is kept here instead: the caller waits for the
    job with a timeout, and on giving up calls :meth:`abandon`; the old thread stays blocked with
    its job (a late message lands in that job's buffers, which the caller keeps), later jobs get a
    fresh thread, and nothing in gloo is closed.

    Example::

        waiter = Waiter("distrain-gossip-wait")
        job = waiter.start(lambda: handle.wait())
        if not job.wait(timeout=5.0):
            waiter.abandon()          # the peer is gone or hung: go on without it
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._spawn()

    def _spawn(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(self._jobs,), name=self.name, daemon=True).start()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Job | None]) -> None:
        while (job := jobs.get()) is not None:
            job.run()

    def start(self, fn: Callable[[], None]) -> Job:
        job = Job(fn)
        self._jobs.put(job)
        return job

    def abandon(self) -> None:
        """Leave the current job to its thread (which ends after it); new jobs get a new thread."""
        self._jobs.put(None)
        self._spawn()

    def bounded(self, fn: Callable[[], None], liveness: Liveness, peers: list[int], ceiling: float, poll: float,
                gone: Callable[[], bool] | None = None) -> GaveUp | None:
        """Run ``fn`` (an exchange with ``peers``) as a job, polling every ``poll`` seconds. None
        once it returned (its exception raised here). Else it is abandoned, and the answer says
        why: once the wait has outlasted a heartbeat's staleness, some of ``peers`` whose
        heartbeat stopped (killed, hung, cut off), or ``gone()`` said so (any time); after
        ``ceiling`` seconds, none (whatever their heartbeats say)."""
        job, began = self.start(fn), time.monotonic()
        while not job.wait(poll):
            waited = time.monotonic() - began
            silent = liveness.silent(peers) if waited > liveness.stale_after else []
            if silent or (gone is not None and gone()):
                self.abandon()
                return GaveUp(silent or list(peers), waited)
            if waited > ceiling:
                self.abandon()
                return GaveUp([], waited)
        return None

    def close(self) -> None:
        self._jobs.put(None)


@dataclass(frozen=True)
class GaveUp:
    """Why :meth:`Waiter.bounded` gave up: the ``silent`` peers (none: its ceiling passed) and the
    seconds ``waited``."""

    silent: list[int]
    waited: float


#: The gloo timeout of gossip groups whose waits a :class:`Waiter` bounds: a gloo timeout would
#: close every connection of the group, so it must never fire while the survivors go on.
GOSSIP_BACKSTOP_S = 7 * 24 * 3600.0


def survivors_link(liveness: Liveness, came: list[int], transport: Transport, timeout: float,
                   name: str = "gossip") -> LinkTransport:
    """The link ``name`` of the workers that ``came`` (some were lost as the run started: no
    group over every worker can be made), opened over a prefix of the launcher's store within
    ``timeout``, its peers named by their ranks in the run; its waits are then bounded by the
    gossip's own deadlines (:data:`GOSSIP_BACKSTOP_S` for gloo's). Local runs listen on the
    store's address (loopback by default)."""
    store = dist.PrefixStore(f"{PREFIX}/groups/{name}-survivors", liveness.store)
    link = open_link(store, came, transport.rank, transport.world_size, timeout, transport.link_model,
                     host=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return bounded_by_us(link, f"the {name} link", timeout)


def bounded_by_us(link: LinkTransport, what: str, timeout: float) -> LinkTransport:
    """``link``, once open, with gloo's timeout raised to :data:`GOSSIP_BACKSTOP_S`: its waits are
    bounded by the gossip's own deadlines (see Waiter), since a gloo timeout would close it while
    a slow worker trains. (Opening it is bounded by ``timeout``, which it keeps where this torch
    cannot change it: logged.)"""
    set_timeout = getattr(link.group, "_set_default_timeout", None)
    if set_timeout is not None:
        set_timeout(timedelta(seconds=GOSSIP_BACKSTOP_S))
    else:
        log.warning("worker %d: %s keeps gloo's %g s timeout", link.rank, what, timeout)
    return link


def gossip_group(timeout: float) -> Any:
    """A new gloo group of all ranks for a communication thread (collective: every rank calls
    it, in the same order). Gloo also on GPU runs: the averaging works on CPU copies."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))


# -- budget and snapshots --------------------------------------------------------------------


@dataclass
class Budget:
    """How long one asynchronous worker trains (``--budget``).

    ``global``: until all workers together have taken ``steps * world`` steps (faster workers
    take more); ``local``: ``steps`` steps of its own; ``time``: ``seconds`` of wall time
    (faster workers take more steps).
    """

    kind: str
    steps: int
    world: int
    seconds: float = 0.0

    def progress(self, step: int, global_steps: int, elapsed: float) -> float:
        """Fraction used (>= 1: done) after ``step`` own steps."""
        if self.kind == "local":
            return step / self.steps
        if self.kind == "time":
            return elapsed / self.seconds
        return global_steps / (self.steps * self.world)

    def schedule_step(self, step: int, global_steps: int, elapsed: float) -> int:
        """Where the learning-rate schedule (defined over ``steps``) stands."""
        if self.kind == "local":
            return step
        return min(self.steps - 1, int(self.progress(step, global_steps, elapsed) * self.steps))


@dataclass
class Snapshot:
    seconds: float  # when it was taken, since the start
    steps: int  # this worker's steps by then
    vector: torch.Tensor


class Snapshots:
    """This worker's model at the points ``k * interval`` seconds after the common start.

    A snapshot is taken at the first step boundary past a point (one copy serves every point a
    long step passed). Beyond ``limit`` points the interval doubles and every other point is
    dropped; this depends only on the clock, so every worker keeps the same points.

    Example::

        snaps = Snapshots(interval=1.0, limit=100)
        if snaps.due(elapsed):
            snaps.take(elapsed, steps, model_vector)
    """

    def __init__(self, interval: float, limit: int) -> None:
        self.interval, self.limit = interval, max(2, limit)
        self.level = 0  # points kept: multiples of 2**level
        self.last = 0  # the last point passed
        self.first = 1  # the first point this worker has (later for a worker that joined the run)
        self.points: dict[int, Snapshot] = {}

    @property
    def stride(self) -> int:
        return 1 << self.level

    def _passed(self, seconds: float) -> int:
        return int(seconds / self.interval)

    def due(self, seconds: float) -> bool:
        return self._passed(seconds) >= (self.last // self.stride + 1) * self.stride

    def start_at(self, seconds: float) -> None:
        """A worker that joins ``seconds`` after the common start keeps the points after it only."""
        self.last = self._passed(seconds)
        self.first = self.last + 1

    def take(self, seconds: float, steps: int, vector: torch.Tensor) -> None:
        passed = self._passed(seconds)
        while passed // self.stride > self.limit:
            self.level += 1
            self.points = {k: s for k, s in self.points.items() if k % self.stride == 0}
        snap = Snapshot(seconds, steps, vector)
        for k in range((self.last // self.stride + 1) * self.stride, passed + 1, self.stride):
            self.points[k] = snap
        self.last = max(self.last, passed)

    def common_points(self, level: int, last: int, first: int = 1) -> list[int]:
        """The points every worker has, given the largest level, the smallest last point and the
        largest first point."""
        stride = 1 << level
        return [k for k in range(stride, last + 1, stride) if k >= first]


def snapshot_limit(model_bytes: int) -> int:
    return max(8, min(MAX_SNAPSHOTS, SNAPSHOT_BYTES // max(1, model_bytes)))


# -- the algorithm ---------------------------------------------------------------------------


class AsyncGossip(Algorithm):
    """The hooks of an asynchronous gossip algorithm; subclasses build the engine.

    Per step (main thread): the gradient is computed on the model as read at the end of the
    previous step; ``apply_update`` runs the optimizer on that copy and adds the difference to
    the shared model under its lock, then reads the shared model back for the next step.
    """

    replicated = False
    synchronous = False
    survives_lost_workers = True  # the others drop a lost worker and finish (see the engines)
    settings: GossipSettings
    #: Set on a worker started again after its loss, before :meth:`setup` (by
    #: :meth:`joiner_transport`): its admission (it takes a peer's model over links in
    #: :meth:`join`, never entering the run's groups).
    entered: Membership | None = None
    #: what the training thread's watch raised as it waited for the gossip threads (see :meth:`_stalled`)
    _stall: BaseException | None = None

    def joiner_transport(self, joined: Membership, link_model: Any = None) -> tuple[Transport, int]:
        """A worker started again keeps its id as its rank (asynchronous gossip never renumbers);
        its neighbours open links with it (see :mod:`distrain.algorithms.rejoin`)."""
        self.entered = joined
        return Transport.detached(joined.me, self.settings.run.workers, link_model), joined.me

    @classmethod
    def survives(cls, settings: GossipSettings) -> bool:
        """The others go on without a lost worker unless ``--min-workers`` equals ``--workers``."""
        return settings.run.min_workers < settings.run.workers

    def liveness(self, world: int) -> Liveness | None:
        """Where the engine declares and looks up lost workers; None (a lost worker stops the run,
        as in a synchronous algorithm) with ``--min-workers`` equal to ``--workers``."""
        return Liveness.from_env(world) if self.survives(self.settings) else None

    def admissions(self, liveness: Liveness | None, transport: Transport) -> Admissions | None:
        """Where workers started again ask to join (None: the launcher starts none)."""
        if self.entered is not None:
            return Admissions(self.entered)
        return Admissions.for_run(liveness, transport.world_size, transport.rank, self.settings.run.timeout)

    def _check_members(self) -> None:
        """Stop with one line once fewer than ``--min-workers`` workers are left."""
        lost, floor = self.state.lost, self.settings.run.min_workers
        if lost and self.state.world - len(lost) < floor:
            raise WorkerFailure(f"worker {self.state.rank}: lost workers {sorted(lost)}; {self.state.world - len(lost)} "
                                f"left, fewer than --min-workers {floor}")

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        super().setup(model, optimizer, transport)
        g = self.settings
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.flat = FlatParams(self.params)  # the module's parameters in and out of the flat CPU vector
        self.sizes = self.flat.sizes
        pin = self.device.type == "cuda"  # averaging works on pinned CPU copies; gradients on the GPU
        flat = torch.empty(sum(self.sizes), dtype=self.params[0].dtype if self.params else torch.float32, pin_memory=pin)
        self.flat.read(flat)
        self.state = SharedModel(flat, transport.rank, transport.world_size)
        self.read_copy = torch.empty_like(flat, pin_memory=pin).copy_(flat)  # the model the next gradient is computed on
        self.new_copy = torch.empty_like(flat, pin_memory=pin)
        self.consensus = copy_module(model)
        self.snapshots = Snapshots(g.snapshot_every, snapshot_limit(flat.numel() * flat.element_size()))
        #: workers lost as the run started, before the gossip groups were made (meet_before_groups)
        self.started_without: set[int] = set()
        #: after training, where losses are survived: the group of the run's last collectives
        #: (a SurvivingGroup over the workers still alive); else the survivors' group, if workers were lost
        self.control: Transport | SurvivingGroup | None = None
        self.engine: GossipEngine | None = self.build_engine(transport) if transport.world_size > 1 else None
        if self.started_without and self.leads(transport):  # one line for the run
            log.warning("worker %d: worker(s) %s lost as the run started, before the gossip groups were made; the "
                        "others go on without them", self.state.rank, sorted(self.started_without))
        self._drained = False
        self._stop_requested = False
        self._lost_in_training: dict[int, float] = {}  # lost before the last collectives (see _survivors)
        self._reported: dict[int, float] = {}  # deaths newly_lost() reported (id -> when declared)
        self._lost_checked = -LOST_CHECK_S
        self._dead: Liveness | None = None  # the main thread's own store client (see newly_lost)
        self._last_step_at: float | None = None
        self._consensus_distance: float | None = None
        self._resumed_at = 0.0  # a resumed run: the run's clock at its checkpoint, seconds

    def build_engine(self, transport: Transport) -> GossipEngine:
        """The communication engine (collective: create process groups here)."""
        raise NotImplementedError

    def meet_before_groups(self, liveness: Liveness | None, transport: Transport) -> list[int]:
        """The workers that make the gossip groups, in rank order; the others are
        :attr:`started_without`. The groups' rendezvous would wait for a worker lost as the run
        starts until their timeout (a week for groups whose waits the survivors bound
        themselves), so with ``liveness`` (a run that survives losses) the workers meet in the
        launcher's store first and agree on who came (see
        :func:`~distrain.runtime.membership.agree_before_groups`); where some did not, the others
        open their links over :func:`survivors_link` instead and go on without them."""
        inject_kill_in("gossip-groups", transport.rank)  # fault injection for tests
        came = list(range(transport.world_size)) if liveness is None else agree_before_groups(
            liveness.store, transport.rank, transport.world_size, self.settings.run.timeout, "its gossip groups", "gossip")
        self.started_without = set(range(transport.world_size)) - set(came)
        return came

    # -- the loop's hooks --

    def start(self, total_steps: int, steps_per_epoch: int) -> None:
        g = self.settings
        self.steps_per_epoch = steps_per_epoch
        self.budget = Budget(g.budget, total_steps, self.state.world, g.time_budget)
        self.flat.read(self.state.x)  # after any change to the module since setup
        self.read_copy.copy_(self.state.x)
        self.t0 = time.perf_counter()
        # The run's clock: a joiner's is that of the peer that handed it its model, a resumed
        # run's goes on from its checkpoint (the time budget and the snapshot points follow it).
        earlier = self.engine.handed_at if self.engine is not None and self.entered is not None else self._resumed_at
        if earlier:
            self.t0 -= earlier
            self.snapshots.start_at(earlier)
        if self.engine is not None:
            self.engine.t0 = self.t0
            self.engine.start()

    # -- checkpoints --

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the model and the optimizer: every worker's step
        count and the run's clock, seconds. A set of step ``s`` holds every worker at its own
        ``s``-th step, so each counts ``s`` for all (what this worker knows of the others may be
        further on, steps that a run resumed from this set will not have taken: counted, they
        would end its global budget early, and merged by maximum into a worker's own count)."""
        own = self.state.own_steps
        return {GOSSIP_COUNTS: [own] * self.state.world,
                GOSSIP_CLOCK: self.elapsed() if hasattr(self, "t0") else self._resumed_at}

    def final_state(self) -> dict[str, Any]:
        """:meth:`state_dict` once training is over (collective over the workers that finished):
        every worker's exact step count and the latest clock, the same in every worker's file.
        Workers lost on the way count the steps the others knew of."""
        ctl = self._ctl()
        mine = torch.tensor([self.state.own_steps, self.elapsed()], dtype=torch.float64)
        rows = ctl.control_all_gather(mine) if ctl.world_size > 1 else [mine]
        with self.state.lock:
            counts = list(self.state.counts)
        for i, row in enumerate(rows):  # in the control group's rank order (the survivors', after a loss)
            counts[ctl.global_rank(i) if ctl.world_size > 1 else self.state.rank] = int(row[0])
        return {GOSSIP_COUNTS: counts, GOSSIP_CLOCK: max(float(row[1]) for row in rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint (before :meth:`start`): the step counts and the clock. A
        checkpoint of another worker (this one was lost before it was saved) gives this worker
        that worker's steps."""
        if GOSSIP_COUNTS not in state:
            return
        counts = [int(c) for c in state[GOSSIP_COUNTS]]
        if len(counts) != self.state.world:
            raise WorkerFailure(f"the checkpoint counts the steps of {len(counts)} workers; this run has {self.state.world}")
        with self.state.lock:
            self.state.counts = counts
            self.state.steps_at_round = counts[self.state.rank]  # --max-lag counts from here
        self._resumed_at = float(state.get(GOSSIP_CLOCK, 0.0))

    def resume_at(self, step: int) -> None:
        with self.state.lock:
            self.state.counts[self.state.rank] = step
            self.state.steps_at_round = step

    def join(self) -> int:
        """This worker was started again and admitted (:attr:`entered`): take a live peer's model
        over a link (into the module too) and what it knows of every worker's progress; returns
        this worker's steps as the others know them, where it goes on from."""
        assert self.entered is not None and self.engine is not None
        engine, timeout = self.engine, 2 * self.settings.peer_timeout
        engine.enter(self.entered.epoch)
        deadline = time.monotonic() + timeout
        while not engine.has_model.wait(0.05):
            engine.check()
            if time.monotonic() > deadline or not engine.alive():
                raise WorkerFailure(f"worker {self.state.rank} was admitted again, but no peer handed it a model "
                                    f"within {timeout:g} s")
        engine.check()
        self.flat.write(self.state.read())
        self.read_copy.copy_(self.state.x)
        return self.state.own_steps

    def newly_joined(self) -> list[Change]:
        """The admissions of workers started again that this worker took part in since it last
        asked (see :mod:`distrain.algorithms.rejoin`)."""
        admissions = self.engine.admissions if self.engine is not None else None
        return admissions.newly_joined() if admissions is not None else []

    def newly_lost(self, force: bool = False) -> dict[int, float]:
        """Workers declared dead since this worker last asked (id -> Unix time of the
        declaration). The others go on in the same group, so the loop deals the data out again
        over them: without it the lost worker's shard would never be seen again (a worker lost
        early takes a quarter of a 4-worker run's samples with it). Read from the run's store at
        once when this worker's gossip found a peer gone, else every ``LOST_CHECK_S / 4`` seconds
        at most unless ``force`` (a few store requests; the others learn of losses there). A
        worker that joined again and is lost once more is reported again (a new declaration)."""
        now = time.monotonic()
        if self.engine is None:
            return {}
        with self.state.lock:
            found = self.state.lost - self._reported.keys()
        if not found and not force and now - self._lost_checked < LOST_CHECK_S / 4:
            return {}
        self._lost_checked = now
        if self._dead is None:
            self._dead = self.liveness(self.state.world)
        dead = self.state.current_deaths(self._dead.dead_ranks()) if self._dead is not None else {}
        dead.update({r: time.time() for r in found if r not in dead})
        new = {r: t for r, t in dead.items() if r != self.state.rank and self._reported.get(r) != t}
        self._reported.update(new)
        return new

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def apply_update(self, ctx: StepContext) -> None:
        assert self.optimizer is not None
        if self.engine is not None:
            self.engine.check()
            self._check_members()
        self.optimizer.step()  # on the copy read before the step; outside the lock
        delta = self.flat.read(self.new_copy).sub_(self.read_copy)
        self.state.apply_step(delta, self.read_copy)  # x += delta, atomically with any averaging
        g = self.settings
        if self.engine is not None and g.max_lag > 0:
            engine, began = self.engine, time.monotonic()
            if not self.state.wait_for_averaging(g.max_lag, g.peer_timeout,
                                                 lambda: engine.error is not None or self._stalled(began)):
                log.warning("worker %d: no averaging for %.0f s (--max-lag %d); going on alone",
                            self.state.rank, g.peer_timeout, g.max_lag)
            self._raise_stall()
            engine.check()
            self.state.read(out=self.read_copy)  # averagings that landed while waiting
        self.flat.write(self.read_copy)
        now = time.perf_counter()
        if self._last_step_at is not None:
            self.state.step_seconds = 0.9 * self.state.step_seconds + 0.1 * (now - self._last_step_at)
        self._last_step_at = now

    def after_update(self, ctx: StepContext) -> None:
        self._snapshot_if_due()

    def _stalled(self, began: float) -> bool:
        """Whether the training thread's watch (a run that stops on any loss: a peer that stopped
        answering, :class:`~distrain.runtime.health.HungPeers`) ends its wait for the gossip
        threads that began at ``began``; what it raised is kept for :meth:`_raise_stall`,
        outside the shared model's lock. The gossip threads' own waits on such a peer would
        otherwise last until --peer-timeout, or, a passive one's any-source receive, for ever."""
        if self._stall is None:
            try:
                if watched(time.monotonic() - began):
                    self._stall = MembershipChanged("the run's membership changed")
            except PeerTimeout as exc:
                self._stall = exc
        return self._stall is not None

    def _raise_stall(self) -> None:
        if self._stall is not None:
            raise self._stall

    def keep_going(self, step: int, total_steps: int) -> bool:
        """False once this worker's budget is used; then first waits until every worker is done
        and no exchange is in flight (the models are final)."""
        if self._drained:
            return False
        if not self._stop_requested and self.budget.progress(step, self.state.global_steps(), self.elapsed()) < 1:
            return True
        self._drain()
        return False

    def request_stop(self) -> None:
        self._stop_requested = True

    def schedule_step(self, step: int) -> int:
        return self.budget.schedule_step(step, self.state.global_steps(), self.elapsed())

    def _snapshot_if_due(self) -> None:
        seconds = self.elapsed()
        if self.snapshots.due(seconds):
            self.snapshots.take(seconds, self.state.own_steps, self.state.read())

    def _drain(self) -> None:
        self.state.finish()
        if self.engine is not None:
            began = time.monotonic()
            while self.engine.alive():
                self.engine.join(timeout=0.05)
                self.engine.check()
                if self._stalled(began):
                    self._raise_stall()
                self._snapshot_if_due()  # the model still changes while the others finish
            self.engine.check()
        self._snapshot_if_due()
        self.flat.write(self.state.x)  # the module holds this worker's final model
        self._drained = True
        self.control = self._survivors()

    @property
    def lost_workers(self) -> dict[int, float]:  # type: ignore[override]
        """Workers lost on the way (id -> when declared dead), in training and in the run's last
        collectives."""
        closing = self.control.lost if isinstance(self.control, SurvivingGroup) else {}
        return {**self._lost_in_training, **closing}

    def _survivors(self) -> Transport | SurvivingGroup | None:
        """The group of the run's last collectives: where losses are survived (a launcher's store
        declares deaths), a :class:`~distrain.comm.surviving.SurvivingGroup` over the workers
        still alive, which goes on without one lost on the way; else a group of the workers
        still alive when some were lost (None: everyone is here).

        The workers still alive agree who they are in the launcher's store: a worker lost during
        training is declared dead before anyone counts it done, but one lost as training ends
        may be declared dead between two workers' looks.
        """
        assert self.transport is not None
        live = Liveness.from_env(self.state.world) if self.state.world > 1 else None
        if live is None:
            return None
        rank = self.transport.rank
        joined = self.engine is not None and self.engine.admissions is not None and self.engine.admissions.joined
        inject_kill_in("closing-0", rank)  # tests: lost as its training ended, before the last collectives
        survives = self.survives(self.settings)
        if survives:
            # Agreed, not read: a worker lost as training ended (after it counted itself done) is
            # declared dead before some read the dead set and after others did.
            if declared_dead(live.store, rank):  # taken for lost (silent, no heartbeat)
                raise LeftBehind(rank)
            alive = [r for r in range(self.state.world) if not declared_dead(live.store, r)]
            survivors = agree_before_groups(live.store, rank, self.state.world, self.settings.peer_timeout,
                                            "the run's last collectives", f"{self.name}-closing", members=alive)
            if declared_dead(live.store, rank):  # (meanwhile)
                raise LeftBehind(rank)
            dead = live.dead_ranks()
            self._lost_in_training = {r: dead.get(r, time.time()) for r in range(self.state.world) if r not in survivors}
        else:
            self._lost_in_training = live.dead_ranks()
            if rank in self._lost_in_training:
                raise LeftBehind(rank)
            survivors = [r for r in range(self.state.world) if r not in self._lost_in_training]
        lost = self._lost_in_training
        group: Any = self.transport
        if joined:  # a worker that joined again is in no group of the others: meet in the store
            log.info("worker %d: the consensus is over workers %s", rank, survivors)
            group = StoreGroup(live.store, survivors, rank, self.settings.peer_timeout,
                               gone=lambda r: declared_dead(live.store, r))
        elif lost:
            log.warning("worker %d: the consensus is over workers %s (lost: %s)", rank, survivors, sorted(lost))
            group = Transport(dist.new_group(survivors, backend="gloo", use_local_synchronization=True,
                                             timeout=timedelta(seconds=self.settings.peer_timeout)))
        if not survives:
            return None if group is self.transport else group
        return SurvivingGroup(group, survivors, rank, live.store, self.settings.peer_timeout, key=self.name)

    def control_transport(self) -> Transport | None:
        return self.control

    def meet_to_start(self) -> bool:
        """A run that survives losses: the workers meet in the launcher's store, not in a barrier
        over every worker, which would fail on one lost as the run starts (before the gossip
        groups were made, :attr:`started_without`, or since); one lost meanwhile is left to the
        gossip to find."""
        if self.engine is None or getattr(self.engine, "liveness", None) is None:
            return False
        store, rank = self.engine.liveness.store, self.state.rank
        came = [r for r in range(self.state.world) if r not in self.started_without]
        try:
            await_ready(dist.PrefixStore(f"{PREFIX}/groups/gossip-start", store), came, rank, self.settings.run.timeout,
                        lambda r: declared_dead(store, r), f"worker {rank}: the workers did not start training")
        except LinkMissed:
            pass
        return True

    def leads(self, transport: Transport) -> bool:
        """After a worker joined again the consensus meets in the store over every live worker;
        the first of them that trained from the run's start writes the summary (its records hold
        the loss and the join, its counters the whole run), as every worker reads from the store
        which workers were started again. Before training, where workers were lost as the run
        started: the first of the others."""
        control = self.control
        if control is None and self.started_without:
            return self.state.rank == min(set(range(self.state.world)) - self.started_without)
        if not isinstance(control, StoreGroup | SurvivingGroup):
            return super().leads(transport)
        restarted = restarted_workers(control.store)
        first = [m for m in control.members if m not in restarted] or control.members
        return control.members[control.rank] == first[0]

    def _ctl(self) -> Transport:
        assert self.transport is not None
        return self.control if self.control is not None else self.transport

    # -- evaluation --

    def _consensus_of(self, vector: torch.Tensor) -> torch.nn.Module:
        """Average ``vector`` over all workers (collective) into the consensus module."""
        ctl = self._ctl()
        # (the number of workers once the sum is done: a SurvivingGroup may have lost one on the way)
        average = ctl.control_all_reduce(vector.to(self.device)) if ctl.world_size > 1 else vector.to(self.device)
        average.div_(ctl.world_size)
        params = [p for p in self.consensus.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, chunk in zip(params, average.split(self.sizes), strict=True):
                p.copy_(chunk.view_as(p))
        return self.consensus

    @torch.no_grad()
    def eval_model(self) -> torch.nn.Module:
        """The consensus (average of every worker's final model); collective, after training."""
        if not self._drained:
            raise RuntimeError(f"{self.name}: the consensus model is only defined once training is over")
        assert self.transport is not None
        mine = self.state.read()
        model = self._consensus_of(mine.clone())
        self._consensus_distance = self._spread(mine, model)
        return model

    def _spread(self, mine: torch.Tensor, consensus: torch.nn.Module) -> float:
        """Mean over workers of ``||x_i - x_avg||^2`` (collective)."""
        assert self.transport is not None
        average = torch.cat([p.detach().reshape(-1).cpu() for p in consensus.parameters() if p.requires_grad])
        spread = torch.tensor([float((mine - average).double().pow(2).sum())], dtype=torch.float64, device=self.device)
        if self._ctl().world_size > 1:
            self._ctl().control_all_reduce(spread)
        return float(spread) / self._ctl().world_size

    def consensus_history(self) -> Iterator[tuple[dict[str, float], torch.nn.Module]]:
        """The consensus model at every snapshot point (collective; each worker iterates fully)."""
        assert self.transport is not None
        snaps = self.snapshots
        mine = torch.tensor([snaps.level, snaps.last, snaps.first], dtype=torch.int64, device=self.device)
        rows = self._ctl().control_all_gather(mine) if self._ctl().world_size > 1 else [mine]
        level = max(int(r[0]) for r in rows)
        last = min(int(r[1]) for r in rows)
        points = self.snapshots.common_points(level, last, max(int(r[2]) for r in rows))
        if not points:
            return
        facts = torch.tensor([[self.snapshots.points[k].seconds, self.snapshots.points[k].steps] for k in points],
                             dtype=torch.float64, device=self.device)
        gathered = self._ctl().control_all_gather(facts) if self._ctl().world_size > 1 else [facts]
        seconds = torch.stack(gathered).amax(0)[:, 0].tolist()  # the consensus exists once the last copy is taken
        steps = torch.stack(gathered).sum(0)[:, 1].tolist()
        per_epoch = self.steps_per_epoch * self.state.world
        for k, t, s in zip(points, seconds, steps, strict=True):
            mine = self.snapshots.points[k].vector
            model = self._consensus_of(mine.clone())
            point = {"time": t, "global_steps": int(s), "epoch": s / per_epoch}
            yield {**point, "consensus_distance": self._spread(mine, model)}, model

    # -- bookkeeping --

    def transports(self) -> list[Transport]:
        return [] if self.engine is None else list(self.engine.transports)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"gossip_rounds": self.state.rounds, "global_steps": self.state.global_steps(),
                                 "lag_wait_s": self.state.lag_seconds}
        if self._consensus_distance is not None:
            out["consensus_distance"], self._consensus_distance = self._consensus_distance, None
        return out

    def close(self) -> None:
        if self.engine is not None:
            if self.engine.alive():
                log.warning("worker %d: gossip threads still running at close", self.state.rank)
            self.engine.close()


__all__ = ["BUDGETS", "GOSSIP_BACKSTOP_S", "AsyncGossip", "Budget", "GaveUp", "GossipEngine", "GossipSettings", "Job", "LeftBehind", "PeerTimeout", "SharedModel",
           "Snapshots", "Waiter", "gossip_group"]
